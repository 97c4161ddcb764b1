"""Zephon's storage view, as zephon-ray needs it: THE fenced module for Zephon's private internals.

Everything zephon-ray uses from ``zephon._internal`` is imported here and nowhere else
(tests/test_identity.py::test_zephon_internals_fence fails loudly, naming the missing name, when a Zephon
release moves or changes one). What it wraps:

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

Endpoints: Zephon 0.2 reads ``S3_ENDPOINT_URL`` only; :func:`zephon_ray.files.export_endpoint_for_zephon` sets it
from ``AWS_ENDPOINT_URL(_S3)`` before any store is built here.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from zephon_ray.files import export_endpoint_for_zephon, is_uri

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
FENCED_METHODS = (
    ("jsonl", "_is_valid_jsonl_index"),
    ("parquet", "_is_valid_parquet_index"),
)
"""Private methods of Zephon's format handlers used for the index rule."""


class ZephonIOError(ValueError):
    """A listing or read that Zephon's storage cannot do; the message names the path or URI. ``transient``: the
    cause may pass (zephon_ray.files.retry waits those out)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient

    def __reduce__(self):
        return (_zephon_io_error, (str(self), self.transient))


def _zephon_io_error(message: str, transient: bool) -> "ZephonIOError":
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
            code = text[i + len(marker):].split("<", 1)[0]
            msg = ""
            j = text.find("<Message>")
            if j >= 0:
                msg = text[j + 9:].split("<", 1)[0]
            return f"{code}: {msg}".strip(": ")
    if "Connect" in text or "connection" in text.lower():
        return "cannot connect to the endpoint (" + (os.environ.get("S3_ENDPOINT_URL") or "default AWS") + ")"
    return text[:300]


def list_objects(uri: str) -> list[ObjectInfo]:
    """The objects directly under ``uri`` (a prefix; not in sub-prefixes), sorted by name, with size, ETag and
    version, from ONE listing through the obstore store Zephon builds for the bucket. A missing bucket or refused
    credentials is one :class:`ZephonIOError` naming the URI; an unreachable endpoint, throttling or a server error
    is retried (obstore's own retry inside each try, zephon_ray.files.retry's budget around them) before it is."""
    from zephon_ray.files import StorageError, retry

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
                name = path[len(base):] if path.startswith(base) else None
                if not name or "/" in name:
                    continue
                etag = meta.get("e_tag")
                out.append(ObjectInfo(name=name, size=int(meta["size"]),
                                      etag=etag.strip('"') if etag else None, version=meta.get("version")))
    except Exception as exc:  # obstore raises its own exception classes; name the URI once
        detail = _describe(exc)
        if "NoSuchBucket" in detail:
            raise ZephonIOError(f"{uri}: bucket {bucket!r} does not exist") from None
        if "AccessDenied" in detail or "InvalidAccessKeyId" in detail or "SignatureDoesNotMatch" in detail \
                or "403" in detail:
            raise ZephonIOError(f"{uri}: access denied ({detail}); check the credentials "
                                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)") from None
        from zephon_ray.files import is_transient

        raise ZephonIOError(f"{uri}: cannot list ({detail})",
                            transient=is_transient(exc) or "cannot connect" in detail) from None
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
    except Exception as exc:
        raise ZephonIOError(f"{uri}: cannot read ({_describe(exc)})") from None


def shard_cache_root(paths: Any) -> str:
    """Node-local directory for Zephon's shard cache of the remote sources at ``paths``.

    Each set of remote roots gets its own directory under ``ZEPHON_RAY_SHARD_CACHE`` (default
    ``<tmp>/zephon-ray-shards-<uid>``): Zephon refuses a cache root that a live process holds for other datasets
    (``CacheInUseError``), so two pipelines of one node reading different buckets at once (two services, or a
    service and a notebook) would otherwise fail (tests/test_s3.py::test_two_buckets_read_at_once_on_one_node)."""
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
