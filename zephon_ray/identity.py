"""Identity: what a recipe's batches depend on, as Zephon itself sees it, and the check each node runs.

A recipe's identity has three parts, all folded into ``Recipe.fingerprint``:

- **The shard listing Zephon uses**, with the row count Zephon assigns each shard. :func:`zephon_shard_listing`
  follows Zephon 0.2.0's own discovery for the recipe's format, step for step and through Zephon's own index
  reader, validity check and suffix tables: a usable ``index.json`` (or ``_index.json``) wins and its shard names
  and row counts are what Zephon reads; without one, the files directly in the source directory (not in
  subdirectories) whose names end in Zephon's suffixes (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.jsonl.bz2``,
  ``.jsonl.xz``; ``.parquet``), sorted by name. ``tests/test_identity.py::test_listing_agrees_with_zephon_discovery``
  checks it against Zephon's ``discover()`` on several layouts. The row counts come from Zephon's
  ``Dataset.from_path`` where the recipe is loaded. An index that names the same shards with their true row
  counts therefore gives the same fingerprint as a directory scan, as it gives the same batches.
- **Shard content.** A sha256 per listed file (the compressed bytes for a compressed shard), computed once and
  cached per node (:func:`digest_files`).
- **The environment** (:class:`Environment`): the tokenizer's content hash, the zephon and tokenizers versions, and
  the global-batch digest format.

Every process that serves data proves it sees the same identity with :func:`verify_on_node` before serving
anything; a mismatch is an :class:`IdentityMismatchError` naming the node, the file and the field.

The hash cache: one small JSON manifest per source directory under ``$ZEPHON_RAY_CACHE_DIR`` (default
``$XDG_CACHE_HOME/zephon-ray`` or ``~/.cache/zephon-ray``), written atomically. An entry is trusted only while the
file's (size, mtime_ns, ctime_ns, inode, device) are all unchanged. Rewriting a file changes its ctime, which no
user call can set back, so a rewrite in place at the same size with its mtime restored is still rehashed
(``tests/test_identity.py::test_hash_cache_is_used_and_never_trusted_blindly``). Files changed within the last
:data:`RACY_WINDOW_S` seconds are hashed but not cached, because file timestamps tick coarsely and a second write
in the same tick would otherwise keep the same key. A manifest that does not parse is ignored and rebuilt.

Limits: a file whose content changes while size, mtime, ctime, inode and device all stay the same (a filesystem
that does not keep ctime, or a clock set back) is trusted from the cache; set ``ZEPHON_RAY_HASH_CACHE=0`` to
rehash every time. Only the ``jsonl`` and ``parquet`` formats are supported. A compressed shard is identified by
its compressed bytes, so recompressing the same records changes the fingerprint though not the batches. Of an
``index.json`` only the shard names and row counts are covered, not its other per-shard fields (a parquet index's
row-group table, a compressed shard's decoded size): an index that lies about those is not detected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import stat
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)

IDENTITY_FORMAT = "zephon-ray/identity/v1"
CACHE_FORMAT = "zephon-ray/shard-sha256-cache/v1"
CACHE_DIR_ENV = "ZEPHON_RAY_CACHE_DIR"
CACHE_SWITCH_ENV = "ZEPHON_RAY_HASH_CACHE"
SUPPORTED_FORMATS = ("jsonl", "parquet")
LISTING_SCAN = "scan"
LISTING_INDEX = "index"

RACY_WINDOW_S = 2.0
"""Files whose mtime or ctime is this recent are hashed but not cached (see the module docstring)."""
RAY_MIN_FILES = 256
"""With Ray initialised, at least this many uncached files are hashed by Ray tasks pinned to this node."""
PROGRESS_MIN_BYTES = 1 << 30
PROGRESS_MIN_FILES = 2000
_READ_CHUNK = 1 << 20
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ShardListingError(ValueError):
    """A source directory from which Zephon would read no shards, or an index it cannot read."""


class IdentityMismatchError(ValueError):
    """What this process sees differs from the recipe's identity; the message names the node, file and field."""


class CheckpointDisagreementError(ValueError):
    """The participants of a collective checkpoint returned different merged states; nothing was persisted."""


# ---------------------------------------------------------------------------------------------- data types
@dataclass(frozen=True)
class ShardIdentity:
    """One shard as Zephon reads it: its name relative to the source directory, size, content hash and the row
    count Zephon's discovery assigns it (from ``index.json`` when Zephon uses one, else from the file)."""

    name: str
    size: int
    sha256: str
    rows: int | None

    def canonical(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256, "rows": self.rows}


