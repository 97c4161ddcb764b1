"""The pyarrow filesystem of each store: built from the environment once per store and settings, then cached.

    file://  pyarrow.fs.LocalFileSystem
    s3://    pyarrow.fs.S3FileSystem     (endpoint, region, credentials, attempts and timeouts from the environment)
    gs://    pyarrow.fs.GcsFileSystem    (Google's default credentials; an emulator's endpoint is anonymous)
    az://    pyarrow.fs.AzureFileSystem  (AZURE_STORAGE_ACCOUNT_NAME, key or Azure's default credentials)

Usage: :func:`resolve` gives a path or URI's :class:`Location` with its filesystem attached (what every operation
of :mod:`zephon_ray.storage` starts with); :func:`filesystem` gives the filesystem itself, e.g. for
``pyarrow.fs.copy_files``; :func:`ray_train_storage` hands the same one to Ray Train, which uses pyarrow.fs too.

Guarantee: one filesystem per store and settings per process, shared by all threads; settings that change (a new
endpoint, other credentials) make a new one. Inside each call pyarrow makes ``ZEPHON_RAY_S3_MAX_ATTEMPTS``
(default 5) tries with ``ZEPHON_RAY_S3_CONNECT_TIMEOUT_S`` (default 5) per connection and
``ZEPHON_RAY_S3_REQUEST_TIMEOUT_S`` (default 30) per request; the longer waits are
:func:`zephon_ray.storage.retry`'s. A setting out of range is one :class:`StorageError` naming it.

Limits: a cached filesystem keeps the credentials it was built with while the settings it was keyed by stay the
same (a credentials file rewritten in place is not noticed): :func:`clear_filesystem_cache` forgets them all.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from zephon_ray.storage.environment import (
    CONNECT_TIMEOUT_ENV,
    MAX_ATTEMPTS_ENV,
    REQUEST_TIMEOUT_ENV,
    azure_endpoint,
    env_number,
    gcs_endpoint,
    s3_endpoint,
)
from zephon_ray.storage.errors import StorageError
from zephon_ray.storage.locations import Location, location

DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0

_FS_LOCK = threading.Lock()
_FS_CACHE: dict[tuple, Any] = {}


def resolve(value: str | os.PathLike[str] | Location) -> Location:
    """The :class:`Location` of a path or URI with its pyarrow filesystem attached."""
    loc = location(value)
    if loc.fs is None:
        loc = Location(loc.uri, loc.path, loc.scheme, _filesystem(loc.scheme))
    return loc


def filesystem(loc: Location) -> Any:
    """The pyarrow filesystem of ``loc`` (one per store and settings, cached per process)."""
    if loc.fs is not None:
        return loc.fs
    return _filesystem(loc.scheme)


def clear_filesystem_cache() -> None:
    """Forget cached filesystems (after changing credentials or endpoints in this process)."""
    with _FS_LOCK:
        _FS_CACHE.clear()


def ray_train_storage(value: str | os.PathLike[str]) -> dict[str, Any]:
    """``RunConfig(**ray_train_storage("s3://bucket/runs"))``: Ray Train's ``storage_path`` plus the pyarrow
    filesystem of this package, so that Ray Train's checkpoints reach the same endpoint with the same credentials
    (pyarrow's own URI parsing ignores ``AWS_ENDPOINT_URL``). A local path is passed through."""
    loc = resolve(value)
    if not loc.remote:
        return {"storage_path": loc.path}
    return {"storage_path": loc.path, "storage_filesystem": loc.fs}


def _filesystem(scheme: str) -> Any:
    import pyarrow.fs as pafs

    if scheme == "file":
        key: tuple = ("file",)
    elif scheme == "s3":
        endpoint = s3_endpoint()
        key = (
            "s3",
            endpoint,
            os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
            os.environ.get("AWS_ACCESS_KEY_ID"),
            os.environ.get("AWS_SECRET_ACCESS_KEY"),
            os.environ.get("AWS_SESSION_TOKEN"),
            os.environ.get("AWS_PROFILE"),
            env_number(MAX_ATTEMPTS_ENV, DEFAULT_MAX_ATTEMPTS, 1, 100),
            env_number(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S, 0.1, 600),
            env_number(REQUEST_TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT_S, 0.1, 3600),
        )
    elif scheme == "gs":
        key = ("gs", gcs_endpoint(), os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"))
    else:
        key = (
            "az",
            os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"),
            os.environ.get("AZURE_STORAGE_ACCOUNT_KEY"),
            azure_endpoint(),
        )
    with _FS_LOCK:
        fs = _FS_CACHE.get(key)
        if fs is not None:
            return fs
        if scheme == "file":
            fs = pafs.LocalFileSystem()
        elif scheme == "s3":
            _, endpoint, region, *_rest, attempts, connect_s, request_s = key
            kwargs: dict[str, Any] = {
                "region": region or "us-east-1",
                "connect_timeout": connect_s,
                "request_timeout": request_s,
                # The SDK's legacy strategy backs off 50 ms, 100 ms, ... inside a try; the standard one waits up
                # to 1 s, 2 s, ... per throttled request, which cost about 0.5 s per 503 SlowDown here
                # (benchmarks/bench_storage_faults.py). Longer waits are retry()'s, jittered and capped.
                "retry_strategy": pafs.AwsDefaultS3RetryStrategy(max_attempts=int(attempts)),
            }
            if endpoint:
                scheme_part, sep, host = endpoint.partition("://")
                kwargs["endpoint_override"] = host.rstrip("/") if sep else endpoint
                kwargs["scheme"] = scheme_part if sep else "https"
            fs = pafs.S3FileSystem(**kwargs)
        elif scheme == "gs":
            endpoint = key[1]
            if endpoint:  # an emulator or a private endpoint: Google's SDK convention, anonymous
                scheme_part, sep, host = endpoint.partition("://")
                fs = pafs.GcsFileSystem(
                    anonymous=True,
                    endpoint_override=host.rstrip("/") if sep else endpoint,
                    scheme=scheme_part if sep else "https",
                )
            else:
                fs = pafs.GcsFileSystem()
        else:
            _, account, account_key, endpoint = key
            if not account:
                raise StorageError("az:// needs AZURE_STORAGE_ACCOUNT_NAME (the storage account) in the environment")
            kwargs = {"account_name": account}
            if account_key:
                kwargs["account_key"] = account_key
            if endpoint:
                scheme_part, sep, host = endpoint.partition("://")
                host = host.rstrip("/") if sep else endpoint
                scheme_part = scheme_part if sep else "https"
                kwargs.update(
                    blob_storage_authority=host,
                    blob_storage_scheme=scheme_part,
                    dfs_storage_authority=host,
                    dfs_storage_scheme=scheme_part,
                )
            fs = pafs.AzureFileSystem(**kwargs)
        _FS_CACHE[key] = fs
        return fs
