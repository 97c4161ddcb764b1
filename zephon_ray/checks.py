"""One validator for the integers and reader positions every layer is handed: :func:`check_int`, :func:`check_reader`.

A core module (it imports nothing from zephon_ray), so every layer, formats to integrations, validates the same way
and says so in the same words::

    check_int("--steps", steps, low=1)                      # --steps must be an int in [1, 10**12], got 0
    check_int("ledger key 'world'", w, low=1, error=LedgerError)
    check_reader(rank, world, max_world=rows, why_max="the global batch's rows: every rank needs one")

Guarantee: a value that passes is a plain ``int`` (never a bool, a float such as 2.0, a string such as "3", None, or
a numpy integer unless ``numpy_ok``) inside the stated closed range; anything else raises the caller's own exception
type (``error``: ``LedgerError``, ``MaterializedError``, ``UserInputError``, ... all stay catchable as before) with one
line naming the value's name, the range and the value. Every range is bounded (default ``high`` is :data:`MAX_INT`),
so a validated number can size a loop or an allocation only as far as the caller's own ``high`` allows.

Limits: the message is the name the caller passes, verbatim; a caller that wants its file or object named puts it in
``name`` (``f"{path}: ledger key 'world'"``). Rules that relate two numbers (a divisor, a multiple, a step behind
another) stay with the caller, after these checks.
"""

from __future__ import annotations

import numbers
from typing import Any

MAX_INT = 10**12
"""The default upper bound of :func:`check_int`: every number a caller validates is bounded, even a step count."""
MAX_STEP = MAX_INT
"""The bound on every step number anything accepts (a step to read, reset to, materialise or train until)."""


def _show(bound: int) -> str:
    """``10**12`` rather than ``1000000000000`` for a large power of ten, so a message reads at a glance."""
    text = str(bound)
    if bound >= 10**6 and text.rstrip("0") == "1":
        return f"10**{len(text) - 1}"
    return text


def check_int(
    name: str,
    value: Any,
    *,
    low: int,
    high: int = MAX_INT,
    error: type[Exception] = ValueError,
    why: str = "",
    numpy_ok: bool = False,
) -> int:
    """``value`` as an int in ``[low, high]``, or raise ``error`` with one line naming ``name``, the range and the
    value: ``"{name} must be an int in [{low}, {high}] ({why}), got {value!r}"`` (``why``, if given, says where the
    bound comes from).

    A bool is refused even though Python counts it as an int (``True`` is never a count); so are floats (2.0),
    strings ("3") and None. ``numpy_ok`` also accepts numpy integers (an index read from an array) and returns them
    as a plain int; numpy bools are refused either way."""
    ok = isinstance(value, numbers.Integral) if numpy_ok else isinstance(value, int)
    if isinstance(value, bool) or not ok or not low <= value <= high:
        note = f" ({why})" if why else ""
        raise error(f"{name} must be an int in [{_show(low)}, {_show(high)}]{note}, got {value!r}")
    return int(value)


def check_reader(
    rank: Any,
    world: Any,
    *,
    max_world: int = MAX_INT,
    why_max: str = "",
    rank_name: str = "rank",
    world_name: str = "world",
    where: str = "",
    error: type[Exception] = ValueError,
) -> tuple[int, int]:
    """``(rank, world)`` of reader ``rank`` of ``world``: ``world`` an int in ``[1, max_world]``, then ``rank`` an int
    in ``[0, world)``; else ``error`` with one line naming the argument (``rank_name``/``world_name``, e.g.
    ``dp_rank``) and its value, after ``where`` (``"FtSlices: "``) if given. The world is checked first, so a rank's
    message can state its range: ``FtSlices: dp_rank must be an int in [0, dp=2), got 2``.

    ``max_world`` bounds the readers (a reader that would get no rows: pass the global batch's rows, with
    ``why_max`` saying so). Limits: no ``None`` shorthand for "one reader"; callers that allow it map it to
    ``(0, 1)`` before calling."""
    world = check_int(where + world_name, world, low=1, high=max_world, why=why_max, error=error)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise error(f"{where}{rank_name} must be an int in [0, {world_name}={world}), got {rank!r}")
    return rank, world
