"""The storage layer: every durable read and write of zephon-ray, on a local path or an object-store URI.

    "/data/run7"  "relative/dir"  "s3://bucket/run7"  "gs://bucket/run7"  "az://container/run7"
          └───────────────┬──────────────────┘
                          ▼
    location(x) ──► Location(fs = one pyarrow.fs.FileSystem, path, uri)   (Ray Data and Ray Train use pyarrow.fs)
                          │
       write_atomic / write_json ─ read_bytes / read_json ─ sha256 ─ listing ─ exists ─ delete ─ upload

Every durable file zephon-ray writes or reads (service ``state_dir``, materialised directories, pre-tokenised
copies, the loader's state files) goes through this module; recipe *sources* are read by Zephon's own storage
router instead (:mod:`zephon_ray.zephon_io`), so that the listing and the bytes are Zephon's view.

Commit points (what a reader can see):

- **Local path**: :func:`write_atomic` writes a temp file in the same directory, fsyncs it, renames it over the
  target and fsyncs the directory, so a reader sees the old content or the new one, never a mix, even after a
  crash (tests/test_files.py::test_local_atomic_write_leaves_old_or_new).
- **Object store** (no rename): :func:`write_atomic` is one upload of the whole object. S3 makes an object
  visible only when its PUT (or a multipart upload's CompleteMultipartUpload) succeeds, and then whole: a reader
  sees the previous object or the new one. Nothing is atomic *across* objects, so every format here writes its
  data objects first and its manifest/state object last, under the name that commits; an object the manifest
  does not name is never read (tests/test_s3.py). Not atomic on S3: a group of objects, a delete of a prefix,
  and a listing taken during writes (S3 listings are strongly consistent since 2020, but a listing sees whichever
  objects are complete at that instant).
- Azure (pyarrow's AzureFileSystem) creates a new blob empty when the upload starts and fills it when it commits:
  a reader that polls for an object another process is writing treats an empty one as not written yet
  (lane_exchange.py; tests/test_clouds.py::test_az_basic_path, where that race was seen).
- A process killed during an upload leaves no object (an unfinished multipart upload is invisible; configure a
  bucket lifecycle rule to expire such parts).
- Deleting through pyarrow leaves a zero-byte ``parent/`` marker object (pyarrow's way of keeping a directory
  that may have become empty); :func:`listing` and every format here skip such markers.

Endpoints and credentials follow the AWS SDK conventions, the same for pyarrow, Zephon and Ray workers
(:func:`aws_environment`): ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (Zephon's ``S3_ENDPOINT_URL`` is read
too and set from them), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_PROFILE``
and the profile files, ``AWS_REGION``/``AWS_DEFAULT_REGION``.

Transient faults are waited out (:func:`retry`): every remote read, listing, write and delete here retries a
connection refused or reset, a timeout, a 5xx answer (503 SlowDown included) and a response cut short, with capped
exponential backoff and jitter (0.2 s doubling to at most 5 s), for up to ``ZEPHON_RAY_STORAGE_RETRY_S`` seconds
(default 600; :func:`set_retry_budget` changes it for one process, e.g. a service's ``storage_retry_s``). Inside
each attempt pyarrow makes ``ZEPHON_RAY_S3_MAX_ATTEMPTS`` (default 5) tries with ``ZEPHON_RAY_S3_CONNECT_TIMEOUT_S``
(default 5) per connection. A permanent fault (a missing bucket, refused credentials, a missing object) is never
retried, and a budget spent is one :class:`StorageError` naming the URI and the last cause
(tests/test_s3.py::test_endpoint_stopped_then_restarted, tests/test_storage_faults.py). A whole-object read checks
its length against the store's listing, so a response cut short is retried, never returned.

Other clouds: ``gs://`` is pyarrow's GcsFileSystem (Google's default credentials; ``ZEPHON_RAY_GCS_ENDPOINT`` or
``STORAGE_EMULATOR_HOST`` for another endpoint, e.g. an emulator), ``az://`` is pyarrow's AzureFileSystem (account
from ``AZURE_STORAGE_ACCOUNT_NAME``, key from ``AZURE_STORAGE_ACCOUNT_KEY`` or Azure's default credentials,
``ZEPHON_RAY_AZURE_ENDPOINT`` for another endpoint). All three run end to end against emulators on loopback
(tests/test_s3.py, tests/test_clouds.py).

Limit: the retry covers one call of this module; a caller holding an open pyarrow file (a Parquet reader) retries
its own reads (:func:`retry`), as :class:`zephon_ray.formats.materialized.MaterializedSource` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from zephon_ray.errors import one_line

log = logging.getLogger("zephon_ray.files")
T = TypeVar("T")

REMOTE_SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
"""URI schemes mapped to an object-store filesystem (``gcs://`` is ``gs://``; ``abfs(s)://`` is ``az://``)."""
ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""The AWS SDK's endpoint variables, service-specific first."""
ZEPHON_ENDPOINT_ENV = "S3_ENDPOINT_URL"
"""What Zephon's S3 backend reads (set from :data:`ENDPOINT_ENVS` by :func:`export_endpoint_for_zephon`)."""
MAX_ATTEMPTS_ENV = "ZEPHON_RAY_S3_MAX_ATTEMPTS"
CONNECT_TIMEOUT_ENV = "ZEPHON_RAY_S3_CONNECT_TIMEOUT_S"
REQUEST_TIMEOUT_ENV = "ZEPHON_RAY_S3_REQUEST_TIMEOUT_S"
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0
MAX_DOCUMENT_BYTES = 256 << 20
"""A JSON document larger than this is refused (a bound on what a corrupt or foreign file can make us load)."""
_READ_CHUNK = 1 << 20


RETRY_BUDGET_ENV = "ZEPHON_RAY_STORAGE_RETRY_S"
DEFAULT_RETRY_BUDGET_S = 600.0
MAX_RETRY_BUDGET_S = 7 * 24 * 3600.0
RETRY_FIRST_S = 0.2
"""The first backoff; each next one doubles, up to :data:`RETRY_CAP_S`, and each is jittered (x 0.5-1.0)."""
RETRY_CAP_S = 5.0


class StorageError(OSError):
    """A store or file that cannot be reached or read as asked; the message names the URI (one line).
    ``transient``: the cause may pass (an outage, throttling, a cut response); :func:`retry` waits those out and
    raises one with ``transient=False`` once its budget is spent."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient

    def __str__(self) -> str:
        return self.args[0] if self.args else ""

    def __reduce__(self):  # keep the flag across processes (Ray ships errors by pickle)
        return (_storage_error, (str(self), self.transient))


def _storage_error(message: str, transient: bool) -> "StorageError":
    return StorageError(message, transient=transient)


class DocumentError(ValueError):
    """A JSON document that is missing, not JSON, or of another format; the message names the file."""


# ---------------------------------------------------------------------------------------------- locations
def is_uri(value: Any) -> bool:
    """True for ``scheme://...`` strings of an object store this module maps (see :data:`REMOTE_SCHEMES`)."""
    if isinstance(value, Location):
        return value.remote
    text = str(value)
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


@dataclass(frozen=True)
class Location:
    """One file or directory: ``uri`` as users name it, ``path`` as ``fs`` names it. Compare and hash by ``uri``."""

    uri: str
    path: str
    scheme: str = "file"
    fs: Any = field(default=None, compare=False, repr=False, hash=False)

    @property
    def remote(self) -> bool:
        return self.scheme != "file"

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def join(self, *parts: str) -> "Location":
        extra = "/".join(str(p).strip("/") for p in parts if str(p).strip("/"))
        if not extra:
            return self
        if self.remote:
            return Location(f"{self.uri.rstrip('/')}/{extra}", f"{self.path.rstrip('/')}/{extra}", self.scheme, self.fs)
        joined = os.path.join(self.path, *extra.split("/"))
        return Location(joined, joined, self.scheme, self.fs)

    def __truediv__(self, part: str) -> "Location":
        return self.join(part)

    @property
    def parent(self) -> "Location":
        if self.remote:
            if "/" not in self.path.rstrip("/"):
                return self  # a bucket is its own parent
            head_uri, head_path = self.uri.rstrip("/").rsplit("/", 1)[0], self.path.rstrip("/").rsplit("/", 1)[0]
            return Location(head_uri, head_path, self.scheme, self.fs)
        parent = os.path.dirname(self.path.rstrip("/")) or "/"
        return Location(parent, parent, self.scheme, self.fs)

    def relative_to(self, other: "Location") -> str:
        base = other.path.rstrip("/") + "/"
        if not self.path.startswith(base):
            raise ValueError(f"{self.uri} is not under {other.uri}")
        return self.path[len(base):]

    def is_within(self, other: "Location") -> bool:
        """True when this location is ``other`` or lies under it (same store)."""
        if self.scheme != other.scheme:
            return False
        mine, theirs = self.path.rstrip("/"), other.path.rstrip("/")
        return mine == theirs or mine.startswith(theirs + "/")

    def local_path(self) -> Path:
        if self.remote:
            raise StorageError(f"{self.uri}: not a local path")
        return Path(self.path)

    def __str__(self) -> str:
        return self.uri

    def __fspath__(self) -> str:  # lets local locations go where os.PathLike is accepted
        if self.remote:
            raise TypeError(f"{self.uri} is an object-store URI, not a local path")
        return self.path


def location(value: "str | os.PathLike[str] | Location", *, base: "str | os.PathLike[str] | None" = None) -> Location:
    """Map a local path (absolute, or relative to ``base``/the working directory; ``~`` expanded) or an object-store
    URI to its :class:`Location`. Refuses other ``scheme://`` strings and empty values with one line."""
    if isinstance(value, Location):
        return value
    text = os.fspath(value) if not isinstance(value, str) else value
    if not text:
        raise StorageError("empty path or URI")
    scheme, sep, rest = text.partition("://")
    if sep:
        canonical = REMOTE_SCHEMES.get(scheme.lower())
        if canonical is None:
            if scheme.lower() == "file":
                return location(rest)
            known = ", ".join(sorted({f"{s}://" for s in REMOTE_SCHEMES.values()}))
            raise StorageError(f"{text}: unsupported URI scheme {scheme!r} (use a local path or one of {known})")
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise StorageError(f"{text}: no bucket in the URI")
        key = "/".join(p for p in key.split("/") if p and p != ".")
        if any(p == ".." for p in key.split("/")):
            raise StorageError(f"{text}: '..' is not allowed in an object-store URI")
        path = f"{bucket}/{key}" if key else bucket
        return Location(f"{canonical}://{path}", path, canonical, None)
    if base is not None and is_uri(base):
        if os.path.isabs(os.path.expanduser(text)):
            resolved = os.path.realpath(os.path.expanduser(text))
            return Location(resolved, resolved)
        return location(base).join(*[p for p in text.split("/") if p not in ("", ".")])
    p = Path(text).expanduser()
    if not p.is_absolute():
        p = Path(base or os.getcwd()) / p
    resolved = os.path.realpath(p)
    return Location(resolved, resolved)


def filesystem(loc: Location) -> Any:
    """The pyarrow filesystem of ``loc`` (one per store and settings, cached per process)."""
    if loc.fs is not None:
        return loc.fs
    return _filesystem(loc.scheme)


_FS_LOCK = threading.Lock()
_FS_CACHE: dict[tuple, Any] = {}


def s3_endpoint() -> str | None:
    """The S3 endpoint by the AWS SDK's rules (``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``), else Zephon's
    ``S3_ENDPOINT_URL``; None for AWS itself. Two different endpoints set at once are refused."""
    aws = next((os.environ[k] for k in ENDPOINT_ENVS if os.environ.get(k)), None)
    zephon = os.environ.get(ZEPHON_ENDPOINT_ENV) or None
    if zephon is not None and zephon == _EXPORTED.get(ZEPHON_ENDPOINT_ENV):
        zephon = None  # set by export_endpoint_for_zephon from the AWS variables, not by the user
    if aws and zephon and aws.rstrip("/") != zephon.rstrip("/"):
        raise StorageError(f"the S3 endpoint is ambiguous: AWS_ENDPOINT_URL(_S3)={aws} but "
                           f"{ZEPHON_ENDPOINT_ENV}={zephon}; set one of them")
    return aws or zephon


_EXPORTED: dict[str, str] = {}
GCS_ENDPOINT_ENVS = ("ZEPHON_RAY_GCS_ENDPOINT", "STORAGE_EMULATOR_HOST")
AZURE_ENDPOINT_ENV = "ZEPHON_RAY_AZURE_ENDPOINT"


def gcs_endpoint() -> str | None:
    """The GCS endpoint when it is not Google's: ``ZEPHON_RAY_GCS_ENDPOINT``, else the Google SDKs'
    ``STORAGE_EMULATOR_HOST`` (both ``http(s)://host:port``); requests there are anonymous."""
    return next((os.environ[k] for k in GCS_ENDPOINT_ENVS if os.environ.get(k)), None)


def azure_endpoint() -> str | None:
    """The Azure Blob endpoint when it is not Azure's (``ZEPHON_RAY_AZURE_ENDPOINT``, ``http(s)://host:port``;
    e.g. Azurite, whose blobs are then at ``<endpoint>/<account>/<container>``)."""
    return os.environ.get(AZURE_ENDPOINT_ENV) or None


def export_endpoint_for_zephon() -> None:
    """Set Zephon's ``S3_ENDPOINT_URL`` from the AWS SDK's endpoint variables in this process (Zephon 0.2 reads
    only its own name), so that one environment works for pyarrow, Zephon and Ray workers."""
    endpoint = s3_endpoint()
    current = os.environ.get(ZEPHON_ENDPOINT_ENV)
    if endpoint and (not current or current == _EXPORTED.get(ZEPHON_ENDPOINT_ENV)):
        os.environ[ZEPHON_ENDPOINT_ENV] = endpoint
        _EXPORTED[ZEPHON_ENDPOINT_ENV] = endpoint


WORKER_ENV_VARS = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "S3_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_ALLOW_HTTP", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "AWS_S3_ADDRESSING_STYLE",
    "ZEPHON_RAY_GCS_ENDPOINT", "STORAGE_EMULATOR_HOST", "GOOGLE_BASE_URL",
    "AZURE_STORAGE_ACCOUNT_NAME", "ZEPHON_RAY_AZURE_ENDPOINT", "AZURE_STORAGE_USE_EMULATOR",
    "AZURITE_BLOB_STORAGE_URL",
    MAX_ATTEMPTS_ENV, CONNECT_TIMEOUT_ENV, REQUEST_TIMEOUT_ENV, RETRY_BUDGET_ENV,
)
"""Storage settings that are safe to hand to a Ray job's workers (:func:`worker_environment`): endpoints, region,
addressing style, account names, retry settings. No secret and no local path."""
SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY",
                   "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET", "GCS_KEY", "GCS_SECRET", "GOOGLE_BEARER_TOKEN",
                   "GOOGLE_SERVICE_ACCOUNT_KEY")
