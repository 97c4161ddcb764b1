"""The per-node sha256 cache of local shard files: hash each file once per node, then trust a stat key.

One small JSON manifest per source directory under ``$ZEPHON_RAY_CACHE_DIR`` (default ``$XDG_CACHE_HOME/zephon-ray``
or ``~/.cache/zephon-ray``), written atomically (:func:`zephon_ray.storage.write_atomic`). The cache always stays on
the node's local disk, whatever storage the data is on; object-store shards are never cached here (their identity
is the store's ETag; ``--verify-content`` rehashes them every time).

Guarantee: an entry is trusted only while the file's (size, mtime_ns, ctime_ns, inode, device) are all unchanged. Rewriting
a file changes its ctime, which no user call can set back, so a rewrite in place at the same size with its mtime
restored is still rehashed. Files
changed within the last :data:`RACY_WINDOW_S` seconds are hashed but not cached, because file timestamps tick
coarsely and a second write in the same tick would otherwise keep the same key. A manifest that does not parse is
ignored and rebuilt.

Limits: a file whose content changes while size, mtime, ctime, inode and device all stay the same (a filesystem
that does not keep ctime, or a clock set back) is trusted from the cache; set ``ZEPHON_RAY_HASH_CACHE=0`` to
rehash every time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from zephon_ray import storage

logger = logging.getLogger(__name__)

CACHE_FORMAT = "zephon-ray/shard-sha256-cache/v1"
CACHE_DIR_ENV = "ZEPHON_RAY_CACHE_DIR"
CACHE_SWITCH_ENV = "ZEPHON_RAY_HASH_CACHE"
RACY_WINDOW_S = 2.0
"""Files whose mtime or ctime is this recent are hashed but not cached (see the module docstring)."""
RAY_MIN_FILES = 256
"""With Ray initialised, at least this many uncached files are hashed by Ray tasks pinned to this node."""
PROGRESS_MIN_BYTES = 1 << 30
PROGRESS_MIN_FILES = 2000
HASH_TASK_TIMEOUT_S = 1800.0
"""The longest a hashing task may run before the fingerprint gives up with one line (a task holds at most a
``1 / parts`` share of the files)."""
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class UnreadableShardError(ValueError):
    """A listed shard that cannot be stat'ed or read on this node; the message names the file and the reason."""


@dataclass
class HashReport:
    """What one :func:`digest` call did: pass one in to have it filled (tests and benchmarks read it)."""

    files: int = 0
    cached: int = 0
    hashed: int = 0
    bytes_hashed: int = 0
    via: str = "none"


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zephon-ray"


