"""A recipe: the TOML file that fixes everything a global batch depends on.

Guarantee: a :class:`Recipe` that loads is valid. Every key is known, typed and in range, every source
directory exists and holds shards of one format, every source has at least ``chunk_size`` records (where the row
counts are known: see :mod:`zephon_ray.identity` for remote sources without an index), and the tokenizer resolves.
Errors are :class:`RecipeError` (a ``ValueError``) naming the file and the key; a source that cannot be listed or
read (a missing bucket, refused credentials, an unreachable endpoint, a file without read permission) is one line
naming the path or URI.

Sources and the recipe file itself may be local paths or object-store URIs (``s3://bucket/prefix``, ``gs://``,
``az://``). A relative source path resolves against the recipe's directory (its prefix, for a recipe in a
bucket).

``Recipe.fingerprint`` identifies the *batches*. It covers every data-defining key; for each source, the shards
exactly as Zephon's own discovery lists them (a usable ``index.json`` first, else the ``.jsonl``/``.jsonl.gz``/
``.jsonl.zst``/... or ``.parquet`` files directly in the directory, not in subdirectories), with each shard's size
and sha256 and the row count Zephon's discovery assigns it (from the index when it uses one); the tokenizer's content
hash; and the zephon, tokenizers and digest-format versions (:mod:`zephon_ray.identity`). It ignores how paths are
spelled, files Zephon does not read, and the run-time-only ``[aggregate]`` table. Each of these leaves the batch digests
unchanged. With ``[[phases]]`` (a mixture schedule keyed by step) the
fingerprint is the end of a chain that starts at :attr:`Recipe.base_fingerprint` (everything but the phases) and
hashes in one phase at a time, so a state at step t can be checked against the phases before t alone
(:meth:`Recipe.check_history`; docs/recipes.md "Mixture schedules"). The fingerprint is
computed once, where the recipe is loaded, and travels with the recipe together with the per-shard detail, so that
:func:`zephon_ray.identity.verify_on_node` can name the file that differs on another node.

Cost: a sha256 of every local shard once per node (cached by path, size, mtime, ctime and inode; see
:mod:`zephon_ray.hash_cache` for the limits of that cache), then a listing and a ``stat`` per shard; for a remote
source one listing (ETags; no download) unless ``verify_content`` is set.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from zephon_ray import storage
from zephon_ray.checks import check_int
from zephon_ray.identity import (
    SUPPORTED_FORMATS,
    Environment,
    MixedFormatsError,
    ShardIdentity,
    ShardListingError,
    detect_format,
    source_identity,
)
from zephon_ray.packaged import UnknownRecipeError, resolve_recipe_path
from zephon_ray.pretokenized_manifest import PretokenizedError, check_manifest, check_sources
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
    """An absolute local path or an object-store URI (``s3://bucket/prefix``), as :mod:`zephon_ray.storage` spells
    it."""
    format: str
    weight: float
    shards: tuple[ShardIdentity, ...]
    """Every shard Zephon reads, in Zephon's shard-id order, with its size and sha256."""
    listing: str = "scan"
    """How Zephon lists this source: ``"index"`` (an ``index.json``) or ``"scan"`` (the directory)."""


@dataclass(frozen=True)
class Phase:
    """From ``start_step`` on, the mixture draws new chunks with ``weights`` (one per recipe source, recipe order;
    a source the phase does not name has weight 0). Each source's read position carries over from the phase before
    (see :mod:`zephon_ray.lanes`, "Phases")."""

    name: str
    start_step: int
    weights: tuple[float, ...]

    def canonical(self, source_names: tuple[str, ...]) -> dict[str, Any]:
        return {
            "name": self.name,
            "start_step": self.start_step,
            "weights": {n: w for n, w in zip(source_names, self.weights)},
        }


@dataclass(frozen=True)
class Skip:
    """Deliberate skip (``[[skips]]``): from training step ``start_step`` on, the run reads the data it would have read
    ``end_step - start_step`` steps later (it skips the data of training steps ``[start_step, end_step)``). A skip
    changes which data step a training step reads, never what a data step holds: it is not in the recipe's
    fingerprint (a service, a materialised run and a state_dir serve data steps and stay valid), and a loader state
    records it, so a resume keeps it and refuses a recipe that rewrites it."""

    name: str
    start_step: int
    end_step: int

    @property
    def length(self) -> int:
        return self.end_step - self.start_step

    def canonical(self) -> dict[str, Any]:
        return {"name": self.name, "start_step": self.start_step, "end_step": self.end_step}


class ScheduleError(RecipeError):
    """A resume whose recipe rewrites a phase that some already-produced step used, or contradicts a phase the run
    recorded."""


def _weights_text(weights: Any, order: tuple[str, ...] = ()) -> str:
    """``{prose 0.2, code 0.8}``: the sources in ``order`` (a recipe's) first."""
    if not isinstance(weights, dict):
        return repr(weights)
    keys = [k for k in order if k in weights] + [k for k in weights if k not in order]
    return (
        "{"
        + ", ".join(
            f"{k} {weights[k]:g}" if isinstance(weights[k], (int, float)) else f"{k} {weights[k]!r}" for k in keys
        )
        + "}"
    )


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
    phases: tuple[Phase, ...] = ()
    """The mixture schedule after step 0 (``[[phases]]``), by strictly increasing ``start_step`` > 0. Step s uses
    the last phase that starts at or before s (the sources' own weights before the first)."""
    skips: tuple[Skip, ...] = ()
    """Deliberate skips (``[[skips]]``), by strictly increasing ``start_step``: training step t reads data step
    :meth:`data_step` (t). Phases are keyed by data step."""
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

    # ------------------------------------------------------------------ schedule
    def phase_index(self, step: int) -> int:
        """0 for the sources' own weights, i for ``phases[i-1]``: the segment that produces ``step``."""
        return sum(1 for p in self.phases if p.start_step <= step)

    def segment_start(self, index: int) -> int:
        """The first step of segment ``index`` (0 for the sources' own weights)."""
        return 0 if index == 0 else self.phases[index - 1].start_step

    def segment_weights(self, index: int) -> tuple[float, ...]:
        """Segment ``index``'s weights, normalised to sum to 1, in recipe source order."""
        raw = tuple(s.weight for s in self.sources) if index == 0 else self.phases[index - 1].weights
        total = sum(raw)
        return tuple(w / total for w in raw)

    def segment_name(self, index: int) -> str:
        return "sources" if index == 0 else self.phases[index - 1].name

    def data_step(self, step: int) -> int:
        """The data step training step ``step`` reads: ``step`` plus the length of every skip that starts at or
        before it."""
        return step + sum(s.length for s in self.skips if s.start_step <= step)

    def data_next(self, next_step: int) -> int:
        """One past the last data step that training steps ``0 .. next_step-1`` read (0 for 0): where a state at
        ``next_step`` stands in the data, which a resume replays up to :meth:`data_step` (``next_step``)."""
        return 0 if next_step <= 0 else self.data_step(next_step - 1) + 1

    def skipped_data(self) -> list[tuple[Skip, int, int]]:
        """Each skip with the data steps ``[first, end)`` it skipped."""
        out = []
        for skip in self.skips:
            first = self.data_step(skip.start_step - 1) + 1 if skip.start_step else 0
            out.append((skip, first, first + skip.length))
        return out

    # ------------------------------------------------------------------ identity
    def canonical(self) -> dict[str, Any]:
        """The data-defining content, independent of how paths are spelled."""
        assert self.environment is not None  # __post_init__ captures it
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
    def base_fingerprint(self) -> str:
        """Everything but the phases: the fingerprint of the steps before the first phase."""
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @cached_property
    def schedule_fingerprints(self) -> tuple[str, ...]:
        """A chain: entry 0 is :attr:`base_fingerprint`, entry i hashes entry i-1 with phase i. Entry i identifies
        every step of segment i and of all segments before it, and nothing after."""
        chain = [self.base_fingerprint]
        for phase in self.phases:
            blob = json.dumps(phase.canonical(self.source_names), sort_keys=True, separators=(",", ":"))
            chain.append(hashlib.sha256(f"{chain[-1]}:{blob}".encode()).hexdigest())
        return tuple(chain)

    @cached_property
    def fingerprint(self) -> str:
        """Identifies every step: the last entry of :attr:`schedule_fingerprints` (the base fingerprint, unchanged,
        for a recipe without phases)."""
        return self.schedule_fingerprints[-1]

    def history_fingerprint(self, next_step: int) -> str:
        """Identifies steps ``0 .. next_step-1`` only: phases starting at or after ``next_step`` do not enter it."""
        return self.schedule_fingerprints[self.phase_index(max(next_step - 1, 0))]

    def schedule_history(self, next_step: int) -> list[list[Any]]:
        """What a state at ``next_step`` records of the schedule it used: ``[start_step, name, chain entry]`` for the
        sources' weights and each phase that starts before ``next_step``."""
        last = self.phase_index(max(next_step - 1, 0))
        return [[self.segment_start(i), self.segment_name(i), self.schedule_fingerprints[i]] for i in range(last + 1)]

    def check_history(self, history: Any, next_step: int, *, what: str = "the state") -> None:
        """Refuse a resume at ``next_step`` whose recipe changes a phase that an already-produced step used, naming
        the phase and the step. Phases that start at or
        after ``next_step`` may be added, moved or removed."""
        if not isinstance(history, list) or not history:
            raise ScheduleError(f"{what}: schedule history {history!r} is not a non-empty list")
        mine = self.schedule_history(next_step)
        for i, entry in enumerate(history):
            start, name, chain = (entry + [None, None, None])[:3] if isinstance(entry, list) else (None, None, None)
            if i >= len(mine):
                raise ScheduleError(
                    f"{what}: phase '{name}' (start_step {start}) produced steps before step {next_step}, but "
                    f"{self.describe()} has no phase there; a resume at step {next_step} may only change phases "
                    f"starting at or after step {next_step}"
                )
            if chain != mine[i][2]:
                theirs = "the sources' weights" if i == 0 else f"phase '{name}' (start_step {start})"
                ours = "the sources' weights" if i == 0 else f"phase '{mine[i][1]}' (start_step {mine[i][0]})"
                if i == 0:
                    raise ScheduleError(
                        f"{what} belongs to recipe fingerprint {str(chain)[:12]}, not {self.describe()}"
                    )
                raise ScheduleError(
                    f"{what}: {ours} differs from {theirs}, which produced steps up to step {next_step - 1}; a resume "
                    f"at step {next_step} may only change phases starting at or after step {next_step}"
                )
        if len(mine) > len(history):
            extra = mine[len(history)]
            raise ScheduleError(
                f"{what}: phase '{extra[1]}' starts at step {extra[0]}, before step {next_step}, which the run has "
                f"already produced without it; a resume at step {next_step} may only add phases starting at or after "
                f"step {next_step}"
            )

    def describe(self) -> str:
        return f"{self.path or '<recipe>'} (fingerprint {self.fingerprint[:12]})"

    def with_phase(self, name: str, start_step: int, weights: dict[str, float]) -> Recipe:
        """This recipe with one more phase (inserted by ``start_step``), checked as ``[[phases]]`` are: one
        :class:`RecipeError` naming the phase and the key (a running service's ``add_phase``)."""
        from dataclasses import replace

        if not isinstance(weights, dict):
            raise RecipeError(f"phase {name!r}: weights must be a table of source weights, got {weights!r}")
        raw = [p.canonical(self.source_names) for p in self.phases]
        raw.append({"name": name, "start_step": start_step, "weights": dict(weights)})
        raw.sort(key=lambda p: p["start_step"] if isinstance(p["start_step"], int) else -1)
        parser = _RecipeParser({}, ".", self.path or "phase", None)
        return replace(self, phases=parser.parse_phases(raw, self.source_names))

    def with_skip(self, name: str, start_step: int, end_step: int) -> Recipe:
        """This recipe with one more skip, checked as ``[[skips]]`` are (one :class:`RecipeError` naming the key)."""
        from dataclasses import replace

        raw = [s.canonical() for s in self.skips] + [{"name": name, "start_step": start_step, "end_step": end_step}]
        raw.sort(key=lambda s: s["start_step"] if isinstance(s["start_step"], int) else -1)
        return replace(self, skips=_RecipeParser({}, ".", self.path or "skip", None).parse_skips(raw))

    def with_run_skips(self, recorded: Any, next_step: int, *, what: str = "the run") -> Recipe:
        """This recipe with the skips a run recorded (every skip of its schedule): a new one is added; one that
        contradicts a skip here, or a skip here that starts before ``next_step`` and the run never made (a rewritten
        past), is a :class:`ScheduleError` naming it."""
        if not isinstance(recorded, list) or not all(isinstance(s, dict) for s in recorded):
            raise ScheduleError(f"{what}: recorded skips must be a list of tables, got {str(recorded)[:200]!r}")
        out = self
        for entry in recorded:
            clash = [s for s in out.skips if s.name == entry.get("name") or s.start_step == entry.get("start_step")]
            if any(s.canonical() == entry for s in clash):
                continue
            if clash:
                raise ScheduleError(
                    f"{what} recorded skip '{entry.get('name')}' (training steps from {entry.get('start_step')} "
                    f"read the data of {entry.get('end_step')} on), but {self.describe()} has skip "
                    f"'{clash[0].name}' from {clash[0].start_step} to {clash[0].end_step}; resume with the recipe "
                    "the run recorded"
                )
            try:
                out = out.with_skip(entry.get("name"), entry.get("start_step"), entry.get("end_step"))
            except RecipeError as exc:
                raise ScheduleError(
                    f"{what} recorded skip {entry.get('name')!r}, which does not fit {self.describe()}: {exc}"
                ) from None
        for skip in self.skips:
            if skip.start_step < next_step and skip.canonical() not in recorded:
                raise ScheduleError(
                    f"{what}: skip '{skip.name}' starts at step {skip.start_step}, before step {next_step}, which "
                    f"the run has already trained without it; a resume at step {next_step} may only add skips "
                    f"starting at or after step {next_step}"
                )
        return out

    def run_phases(self, base: Recipe) -> list[dict[str, Any]]:
        """The phases of this recipe that ``base`` does not have, canonical (``{"name", "start_step", "weights"}``):
        what a run decided beyond its recipe file (``add_phase``), which its state records so that every resume
        replays it."""
        theirs = {(p.name, p.start_step, p.weights) for p in base.phases}
        return [p.canonical(self.source_names) for p in self.phases if (p.name, p.start_step, p.weights) not in theirs]

    def with_run_phases(self, recorded: Any, *, what: str = "the run") -> Recipe:
        """This recipe with the phases a run recorded (:meth:`run_phases` of the run's schedule): one already here is
        kept, a new one is added; one that contradicts a phase of this recipe (the same name or start step, other
        weights) is a :class:`ScheduleError` naming both, never a silent choice."""
        if not isinstance(recorded, list) or not all(isinstance(p, dict) for p in recorded):
            raise ScheduleError(f"{what}: recorded phases must be a list of tables, got {str(recorded)[:200]!r}")
        out = self
        for entry in recorded:
            name, start, weights = entry.get("name"), entry.get("start_step"), entry.get("weights")
            clash = [p for p in out.phases if p.name == name or p.start_step == start]
            if any(p.canonical(out.source_names) == entry for p in clash):
                continue
            if clash:
                mine = clash[0].canonical(out.source_names)
                raise ScheduleError(
                    f"{what} recorded phase '{name}' from step {start} with weights "
                    f"{_weights_text(weights, self.source_names)}, but "
                    f"{self.describe()} has phase '{mine['name']}' from step {mine['start_step']} with weights "
                    f"{_weights_text(mine['weights'])}; resume with the recipe the run recorded, or without that "
                    "phase in the file"
                )
            try:
                out = out.with_phase(name, start, weights)
            except RecipeError as exc:
                raise ScheduleError(
                    f"{what} recorded phase {name!r}, which does not fit {self.describe()}: {exc}"
                ) from None
        return out

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], *, verify_content: bool | None = None) -> Recipe:
        """Load a recipe file: a local path, an object-store URI, or a bare packaged name such as ``tiny``.
        ``verify_content`` overrides the recipe's key of that name (None: keep it)."""
        if storage.is_uri(path):
            loc = storage.location(path)
            try:
                blob = storage.read_bytes(loc, limit=1 << 20)
            except (FileNotFoundError, storage.StorageError) as exc:
                raise RecipeError(f"recipe file {exc}") from None
            origin: Path | str = loc.uri
            base_dir: str = loc.parent.uri
        else:
            try:
                local = resolve_recipe_path(path)
                blob = storage.read_bytes(local, limit=1 << 20)
            except UnknownRecipeError as exc:
                raise RecipeError(str(exc)) from None
            except (FileNotFoundError, storage.StorageError) as exc:
                raise RecipeError(f"recipe file {exc}") from None
            origin, base_dir = local, str(local.parent)
        try:
            raw = tomllib.loads(blob.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise RecipeError(f"{origin}: not valid TOML: {exc}") from None
        return cls.from_dict(raw, base_dir=base_dir, origin=origin, verify_content=verify_content)

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        *,
        base_dir: str | Path = ".",
        origin: Path | str | None = None,
        verify_content: bool | None = None,
    ) -> Recipe:
        return _RecipeParser(raw, str(base_dir), origin, verify_content).parse()


