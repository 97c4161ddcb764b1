"""Errors the data service raises to its users: one clear message each, never a wall of Ray traceback.

Shared by both sides: the client raises them (client/step_refs.py maps Ray's errors to them), the actors use
:func:`describe` (an exception as one line) and :func:`reply_within` (an awaited call with a deadline).

Guarantee: callers branch on these types, never on message text: :class:`ReplyTimeoutError` is "no reply in time,
retry", a plain ``TimeoutError`` from the coordinator is "the step was not produced within request_timeout_s".
"""

from __future__ import annotations

import asyncio
import traceback
from typing import Any

from zephon_ray.errors import one_line
from zephon_ray.formats.service_state import FingerprintMismatchError

__all__ = [
    "FingerprintMismatchError",
    "ReadTimeoutError",
    "ReplyTimeoutError",
    "ServiceError",
    "ServiceNotFoundError",
    "ShardsLostError",
]


class ServiceError(RuntimeError):
    """The service could not do what was asked; the message says what and why."""


class ServiceNotFoundError(ServiceError):
    """No service of that name runs in that namespace (or its coordinator died or was stopped)."""


class ShardsLostError(ServiceError):
    """A step's shards were lost (the node holding them, or the producer or replayer that owned them, died). Reads
    through :class:`DataService` retry this on their own (the step is made again) for ``reconnect_timeout_s``."""


class ReplyTimeoutError(ServiceError, TimeoutError):
    """A call to the coordinator or a node reader got no reply in time (it may be restarting). Reads retry it for
    ``reconnect_timeout_s``; it is never raised for a step that is merely not produced yet (that is a plain
    ``TimeoutError`` naming the window)."""


class ReadTimeoutError(ServiceError, TimeoutError):
    """A read did not finish by its deadline (``read_timeout_s``, or the ``timeout_s`` passed), retries included.
    The message names the step, what it waited for and how long. Raised once: it is the read's answer."""


class NoReply(Exception):
    """:func:`reply_within`'s bound passed. Not a ``TimeoutError``: a call's own TimeoutError (the coordinator's
    "not produced within", say) is its answer and stays what it is."""


async def reply_within(awaitable: Any, timeout_s: float) -> Any:
    """The result of ``awaitable`` (an actor call's ref, a coroutine, a shielded future), or :class:`NoReply` after
    ``timeout_s``. Unlike ``asyncio.wait_for``, an exception the awaitable raises itself, a ``TimeoutError``
    included, comes through unchanged (``asyncio.TimeoutError`` is ``TimeoutError`` since Python 3.11)."""
    future = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({future}, timeout=timeout_s)
    if not done:
        future.cancel()
        raise NoReply(f"no reply within {timeout_s:g}s")
    return future.result()  # done: asyncio.wait returned it


def describe(exc: BaseException) -> str:
    """One line for an error: a Ray task error's cause, as its type and message, then its notes (``add_note``), if
    any, in brackets (the traceback goes to the log)."""
    from ray.exceptions import RayError  # here: `zephon-ray inspect` imports this module and never Ray

    cause = exc
    while isinstance(cause, RayError):
        inner = getattr(cause, "cause", None)  # RayTaskError sets it; RayError declares no such attribute
        if not isinstance(inner, BaseException) or inner is cause:
            break
        cause = inner
    notes: list[str] = []
    try:
        formatted = traceback.TracebackException(type(cause), cause, None, compact=True)
        # Notes (``add_note``) follow the message in the formatted lines: the message is the last line without them
        # (a SyntaxError's source lines come before it), and the notes follow it in brackets.
        notes = [str(n) for n in formatted.__notes__ or []]
        formatted.__notes__ = None
        last = list(formatted.format_exception_only())[-1]
    except Exception:  # noqa: BLE001 - an exception whose str() fails
        last = type(cause).__name__
    if isinstance(cause, RayError) or "Traceback (most recent call last)" in last:
        lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else type(cause).__name__
    if notes:
        last = f"{last.rstrip()} ({'; '.join(notes)})"
    return one_line(last, 600)