def cache_enabled() -> bool:
    return os.environ.get(CACHE_SWITCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _manifest_path(directory: str) -> Path:
    return cache_dir() / f"sha256-{hashlib.sha256(directory.encode()).hexdigest()[:32]}.json"


def _load_manifest(path: Path) -> dict[str, list]:
    """Entries ``{absolute path: [size, mtime_ns, ctime_ns, ino, dev, sha256]}``; anything malformed is dropped."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("files"), dict):
        return {}
    return {
        name: entry
        for name, entry in data["files"].items()
        if isinstance(entry, list)
        and len(entry) == 6
        and all(type(x) is int for x in entry[:5])
        and isinstance(entry[5], str)
        and _SHA256_HEX.fullmatch(entry[5])
    }


def _write_manifest(path: Path, directory: str, entries: dict[str, list]) -> None:
    """Atomic replace; a cache that cannot be written only costs a rehash next time."""
    try:
        storage.write_json(str(path), {"format": CACHE_FORMAT, "dir": directory, "files": entries}, compact=True)
    except OSError as exc:
        logger.warning("zephon-ray: cannot write the shard hash cache %s (%s); shards will be rehashed", path, exc)


def _sha256_checked(path: str) -> str:
    try:
        return storage.sha256_file(path)
    except OSError as exc:
        raise UnreadableShardError(f"shard {path} cannot be read ({exc.strerror or exc})") from None


def _sha256_many(paths: list[str]) -> list[str]:
    return [_sha256_checked(p) for p in paths]


def _hash_with_threads(todo: list[str], sizes: list[int], progress: bool) -> list[str]:
    from tqdm import tqdm

    workers = max(1, min(8, 2 * (os.cpu_count() or 1), len(todo)))
    with (
        ThreadPoolExecutor(max_workers=workers) as pool,
        tqdm(
            total=sum(sizes),
            unit="B",
            unit_scale=True,
            desc="zephon-ray: hashing shards",
            disable=not progress,
            file=sys.stderr,
        ) as bar,
    ):
        out = []
        for size, digest in zip(sizes, pool.map(_sha256_checked, todo)):
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
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    )
    parts = max(1, min(4 * (os.cpu_count() or 1), len(todo) // 64 or 1))
    bounds = [(i * len(todo) // parts, (i + 1) * len(todo) // parts) for i in range(parts)]
    refs = {task.remote(todo[a:b]): (a, b) for a, b in bounds}
    out: list[str] = [""] * len(todo)
    with tqdm(
        total=sum(sizes),
        unit="B",
        unit_scale=True,
        desc="zephon-ray: hashing shards (ray)",
        disable=not progress,
        file=sys.stderr,
    ) as bar:
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=HASH_TASK_TIMEOUT_S)
            if not done:
                raise TimeoutError(
                    f"hashing shards: no task of {len(pending)} finished within {HASH_TASK_TIMEOUT_S:.0f}s"
                )
            a, b = refs[done[0]]
            out[a:b] = ray.get(done[0], timeout=60)  # finished: only its digests to read
            bar.update(sum(sizes[a:b]))
    return out


def digest_files(
    paths: Sequence[str | Path],
    *,
    progress: bool | None = None,
    use_ray: bool | None = None,
    report: HashReport | None = None,
) -> dict[Path, str]:
    """sha256 of every local file, from the per-node cache where its stat key is unchanged, else computed in
    parallel. ``use_ray=None`` uses Ray tasks on this node when Ray is initialised here and at least
    :data:`RAY_MIN_FILES` files need hashing, else a thread pool. ``progress=None`` shows a tqdm bar for large jobs.
    ``report``, when given, is filled with what was cached and hashed."""
    names = [str(p) for p in paths]
    _sizes, digests = digest(names, progress=progress, use_ray=use_ray, report=report)
    return {Path(n): d for n, d in zip(names, digests)}


def digest(
    paths: list[str], *, progress: bool | None = None, use_ray: bool | None = None, report: HashReport | None = None
) -> tuple[list[int], list[str]]:
    """``(sizes, sha256s)`` aligned with ``paths`` (absolute local path strings); see :func:`digest_files`.
    A file that cannot be stat'ed or read is one :class:`UnreadableShardError` naming it."""
    racy_before = time.time_ns() - int(RACY_WINDOW_S * 1e9)
    use_cache = cache_enabled()
    keys: list[list[int]] = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError as exc:
            raise UnreadableShardError(f"shard {p} cannot be read ({exc.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableShardError(f"shard {p} is not a regular file")
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
        for i, value in zip(todo, hashed):
            digests[i] = value
        if use_cache:
            for d in {os.path.dirname(paths[i]) for i in todo}:
                # The manifest of a directory holds exactly the files listed now, minus those too recent to trust.
                entries = {
                    paths[i]: keys[i] + [digests[i]] for i in by_dir[d] if max(keys[i][1], keys[i][2]) < racy_before
                }
                _write_manifest(_manifest_path(d), d, entries)
    if report is not None:
        report.files, report.cached, report.hashed = len(paths), len(paths) - len(todo), len(todo)
        report.bytes_hashed = sum(sizes)
        report.via = "none" if not todo else ("ray" if use_ray else "threads")
    return [k[0] for k in keys], digests
