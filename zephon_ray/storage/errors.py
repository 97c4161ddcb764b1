"""What storage faults look like, and which of them may pass: the two error types and the fault classification.

    StorageError        a store or file that cannot be reached or read as asked (``transient``: the cause may pass)
    DocumentError       a JSON document that is missing, not JSON, or of another format
    is_transient(exc)   True for a fault worth waiting out (:func:`zephon_ray.storage.retry` asks it)
    describe_error(exc) the useful part of a store's error message, on one line

Usage: the operations of :mod:`zephon_ray.storage` raise :class:`StorageError` (naming the URI) and
``FileNotFoundError`` (naming the file); :func:`zephon_ray.storage.read_json` raises :class:`DocumentError` (or the
caller's own type). Code that talks to a store through another client (:mod:`zephon_ray.zephon_io`, a Parquet
reader) asks :func:`is_transient` whether to retry.

Guarantee: messages are one line, naming the URI or file, without request ids; a :class:`StorageError` keeps its
``transient`` flag across processes (Ray ships errors by pickle). Missing objects and buckets and refused credentials
are permanent; so is a spent retry budget (its message carries :data:`GAVE_UP`), even after a caller wraps it in its
own error type.

Limits: an error other than a :class:`StorageError` is judged by its type and its text (the markers of pyarrow's
AWS, GCS and Azure errors, of obstore's, and HTTP 429/5xx codes); a message with none of the known markers is taken
as permanent (raised at once, never waited out).
"""

from __future__ import annotations

import re

from zephon_ray.errors import one_line

GAVE_UP = "of retries; the budget is"
"""The phrase in the message of a call whose retry budget is spent: a fault that carries it is final."""


class StorageError(OSError):
    """A store or file that cannot be reached or read as asked; the message names the URI (one line).
    ``transient``: the cause may pass (an outage, throttling, a cut response); :func:`zephon_ray.storage.retry`
    waits those out and raises one with ``transient=False`` once its budget is spent."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient

    def __str__(self) -> str:
        return self.args[0] if self.args else ""

    def __reduce__(self):  # keep the flag across processes (Ray ships errors by pickle)
        return (_storage_error, (str(self), self.transient))


def _storage_error(message: str, transient: bool) -> StorageError:
    return StorageError(message, transient=transient)


class DocumentError(ValueError):
    """A JSON document that is missing, not JSON, or of another format; the message names the file."""


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


_PERMANENT = (
    "NO_SUCH_BUCKET",
    "NoSuchBucket",
    "ACCESS_DENIED",
    "AccessDenied",
    "INVALID_ACCESS_KEY_ID",
    "InvalidAccessKeyId",
    "SIGNATURE_DOES_NOT_MATCH",
    "SignatureDoesNotMatch",
    "AuthenticationFailed",
    "AuthorizationFailure",
    "ContainerNotFound",
    "PERMISSION_DENIED",
    "UNAUTHENTICATED",
    "Forbidden",
)
_TRANSIENT = (
    "NETWORK_CONNECTION",
    "SLOW_DOWN",
    "SlowDown",
    "Slow Down",
    "SERVICE_UNAVAILABLE",
    "ServiceUnavailable",
    "INTERNAL_FAILURE",
    "InternalError",
    "THROTTLING",
    "Throttling",
    "RequestTimeout",
    "REQUEST_TIMEOUT",
    "RequestTimeTooSkewed",
    "Connection reset",
    "connection reset",
    "Connection refused",
    "connection refused",
    "Connection was reset",
    "timed out",
    "Timeout was reached",
    "Timeout",
    "Couldn't connect",
    "Could not connect",
    "Failed to connect",
    "Recv failure",
    "Send failure",
    "partial file",
    "Empty reply",
    "Server returned nothing",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "ServerBusy",
    "OperationTimedOut",
    "cut short",
    "Broken pipe",
    "EOF",
    "Connection closed",
    "connection closed",
    "TooManyRequests",
    "RESOURCE_EXHAUSTED",
    "Transferred a partial",
    "tcp connect error",
    "error sending request",
    "cannot connect to the endpoint",
)
_TRANSIENT_CODES = re.compile(
    r"(?:HTTP|http|status|response code|code|Code)[ :=]*(?:429|500|502|503|504)\b"
    r"|\b(?:429|500|502|503|504) (?:Service|Internal|Bad Gateway|Gateway|Slow|Too Many)"
    r"|curlCode: (?:6|7|18|28|35|52|55|56)\b"
)


def is_permanent_text(text: str) -> bool:
    """True when a store's message says the fault will not pass: a missing bucket, refused credentials (403, 401)."""
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
