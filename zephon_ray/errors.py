"""The one error type for bad user input (:class:`UserInputError`), one-line messages (:func:`one_line`), and
clean-up whose failure may be ignored (:func:`best_effort`).

A command-line value, a path, or a file given by the user that cannot be used raises it, with a message that names
what is wrong (the flag, the path, the number). ``zephon-ray`` prints it as one line ``zephon-ray: error: ...`` and
exits 2. It is a ``ValueError``, so callers that catch the library's validation errors (all
``ValueError`` subclasses: ``RecipeError``, ``MaterializedError``, ...) catch it too.

Usage: ``raise UserInputError(f"--steps must be A:B, got {text!r}")``; ``with best_effort(log, "removing the temp
dir"): ...`` for clean-up that must not mask the error being handled.

Limits: what is *not* a user-input error keeps its traceback: an ``OSError`` from a path is turned into one only where the
path came from the user (``corpus OUT_DIR``, ``show --plot FILE``), never by catching every exception.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class UserInputError(ValueError):
    """Input the user can fix; the message names the argument, path or value at fault."""


def one_line(text: object, limit: int | None = None) -> str:
    """``text`` with every run of whitespace (newlines included) as one space; longer than ``limit`` characters, it
    is cut at a word boundary and ends with "…" (a message is never cut mid-word)."""
    line = " ".join(str(text).split())
    if limit is None or len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[: cut if cut > limit // 2 else limit - 1].rstrip() + " …"


@contextmanager
def best_effort(log: logging.Logger, why: str) -> Iterator[None]:
    """Run the block; an ``Exception`` from it is logged at debug level with ``why`` (the reason it may be
    ignored, for example "already dead") and not raised. For clean-up and notices whose failure changes nothing."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - each caller states why in `why`
        log.debug("ignored (%s): %r", why, exc)
