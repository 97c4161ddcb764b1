"""A recipe: the TOML file that fixes everything a global batch depends on.

Guarantee: a :class:`Recipe` that loads is valid. Every key is known, typed and in range, every source
directory exists and holds shards of one format, every source has at least ``chunk_size`` records (where the row
counts are known: see :mod:`zephon_ray.identity` for remote sources without an index), and the tokenizer resolves.
Errors are :class:`RecipeError` (a ``ValueError``) naming the file and the key; a source that cannot be listed or
read (a missing bucket, refused credentials, an unreachable endpoint, a file without read permission) is one line
naming the path or URI (tests/test_recipe.py, tests/test_s3.py).

Sources and the recipe file itself may be local paths or object-store URIs (``s3://bucket/prefix``, ``gs://``,
``az://``). A relative source path resolves against the recipe's directory (its prefix, for a recipe in a
bucket).

``Recipe.fingerprint`` identifies the *batches*. It covers every data-defining key; for each source, the shards
exactly as Zephon's own discovery lists them (a usable ``index.json`` first, else the ``.jsonl``/``.jsonl.gz``/
``.jsonl.zst``/... or ``.parquet`` files directly in the directory, not in subdirectories), with each shard's size
and sha256 and the row count Zephon's discovery assigns it (from the index when it uses one); the tokenizer's content
hash; and the zephon, tokenizers and digest-format versions (:mod:`zephon_ray.identity`). It ignores how paths are
spelled, files Zephon does not read, and the run-time-only ``[aggregate]`` table. Each of these is checked against
the batch digests in ``tests/test_identity.py``. The fingerprint is computed once, where the recipe is loaded, and
travels with the recipe together with the per-shard detail, so that :func:`zephon_ray.identity.verify_on_node` can
name the file that differs on another node.

Cost: a sha256 of every local shard once per node (cached by path, size, mtime, ctime and inode; see
:mod:`zephon_ray.hash_cache` for the limits of that cache), then a listing and a ``stat`` per shard; for a remote
source one listing (ETags; no download) unless ``verify_content`` is set.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from zephon_ray import files
from zephon_ray.pretokenized_manifest import PretokenizedError, check_manifest, check_sources
from zephon_ray.identity import (
    SUPPORTED_FORMATS, Environment, MixedFormatsError, ShardIdentity, ShardListingError, detect_format,
    source_identity,
)
from zephon_ray.packaged import UnknownRecipeError, resolve_recipe_path
from zephon_ray.tokenizers import validate_tokenizer_spec

RECIPE_FORMAT = "zephon-ray/recipe/v1"
BINNED_PACKING = ("first_fit", "best_fit")  # Zephon requires num_bins for these, and refuses it for the others
PACKING_ALGORITHMS = ("wrap", "best_fit_wrap", "first_fit", "best_fit")


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file and the key at fault."""


@dataclass(frozen=True)
class Source:
    """One named dataset directory (local) or prefix (object store) in the mixture."""

    name: str
    path: str
    """An absolute local path or an object-store URI (``s3://bucket/prefix``), as :mod:`zephon_ray.files` spells
    it."""
    format: str
    weight: float
    shards: tuple[ShardIdentity, ...]
    """Every shard Zephon reads, in Zephon's shard-id order, with its size and sha256."""
    listing: str = "scan"
    """How Zephon lists this source: ``"index"`` (an ``index.json``) or ``"scan"`` (the directory)."""


@dataclass(frozen=True)
class Shuffle:
    shards: bool = True
    within_shard: bool = True
    reshuffle_on_repeat: bool = True


@dataclass(frozen=True)
class Aggregate:
    """Where collective Zephon checkpoints meet. Run-time only: not part of the fingerprint."""

    store: str | None = None
    dir: str | None = None


