"""The storage layer: every durable read and write of zephon-ray, on a local path or an object-store URI.

    "/data/run7"  "s3://bucket/run7"  "gs://bucket/run7"  "az://container/run7"
          │
          ▼
    locations     location(x) ──► Location(uri, path, scheme)             naming, no I/O
    filesystems   its pyarrow.fs filesystem, cached per store and settings (Ray Data and Ray Train use pyarrow.fs)
    operations    exists, listing, read_bytes, read_json, write_atomic, write_json, spool + upload, sha256, delete
    retries       transient faults waited out within a budget; process-wide retry statistics
    errors        StorageError, DocumentError; which faults are transient
    environment   endpoints, credentials, tuning from the environment; what a Ray job's workers may be given

Usage: ``from zephon_ray import storage``, then ``root = storage.location("s3://bucket/run7")``,
``storage.write_json(root / "state.json", doc)``, ``storage.read_json(root / "state.json", expect_format=...)``.
This module re-exports the names callers use; each is defined in exactly one of the modules above, which hold
the details of its guarantee (commit points: :mod:`~zephon_ray.storage.operations`; the retry policy:
:mod:`~zephon_ray.storage.retries`; endpoints and credentials: :mod:`~zephon_ray.storage.environment`).

Guarantee: a write commits one whole file: a local rename, or one whole-object upload on S3, GCS and Azure (what
a reader can see meanwhile, store by store: :mod:`~zephon_ray.storage.operations`); a fault is one line naming
the URI, after transient ones were waited out. The three object stores run end to end against emulators on
loopback.

Limits: nothing is atomic across files (formats write their data first and the file that commits last); recipe
sources are read through Zephon's own router (:mod:`zephon_ray.zephon_io`), not here.
"""

from zephon_ray.storage.environment import (
    LOCAL_ONLY_ENV_VARS,
    MAX_ATTEMPTS_ENV,
    RETRY_BUDGET_ENV,
    SECRET_ENV_VARS,
    WORKER_ENV_VARS,
    export_endpoint_for_zephon,
    local_credentials,
    s3_endpoint,
    worker_environment,
)
from zephon_ray.storage.errors import DocumentError, StorageError, describe_error, is_transient
from zephon_ray.storage.filesystems import clear_filesystem_cache, filesystem, ray_train_storage
from zephon_ray.storage.locations import Location, is_uri, location
from zephon_ray.storage.operations import (
    MAX_DOCUMENT_BYTES,
    delete,
    delete_tree,
    entries,
    exists,
    is_dir,
    is_file,
    json_bytes,
    listing,
    make_dirs,
    misreported_missing,
    open_input_file,
    read_bytes,
    read_json,
    sha256,
    sha256_bytes,
    sha256_file,
    size,
    spool,
    spool_path,
    upload,
    write_atomic,
    write_json,
)
from zephon_ray.storage.retries import (
    RETRY_CAP_S,
    RETRY_FIRST_S,
    RETRY_STATS,
    START_BUDGET_S,
    first_contact,
    retry,
    retry_budget_s,
    set_retry_budget,
)

__all__ = [
    # locations
    "Location",
    "location",
    "is_uri",
    # errors
    "StorageError",
    "DocumentError",
    "describe_error",
    "is_transient",
    # environment
    "worker_environment",
    "local_credentials",
    "export_endpoint_for_zephon",
    "s3_endpoint",
    "WORKER_ENV_VARS",
    "SECRET_ENV_VARS",
    "LOCAL_ONLY_ENV_VARS",
    "MAX_ATTEMPTS_ENV",
    "RETRY_BUDGET_ENV",
    # filesystems
    "filesystem",
    "clear_filesystem_cache",
    "ray_train_storage",
    # retries
    "retry",
    "retry_budget_s",
    "set_retry_budget",
    "first_contact",
    "START_BUDGET_S",
    "RETRY_STATS",
    "RETRY_FIRST_S",
    "RETRY_CAP_S",
    # operations
    "exists",
    "is_file",
    "is_dir",
    "size",
    "listing",
    "entries",
    "read_bytes",
    "open_input_file",
    "read_json",
    "sha256",
    "sha256_file",
    "sha256_bytes",
    "json_bytes",
    "make_dirs",
    "misreported_missing",
    "write_atomic",
    "write_json",
    "upload",
    "spool_path",
    "spool",
    "delete",
    "delete_tree",
    "MAX_DOCUMENT_BYTES",
]
