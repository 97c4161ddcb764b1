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

Guarantee: :func:`quiet_known_noise` is idempotent and drops, on each of those loggers only, exactly the records
whose format string starts with that logger's prefix in :data:`KNOWN_HARMLESS` (``tests/test_noise.py``). Limits: a
library release that rewords a message lets it through again (visible, never something else hidden);
``tests/test_noise.py`` checks the installed libraries' wording.
"""

from __future__ import annotations

import logging

PACK_SEQUENCES_LOGGER = "zephon._internal.ops.pack_sequences"
PACK_TAIL_DROP_PREFIX = "PackSequences wrap: dropping "
RAY_DATA_PROGRESS_LOGGER = "ray.data._internal.progress"
RAY_DATA_BARS_OFF_PREFIX = "Progress bars disabled. To enable, set "

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
