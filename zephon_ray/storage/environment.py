"""What storage reads from the process environment, and which of it a Ray job's workers may be given.

Endpoints and credentials follow the AWS SDK conventions, the same for pyarrow, Zephon and Ray workers:

- S3: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (:func:`s3_endpoint`; Zephon's ``S3_ENDPOINT_URL`` is read
  too and set from them by :func:`export_endpoint_for_zephon`), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the profile files, ``AWS_REGION``/``AWS_DEFAULT_REGION``.
- GCS: Google's default credentials; ``ZEPHON_RAY_GCS_ENDPOINT`` or ``STORAGE_EMULATOR_HOST`` for another endpoint
  (:func:`gcs_endpoint`, e.g. an emulator).
- Azure: the account from ``AZURE_STORAGE_ACCOUNT_NAME``, the key from ``AZURE_STORAGE_ACCOUNT_KEY`` or Azure's
  default credentials, ``ZEPHON_RAY_AZURE_ENDPOINT`` for another endpoint (:func:`azure_endpoint`).
- Tuning: ``ZEPHON_RAY_S3_MAX_ATTEMPTS``, ``ZEPHON_RAY_S3_CONNECT_TIMEOUT_S``, ``ZEPHON_RAY_S3_REQUEST_TIMEOUT_S``
  (read by :mod:`zephon_ray.storage.filesystems`) and ``ZEPHON_RAY_STORAGE_RETRY_S`` (read by
  :mod:`zephon_ray.storage.retries`), each checked by :func:`env_number`.

Usage: a job submitter passes ``runtime_env={"env_vars": worker_environment()}``; an error that a worker found no
credentials names :func:`local_credentials`, the settings this shell has and the workers do not get.

Guarantee: :func:`worker_environment` never holds a secret (:data:`SECRET_ENV_VARS`) nor a name or path that means
something on this machine only (:data:`LOCAL_ONLY_ENV_VARS`): Ray's job API shows a ``runtime_env``, and the nodes
bring their own credentials (their environment, an instance role, their own files). Two different S3 endpoints
set at once are refused, not guessed between.

Limits: the environment is read at each call, but pyarrow filesystems are cached per settings
(:func:`zephon_ray.storage.clear_filesystem_cache` after changing credentials in a running process).
"""

from __future__ import annotations

import os

from zephon_ray.storage.errors import StorageError

ENDPOINT_ENVS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""The AWS SDK's endpoint variables, service-specific first."""
ZEPHON_ENDPOINT_ENV = "S3_ENDPOINT_URL"
"""What Zephon's S3 backend reads (set from :data:`ENDPOINT_ENVS` by :func:`export_endpoint_for_zephon`)."""
GCS_ENDPOINT_ENVS = ("ZEPHON_RAY_GCS_ENDPOINT", "STORAGE_EMULATOR_HOST")
AZURE_ENDPOINT_ENV = "ZEPHON_RAY_AZURE_ENDPOINT"
MAX_ATTEMPTS_ENV = "ZEPHON_RAY_S3_MAX_ATTEMPTS"
CONNECT_TIMEOUT_ENV = "ZEPHON_RAY_S3_CONNECT_TIMEOUT_S"
REQUEST_TIMEOUT_ENV = "ZEPHON_RAY_S3_REQUEST_TIMEOUT_S"
RETRY_BUDGET_ENV = "ZEPHON_RAY_STORAGE_RETRY_S"

WORKER_ENV_VARS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "S3_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ALLOW_HTTP",
    "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
    "AWS_S3_ADDRESSING_STYLE",
    "ZEPHON_RAY_GCS_ENDPOINT",
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_BASE_URL",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "ZEPHON_RAY_AZURE_ENDPOINT",
    "AZURE_STORAGE_USE_EMULATOR",
    "AZURITE_BLOB_STORAGE_URL",
    MAX_ATTEMPTS_ENV,
    CONNECT_TIMEOUT_ENV,
    REQUEST_TIMEOUT_ENV,
    RETRY_BUDGET_ENV,
)
"""Storage settings that are safe to hand to a Ray job's workers (:func:`worker_environment`): endpoints, region,
addressing style, account names, retry settings. No secret and no local path."""
SECRET_ENV_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
    "GCS_KEY",
    "GCS_SECRET",
    "GOOGLE_BEARER_TOKEN",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
)
"""Credentials: never put in a ``runtime_env`` (Ray's job API shows it); the nodes bring their own."""
LOCAL_ONLY_ENV_VARS = (
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CA_BUNDLE",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "ZEPHON_RAY_SHARD_CACHE",
)
"""Names and paths that mean something on this machine only (a profile of its files, a file path)."""

_EXPORTED: dict[str, str] = {}
"""What :func:`export_endpoint_for_zephon` set in this process (so that it is not taken for the user's setting)."""


def s3_endpoint() -> str | None:
    """The S3 endpoint by the AWS SDK's rules (``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``), else Zephon's
    ``S3_ENDPOINT_URL``; None for AWS itself. Two different endpoints set at once are refused."""
    aws = next((os.environ[k] for k in ENDPOINT_ENVS if os.environ.get(k)), None)
    zephon = os.environ.get(ZEPHON_ENDPOINT_ENV) or None
    if zephon is not None and zephon == _EXPORTED.get(ZEPHON_ENDPOINT_ENV):
        zephon = None  # set by export_endpoint_for_zephon from the AWS variables, not by the user
    if aws and zephon and aws.rstrip("/") != zephon.rstrip("/"):
        raise StorageError(
            f"the S3 endpoint is ambiguous: AWS_ENDPOINT_URL(_S3)={aws} but "
            f"{ZEPHON_ENDPOINT_ENV}={zephon}; set one of them"
        )
    return aws or zephon


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


def worker_environment() -> dict[str, str]:
    """The storage settings of this process that a Ray job's workers need and may see: endpoints, region,
    addressing style, account names and retry settings (:data:`WORKER_ENV_VARS` that are set), with Zephon's
    endpoint name filled in. Never a secret (:data:`SECRET_ENV_VARS`) nor a local name or path
    (:data:`LOCAL_ONLY_ENV_VARS`): the nodes bring their own credentials (their environment, an instance role,
    their own files). The CLI passes it as ``runtime_env={"env_vars": ...}``."""
    env = {k: os.environ[k] for k in WORKER_ENV_VARS if os.environ.get(k)}
    endpoint = s3_endpoint()
    if endpoint:
        env.setdefault(ZEPHON_ENDPOINT_ENV, endpoint)
    return env


def local_credentials() -> list[str]:
    """Names of the credential settings of this shell that workers do NOT get (secrets, profiles, file paths):
    what a one-line error mentions when a worker is refused or finds no credentials."""
    return [k for k in (*SECRET_ENV_VARS, *LOCAL_ONLY_ENV_VARS) if os.environ.get(k) and k != "ZEPHON_RAY_SHARD_CACHE"]


def env_number(name: str, default: float, low: float, high: float) -> float:
    """The number in environment variable ``name`` (``default`` when unset or empty); one :class:`StorageError`
    naming the variable when it is not a number in ``[low, high]``."""
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
