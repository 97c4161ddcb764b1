"""Zephon's storage view, as zephon-ray needs it: THE fenced module for Zephon's private internals.

Everything zephon-ray uses from ``zephon._internal`` is imported here and nowhere else
(a fence test of the suite fails loudly, naming the missing name, when a Zephon release moves or changes one). What it wraps:

- discovery rules of Zephon 0.2.0: a format's handler, its rule for trusting an ``index.json``, its shard
  suffixes, its index reader, and its storage router (``RouterStorageBackend``: local paths and ``s3://``,
  ``gs://``, ``az://`` through obstore);
- the object listing *with metadata* (size, ETag, version) through the same obstore store Zephon builds for a
  bucket (its credentials and endpoint), so a remote fingerprint is Zephon's listing plus the store's own
  content identity, and no shard is downloaded;
- reading a source object's bytes through the router (pre-tokenisation, ``--verify-content``);
- the pipeline option Zephon needs to read remote roots: ``io_options={"cache": {"enabled": True, "root": DIR}}``
  (:func:`pipeline_io_options`; Zephon raises "Cannot read remote dataset root ... without the shard cache"
  otherwise). DIR is node-local: ``<ZEPHON_RAY_SHARD_CACHE or <tmp>/zephon-ray-shards-<uid>>/<key>``, one key per
  set of remote roots.

- mixture phases (:mod:`zephon_ray.lanes`, "Phases"): the state of ``StaticMixtureWorkSource``'s *global* chunk
  stream at a given global chunk index, with its weights replaced, loaded into an unbound work source that a new
  pipeline then clones for each lane (:class:`ChunkStream`, :func:`load_work_source_state`), and the global
  chunk index of a lane's c-th chunk (:meth:`ChunkStream.global_index`), from Zephon's own chunk-to-lane routing.
  ``WORK_SOURCE_STATE_KEYS`` are the state keys read or written; a fence test
  fails loudly, naming the key, when a Zephon release changes them.

Endpoints: Zephon 0.2 reads ``S3_ENDPOINT_URL`` only; :func:`zephon_ray.storage.export_endpoint_for_zephon` sets it
from ``AWS_ENDPOINT_URL(_S3)`` before any store is built here.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from zephon_ray.errors import one_line
from zephon_ray.storage import export_endpoint_for_zephon, is_uri

SHARD_CACHE_ENV = "ZEPHON_RAY_SHARD_CACHE"

# Every private name used, as (module, attribute): the fence test imports each one.
FENCED_NAMES = (
    ("zephon._internal.io.formats", "ensure_builtin_formats"),
    ("zephon._internal.io.formats.base", "get_format"),
    ("zephon._internal.io.index.index_types", "is_shard_index"),
    ("zephon._internal.io.index", "find_and_load_index"),
    ("zephon._internal.io.suffixes", "JSONL_SUFFIXES"),
    ("zephon._internal.io.suffixes", "PARQUET_SUFFIXES"),
    ("zephon._internal.io.storage", "RouterStorageBackend"),
)
FENCED_WORK_SOURCE_ATTRS = (
    "_lane",
    "_canon",
    "_lane_for_chunk",
    "clone_for_lane",
    "next_chunk",
    "state_dict",
    "load_state_dict",
)
"""StaticMixtureWorkSource attributes used for phases: ``_lane``/``_canon`` (its lane binding, which
``load_state_dict`` checks) and ``_lane_for_chunk`` (its chunk-to-lane routing) are private."""
WORK_SOURCE_STATE_KEYS = (
    "global_chunk_index",
    "weights",
    "component_order",
    "lane_id",
    "canonical_replicas",
    "cursor_states",
    "accumulators",
    "allocation_mode",
)
FENCED_METHODS = (
    ("jsonl", "_is_valid_jsonl_index"),
    ("parquet", "_is_valid_parquet_index"),
)
"""Private methods of Zephon's format handlers used for the index rule."""


