"""Library log lines that are known to be harmless here, filtered by their exact message, nothing broader.

* Zephon's ``zephon._internal.ops.pack_sequences`` logger: ``"PackSequences wrap: dropping N trailing token(s)
  across ... packing group(s) in ... lane(s) that did not fill a full max_length=... bin; ..."``. Zephon logs it (a
  WARNING, once per lane per flush) whenever wrap packing flushes a lane's partial bin: at every
  ``flush_every_k_chunks`` boundary and when a pipeline is closed. For zephon-ray that is part of what a recipe
  means, not a loss: the dropped tail is the same at every run, every W and every mode (the recipe's fingerprint
  fixes it), and the global batches ``zephon-ray digest`` describes are the rows that remain. Every other Zephon
  message, warnings about oversized documents, mixture discards or cache space included, still reaches the user
  (before this filter, a blanket ``setLevel(ERROR)`` on the ``zephon`` logger hid them all).
* Ray Data's ``ray.data._internal.progress`` logger: ``"Progress bars disabled. To enable, set ..."``, which Ray
  Data prints because ``materialize`` and ``pretokenize`` turn its bars off on purpose: each shows one tqdm bar of
  its own (``--quiet`` turns it off). Ray Data's other progress warnings still show.

* Ray's C++ core worker, once per Ray Data map actor: ``"... core_worker.cc:...] Actor with class name: ... has
  constructor arguments in the object store and max_restarts > 0. ..."`` (docs/troubleshooting.md says why it is
  harmless for ``materialize``, ``pretokenize`` and ``locate``). C++ writes it to file descriptor 2, out of reach of
  Python's logging, so :func:`quiet_command` passes the command's stderr through a line filter that drops exactly
  the lines holding :data:`RAY_ACTOR_ARGS_MARKER` and copies every other byte unchanged.

Our commands also keep Ray Data's INFO lines ("Dataset ... execution finished in 13.6 seconds") off the terminal
(:func:`quiet_command`); Ray Data's own log file in the Ray session directory still gets them.

Guarantee: :func:`quiet_known_noise` is idempotent and drops, on each of those loggers only, exactly the records
whose format string starts with that logger's prefix in :data:`KNOWN_HARMLESS`. Limits: a
library release that rewords a message lets it through again (visible, never something else hidden);
a test checks the installed libraries' wording.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

PACK_SEQUENCES_LOGGER = "zephon._internal.ops.pack_sequences"
PACK_TAIL_DROP_PREFIX = "PackSequences wrap: dropping "
RAY_DATA_PROGRESS_LOGGER = "ray.data._internal.progress"
RAY_DATA_BARS_OFF_PREFIX = "Progress bars disabled. To enable, set "

RAY_ACTOR_ARGS_MARKER = b"has constructor arguments in the object store and max_restarts > 0"
RAY_DATA_LOGGER = "ray.data"

KNOWN_HARMLESS = {PACK_SEQUENCES_LOGGER: PACK_TAIL_DROP_PREFIX, RAY_DATA_PROGRESS_LOGGER: RAY_DATA_BARS_OFF_PREFIX}
"""Logger name -> the start of the one message filtered there (the module docstring says why each is harmless)."""


class KnownHarmlessFilter(logging.Filter):
    """Drops a logger's records whose format string starts with ``prefix``; passes every other record."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefix))


def quiet_known_noise() -> None:
    """Install the filters of :data:`KNOWN_HARMLESS` (idempotent)."""
    for name, prefix in KNOWN_HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownHarmlessFilter) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(KnownHarmlessFilter(prefix))


@contextmanager
def quiet_command() -> Iterator[None]:
    """For the length of one CLI command's Ray Data job: Ray Data's console below WARNING and the core worker's
    actor-arguments line are dropped from the terminal; everything else reaches it unchanged.

    Enter it after Ray has started: processes started inside it would inherit the filtered stderr.
    """
    import ray.data  # noqa: F401  (its import installs the console handler this lowers)

    quiet_known_noise()
    console = [h for h in logging.getLogger(RAY_DATA_LOGGER).handlers if h.name == "console"]
    levels = [h.level for h in console]
    for handler in console:
        handler.setLevel(max(handler.level, logging.WARNING))
    try:
        with _dropping_stderr_lines(RAY_ACTOR_ARGS_MARKER):
            yield
    finally:
        for handler, level in zip(console, levels):
            handler.setLevel(level)


@contextmanager
def _dropping_stderr_lines(marker: bytes) -> Iterator[None]:
    """Route file descriptor 2 through a pipe whose reader drops whole lines holding ``marker``.

    A partial line is passed on at once unless it starts like a C++ log line (``[``), so progress bars that redraw
    with carriage returns keep drawing. On exit descriptor 2 is restored and the pipe drained before returning, so
    a traceback printed after the block, or a line written just before leaving it, is never lost.
    """
    sys.stderr.flush()
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        held = b""
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                *lines, held = (held + chunk).split(b"\n")
                out = b"".join(line + b"\n" for line in lines if marker not in line)
                if held and not held.startswith(b"["):
                    out, held = out + held, b""
                _write_all(original, out)
        if marker not in held:
            _write_all(original, held)

    reader = threading.Thread(target=forward, name="zephon-ray-stderr-filter", daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, 2)  # closes the pipe's last write end: the reader sees the end and returns
        reader.join(timeout=10)
        os.close(original)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]