@dataclass(frozen=True)
class Environment:
    """The libraries and tokenizer that turn the same files into the same batches."""

    tokenizer: str
    zephon: str
    tokenizers: str
    digest_format: str

    @classmethod
    def capture(cls, tokenizer_spec: str) -> "Environment":
        import zephon

        from zephon_ray.batch import DIGEST_HEADER
        from zephon_ray.tokenizers import tokenizer_identity

        try:
            tokenizers_version = metadata.version("tokenizers")
        except metadata.PackageNotFoundError:
            tokenizers_version = "absent"
        return cls(
            tokenizer=tokenizer_identity(tokenizer_spec),
            zephon=str(zephon.__version__),
            tokenizers=tokenizers_version,
            digest_format=DIGEST_HEADER.decode().strip(),
        )

    def canonical(self) -> dict[str, str]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------- listing
def _zephon_format(fmt: str) -> Any:
    from zephon._internal.io.formats import ensure_builtin_formats
    from zephon._internal.io.formats.base import get_format

    ensure_builtin_formats(required={fmt})
    return get_format(fmt)


def _usable_index(handler: Any, fmt: str, data: Any) -> bool:
    """Zephon's own rule (``JsonlFormat.discover`` / ``ParquetFormat.discover``) for trusting an index."""
    from zephon._internal.io.index.index_types import is_shard_index

    if not is_shard_index(data):
        return False
    if fmt == "jsonl":
        return bool(handler._is_valid_jsonl_index(data))
    return bool(handler._is_valid_parquet_index(data))