# ---------------------------------------------------------------------- parsing
_TOP_KEYS = {
    "seed",
    "lanes",
    "microbatches_per_lane",
    "rows_per_microbatch",
    "seq_len",
    "tokenizer",
    "text_field",
    "chunk_size",
    "packing",
    "packing_bins",
    "repeat",
    "flush_every_k_chunks",
    "shuffle",
    "sources",
    "aggregate",
    "pretokenized",
    "verify_content",
    "phases",
    "skips",
}
MAX_PHASES = 64
_REQUIRED = ("sources", "seed", "lanes", "microbatches_per_lane", "rows_per_microbatch", "seq_len", "tokenizer")
_SOURCE_KEYS = {"name", "path", "format", "weight"}
_PHASE_KEYS = {"name", "start_step", "weights"}
_SKIP_KEYS = {"name", "start_step", "end_step"}
MAX_SKIPS = 1024
MAX_SKIP_STEPS = 10**9
_SHUFFLE_KEYS = {"shards", "within_shard", "reshuffle_on_repeat"}
_AGGREGATE_KEYS = {"store", "dir"}


class _RecipeParser:
    def __init__(
        self, raw: dict[str, Any], base_dir: str, origin: Path | str | None, verify_content: bool | None
    ) -> None:
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
        return check_int(f"{self.where}: key '{prefix + key}'", value, low=1, error=RecipeError)

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
            raise self.fail("packing_bins", f"applies only to packing {' or '.join(BINNED_PACKING)}, not {packing!r}")
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
        if storage.is_uri(tokenizer):
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
            except (PretokenizedError, storage.StorageError) as exc:
                raise self.fail("pretokenized", str(exc)) from None
        sources = self.parse_sources(raw["sources"], chunk_size, verify_content)
        phases = self.parse_phases(raw.get("phases", []), tuple(s.name for s in sources))
        skips = self.parse_skips(raw.get("skips", []))
        recipe = Recipe(
            sources=sources,
            seed=seed,
            lanes=lanes,
            microbatches_per_lane=k,
            rows_per_microbatch=m,
            seq_len=seq_len,
            tokenizer=tokenizer,
            text_field=text_field,
            chunk_size=chunk_size,
            packing=packing,
            packing_bins=packing_bins,
            repeat=repeat,
            flush_every_k_chunks=flush,
            shuffle=shuffle,
            aggregate=Aggregate(store=store, dir=agg_dir),
            path=self.origin,
            pretokenized=pretokenized,
            verify_content=verify_content,
            phases=phases,
            skips=skips,
        )
        if pretokenized is not None:
            try:
                check_sources(pretokenized, recipe.sources)
            except (PretokenizedError, storage.StorageError) as exc:
                raise self.fail("pretokenized", str(exc)) from None
        return recipe

    def resolve(self, value: str, key: str) -> str:
        """A path relative to the recipe's directory (or bucket prefix), an absolute path, or a URI, spelled as
        :mod:`zephon_ray.storage` spells it."""
        try:
            return storage.location(value, base=self.base_dir).uri
        except storage.StorageError as exc:
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
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not math.isfinite(weight)
                or weight < 0
            ):
                raise self.fail(prefix + "weight", f"must be a number >= 0, got {weight!r}")
            path = self.resolve(self.typed(src, "path", str, ..., prefix), prefix + "path")
            fmt = self.typed(src, "format", str, None, prefix) if "format" in src else None
            if fmt is not None and fmt not in SUPPORTED_FORMATS:
                raise self.fail(prefix + "format", f"must be one of {', '.join(SUPPORTED_FORMATS)}, got {fmt!r}")
            fmt, listing, shards = self.list_shards(path, fmt, prefix, verify_content)
            records = sum(s.rows or 0 for s in shards) if all(s.rows is not None for s in shards) else None
            if records is not None and records < chunk_size:
                raise self.fail(
                    "chunk_size",
                    f"{chunk_size} is larger than source '{name}' ({records} records in {path}); "
                    "Zephon would drop the whole source as a trailing partial chunk",
                )
            out.append(Source(name=name, path=path, format=fmt, weight=float(weight), shards=shards, listing=listing))
        if not any(s.weight > 0 for s in out):
            raise self.fail("sources", "at least one source needs a weight > 0")
        return tuple(out)

    def parse_phases(self, raw_phases: Any, names: tuple[str, ...]) -> tuple[Phase, ...]:
        """``[[phases]]``: each with ``start_step`` (> 0, strictly increasing), ``weights`` (a table naming recipe
        sources; unnamed ones get 0; at least one > 0) and an optional unique ``name``."""
        if not isinstance(raw_phases, list) or any(not isinstance(p, dict) for p in raw_phases):
            raise self.fail("phases", "must be an array of tables ([[phases]])")
        if len(raw_phases) > MAX_PHASES:
            raise self.fail("phases", f"at most {MAX_PHASES} phases, got {len(raw_phases)}")
        out: list[Phase] = []
        seen = {"sources"}
        for i, ph in enumerate(raw_phases):
            prefix = f"phases[{i}]."
            self.check_keys(ph, _PHASE_KEYS, prefix)
            name = self.typed(ph, "name", str, f"phase{i + 1}", prefix)
            if not name or name in seen:
                raise self.fail(prefix + "name", f"must be non-empty and unique (and not 'sources'), got {name!r}")
            seen.add(name)
            start = self.positive_int(ph, "start_step", prefix)
            if out and start <= out[-1].start_step:
                raise self.fail(
                    prefix + "start_step",
                    f"phase '{name}' starts at step {start}, not after phase "
                    f"'{out[-1].name}' (step {out[-1].start_step})",
                )
            table = self.typed(ph, "weights", dict, ..., prefix)
            for key, value in table.items():
                if key not in names:
                    raise self.fail(
                        f"{prefix}weights.{key}",
                        f"phase '{name}' names no source of this recipe "
                        f"(sources: {', '.join(names)}); a phase cannot add a "
                        "source: declare it in [[sources]] with weight 0",
                    )
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or value < 0
                ):
                    raise self.fail(f"{prefix}weights.{key}", f"must be a number >= 0, got {value!r}")
            weights = tuple(float(table.get(n, 0.0)) for n in names)
            if not any(w > 0 for w in weights):
                raise self.fail(prefix + "weights", f"phase '{name}' needs at least one weight > 0")
            out.append(Phase(name=name, start_step=start, weights=weights))
        return tuple(out)

    def parse_skips(self, raw_skips: Any) -> tuple[Skip, ...]:
        """``[[skips]]``: each with a unique ``name``, ``start_step`` >= 0 (strictly increasing) and ``end_step`` >
        ``start_step`` (at most 10**9 steps later)."""
        if not isinstance(raw_skips, list) or any(not isinstance(s, dict) for s in raw_skips):
            raise self.fail("skips", "must be an array of tables ([[skips]])")
        if len(raw_skips) > MAX_SKIPS:
            raise self.fail("skips", f"at most {MAX_SKIPS} skips, got {len(raw_skips)}")
        out: list[Skip] = []
        for i, sk in enumerate(raw_skips):
            prefix = f"skips[{i}]."
            self.check_keys(sk, _SKIP_KEYS, prefix)
            name = self.typed(sk, "name", str, ..., prefix)
            if not name or any(s.name == name for s in out):
                raise self.fail(prefix + "name", f"must be non-empty and unique, got {name!r}")
            start = sk.get("start_step")
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise self.fail(prefix + "start_step", f"must be an int >= 0, got {start!r}")
            if out and start <= out[-1].start_step:
                raise self.fail(
                    prefix + "start_step",
                    f"skip '{name}' starts at step {start}, not after skip "
                    f"'{out[-1].name}' (step {out[-1].start_step})",
                )
            end = sk.get("end_step")
            if isinstance(end, bool) or not isinstance(end, int) or not start < end <= start + MAX_SKIP_STEPS:
                raise self.fail(
                    prefix + "end_step", f"must be an int in ({start}, {start + MAX_SKIP_STEPS}], got {end!r}"
                )
            out.append(Skip(name=name, start_step=start, end_step=end))
        return tuple(out)

    def list_shards(
        self, path: str, fmt: str | None, prefix: str, verify_content: bool
    ) -> tuple[str, str, tuple[ShardIdentity, ...]]:
        """Zephon's own view of the source directory (see :mod:`zephon_ray.identity`), content-identified."""
        try:
            if fmt is None:
                fmt = detect_format(path)
            listing, shards = source_identity(path, fmt, verify_content=verify_content)
        except MixedFormatsError as exc:
            raise self.fail(prefix + "format", str(exc)) from None
        except (ShardListingError, storage.StorageError) as exc:
            raise self.fail(prefix + "path", str(exc)) from None
        empty = [s.name for s in shards if s.size == 0]
        if empty:
            raise self.fail(prefix + "path", f"empty shard file: {path.rstrip('/')}/{empty[0]}")
        return fmt, listing, shards