"""Credentials: never put in a ``runtime_env`` (Ray's job API shows it); the nodes bring their own."""
LOCAL_ONLY_ENV_VARS = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CA_BUNDLE",
                       "GOOGLE_APPLICATION_CREDENTIALS", "ZEPHON_RAY_SHARD_CACHE")
"""Names and paths that mean something on this machine only (a profile of its files, a file path)."""
AWS_ENV_VARS = WORKER_ENV_VARS  # the old name


def worker_environment() -> dict[str, str]:
    """The storage settings of this process that a Ray job's workers need and may see: endpoints, region,
    addressing style, account names and retry settings (:data:`WORKER_ENV_VARS` that are set), with Zephon's
    endpoint name filled in. Never a secret (:data:`SECRET_ENV_VARS`) nor a local name or path
    (:data:`LOCAL_ONLY_ENV_VARS`): the nodes bring their own credentials (their environment, an instance role,
    their own files). The CLI passes it as ``runtime_env={"env_vars": ...}`` (tests/test_files.py)."""
    env = {k: os.environ[k] for k in WORKER_ENV_VARS if os.environ.get(k)}
    endpoint = s3_endpoint()
    if endpoint:
        env.setdefault(ZEPHON_ENDPOINT_ENV, endpoint)
    return env


aws_environment = worker_environment  # the old name; it no longer forwards secrets, profiles or paths