def format_suffixes(fmt: str) -> tuple[str, ...]:
    from zephon._internal.io.suffixes import JSONL_SUFFIXES, PARQUET_SUFFIXES

    return {"jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES}[fmt]


def zephon_shard_listing(path: str | Path, fmt: str) -> tuple[str, list[tuple[str, int | None]]]:
    """The shards Zephon's discovery reads from ``path`` as format ``fmt``, in Zephon's shard-id order.

    Returns ``(LISTING_INDEX or LISTING_SCAN, [(name relative to path, rows from the index or None), ...])``.
    Raises :class:`ShardListingError` where Zephon would fail or read nothing.
    """
    if fmt not in SUPPORTED_FORMATS:
        raise ShardListingError(f"format {fmt!r} is not supported (use one of {', '.join(SUPPORTED_FORMATS)})")
    from zephon._internal.io.index import find_and_load_index
    from zephon._internal.io.storage import RouterStorageBackend

    root = Path(path).resolve()
    if not root.is_dir():
        raise ShardListingError(f"source directory not found: {root}")
    storage = RouterStorageBackend()
    handler = _zephon_format(fmt)
    root_str = handler.resolve_root(storage.canonical_root(str(root), fmt=fmt), storage)
    try:
        index = find_and_load_index(root_str, storage)
    except ValueError as exc:  # Zephon fails on an index.json it cannot parse; so do we, naming the file
        raise ShardListingError(f"{root}: unusable index file: {exc}") from None
    if index is not None and _usable_index(handler, fmt, index):
        return LISTING_INDEX, [(str(shard["basename"]), int(shard.get("num_rows", 0))) for shard in index["shards"]]
    suffixes = format_suffixes(fmt)
    # Zephon's LocalStorageBackend.listdir is the names in the directory (files and directories alike); os.listdir
    # gives the same names without sorting 10,000 Path objects, and Zephon then sorts the names, as we do.
    names = sorted(name for name in os.listdir(root_str) if name.endswith(suffixes))
    if not names:
        raise ShardListingError(f"source directory holds no {fmt} shards ({', '.join(suffixes)}): {root}")
    return LISTING_SCAN, [(name, None) for name in names]


def detect_format(path: str | Path) -> str:
    """The format of the shard files directly in ``path``; refuses a directory that mixes formats."""
    root = Path(path)
    names = [p.name for p in root.iterdir() if p.is_file()]
    present = [f for f in SUPPORTED_FORMATS if any(n.endswith(format_suffixes(f)) for n in names)]
    if not present:
        wanted = ", ".join(s for f in SUPPORTED_FORMATS for s in format_suffixes(f))
        raise ShardListingError(f"source directory holds no shards ({wanted}): {root}")
    if len(present) > 1:
        raise ShardListingError(f"{root} mixes {' and '.join(present)} shards; set 'format'")
    return present[0]


def source_identity(path: str | Path, fmt: str, *, known: Sequence[ShardIdentity] | None = None,
                    progress: bool | None = None) -> tuple[str, tuple[ShardIdentity, ...]]:
    """``(listing kind, shard identities)`` of one source directory as this process sees it.

    Row counts come from the index when Zephon uses one. Otherwise they are a function of the content: with
    ``known`` (the recipe's shards) a shard with the same name and sha256 takes the known count and any other
    gets ``None``, which costs nothing; without ``known`` Zephon's ``Dataset.from_path`` counts them (a full read).
    """
    root = Path(path).resolve()
    listing, entries = zephon_shard_listing(root, fmt)
    sizes, digests = _digest([os.path.normpath(os.path.join(root, name)) for name, _ in entries],
                             progress=progress, use_ray=None)
    rows = [r for _, r in entries]
    if listing == LISTING_SCAN:
        if known is not None:
            by_content = {(s.name, s.sha256): s.rows for s in known}
            rows = [by_content.get((name, digest)) for (name, _), digest in zip(entries, digests)]
        else:
            rows = zephon_row_counts(root, fmt)
            if len(rows) != len(entries):
                raise ShardListingError(f"{root}: Zephon discovered {len(rows)} shards, the listing has "
                                        f"{len(entries)} (the directory changed while it was read?)")
    return listing, tuple(ShardIdentity(name=name, size=size, sha256=digest, rows=r)
                          for (name, _), size, digest, r in zip(entries, sizes, digests, rows))


def zephon_row_counts(path: Path, fmt: str) -> list[int]:
    """Per-shard row counts in shard-id order, from Zephon's own ``Dataset.from_path``."""
    from zephon.io import Dataset

    try:
        return [int(c) for c in Dataset.from_path(path.name or "source", str(path), fmt=fmt).counts()]
    except (ValueError, FileNotFoundError) as exc:
        raise ShardListingError(f"{path}: Zephon cannot read this source: {exc}") from None


# ---------------------------------------------------------------------------------------------- hashing
def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zephon-ray"


def _cache_enabled() -> bool:
    return os.environ.get(CACHE_SWITCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _manifest_path(directory: str) -> Path:
    return cache_dir() / f"sha256-{hashlib.sha256(directory.encode()).hexdigest()[:32]}.json"


def _load_manifest(path: Path) -> dict[str, list]:
    """Entries ``{absolute path: [size, mtime_ns, ctime_ns, ino, dev, sha256]}``; anything malformed is dropped."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("files"), dict):
        return {}
    return {name: entry for name, entry in data["files"].items()
            if isinstance(entry, list) and len(entry) == 6 and all(type(x) is int for x in entry[:5])
            and isinstance(entry[5], str) and _SHA256_HEX.fullmatch(entry[5])}


def _write_manifest(path: Path, directory: str, files: dict[str, list]) -> None:
    """Atomic replace; a cache that cannot be written only costs a rehash next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"format": CACHE_FORMAT, "dir": directory, "files": files}, fh)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        logger.warning("zephon-ray: cannot write the shard hash cache %s (%s); shards will be rehashed", path, exc)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sha256_many(paths: list[str]) -> list[str]:
    return [sha256_file(p) for p in paths]


@dataclass
class HashReport:
    """What the last :func:`digest_files` call did (for tests and benchmarks)."""

    files: int = 0
    cached: int = 0
    hashed: int = 0
    bytes_hashed: int = 0
    via: str = "none"


last_report = HashReport()


def _hash_with_threads(todo: list[str], sizes: list[int], progress: bool) -> list[str]:
    from tqdm import tqdm

    workers = max(1, min(8, 2 * (os.cpu_count() or 1), len(todo)))
    with ThreadPoolExecutor(max_workers=workers) as pool, tqdm(
        total=sum(sizes), unit="B", unit_scale=True, desc="zephon-ray: hashing shards", disable=not progress,
        file=sys.stderr,
    ) as bar:
        out = []
        for size, digest in zip(sizes, pool.map(sha256_file, todo)):
            out.append(digest)
            bar.update(size)
    return out