class ZephonIOError(ValueError):
    """A listing or read that Zephon's storage cannot do; the message names the path or URI. ``transient``: the
    cause may pass (zephon_ray.storage.retry waits those out)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient

    def __reduce__(self):
        return (_zephon_io_error, (str(self), self.transient))


def _zephon_io_error(message: str, transient: bool) -> ZephonIOError:
    return ZephonIOError(message, transient=transient)


@dataclass(frozen=True)
class ObjectInfo:
    """One object as the store lists it: name relative to the listed prefix, size, ETag and version (when the
    store's listing carries one: GCS generations do, S3's ListObjectsV2 does not)."""

    name: str
    size: int
    etag: str | None
    version: str | None


def format_handler(fmt: str) -> Any:
    from zephon._internal.io.formats import ensure_builtin_formats
    from zephon._internal.io.formats.base import get_format

    ensure_builtin_formats(required={fmt})
    return get_format(fmt)


def format_suffixes(fmt: str) -> tuple[str, ...]:
    from zephon._internal.io.suffixes import JSONL_SUFFIXES, PARQUET_SUFFIXES

    return {"jsonl": tuple(JSONL_SUFFIXES), "parquet": tuple(PARQUET_SUFFIXES)}[fmt]


def usable_index(fmt: str, data: Any) -> bool:
    """Zephon's own rule (``JsonlFormat.discover`` / ``ParquetFormat.discover``) for trusting an index."""
    from zephon._internal.io.index.index_types import is_shard_index

    if not is_shard_index(data):
        return False
    handler = format_handler(fmt)
    if fmt == "jsonl":
        return bool(handler._is_valid_jsonl_index(data))
    return bool(handler._is_valid_parquet_index(data))


_STORAGE: Any = None


def storage() -> Any:
    """Zephon's storage router (one per process; it caches one obstore store per bucket)."""
    global _STORAGE
    export_endpoint_for_zephon()
    if _STORAGE is None:
        from zephon._internal.io.storage import RouterStorageBackend

        _STORAGE = RouterStorageBackend()
    return _STORAGE


def reset_storage() -> None:
    """Forget the router (and its cached stores and credentials): after changing the environment."""
    global _STORAGE
    _STORAGE = None


def resolved_root(path: str, fmt: str) -> str:
    """The dataset root Zephon reads for ``path`` (its ``canonical_root`` and the format's ``resolve_root``)."""
    store = storage()
    return format_handler(fmt).resolve_root(store.canonical_root(path, fmt=fmt), store)


def load_index(root: str) -> Any:
    """Zephon's index reader on ``root`` (None when there is none); an index Zephon cannot parse raises."""
    from zephon._internal.io.index import find_and_load_index

    return find_and_load_index(root, storage())


def _split(uri: str) -> tuple[str, str, str]:
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key.strip("/")


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    for marker in ("<Code>",):
        i = text.find(marker)
        if i >= 0:
            code = text[i + len(marker) :].split("<", 1)[0]
            msg = ""
            j = text.find("<Message>")
            if j >= 0:
                msg = text[j + 9 :].split("<", 1)[0]
            return f"{code}: {msg}".strip(": ")
    if "Connect" in text or "connection" in text.lower():
        return "cannot connect to the endpoint (" + (os.environ.get("S3_ENDPOINT_URL") or "default AWS") + ")"
    return one_line(text, 300)


def list_objects(uri: str) -> list[ObjectInfo]:
    """The objects directly under ``uri`` (a prefix; not in sub-prefixes), sorted by name, with size, ETag and
    version, from ONE listing through the obstore store Zephon builds for the bucket. A missing bucket or refused
    credentials is one :class:`ZephonIOError` naming the URI; an unreachable endpoint, throttling or a server error
    is retried (obstore's own retry inside each try, zephon_ray.storage.retry's budget around them) before it is."""
    from zephon_ray.storage import StorageError, retry

    try:
        return retry(lambda: _list_objects(uri), uri)
    except StorageError as exc:  # the budget spent
        raise ZephonIOError(str(exc)) from None


def _list_objects(uri: str) -> list[ObjectInfo]:
    import obstore as obs

    scheme, bucket, key = _split(uri)
    backend = storage()._backend_for(uri)
    base = f"{key}/" if key else ""
    try:
        store = backend._get_store(bucket)
        out = []
        for chunk in obs.list(store, prefix=base):
            for meta in chunk:
                path = meta["path"]
                name = path[len(base) :] if path.startswith(base) else None
                if not name or "/" in name:
                    continue
                etag = meta.get("e_tag")
                out.append(
                    ObjectInfo(
                        name=name,
                        size=int(meta["size"]),
                        etag=etag.strip('"') if etag else None,
                        version=meta.get("version"),
                    )
                )
    except Exception as exc:  # noqa: BLE001 - obstore raises its own exception classes; name the URI once
        detail = _describe(exc)
        if "NoSuchBucket" in detail:
            raise ZephonIOError(f"{uri}: bucket {bucket!r} does not exist") from None
        if (
            "AccessDenied" in detail
            or "InvalidAccessKeyId" in detail
            or "SignatureDoesNotMatch" in detail
            or "403" in detail
        ):
            raise ZephonIOError(
                f"{uri}: access denied ({detail}); check the credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
            ) from None
        from zephon_ray.storage import is_transient

        raise ZephonIOError(
            f"{uri}: cannot list ({detail})", transient=is_transient(exc) or "cannot connect" in detail
        ) from None
    return sorted(out, key=lambda o: o.name)