def local_credentials() -> list[str]:
    """Names of the credential settings of this shell that workers do NOT get (secrets, profiles, file paths):
    what a one-line error mentions when a worker is refused or finds no credentials."""
    return [k for k in (*SECRET_ENV_VARS, *LOCAL_ONLY_ENV_VARS) if os.environ.get(k) and k != "ZEPHON_RAY_SHARD_CACHE"]


def _env_number(name: str, default: float, low: float, high: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise StorageError(f"{name}={raw!r}: not a number") from None
    if not low <= value <= high:
        raise StorageError(f"{name}={raw!r}: must be in [{low:g}, {high:g}]")
    return value


def _filesystem(scheme: str) -> Any:
    import pyarrow.fs as pafs

    if scheme == "file":
        key: tuple = ("file",)
    elif scheme == "s3":
        endpoint = s3_endpoint()
        key = ("s3", endpoint, os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
               os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY"),
               os.environ.get("AWS_SESSION_TOKEN"), os.environ.get("AWS_PROFILE"),
               _env_number(MAX_ATTEMPTS_ENV, DEFAULT_MAX_ATTEMPTS, 1, 100),
               _env_number(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S, 0.1, 600),
               _env_number(REQUEST_TIMEOUT_ENV, DEFAULT_REQUEST_TIMEOUT_S, 0.1, 3600))
    elif scheme == "gs":
        key = ("gs", gcs_endpoint(), os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"))
    else:
        key = ("az", os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"), os.environ.get("AZURE_STORAGE_ACCOUNT_KEY"),
               azure_endpoint())
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
                fs = pafs.GcsFileSystem(anonymous=True, endpoint_override=host.rstrip("/") if sep else endpoint,
                                        scheme=scheme_part if sep else "https")
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
                kwargs.update(blob_storage_authority=host, blob_storage_scheme=scheme_part,
                              dfs_storage_authority=host, dfs_storage_scheme=scheme_part)
            fs = pafs.AzureFileSystem(**kwargs)
        _FS_CACHE[key] = fs
        return fs


def clear_filesystem_cache() -> None:
    """Forget cached filesystems (after changing credentials or endpoints in this process)."""
    with _FS_LOCK:
        _FS_CACHE.clear()


def _loc(value: "str | os.PathLike[str] | Location") -> Location:
    loc = location(value)
    if loc.fs is None:
        loc = Location(loc.uri, loc.path, loc.scheme, _filesystem(loc.scheme))
    return loc


def describe_error(exc: BaseException) -> str:
    """The useful part of a store's error, on one line (pyarrow's AWS errors carry request ids and newlines)."""
    text = " ".join(str(exc).split())
    for marker in ("AWS Error ", "Google Cloud Storage error", "Azure Error"):
        i = text.find(marker)
        if i >= 0:
            text = text[i:]
            break
    cut = text.find(" (Request ID")
    if cut > 0:
        text = text[:cut]
    return one_line(text, 300)


_PERMANENT = ("NO_SUCH_BUCKET", "NoSuchBucket", "ACCESS_DENIED", "AccessDenied", "INVALID_ACCESS_KEY_ID",
              "InvalidAccessKeyId", "SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch", "AuthenticationFailed",
              "AuthorizationFailure", "ContainerNotFound", "PERMISSION_DENIED", "UNAUTHENTICATED", "Forbidden")
_TRANSIENT = ("NETWORK_CONNECTION", "SLOW_DOWN", "SlowDown", "Slow Down", "SERVICE_UNAVAILABLE", "ServiceUnavailable",
              "INTERNAL_FAILURE", "InternalError", "THROTTLING", "Throttling", "RequestTimeout", "REQUEST_TIMEOUT",
              "RequestTimeTooSkewed", "Connection reset", "connection reset", "Connection refused",
              "connection refused", "Connection was reset", "timed out", "Timeout was reached", "Timeout",
              "Couldn't connect", "Could not connect", "Failed to connect", "Recv failure", "Send failure",
              "partial file", "Empty reply", "Server returned nothing", "UNAVAILABLE", "DEADLINE_EXCEEDED",
              "ServerBusy", "OperationTimedOut", "cut short", "Broken pipe", "EOF", "Connection closed",
              "connection closed", "TooManyRequests", "RESOURCE_EXHAUSTED", "Transferred a partial",
              "tcp connect error", "error sending request", "cannot connect to the endpoint")
_TRANSIENT_CODES = re.compile(r"(?:HTTP|http|status|response code|code|Code)[ :=]*(?:429|500|502|503|504)\b"
                              r"|\b(?:429|500|502|503|504) (?:Service|Internal|Bad Gateway|Gateway|Slow|Too Many)"
                              r"|curlCode: (?:6|7|18|28|35|52|55|56)\b")


def is_permanent_text(text: str) -> bool:
    return any(m in text for m in _PERMANENT) or "403" in text.split() or "401" in text.split()


def is_transient(exc: BaseException) -> bool:
    """True for a fault that may pass: an outage (connection refused, reset, timed out), throttling (503 SlowDown,
    429), a server error (5xx) or a response cut short. A :class:`StorageError` (or any error with a ``transient``
    attribute) says so itself; other errors are judged by their text. Missing objects and buckets and refused
    credentials are permanent."""
    flag = getattr(exc, "transient", None)
    if isinstance(flag, bool):
        return flag
    if GAVE_UP in str(exc):  # a spent budget, wrapped by a caller into its own error type: final
        return False
    if isinstance(exc, (FileNotFoundError, PermissionError, DocumentError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    text = " ".join(str(exc).split())
    if is_permanent_text(text):
        return False
    return any(m in text for m in _TRANSIENT) or bool(_TRANSIENT_CODES.search(text))


GAVE_UP = "of retries; the budget is"
_BUDGET_OVERRIDE: list[float] = []
RETRY_STATS = {"retried_calls": 0, "retries": 0, "longest_wait_s": 0.0, "gave_up": 0}
"""Process-wide counters of :func:`retry` (for status reports and benchmarks): calls that retried at least once,
retries in all, the longest time one call spent waiting before it succeeded or gave up, calls that gave up."""


_THREAD_BUDGET = threading.local()
START_BUDGET_S = 20.0
"""The retry budget of a start's first contact with its storage (:func:`first_contact`): an unresolvable endpoint,
refused credentials or a missing bucket is one line within it, not an outage waited out for the full budget."""


def retry_budget_s() -> float:
    """Seconds a call keeps retrying transient faults: this thread's :func:`first_contact` budget, else
    :func:`set_retry_budget`'s value, else ``ZEPHON_RAY_STORAGE_RETRY_S``, else 600."""
    local = getattr(_THREAD_BUDGET, "seconds", None)
    if local is not None:
        return local
    if _BUDGET_OVERRIDE:
        return _BUDGET_OVERRIDE[-1]
    return _env_number(RETRY_BUDGET_ENV, DEFAULT_RETRY_BUDGET_S, 0, MAX_RETRY_BUDGET_S)


@contextlib.contextmanager
def first_contact(seconds: float = START_BUDGET_S) -> Iterator[None]:
    """Storage calls of this thread inside the block retry transient faults for at most ``seconds`` (never more
    than the usual budget): for a start, whose storage has not answered yet, so that a misconfiguration is one
    line at once. The long budget is for outages of storage that has answered before."""
    old = getattr(_THREAD_BUDGET, "seconds", None)
    _THREAD_BUDGET.seconds = min(seconds, retry_budget_s())
    try:
        yield
    finally:
        _THREAD_BUDGET.seconds = old


def set_retry_budget(seconds: float | None) -> None:
    """Set this process's retry budget (None: back to the environment's). 0 disables retries."""
    if seconds is None:
        _BUDGET_OVERRIDE.clear()
        return
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_RETRY_BUDGET_S:
        raise StorageError(f"storage retry budget must be a number of seconds in [0, {MAX_RETRY_BUDGET_S:g}], "
                           f"got {seconds!r}")
    _BUDGET_OVERRIDE[:] = [float(seconds)]


def retry(fn: "Callable[[], T]", what: str, *, budget_s: float | None = None,
          on_retry: "Callable[[BaseException], None] | None" = None) -> T:
    """``fn()``, called again while it raises a transient fault (:func:`is_transient`), with capped exponential
    backoff and jitter, for at most ``budget_s`` (default :func:`retry_budget_s`) seconds. A permanent fault is
    raised at once, unchanged; a budget spent raises one :class:`StorageError` naming ``what`` and the last cause.
    ``on_retry(exc)`` runs before each retry (e.g. to drop a cached handle)."""
    budget = retry_budget_s() if budget_s is None else budget_s
    t0 = time.monotonic()
    attempt = 0
    last_log = t0
    while True:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - classified below; anything not transient propagates as is
            if not isinstance(exc, Exception) or not is_transient(exc):
                raise
            now = time.monotonic()
            waited = now - t0
            delay = min(RETRY_CAP_S, RETRY_FIRST_S * 2 ** attempt) * random.uniform(0.5, 1.0)
            if waited + delay > budget:
                RETRY_STATS["gave_up"] += 1
                RETRY_STATS["longest_wait_s"] = max(RETRY_STATS["longest_wait_s"], waited)
                cause = _with(what, exc)
                raise StorageError(f"{cause} (still failing after {waited:.0f}s {GAVE_UP} "
                                   f"{budget:g}s, {RETRY_BUDGET_ENV})") from None
            if attempt == 0:
                RETRY_STATS["retried_calls"] += 1
                log.warning("storage: %s; retrying for up to %gs", _with(what, exc), budget)
            elif now - last_log > 30:
                last_log = now
                log.warning("storage: still failing after %.0fs: %s", waited, _with(what, exc))
            RETRY_STATS["retries"] += 1
            attempt += 1
            if on_retry is not None:
                on_retry(exc)
            time.sleep(delay)
            continue
        if attempt:
            RETRY_STATS["longest_wait_s"] = max(RETRY_STATS["longest_wait_s"], time.monotonic() - t0)
        return result


def _with(what: str, exc: BaseException) -> str:
    text = one_line(exc, 400) or type(exc).__name__
    return text if not what or what in text else f"{what}: {text}"


def _io(loc: Location, action: str, fn: "Callable[[], T]") -> T:
    """One remote operation on ``loc``: store errors mapped to one line (:func:`_errors`), transient ones retried."""

    def attempt() -> T:
        with _errors(loc, action):
            return fn()

    return retry(attempt, loc.uri)


@contextlib.contextmanager
def _errors(loc: Location, action: str) -> Iterator[None]:
    try:
        yield
    except (StorageError, DocumentError):
        raise
    except FileNotFoundError as exc:
        if loc.remote and action in ("write it", "upload it"):  # GCS: a write into a bucket that does not exist
            _check_bucket(loc)
            raise StorageError(f"{loc.uri}: cannot {action}: {describe_error(exc)}") from None
        raise
    except PermissionError as exc:
        raise StorageError(f"{loc.uri}: permission denied ({action}): {exc.strerror or exc}") from None
    except OSError as exc:
        text = describe_error(exc)
        if "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text or "ContainerNotFound" in text:
            bucket = loc.path.split("/", 1)[0]
            raise StorageError(f"{loc.uri}: bucket {bucket!r} does not exist ({action})") from None
        if is_permanent_text(text):
            raise StorageError(f"{loc.uri}: access denied ({action}); check the credentials "
                               f"({_CREDENTIALS_HINT.get(loc.scheme, 'the store')}): {text}") from None
        raise StorageError(f"{loc.uri}: cannot {action}: {text}", transient=is_transient(exc)) from None


_CREDENTIALS_HINT = {
    "s3": "AWS_ACCESS_KEY_ID/AWS_PROFILE, or the node's instance role",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS, or the node's service account",
    "az": "AZURE_STORAGE_ACCOUNT_KEY, or Azure's default credentials",
}


def _check_bucket(loc: Location) -> None:
    """After a not-found on an object store: say so once if the bucket itself is missing (a configuration error,
    not an absent file)."""
    import pyarrow.fs as pafs

    bucket = loc.path.split("/", 1)[0]
    if loc.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
        raise StorageError(f"{loc.uri}: bucket {bucket!r} does not exist")


# ---------------------------------------------------------------------------------------------- queries
def exists(value: "str | os.PathLike[str] | Location") -> bool:
    """True when a file or a non-empty directory (object prefix) is there. A missing bucket is an error."""
    loc = _loc(value)
    if not loc.remote:
        return os.path.exists(loc.path)
    import pyarrow.fs as pafs

    def look() -> Any:
        info = loc.fs.get_file_info(loc.path)
        if info.type == pafs.FileType.NotFound:
            _check_bucket(loc)
        return info

    return _io(loc, "look it up", look).type != pafs.FileType.NotFound


def is_file(value: "str | os.PathLike[str] | Location") -> bool:
    loc = _loc(value)
    if not loc.remote:
        return os.path.isfile(loc.path)
    import pyarrow.fs as pafs

    return _io(loc, "look it up", lambda: loc.fs.get_file_info(loc.path)).type == pafs.FileType.File


def is_dir(value: "str | os.PathLike[str] | Location") -> bool:
    """Local: a directory. Object store: a prefix with at least one object under it (or a bucket that exists)."""
    loc = _loc(value)
    if not loc.remote:
        return os.path.isdir(loc.path)
    import pyarrow.fs as pafs

    return _io(loc, "look it up", lambda: loc.fs.get_file_info(loc.path)).type == pafs.FileType.Directory


def size(value: "str | os.PathLike[str] | Location") -> int | None:
    """The file's size in bytes, or None when there is no file."""
    loc = _loc(value)
    if not loc.remote:
        try:
            st = os.stat(loc.path)
        except FileNotFoundError:
            return None
        except PermissionError as exc:
            raise StorageError(f"{loc.uri}: permission denied (stat): {exc.strerror}") from None
        return st.st_size if os.path.isfile(loc.path) else None
    import pyarrow.fs as pafs

    info = _io(loc, "stat it", lambda: loc.fs.get_file_info(loc.path))
    return info.size if info.type == pafs.FileType.File else None


def listing(value: "str | os.PathLike[str] | Location", *, recursive: bool = False) -> dict[str, int]:
    """``{name relative to the directory: size}`` of the files under it (directly in it unless ``recursive``),
    sorted by name; ``{}`` for a directory that does not exist. Directory markers are left out."""
    loc = _loc(value)
    import pyarrow.fs as pafs

    infos = _io(loc, "list it",
                lambda: loc.fs.get_file_info(pafs.FileSelector(loc.path, allow_not_found=True, recursive=recursive)))
    base = loc.path.rstrip("/") + "/"
    out = {}
    for info in infos:
        if info.type != pafs.FileType.File or not info.path.startswith(base):
            continue
        out[info.path[len(base):]] = int(info.size)
    return dict(sorted(out.items()))


def entries(value: "str | os.PathLike[str] | Location") -> list[str]:
    """Names directly under a directory (files and subdirectories; an object store's common prefixes), sorted;
    ``[]`` when it does not exist."""
    loc = _loc(value)
    import pyarrow.fs as pafs

    infos = _io(loc, "list it",
                lambda: loc.fs.get_file_info(pafs.FileSelector(loc.path, allow_not_found=True, recursive=False)))
    base = loc.path.rstrip("/") + "/"
    return sorted({i.path[len(base):].strip("/") for i in infos if i.path.startswith(base)} - {""})


def ray_train_storage(value: "str | os.PathLike[str]") -> dict[str, Any]:
    """``RunConfig(**ray_train_storage("s3://bucket/runs"))``: Ray Train's ``storage_path`` plus the pyarrow
    filesystem of this module, so that Ray Train's checkpoints reach the same endpoint with the same credentials
    (pyarrow's own URI parsing ignores ``AWS_ENDPOINT_URL``). A local path is passed through."""
    loc = _loc(value)
    if not loc.remote:
        return {"storage_path": loc.path}
    return {"storage_path": loc.path, "storage_filesystem": loc.fs}


# ---------------------------------------------------------------------------------------------- reads
def read_bytes(value: "str | os.PathLike[str] | Location", *, limit: int | None = None) -> bytes:
    """The whole file. ``FileNotFoundError`` (naming it) when absent; :class:`StorageError` for anything else;
    ``limit`` bounds the size read (a larger file is refused before it is read)."""
    loc = _loc(value)
    if not loc.remote:
        try:
            with open(loc.path, "rb") as fh:
                if limit is not None and os.fstat(fh.fileno()).st_size > limit:
                    raise StorageError(f"{loc.uri}: larger than the {limit} bytes allowed here")
                return fh.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"{loc.uri}: not found") from None
        except IsADirectoryError:
            raise StorageError(f"{loc.uri}: is a directory, not a file") from None
        except PermissionError as exc:
            raise StorageError(f"{loc.uri}: permission denied (read): {exc.strerror}") from None
        except OSError as exc:
            raise StorageError(f"{loc.uri}: cannot read: {exc.strerror or exc}") from None
    import pyarrow.fs as pafs

    def read() -> bytes:
        info = loc.fs.get_file_info(loc.path)
        if info.type != pafs.FileType.File:
            if "/" not in loc.path:
                raise StorageError(f"{loc.uri}: a bucket, not an object")
            if info.type == pafs.FileType.NotFound:
                _check_bucket(loc)
            raise FileNotFoundError(f"{loc.uri}: not found")
        if limit is not None and info.size is not None and info.size > limit:
            raise StorageError(f"{loc.uri}: larger than the {limit} bytes allowed here")
        with loc.fs.open_input_stream(loc.path) as fh:
            data = fh.read()
        if info.size is not None and len(data) != info.size:
            # A response cut mid-body that the client did not notice: never hand back a prefix of the object.
            raise StorageError(f"{loc.uri}: response cut short ({len(data)} of {info.size} bytes)", transient=True)
        return data

    return _io(loc, "read it", read)


def open_input_file(value: "str | os.PathLike[str] | Location") -> Any:
    """A random-access pyarrow file (for Parquet footers and row groups: ranged reads on an object store)."""
    loc = _loc(value)
    return _io(loc, "open it", lambda: loc.fs.open_input_file(loc.path))


def read_json(value: "str | os.PathLike[str] | Location", *, expect_format: str | None = None,
              format_key: str = "format", error: type[Exception] = DocumentError, what: str = "file",
              missing_hint: str = "") -> Any:
    """A versioned JSON document, or ONE ``error`` naming the file: missing, unreadable, not JSON, or (with
    ``expect_format``) not a table whose ``format_key`` is ``expect_format``."""
    loc = _loc(value)
    try:
        blob = read_bytes(loc, limit=MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        raise error(f"{loc.uri}: {what} missing{missing_hint}") from None
    except StorageError as exc:
        raise error(f"{what} unreadable: {exc}") from None
    try:
        doc = json.loads(blob)
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{loc.uri}: corrupt {what} (not valid JSON: {exc})") from None
    if expect_format is not None:
        found = doc.get(format_key) if isinstance(doc, dict) else type(doc).__name__
        if found != expect_format:
            raise error(f"{loc.uri}: {what} format {found!r} is not {expect_format!r}")
    return doc


def sha256_file(path: "str | os.PathLike[str]") -> str:
    """sha256 of a local file's bytes (the fast path for many shards: no location parsing)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256(value: "str | os.PathLike[str] | Location") -> str:
    """sha256 of the file's bytes (streamed; an object is downloaded once)."""
    loc = _loc(value)
    if not loc.remote:
        try:
            return sha256_file(loc.path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{loc.uri}: not found") from None
        except PermissionError as exc:
            raise StorageError(f"{loc.uri}: permission denied (read): {exc.strerror}") from None

    def digest() -> str:
        h = hashlib.sha256()
        with loc.fs.open_input_stream(loc.path) as fh:
            while chunk := fh.read(_READ_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    return _io(loc, "read it", digest)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------- writes
def json_bytes(obj: Any, *, compact: bool = False) -> bytes:
    """The one JSON encoding of durable documents: sorted keys; indented unless ``compact``; a final newline."""
    if compact:
        return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode()
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def fsync_dir(path: "str | os.PathLike[str]") -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(value: "str | os.PathLike[str] | Location") -> None:
    """Create a local directory (and parents). Object stores have no directories: nothing is written."""
    loc = _loc(value)
    if not loc.remote:
        try:
            os.makedirs(loc.path, exist_ok=True)
        except FileExistsError:
            raise StorageError(f"{loc.uri}: exists and is not a directory") from None
        except PermissionError as exc:
            raise StorageError(f"{loc.uri}: permission denied (create directory): {exc.strerror}") from None


def write_atomic(value: "str | os.PathLike[str] | Location", data: bytes) -> None:
    """Replace the file with ``data`` so that a reader sees the old content or the new, never a mix (see the
    module docstring for what that means on an object store)."""
    loc = _loc(value)
    if not loc.remote:
        make_dirs(loc.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{loc.name}.", suffix=".part", dir=loc.parent.path)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, loc.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(loc.parent.path)
        return
    def write() -> None:
        with loc.fs.open_output_stream(loc.path) as fh:  # one object: visible whole when the upload completes
            fh.write(data)

    _io(loc, "write it", write)  # a PUT of the whole object: safe to repeat


def write_json(value: "str | os.PathLike[str] | Location", obj: Any, *, compact: bool = False) -> None:
    write_atomic(value, json_bytes(obj, compact=compact))


def upload(local_file: "str | os.PathLike[str]", value: "str | os.PathLike[str] | Location") -> None:
    """Commit a finished local file (a spool) at ``value``: a rename on a local filesystem (same directory tree
    expected; else a copy then rename), one upload to an object store. The local file is consumed."""
    loc = _loc(value)
    if not loc.remote:
        make_dirs(loc.parent)
        with open(local_file, "rb+") as fh:
            os.fsync(fh.fileno())
        try:
            os.replace(local_file, loc.path)
        except OSError:  # another filesystem: copy next to the target, then rename
            fd, tmp = tempfile.mkstemp(prefix=f".tmp-{loc.name}.", suffix=".part", dir=loc.parent.path)
            os.close(fd)
            import shutil

            shutil.copyfile(local_file, tmp)
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, loc.path)
            os.unlink(local_file)
        fsync_dir(loc.parent.path)
        return
    def put() -> None:
        with open(local_file, "rb") as src, loc.fs.open_output_stream(loc.path) as dst:
            while chunk := src.read(8 * _READ_CHUNK):
                dst.write(chunk)

    _io(loc, "upload it", put)  # the spool is read again from its start on each try
    os.unlink(local_file)


def spool_path(value: "str | os.PathLike[str] | Location") -> str:
    """A new, empty local temp file for ``value``'s content, to be committed with :func:`upload` (or removed).
    Local targets spool in their own directory (so the commit is a rename, and a crash leaves a ``.tmp-*`` file
    next to it), remote ones in the system temp directory."""
    loc = _loc(value)
    if loc.remote:
        directory = None
    else:
        make_dirs(loc.parent)
        directory = loc.parent.path
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{loc.name}.", suffix=".part", dir=directory)
    os.close(fd)
    return tmp


@contextlib.contextmanager
def spool(value: "str | os.PathLike[str] | Location") -> Iterator[str]:
    """A local temp file (:func:`spool_path`) to write ``value``'s content into; committed with :func:`upload` when
    the block ends without an exception, removed otherwise."""
    loc = _loc(value)
    tmp = spool_path(loc)
    try:
        yield tmp
        upload(tmp, loc)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def delete(value: "str | os.PathLike[str] | Location") -> None:
    """Remove one file; absent is fine."""
    loc = _loc(value)
    if not loc.remote:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(loc.path)
        return
    import pyarrow.fs as pafs

    def remove() -> None:
        if loc.fs.get_file_info(loc.path).type == pafs.FileType.File:
            loc.fs.delete_file(loc.path)

    _io(loc, "delete it", remove)


def delete_tree(value: "str | os.PathLike[str] | Location") -> None:
    """Remove a directory (object prefix) and everything under it; absent is fine. Not atomic on object stores."""
    loc = _loc(value)
    if not loc.remote:
        import shutil

        shutil.rmtree(loc.path, ignore_errors=True)
        return
    import pyarrow.fs as pafs

    def remove() -> None:
        if loc.fs.get_file_info(loc.path).type == pafs.FileType.Directory:
            loc.fs.delete_dir(loc.path)

    _io(loc, "delete it", remove)
