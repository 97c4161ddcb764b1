"""Library log lines that are known to be harmless here, filtered by their exact message, nothing broader.

One filter today, :class:`PackTailDropFilter`, on Zephon's ``zephon._internal.ops.pack_sequences`` logger:
``"PackSequences wrap: dropping N trailing token(s) across ... packing group(s) in ... lane(s) that did not fill a
full max_length=... bin; ..."``. Zephon logs it (a WARNING, once per lane per flush) whenever wrap packing flushes a
lane's partial bin: at every ``flush_every_k_chunks`` boundary and when a pipeline is closed. For zephon-ray that
is part of what a recipe means, not a loss: the dropped tail is the same at every run, every W and every mode (the
recipe's fingerprint fixes it), and the global batches ``zephon-ray digest`` describes are the rows that remain.
Every other Zephon message, warnings about oversized documents, mixture discards or cache space included, still
reaches the user (before this filter, a blanket ``setLevel(ERROR)`` on the ``zephon`` logger hid them all).

Guarantee: :func:`quiet_known_noise` is idempotent and drops exactly the records whose format string starts with
:data:`PACK_TAIL_DROP_PREFIX` on that one logger (``tests/test_noise.py``). Limits: a Zephon release that rewords
the message lets it through again (visible, never hidden wrongly).
"""

from __future__ import annotations

import logging

PACK_SEQUENCES_LOGGER = "zephon._internal.ops.pack_sequences"
PACK_TAIL_DROP_PREFIX = "PackSequences wrap: dropping "


class PackTailDropFilter(logging.Filter):
    """Drops Zephon's wrap-packing tail-drop line (see the module docstring for why it is harmless)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(PACK_TAIL_DROP_PREFIX))


def quiet_known_noise() -> None:
    """Install the filters above (idempotent)."""
    logger = logging.getLogger(PACK_SEQUENCES_LOGGER)
    if not any(isinstance(f, PackTailDropFilter) for f in logger.filters):
        logger.addFilter(PackTailDropFilter())