def _hash_with_ray(todo: list[str], sizes: list[int], progress: bool) -> list[str]:
    """Ray tasks pinned to this node (they must read this node's files), claiming no CPU: hashing is I/O-bound
    and must never wait behind the fractional-CPU actors that asked for it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from tqdm import tqdm

    node = ray.get_runtime_context().get_node_id()
    task = ray.remote(num_cpus=0, max_retries=1)(_sha256_many).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
    parts = max(1, min(4 * (os.cpu_count() or 1), len(todo) // 64 or 1))
    bounds = [(i * len(todo) // parts, (i + 1) * len(todo) // parts) for i in range(parts)]
    refs = {task.remote(todo[a:b]): (a, b) for a, b in bounds}
    out: list[str] = [""] * len(todo)
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="zephon-ray: hashing shards (ray)",
              disable=not progress, file=sys.stderr) as bar:
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            a, b = refs[done[0]]
            out[a:b] = ray.get(done[0])
            bar.update(sum(sizes[a:b]))
    return out


def digest_files(paths: Sequence[str | Path], *, progress: bool | None = None,
                 use_ray: bool | None = None) -> dict[Path, str]:
    """sha256 of every file, from the per-node cache where its stat key is unchanged, else computed in parallel.

    ``use_ray=None`` uses Ray tasks on this node when Ray is initialised here and at least :data:`RAY_MIN_FILES`
    files need hashing, else a thread pool. ``progress=None`` shows a tqdm bar for large jobs.
    """
    names = [str(p) for p in paths]
    sizes, digests = _digest(names, progress=progress, use_ray=use_ray)
    return {Path(n): d for n, d in zip(names, digests)}


def _digest(paths: list[str], *, progress: bool | None, use_ray: bool | None) -> tuple[list[int], list[str]]:
    """``(sizes, sha256s)`` aligned with ``paths`` (absolute path strings); see :func:`digest_files`."""
    global last_report
    racy_before = time.time_ns() - int(RACY_WINDOW_S * 1e9)
    use_cache = _cache_enabled()
    keys: list[list[int]] = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError as exc:
            raise ShardListingError(f"shard listed by Zephon's discovery cannot be read: {p} ({exc.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise ShardListingError(f"shard listed by Zephon's discovery is not a regular file: {p}")
        keys.append(_stat_key(st))
    by_dir: dict[str, list[int]] = {}
    for i, p in enumerate(paths):
        by_dir.setdefault(os.path.dirname(p), []).append(i)
    digests: list[str] = [""] * len(paths)
    todo: list[int] = []
    for d, members in by_dir.items():
        cached = _load_manifest(_manifest_path(d)) if use_cache else {}
        for i in members:
            hit = cached.get(paths[i])
            if hit is not None and hit[:5] == keys[i]:
                digests[i] = hit[5]
            else:
                todo.append(i)
    sizes = [keys[i][0] for i in todo]
    if progress is None:
        progress = sum(sizes) >= PROGRESS_MIN_BYTES or len(todo) >= PROGRESS_MIN_FILES
    if use_ray is None:
        use_ray = len(todo) >= RAY_MIN_FILES and "ray" in sys.modules and sys.modules["ray"].is_initialized()
    if todo:
        hashed = (_hash_with_ray if use_ray else _hash_with_threads)([paths[i] for i in todo], sizes, progress)
        for i, digest in zip(todo, hashed):
            digests[i] = digest
        if use_cache:
            dirty = {os.path.dirname(paths[i]) for i in todo}
            for d in dirty:
                # The manifest of a directory holds exactly the files listed now, minus those too recent to trust.
                entries = {paths[i]: keys[i] + [digests[i]] for i in by_dir[d]
                           if max(keys[i][1], keys[i][2]) < racy_before}
                _write_manifest(_manifest_path(d), d, entries)
    last_report = HashReport(files=len(paths), cached=len(paths) - len(todo), hashed=len(todo),
                             bytes_hashed=sum(sizes), via="none" if not todo else ("ray" if use_ray else "threads"))
    return [k[0] for k in keys], digests


# ---------------------------------------------------------------------------------------------- the check
def node_description() -> str:
    """Hostname, plus the Ray node id and IP when this process is part of a Ray cluster."""
    parts = [f"host {socket.gethostname()}"]
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            parts.append(f"ray node {ray.get_runtime_context().get_node_id()[:12]}")
            parts.append(f"ip {ray.util.get_node_ip_address()}")
        except Exception:  # describing the node must never hide the real error
            pass
    return ", ".join(parts)


def _short(value: Any) -> str:
    text = str(value)
    return text[:12] + "…" if len(text) == 64 else text


def _diff(recipe: Any, observed_env: Environment,
          observed_sources: list[tuple[str | None, tuple[ShardIdentity, ...], str | None]]) -> list[str]:
    """Every difference between the recipe's carried identity and this node's, one readable line each."""
    out = []
    for key, want in recipe.environment.canonical().items():
        got = getattr(observed_env, key)
        if got != want:
            out.append(f"{key}: {_short(got)} here, {_short(want)} in the recipe's fingerprint")
    for source, (listing, shards, error) in zip(recipe.sources, observed_sources):
        label = f"source '{source.name}' ({source.path})"
        if error is not None:
            out.append(f"{label}: {error}")
            continue
        want = {s.name: s for s in source.shards}
        got = {s.name: s for s in shards}
        for name in [s.name for s in source.shards if s.name not in got]:
            out.append(f"{label} shard {name}: missing here, present in the recipe's fingerprint")
        for name in [s.name for s in shards if s.name not in want]:
            out.append(f"{label} shard {name}: present here, not in the recipe's fingerprint")
        for s in source.shards:
            mine = got.get(s.name)
            if mine is None:
                continue
            for key in ("size", "sha256", "rows"):
                if getattr(mine, key) is not None and getattr(mine, key) != getattr(s, key):
                    out.append(f"{label} shard {s.name}: {key} {_short(getattr(mine, key))} here, "
                               f"{_short(getattr(s, key))} in the recipe's fingerprint")
        if not any(m.startswith(label) for m in out) and [s.name for s in shards] != [s.name for s in source.shards]:
            out.append(f"{label}: shard order differs from the recipe's fingerprint")
    return out


def verify_on_node(recipe: Any, expected_fingerprint: str | None = None, *, where: str = "this process") -> str:
    """Recompute ``recipe``'s identity from what this process can see, before it serves anything.

    Checks the recipe object against ``expected_fingerprint`` (when given), then re-lists every source through
    Zephon's discovery, rehashes (or reuses cached hashes of) every shard and re-reads the environment on this
    node. Returns the fingerprint. Raises :class:`IdentityMismatchError` naming this node (``where`` plus hostname,
    Ray node id and IP), the file and the differing field. Cost: a listing and a ``stat`` per shard when the
    node's hash cache is warm (``benchmarks/bench_fingerprint.py``); a full read of every shard when it is cold.
    """
    carried = recipe.fingerprint
    if expected_fingerprint is not None and carried != expected_fingerprint:
        raise IdentityMismatchError(
            f"{where} on {node_description()}: was handed recipe fingerprint {carried[:12]}, expected "
            f"{expected_fingerprint[:12]}")
    observed_env = Environment.capture(recipe.tokenizer)
    observed_sources = []
    for source in recipe.sources:
        try:
            listing, shards = source_identity(source.path, source.format, known=source.shards)
            observed_sources.append((listing, shards, None))
        except (ShardListingError, OSError) as exc:
            observed_sources.append((None, (), str(exc)))
    problems = _diff(recipe, observed_env, observed_sources)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise IdentityMismatchError(
            f"{where} on {node_description()} does not see the data of recipe {recipe.describe()}: "
            + "; ".join(problems[:3]) + more)
    return carried


# ---------------------------------------------------------------------------------------------- collective agreement
def state_digest(state: Any) -> str:
    """sha256 of a JSON-safe state in canonical form (keys as JSON writes them, sorted)."""
    canonical = json.loads(json.dumps(state))
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_checkpoint_agreement(states: Sequence[Any], *, what: str = "collective checkpoint") -> Any:
    """Return the merged state once every participant's copy hashes the same; raise before anything is persisted.

    ``states[r]`` is participant r's copy. On disagreement raises :class:`CheckpointDisagreementError` naming the
    ranks whose copy differs from the majority (from rank 0's when there is no majority).
    """
    if not states:
        raise CheckpointDisagreementError(f"{what}: no participant returned a state")
    digests = [state_digest(s) for s in states]
    if len(set(digests)) == 1:
        return states[0]
    counts = Counter(digests)
    top, top_count = counts.most_common(1)[0]
    reference = top if top_count * 2 > len(digests) else digests[0]
    ref_rank = digests.index(reference)
    odd = [r for r, d in enumerate(digests) if d != reference]
    detail = ", ".join(f"rank {r} has {digests[r][:12]}" for r in odd)
    raise CheckpointDisagreementError(
        f"{what}: participants disagree on the merged state ({detail}; rank {ref_rank} and "
        f"{len(digests) - len(odd) - 1} other(s) have {reference[:12]}); not persisted, the previous durable "
        "checkpoint is kept")