def read_object(uri: str, size: int | None = None) -> bytes:
    """A source object's bytes through Zephon's router (the bytes Zephon reads): one ranged GET when ``size`` is
    known, else Zephon's open (a download to a temp file)."""
    try:
        if size is not None:
            return bytes(storage().read_range(uri, 0, length=size)) if size else b""
        with storage().open(uri, "rb") as fh:
            return fh.read()
    except FileNotFoundError as exc:
        raise ZephonIOError(f"{uri}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - obstore's own exception classes, named once with the URI
        raise ZephonIOError(f"{uri}: cannot read ({_describe(exc)})") from None


def shard_cache_root(paths: Any) -> str:
    """Node-local directory for Zephon's shard cache of the remote sources at ``paths``.

    Each set of remote roots gets its own directory under ``ZEPHON_RAY_SHARD_CACHE`` (default
    ``<tmp>/zephon-ray-shards-<uid>``): Zephon refuses a cache root that a live process holds for other datasets
    (``CacheInUseError``), so two pipelines of one node reading different buckets at once (two services, or a
    service and a notebook) would otherwise fail."""
    parent = os.environ.get(SHARD_CACHE_ENV) or os.path.join(tempfile.gettempdir(), f"zephon-ray-shards-{os.getuid()}")
    roots = sorted(str(p) for p in paths if is_uri(p))
    return os.path.join(parent, hashlib.sha256("\n".join(roots).encode()).hexdigest()[:16])


def pipeline_io_options(paths: Any) -> dict[str, Any]:
    """Extra ``Pipeline.options`` for sources at ``paths``: Zephon's shard cache (node-local) when any of them is
    remote, else nothing. Also exports the S3 endpoint for Zephon in this process."""
    if not any(is_uri(p) for p in paths):
        return {}
    export_endpoint_for_zephon()
    return {"io_options": {"cache": {"enabled": True, "root": shard_cache_root(paths)}}}


# ---------------------------------------------------------------------- mixture phases
class ZephonStateError(RuntimeError):
    """Zephon's work-source state is not the format this module was written for (a Zephon upgrade)."""


def _check_work_source_state(state: Any) -> None:
    missing = [k for k in WORK_SOURCE_STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ZephonStateError(
            f"Zephon's StaticMixtureWorkSource state has no key {missing[0]!r}: this zephon release changed its "
            "state format, which zephon_ray.zephon_io (mixture phases) was written for (zephon 0.2.0)"
        )
    if state["allocation_mode"] != "accumulator":
        raise ZephonStateError(
            f"mixture phases support Zephon's 'accumulator' allocation only, got {state['allocation_mode']!r}"
        )


def load_work_source_state(work_source: Any, state: dict[str, Any], weights: dict[str, float] | None = None) -> None:
    """Put an unbound (not yet cloned for a lane) work source in ``state``, with ``weights`` (normalised, one per
    dataset, zero allowed) replacing the state's. Zephon's ``load_state_dict`` takes the weights from the state, as it
    does seed and chunk_size; it checks the lane binding, so the binding is set around the call and cleared again
    (a pipeline clones the work source for each of its lanes afterwards)."""
    _check_work_source_state(state)
    state = dict(state)
    if state["lane_id"] is None:  # an unbound work source's own state: any binding the loader accepts
        state["lane_id"], state["canonical_replicas"] = 0, 1
    if weights is not None:
        if sorted(weights) != sorted(state["component_order"]):
            raise ZephonStateError(
                f"weights for {sorted(weights)}, but the work source mixes {state['component_order']}"
            )
        state["weights"] = {name: float(weights[name]) for name in state["component_order"]}
    work_source._lane, work_source._canon = state["lane_id"], state["canonical_replicas"]
    try:
        work_source.load_state_dict(state)
    finally:
        work_source._lane, work_source._canon = None, None


class ChunkStream:
    """Zephon's global chunk stream, followed forward, and its chunk-to-lane routing.

    ``work_source`` is an unbound work source (a segment's start); it is not changed. :meth:`advance` draws global
    chunks until ``index`` have been drawn and :meth:`state` is the stream's state there: the same state whether the
    stream got there in one walk or in many (each walk runs the same allocation over the same chunks; the lane
    binding only decides which chunks a call returns), the same as one walk from the
    start. Cost: one allocation per global chunk advanced (about 25 us, ``benchmarks/bench_phases.py``); a routing
    query (:meth:`global_index`) costs one seeded shuffle per block of ``lanes`` chunks, whatever the position.
    """

    def __init__(self, work_source: Any, lanes: int) -> None:
        state = work_source.state_dict()
        _check_work_source_state(state)
        self.lanes = lanes
        self.index = int(state["global_chunk_index"])
        """Global chunks drawn so far."""
        self._clone = work_source.clone_for_lane(0, lanes)
        self._blocks: dict[int, dict[int, int]] = {}

    def advance(self, index: int) -> None:
        if index < self.index:
            raise ValueError(f"global chunk {index} is before the stream's position {self.index}")
        if index == self.index:
            return
        # A lane clone stops right after a chunk it owns: bind it to the owner of chunk index-1.
        self._clone._lane = self._clone._lane_for_chunk(index - 1)
        while self.index < index:
            if self._clone.next_chunk() is None:
                raise ValueError(f"the mixture ran out of data before global chunk {index}")
            self.index = int(self._clone.state_dict()["global_chunk_index"])
        if self.index != index:
            raise ZephonStateError(
                f"reached global chunk {self.index}, not {index}: Zephon's chunk routing is not "
                "what zephon_ray.zephon_io expects"
            )

    def state(self) -> dict[str, Any]:
        """The stream's state at :attr:`index`, bound to the lane that owns chunk ``index - 1``."""
        return self._clone.state_dict()

    def global_index(self, start: int, positions: dict[int, int]) -> dict[int, int]:
        """For each lane l in ``positions``, the global index of its ``positions[l]``-th chunk (0-based) of a
        pipeline whose work source started at global chunk ``start``. Zephon routes each block of ``lanes``
        consecutive global chunks through a seeded permutation of the lanes (``_lane_for_chunk``, a pure function
        of the seed and the chunk index), so a lane gets one chunk per block and numbers its chunks in order."""
        first_block, first_slot = divmod(start, self.lanes)
        head = self._block(first_block)
        out = {}
        for lane, n in positions.items():
            in_head = head[lane] >= first_slot  # the lane's chunk of the partly drawn first block is its chunk 0
            block = first_block + n if in_head else first_block + 1 + n
            out[lane] = block * self.lanes + self._block(block)[lane]
        return out

    def _block(self, block: int) -> dict[int, int]:
        """``{lane: slot}`` of global chunks ``block*lanes .. block*lanes+lanes-1``."""
        slots = self._blocks.get(block)
        if slots is None:
            slots = {self._clone._lane_for_chunk(block * self.lanes + s): s for s in range(self.lanes)}
            if sorted(slots) != list(range(self.lanes)):
                raise ZephonStateError(
                    f"Zephon routed the chunks of block {block} to lanes {sorted(slots)}, not "
                    f"to each of {self.lanes} lanes once: zephon_ray.zephon_io expects that"
                )
            if len(self._blocks) >= 64:
                self._blocks.clear()
            self._blocks[block] = slots
        return slots


def contributing_chunks(record: Any) -> list[tuple[int, tuple[int, ...]]]:
    """``(lane chunk id, sample id)`` of every source record that contributed tokens to a packed row, from Zephon's
    public ``SampleMeta.contribution_cursors()`` (a sample id is ``(dataset id, shard id, index in shard)``)."""
    return [(int(c.chunk_id), tuple(int(x) for x in c.sample_id)) for c in record.meta.contribution_cursors()]


def last_contributing_chunk(records: Any) -> int:
    """The highest lane chunk id that any of ``records`` (packed rows of one lane) drew from; -1 for none."""
    return max((c.chunk_id for rec in records for c in rec.meta.contribution_cursors()), default=-1)