@dataclass(frozen=True)
class Recipe:
    sources: tuple[Source, ...]
    seed: int
    lanes: int
    microbatches_per_lane: int
    rows_per_microbatch: int
    seq_len: int
    tokenizer: str
    """``"bytes"`` (built-in byte-level tokenizer) or an absolute path to a HF ``tokenizer.json``."""
    text_field: str = "text"
    chunk_size: int = 64
    packing: str = "wrap"
    packing_bins: int | None = None
    """Zephon's ``num_bins``: open bins per lane for ``first_fit``/``best_fit`` (required there, refused for the
    wrapping packers, as Zephon does at build time; checked here at load instead)."""
    repeat: bool = True
    flush_every_k_chunks: int | None = None
    shuffle: Shuffle = field(default_factory=Shuffle)
    aggregate: Aggregate = field(default_factory=Aggregate)
    path: Path | str | None = field(default=None, compare=False)
    """The recipe file (a local path, or a URI for a recipe read from a bucket)."""
    pretokenized: str | None = None
    """The manifest of ``zephon-ray pretokenize`` when the sources hold token ids (column ``input_ids``) instead of
    text; Zephon then packs them without decoding or tokenising (see :mod:`zephon_ray.jobs.pretokenize`)."""
    verify_content: bool = False
    """Hash the bytes of every object-store shard (a download) in the fingerprint and on every node that verifies
    it, instead of trusting the store's ETags alone. Local shards are always hashed."""
    environment: Environment | None = None
    """Tokenizer content hash and library versions, captured where the recipe was loaded (and carried to other
    nodes, which compare their own with it). ``dataclasses.replace`` keeps it: pass ``environment=None`` to
    capture it again after changing ``tokenizer``."""

    def __post_init__(self) -> None:
        if self.environment is None:
            object.__setattr__(self, "environment", Environment.capture(self.tokenizer))

    # ------------------------------------------------------------------ derived sizes
    @property
    def rows_per_lane(self) -> int:
        """Rows one lane contributes to each global batch (k * m)."""
        return self.microbatches_per_lane * self.rows_per_microbatch

    @property
    def global_batch_rows(self) -> int:
        """B = L * k * m rows per global batch."""
        return self.lanes * self.rows_per_lane

    @property
    def row_length(self) -> int:
        """Tokens per row: seq_len + 1, so that input and labels are both seq_len long."""
        return self.seq_len + 1

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_rows * self.seq_len

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    # ------------------------------------------------------------------ identity
    def canonical(self) -> dict[str, Any]:
        """The data-defining content, independent of how paths are spelled."""
        return {
            "format": RECIPE_FORMAT,
            "seed": self.seed,
            "lanes": self.lanes,
            "microbatches_per_lane": self.microbatches_per_lane,
            "rows_per_microbatch": self.rows_per_microbatch,
            "seq_len": self.seq_len,
            "text_field": self.text_field,
            "chunk_size": self.chunk_size,
            "packing": self.packing,
            **({"packing_bins": self.packing_bins} if self.packing_bins is not None else {}),
            "repeat": self.repeat,
            "flush_every_k_chunks": self.flush_every_k_chunks,
            "shuffle": {
                "shards": self.shuffle.shards,
                "within_shard": self.shuffle.within_shard,
                "reshuffle_on_repeat": self.shuffle.reshuffle_on_repeat,
            },
            "sources": [
                {"name": s.name, "format": s.format, "weight": s.weight, "shards": [x.canonical() for x in s.shards]}
                for s in self.sources
            ],
            "environment": self.environment.canonical(),
        }

    @cached_property
    def fingerprint(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def describe(self) -> str:
        return f"{self.path or '<recipe>'} (fingerprint {self.fingerprint[:12]})"

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_toml(cls, path: str | Path, *, verify_content: bool | None = None) -> "Recipe":
        """Load a recipe file: a local path, an object-store URI, or a bare packaged name such as ``tiny``.
        ``verify_content`` overrides the recipe's key of that name (None: keep it)."""
        if files.is_uri(path):
            loc = files.location(path)
            try:
                blob = files.read_bytes(loc, limit=1 << 20)
            except (FileNotFoundError, files.StorageError) as exc:
                raise RecipeError(f"recipe file {exc}") from None
            origin: Path | str = loc.uri
            base_dir: str = loc.parent.uri
        else:
            try:
                local = resolve_recipe_path(path)
                blob = files.read_bytes(local, limit=1 << 20)
            except UnknownRecipeError as exc:
                raise RecipeError(str(exc)) from None
            except (FileNotFoundError, files.StorageError) as exc:
                raise RecipeError(f"recipe file {exc}") from None
            origin, base_dir = local, str(local.parent)
        try:
            raw = tomllib.loads(blob.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise RecipeError(f"{origin}: not valid TOML: {exc}") from None
        return cls.from_dict(raw, base_dir=base_dir, origin=origin, verify_content=verify_content)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, base_dir: str | Path = ".", origin: Path | str | None = None,
                  verify_content: bool | None = None) -> "Recipe":
        return _RecipeParser(raw, str(base_dir), origin, verify_content).parse()


# ---------------------------------------------------------------------- parsing
_TOP_KEYS = {
    "seed", "lanes", "microbatches_per_lane", "rows_per_microbatch", "seq_len", "tokenizer", "text_field",
    "chunk_size", "packing", "packing_bins", "repeat", "flush_every_k_chunks", "shuffle", "sources", "aggregate",
    "pretokenized", "verify_content",
}
_REQUIRED = ("sources", "seed", "lanes", "microbatches_per_lane", "rows_per_microbatch", "seq_len", "tokenizer")
_SOURCE_KEYS = {"name", "path", "format", "weight"}
_SHUFFLE_KEYS = {"shards", "within_shard", "reshuffle_on_repeat"}
_AGGREGATE_KEYS = {"store", "dir"}


class _RecipeParser:
    def __init__(self, raw: dict[str, Any], base_dir: str, origin: Path | str | None,
                 verify_content: bool | None) -> None:
        self.raw = raw
        self.base_dir = base_dir
        self.origin = origin
        self.where = str(origin) if origin else "recipe"
        self.verify_content = verify_content

    def fail(self, key: str, message: str) -> RecipeError:
        return RecipeError(f"{self.where}: key '{key}': {message}")

    def check_keys(self, table: dict[str, Any], allowed: set[str], prefix: str) -> None:
        unknown = sorted(set(table) - allowed)
        if unknown:
            hint = ", ".join(sorted(allowed))
            raise self.fail(prefix + unknown[0], f"unknown key (allowed here: {hint})")

    def positive_int(self, table: dict[str, Any], key: str, prefix: str = "", default: Any = ...) -> int:
        value = table.get(key, default)
        if value is ...:
            raise self.fail(prefix + key, "is required")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(prefix + key, f"must be an integer, got {type(value).__name__} {value!r}")
        if value <= 0:
            raise self.fail(prefix + key, f"must be positive, got {value}")
        return value

    def typed(self, table: dict[str, Any], key: str, kind: type, default: Any, prefix: str = "") -> Any:
        value = table.get(key, default)
        if value is ...:
            raise self.fail(prefix + key, "is required")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(prefix + key, f"must be {kind.__name__}, got {type(value).__name__} {value!r}")
        return value

    def parse(self) -> Recipe:
        raw = self.raw
        if not isinstance(raw, dict):
            raise RecipeError(f"{self.where}: a recipe must be a TOML table")
        self.check_keys(raw, _TOP_KEYS, "")
        for key in _REQUIRED:
            if key not in raw:
                raise self.fail(key, "is required")

        seed = self.typed(raw, "seed", int, ...)
        if seed < 0:
            raise self.fail("seed", f"must be >= 0, got {seed}")
        lanes = self.positive_int(raw, "lanes")
        k = self.positive_int(raw, "microbatches_per_lane")
        m = self.positive_int(raw, "rows_per_microbatch")
        seq_len = self.positive_int(raw, "seq_len")
        chunk_size = self.positive_int(raw, "chunk_size", default=64)
        flush = raw.get("flush_every_k_chunks")
        if flush is not None:
            flush = self.positive_int(raw, "flush_every_k_chunks")
        text_field = self.typed(raw, "text_field", str, "text")
        if not text_field:
            raise self.fail("text_field", "must not be empty")
        packing = self.typed(raw, "packing", str, "wrap")
        if packing not in PACKING_ALGORITHMS:
            raise self.fail("packing", f"must be one of {', '.join(PACKING_ALGORITHMS)}, got {packing!r}")
        packing_bins = None
        if packing in BINNED_PACKING:
            packing_bins = self.positive_int(raw, "packing_bins")
        elif "packing_bins" in raw:
            raise self.fail("packing_bins", f"applies only to packing {' or '.join(BINNED_PACKING)}, "
                                            f"not {packing!r}")
        repeat = self.typed(raw, "repeat", bool, True)

        shuffle_raw = self.typed(raw, "shuffle", dict, {})
        self.check_keys(shuffle_raw, _SHUFFLE_KEYS, "shuffle.")
        shuffle = Shuffle(**{k_: self.typed(shuffle_raw, k_, bool, True, "shuffle.") for k_ in _SHUFFLE_KEYS})

        aggregate_raw = self.typed(raw, "aggregate", dict, {})
        self.check_keys(aggregate_raw, _AGGREGATE_KEYS, "aggregate.")
        store = self.typed(aggregate_raw, "store", str, None, "aggregate.") if "store" in aggregate_raw else None
        agg_dir = self.typed(aggregate_raw, "dir", str, None, "aggregate.") if "dir" in aggregate_raw else None
        if agg_dir is not None:
            agg_dir = self.resolve(agg_dir, "aggregate.dir")
        if store is not None and agg_dir is not None:
            raise self.fail("aggregate", "set at most one of 'store' and 'dir'")

        tokenizer_raw = self.typed(raw, "tokenizer", str, ...)
        tokenizer = tokenizer_raw if tokenizer_raw == "bytes" else self.resolve(tokenizer_raw, "tokenizer")
        if files.is_uri(tokenizer):
            raise self.fail("tokenizer", f"must be a local file (tokenizers load from local disk), got {tokenizer}")
        try:
            validate_tokenizer_spec(tokenizer)
        except ValueError as exc:
            raise self.fail("tokenizer", str(exc)) from None

        verify_content = self.typed(raw, "verify_content", bool, False)
        if self.verify_content is not None:
            verify_content = self.verify_content
        pretokenized = raw.get("pretokenized")
        if pretokenized is not None:
            pretokenized = self.resolve(self.typed(raw, "pretokenized", str, ...), "pretokenized")
            try:  # before the sources are read: a damaged token shard is named here, not by a Parquet reader
                check_manifest(pretokenized, tokenizer)
            except (PretokenizedError, files.StorageError) as exc:
                raise self.fail("pretokenized", str(exc)) from None
        sources = self.parse_sources(raw["sources"], chunk_size, verify_content)
        recipe = Recipe(
            sources=sources, seed=seed, lanes=lanes, microbatches_per_lane=k, rows_per_microbatch=m,
            seq_len=seq_len, tokenizer=tokenizer, text_field=text_field, chunk_size=chunk_size, packing=packing,
            packing_bins=packing_bins, repeat=repeat, flush_every_k_chunks=flush, shuffle=shuffle,
            aggregate=Aggregate(store=store, dir=agg_dir), path=self.origin, pretokenized=pretokenized,
            verify_content=verify_content,
        )
        if pretokenized is not None:
            try:
                check_sources(pretokenized, recipe.sources)
            except (PretokenizedError, files.StorageError) as exc:
                raise self.fail("pretokenized", str(exc)) from None
        return recipe

    def resolve(self, value: str, key: str) -> str:
        """A path relative to the recipe's directory (or bucket prefix), an absolute path, or a URI, spelled as
        :mod:`zephon_ray.files` spells it."""
        try:
            return files.location(value, base=self.base_dir).uri
        except files.StorageError as exc:
            raise self.fail(key, str(exc)) from None

    def parse_sources(self, raw_sources: Any, chunk_size: int, verify_content: bool) -> tuple[Source, ...]:
        if not isinstance(raw_sources, list) or not raw_sources:
            raise self.fail("sources", "must be a non-empty array of tables ([[sources]])")
        seen: set[str] = set()
        out = []
        for i, src in enumerate(raw_sources):
            prefix = f"sources[{i}]."
            if not isinstance(src, dict):
                raise self.fail(f"sources[{i}]", "must be a table")
            self.check_keys(src, _SOURCE_KEYS, prefix)
            name = self.typed(src, "name", str, ..., prefix)
            if not name or name in seen:
                raise self.fail(prefix + "name", f"must be non-empty and unique, got {name!r}")
            seen.add(name)
            weight = src.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or weight <= 0:
                raise self.fail(prefix + "weight", f"must be a positive number, got {weight!r}")
            path = self.resolve(self.typed(src, "path", str, ..., prefix), prefix + "path")
            fmt = self.typed(src, "format", str, None, prefix) if "format" in src else None
            if fmt is not None and fmt not in SUPPORTED_FORMATS:
                raise self.fail(prefix + "format", f"must be one of {', '.join(SUPPORTED_FORMATS)}, got {fmt!r}")
            fmt, listing, shards = self.list_shards(path, fmt, prefix, verify_content)
            records = sum(s.rows for s in shards) if all(s.rows is not None for s in shards) else None
            if records is not None and records < chunk_size:
                raise self.fail(
                    "chunk_size",
                    f"{chunk_size} is larger than source '{name}' ({records} records in {path}); "
                    "Zephon would drop the whole source as a trailing partial chunk",
                )
            out.append(Source(name=name, path=path, format=fmt, weight=float(weight), shards=shards, listing=listing))
        return tuple(out)

    def list_shards(self, path: str, fmt: str | None, prefix: str,
                    verify_content: bool) -> tuple[str, str, tuple[ShardIdentity, ...]]:
        """Zephon's own view of the source directory (see :mod:`zephon_ray.identity`), content-identified."""
        try:
            if fmt is None:
                fmt = detect_format(path)
            listing, shards = source_identity(path, fmt, verify_content=verify_content)
        except MixedFormatsError as exc:
            raise self.fail(prefix + "format", str(exc)) from None
        except (ShardListingError, files.StorageError) as exc:
            raise self.fail(prefix + "path", str(exc)) from None
        empty = [s.name for s in shards if s.size == 0]
        if empty:
            raise self.fail(prefix + "path", f"empty shard file: {path.rstrip('/')}/{empty[0]}")
        return fmt, listing, shards

