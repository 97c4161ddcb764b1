"""Progress for long CLI commands, on stderr only: stdout stays the command's output, byte for byte.

* :func:`note` prints one ``zephon-ray: ...`` line on stderr for a slow phase (starting Ray, starting a service,
  stopping it), so a command that is silent for tens of seconds before its first result says what it waits for.
* :func:`step_bar` is a tqdm bar on stderr over a command's steps; each result line goes to stdout through the
  bar (``tqdm.write``), so the two never garble each other. tqdm shows the bar only when stderr is a terminal
  (``disable=None``): a pipe or a log file gets the notes and the unchanged stdout lines, no carriage returns.

Usage: ``note("starting Ray")``; ``with step_bar(n, "digest") as emit: emit(line)`` per result line. Limits: a
command that prints to stdout by other means inside a bar garbles it on a terminal.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def note(message: str) -> None:
    """One line on stderr: what a long command is doing now."""
    print(f"zephon-ray: {message}", file=sys.stderr, flush=True)


@contextmanager
def step_bar(total: int, desc: str) -> Iterator[Callable[[str], None]]:
    """Yields ``emit(line)``: print ``line`` on stdout (flushed) and advance a bar of ``total`` steps on stderr."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=None, dynamic_ncols=True, leave=False)

    def emit(line: str) -> None:
        bar.write(line, file=sys.stdout)
        sys.stdout.flush()
        bar.update(1)

    try:
        yield emit
    finally:
        bar.close()
