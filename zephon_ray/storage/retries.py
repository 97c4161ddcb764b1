"""Transient storage faults are waited out: the retry policy, its budget, and the process's retry statistics.

Every remote read, listing, write and delete of :mod:`zephon_ray.storage` goes through :func:`retry`: a connection
refused or reset, a timeout, a 5xx answer (503 SlowDown included) and a response cut short are retried with capped
exponential backoff and jitter (:data:`RETRY_FIRST_S` doubling to at most :data:`RETRY_CAP_S`), for up to
``ZEPHON_RAY_STORAGE_RETRY_S`` seconds (default 600). A permanent fault (a missing bucket, refused credentials, a
missing object) is never retried.

Usage: ``retry(read, uri, on_retry=drop_handle)`` around a call to a store made outside the operations of this
package (a read through an open Parquet file); :func:`set_retry_budget` sets one process's budget (e.g. a
service's ``storage_retry_s``); ``with first_contact():`` bounds the calls of a start, whose storage has not
answered yet, to :data:`START_BUDGET_S`, so that a misconfiguration is one line at once, not an outage waited out.
:data:`RETRY_STATS` counts what was retried (status reports and benchmarks read it).

Guarantee: a budget spent is one :class:`StorageError` naming what was tried and the last cause, final
(``transient=False``); a permanent fault is raised at once, unchanged. The budget, its override and the statistics
are process-wide and live here only; :func:`first_contact`'s budget is per thread.

Limits: the retry covers one call; a caller holding an open pyarrow file (a Parquet reader) retries its own reads
with :func:`retry`, as :class:`zephon_ray.formats.materialized.MaterializedSource` does. Only calls that are
safe to repeat may be retried: every remote write of :mod:`zephon_ray.storage` is one whole-object PUT.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from zephon_ray.errors import one_line
from zephon_ray.storage.environment import RETRY_BUDGET_ENV, env_number
from zephon_ray.storage.errors import GAVE_UP, StorageError, is_transient

log = logging.getLogger("zephon_ray.storage")
T = TypeVar("T")

DEFAULT_RETRY_BUDGET_S = 600.0
MAX_RETRY_BUDGET_S = 7 * 24 * 3600.0
RETRY_FIRST_S = 0.2
"""The first backoff; each next one doubles, up to :data:`RETRY_CAP_S`, and each is jittered (x 0.5-1.0)."""
RETRY_CAP_S = 5.0
START_BUDGET_S = 20.0
"""The retry budget of a start's first contact with its storage (:func:`first_contact`): an unresolvable endpoint,
refused credentials or a missing bucket is one line within it, not an outage waited out for the full budget."""

RETRY_STATS = {"retried_calls": 0, "retries": 0, "longest_wait_s": 0.0, "gave_up": 0}
"""Process-wide counters of :func:`retry` (for status reports and benchmarks): calls that retried at least once,
retries in all, the longest time one call spent waiting before it succeeded or gave up, calls that gave up."""
_BUDGET_OVERRIDE: list[float] = []
_THREAD_BUDGET = threading.local()


def retry_budget_s() -> float:
    """Seconds a call keeps retrying transient faults: this thread's :func:`first_contact` budget, else
    :func:`set_retry_budget`'s value, else ``ZEPHON_RAY_STORAGE_RETRY_S``, else 600."""
    local = getattr(_THREAD_BUDGET, "seconds", None)
    if local is not None:
        return local
    if _BUDGET_OVERRIDE:
        return _BUDGET_OVERRIDE[-1]
    return env_number(RETRY_BUDGET_ENV, DEFAULT_RETRY_BUDGET_S, 0, MAX_RETRY_BUDGET_S)


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
        raise StorageError(
            f"storage retry budget must be a number of seconds in [0, {MAX_RETRY_BUDGET_S:g}], got {seconds!r}"
        )
    _BUDGET_OVERRIDE[:] = [float(seconds)]


def retry(
    fn: Callable[[], T],
    what: str,
    *,
    budget_s: float | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
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
        except BaseException as exc:
            if not isinstance(exc, Exception) or not is_transient(exc):
                raise
            now = time.monotonic()
            waited = now - t0
            delay = min(RETRY_CAP_S, RETRY_FIRST_S * 2**attempt) * random.uniform(0.5, 1.0)
            if waited + delay > budget:
                RETRY_STATS["gave_up"] += 1
                RETRY_STATS["longest_wait_s"] = max(RETRY_STATS["longest_wait_s"], waited)
                cause = _with(what, exc)
                raise StorageError(
                    f"{cause} (still failing after {waited:.0f}s {GAVE_UP} {budget:g}s, {RETRY_BUDGET_ENV})"
                ) from None
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
