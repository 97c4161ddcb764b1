"""Errors the data service raises to its users: one clear message each, never a wall of Ray traceback."""

from __future__ import annotations


class ServiceError(RuntimeError):
    """The service could not do what was asked; the message says what and why."""


class ServiceNotFoundError(ServiceError):
    """No service of that name runs in that namespace (or its coordinator died)."""


class FingerprintMismatchError(ValueError):
    """A ``state_dir`` that belongs to another recipe. Refused before anything is written."""


class ShardsLostError(ServiceError):
    """A step's shards were lost (the node holding them, or the coordinator that owned them, died). Reads through
    :class:`DataService` retry this on their own (replaying the step) for ``reconnect_timeout_s``."""
