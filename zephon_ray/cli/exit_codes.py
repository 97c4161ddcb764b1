"""The one error mapping of the ``zephon-ray`` command: which exceptions are the user's to fix, and how each becomes
one line on stderr and an exit code.

Every command raises; only :func:`run_command` (called by ``main``) turns an exception into output:

- a user error (:data:`USER_ERRORS`) prints ``zephon-ray: error: <message>`` as ONE line (whitespace in the
  message collapsed) and exits :data:`USER_ERROR_EXIT` (2) through ``SystemExit``, as argparse does for a bad flag;
- an error that came back from the cluster's workers (a Ray task or actor error anywhere in its cause chain)
  prints one line too, never the workers' traceback: the storage object it names with the likely cause
  (:func:`storage_failure`), else the last line of the cause;
- ``KeyboardInterrupt`` prints nothing and returns :data:`INTERRUPTED_EXIT` (130, the shell's code for SIGINT);
- anything else is a bug or a broken environment: it propagates with its traceback (exit 1).

Limits: the line is the exception's own message, so it names the key, file or number at fault only as well as the
raising code wrote it; a ``raise X from None`` replaces the error it handled (its message is the one shown, Python's
own traceback printing does the same), so a worker failure hidden that way is reported as ``X``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from zephon_ray.errors import UserInputError, one_line
from zephon_ray.service.errors import ServiceError

PROG = "zephon-ray"
USER_ERROR_EXIT = 2
"""Exit code of a user error; argparse uses the same for a bad flag."""
INTERRUPTED_EXIT = 130
"""Exit code after Ctrl-C (128 + SIGINT), without a traceback."""

OWN_MESSAGE_ERRORS = (ServiceError, ConnectionError)
"""Errors whose message is the report even when a Ray error is their cause: the service writes one clear line per
error (service/errors.py), and a ``ConnectionError`` is Ray's "no cluster at that address"."""

USER_ERRORS = (UserInputError, ValueError, FileNotFoundError, TimeoutError) + OWN_MESSAGE_ERRORS
"""What is reported as one line: bad input (UserInputError and the library's ValueError subclasses such as
RecipeError), a path that does not exist (the message names it), a service that did not answer in time, a service
that refused or is not running, a cluster that cannot be reached. Deliberately not OSError, RuntimeError or
Exception: other OSErrors on a path the user gave are turned into UserInputError where that path is used
(``corpus OUT_DIR``, ``show --plot FILE``); anything else keeps its traceback, the useful report of a bug."""


MAX_LINE = 1000
"""The longest error line printed (cut at a word boundary)."""
MAX_STORAGE_LINE = 500
"""The longest storage failure before its hint: the object and the store's reason, not a client's whole dump."""


def error_line(exc: BaseException) -> str | None:
    """The one line that reports ``exc`` to the user, or None when ``exc`` is not the user's to fix (a bug). A
    service's error about storage (its actors could not use a bucket) carries the same hint as a worker's."""
    if isinstance(exc, ServiceError):
        line = one_line(exc, MAX_LINE) or type(exc).__name__
        hinted = with_storage_hint(one_line(exc, MAX_STORAGE_LINE)) if "://" in line else None
        return hinted or line
    if isinstance(exc, OWN_MESSAGE_ERRORS):
        return one_line(exc, MAX_LINE) or type(exc).__name__
    worker = worker_error(exc)
    if worker is not None:
        return worker
    if isinstance(exc, USER_ERRORS):
        return one_line(exc, MAX_LINE) or type(exc).__name__
    return None


def run_command(command: Callable[[Any], int], args: Any) -> int:
    """``command(args)``'s exit code, with the mapping of the module docstring applied to what it raises: a user
    error writes its line to stderr and raises ``SystemExit(2)``; Ctrl-C returns 130; anything else propagates."""
    try:
        return command(args)
    except KeyboardInterrupt:
        return INTERRUPTED_EXIT
    except Exception as exc:
        line = error_line(exc)
        if line is None:
            raise
        sys.stderr.write(f"{PROG}: error: {line}\n")
        sys.stderr.flush()
        raise SystemExit(USER_ERROR_EXIT) from None


# ---------------------------------------------------------------------- errors from the cluster's workers
def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: Ray's ``.cause``, ``__cause__``, and ``__context__`` unless suppressed
    (``raise ... from None``)."""
    seen: set[int] = set()
    out: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        todo += [getattr(e, "cause", None), e.__cause__, None if e.__suppress_context__ else e.__context__]
    return out


def _from_ray(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("ray.")


def worker_error(exc: BaseException) -> str | None:
    """One line for an error raised in a Ray worker (a Ray Data or service actor): the storage failure it names,
    with its likely cause, else the cause's last line; None for an error of this process."""
    if not any(_from_ray(c) for c in causes(exc)):
        return None
    line = storage_failure(exc)
    if line is not None:
        return line
    from zephon_ray.service.errors import describe

    return describe(exc)


_STORAGE_WORDS = (
    "s3://",
    "gs://",
    "az://",
    "abfs",
    "bucket",
    "endpoint",
    "credential",
    "access denied",
    "AccessDenied",
    "Could not resolve host",
    "Could not connect",
    "NETWORK_CONNECTION",
    "InvalidAccessKeyId",
    "NoSuchBucket",
    "does not exist",
    "still failing after",
)
_RAY_TASK_PREFIXES = ("ray.exceptions.RayTaskError", "RayTaskError")


def strip_ray_prefix(line: str) -> str:
    """``RayTaskError(OSError): s3://b/k: ...`` as ``s3://b/k: ...``: the wrapper's name is not the user's news."""
    return line.split("): ", 1)[-1] if line.startswith(_RAY_TASK_PREFIXES) else line


def storage_failure(exc: BaseException) -> str | None:
    """One line for an error that came back from the cluster's workers because of storage (an object they could not
    reach or read), naming the object and the likely cause; None for anything else. Never a secret: the hint names
    only which credential variables stay in this shell."""
    texts = []
    for cause in causes(exc):
        lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
        texts += [ln for ln in lines if not ln.startswith(("File ", "Traceback", "^", "~"))]
    hits = [t for t in texts if any(w in t for w in _STORAGE_WORDS)]
    if not hits:
        return None
    line = min(hits, key=lambda t: (("://" not in t), len(t)))  # the shortest that names an object
    return with_storage_hint(one_line(strip_ray_prefix(line), MAX_STORAGE_LINE))


def with_storage_hint(line: str) -> str | None:
    """``line`` (a failure of the cluster's workers) with the likely cause of a storage failure it names appended;
    None when it names none."""
    from zephon_ray import storage

    if not any(w in line for w in _STORAGE_WORDS):
        return None
    lower = line.lower()
    if (
        "access denied" in lower
        or "accessdenied" in lower
        or "invalidaccesskeyid" in lower
        or "403" in line
        or "credential" in lower
    ):
        local = storage.local_credentials()
        hint = (
            "the workers have no credentials for it, or not these: credentials are never shipped to the "
            "cluster"
            + (f" ({', '.join(local)} stay in this shell)" if local else "")
            + "; give the nodes their own (instance role, their environment or files)"
        )
    elif "resolve host" in lower or "connect" in lower or "endpoint" in lower:
        hint = (
            "the workers have no endpoint for it or cannot reach it: set AWS_ENDPOINT_URL (or "
            "ZEPHON_RAY_GCS_ENDPOINT / ZEPHON_RAY_AZURE_ENDPOINT) where this command runs; it reaches the "
            "workers through the job's runtime_env"
        )
    else:
        hint = "the workers could not use it"
    return f"{line} ({hint})"
