"""The fence around TorchTitan's private internals: the only module of zephon-ray that relies on them.

TorchTitan 0.3.0 (:data:`TORCHTITAN_VERSION`) has no public way for an ``--override.imports`` factory to see the
trainer config it is applied to, and the factory is handed only the node it replaces. The override route needs
the trainer's global batch, seq_len and tokenizer to check them against the recipe, so
:func:`trainer_config_being_overridden` walks up the call stack to the frame of
``torchtitan.config.override.apply_overrides`` and reads its ``config_root`` local. That is private: a TorchTitan
that renames the local or applies overrides another way breaks it.

A fence test of the suite fails loudly when TorchTitan changes under us: it checks the version, runs
this walk through TorchTitan's real ``apply_overrides``, and checks that ``Trainer.__init__`` still builds the data
loader with exactly the keywords ``ZephonRayDataLoader`` accepts (and the CPU shims' private targets, which live in
examples/torchtitan_cpu.py, outside the wheel). If the walk finds nothing at run time, the error says so rather
than skipping the checks.
"""

from __future__ import annotations

import inspect
from typing import Any

from zephon_ray.stream.geometry import TrainerMismatchError

TORCHTITAN_VERSION = "0.3.0"
"""The TorchTitan release these internals were read from (pinned by the ``torchtitan`` extra)."""

APPLY_OVERRIDES_ROOT = "config_root"
"""The name of ``apply_overrides``'s parameter holding the whole trainer config (private to TorchTitan)."""


def trainer_config_being_overridden() -> Any:
    """The ``Trainer.Config`` that TorchTitan's ``apply_overrides`` (somewhere up the stack) is applying to."""
    from torchtitan.config.override import apply_overrides

    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is apply_overrides.__code__:
                root = frame.f_locals.get(APPLY_OVERRIDES_ROOT)
                if root is not None and hasattr(root, "training"):
                    return root
            frame = frame.f_back
    finally:
        del frame
    raise TrainerMismatchError(
        "zephon_dataloader: cannot find the trainer config this override is applied to (TorchTitan's "
        f"apply_overrides with a {APPLY_OVERRIDES_ROOT!r} that has 'training'; written for TorchTitan "
        f"{TORCHTITAN_VERSION}); zephon-ray needs it to check the global batch. Use the config registry "
        "(--module zephon_ray.integrations.torchtitan) or build Trainer.Config in Python"
    )
