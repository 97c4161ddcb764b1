"""TorchTitan 0.3.0's torchft trainer on zephon-ray batches, with the exactly-once ledger (extras: ``torchtitan``, ``ft``).

``torchtitan.experiments.torchft.FaultTolerantTrainer`` builds its data loader once, with a fixed ``dp_world_size =
dp x group_size`` and ``dp_rank = dp x replica_id + r``, and steps its optimizer inside torchft's ``OptimizerWrapper``
(``TorchFTOptimizersContainer``), which applies the step only when ``manager.should_commit()`` passes and tells no
one. :class:`ZephonFTTrainer` is that trainer plus three connections, all through TorchTitan's and torch's public
extension points (a ``Trainer`` subclass, as :class:`~zephon_ray.integrations.torchtitan.config_registry.ZephonTrainer`
is, and an optimizer step hook):

* after building, the loader reads every step through :class:`~zephon_ray.stream.ft.FtSlices` after the quorum
  (``ZephonRayDataLoader.use_torchft``): replica group p of the P live groups reads ``slice(s, p·dp + r, P·dp)`` of
  ``s = manager.current_step()``, so every committed step trains the fixed global batch whatever P is;
* the verdict: a step post-hook on the first inner optimizer (the model parts' optimizers step together) counts the
  optimizer steps that really happened during ``train_step``; after it, the loader is told that the step it handed
  out was applied (:meth:`zephon_ray.stream.ft.FtSlices.applied`), which writes this reader's part of the step's
  ledger segment. A step that ``should_commit()`` rejected is not applied, leaves no record and is served again; one
  applied anyway (an optimizer that ignores the verdict) is recorded as applied, and the audit names it ("trained
  twice", attempt 1), because the step is served again;
* the ledger head travels with the model when torchft heals a group: the loader's state (``FtSlices.state_dict``) is
  part of the trainer's ``train_state``, which TorchTitan's ``TorchFTCheckpointManager`` hands to torchft as the state
  a healing group receives. Under TorchTitan's async quorum a group heals during a step it does not participate in
  (placeholder rows, gradients zeroed); its ledger then follows the participants' segment of that step.

Usage: a ``ZephonFTTrainer.Config`` (a ``FaultTolerantTrainer.Config``) with ``fault_tolerance.enable``, the
``TorchFTOptimizersContainer`` and ``TorchFTCheckpointManager`` configs (``checkpoint.enable``: it registers the heal
state), and ``ZephonRayDataLoader.Config(mode="service" | "dataset", run_id=..., ledger_dir=...)``; ``config.build()``
makes this trainer. ``examples/torchtitan_torchft.py`` is a complete CPU run (``zephon_ft_cpu``) with kills and
rejoins whose ledger audits clean.

Guarantee: every step a group's optimizer applied is in the ledger with the digest of the rows it read, and nothing
else is; a churn (groups SIGKILLed in a step and restarted) audits clean (``zephon-ray audit``).

Limits: service or dataset mode (local mode's lanes cannot follow a quorum: :mod:`zephon_ray.stream.ft`); per-step
quorums only (``semi_sync_method`` such as DiLoCo advances the manager's step per sync and is refused);
TorchTitan's trainer step (``self.step``, the LR schedule's) counts attempts, a rejected one included, while the
data step is torchft's committed step, so a run with rejected attempts trains fewer data steps than
``training.steps``. Each group divides its loss by its own valid-token count and torchft averages the groups'
gradients, so the gradient is the global batch's only when every group holds the same number of valid tokens (P
dividing B, ``wrap`` packing); see docs/torchft.md, "Loss weighting". There is no trainer-step check against the loader
state on this route: the data step is torchft's, and the ledger refuses a step it cannot follow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

from zephon_ray.integrations.torchtitan.loader import ZephonRayDataLoader

TRAIN_STATE_KEY = "zephon_ray_loader"
"""The key of the loader's state (JSON) inside the trainer's ``train_state``: what a healing group receives."""


class ZephonFTTrainer(FaultTolerantTrainer):
    """TorchTitan's ``FaultTolerantTrainer`` whose :class:`ZephonRayDataLoader` reads through ``FtSlices`` and
    records every applied step in the ledger. See the module docstring for the guarantee and its limits."""

    @dataclass(kw_only=True, slots=True)
    class Config(FaultTolerantTrainer.Config):  # its own Config: TorchTitan's build() makes the owner class
        pass

    def __init__(self, config: Config) -> None:
        ft = config.fault_tolerance
        if not ft.enable:
            raise ValueError(
                "ZephonFTTrainer: fault_tolerance.enable is off; use ZephonTrainer (the config registry's "
                "trainer) for a run without torchft"
            )
        if ft.semi_sync_method is not None:
            raise ValueError(
                f"ZephonFTTrainer: fault_tolerance.semi_sync_method {ft.semi_sync_method!r} advances "
                "torchft's step once per sync, not per step; zephon-ray's per-step slices need it unset"
            )
        if not isinstance(config.optimizer, TorchFTOptimizersContainer.Config):
            raise ValueError(
                f"ZephonFTTrainer: optimizer {type(config.optimizer).__name__} is not TorchTitan's "
                "TorchFTOptimizersContainer.Config: without it nothing asks should_commit() and "
                "torchft's step never moves"
            )
        super().__init__(config)
        loader = self.dataloader
        if not isinstance(loader, ZephonRayDataLoader):
            raise TypeError(f"ZephonFTTrainer: the data loader is {type(loader).__name__}, not ZephonRayDataLoader")
        loader.use_torchft(self.ft_manager.manager, group_size=ft.group_size)
        self._applied = 0
        # Every model part's optimizer steps in the same call: counting the first one counts the step once.
        self.optimizers.optimizers[0].register_step_post_hook(self._count_applied)

    def _count_applied(self, *_: Any) -> None:
        self._applied += 1

    def train_step(self, data_iterator: Any) -> None:
        self._applied = 0
        super().train_step(data_iterator)
        if self._applied:  # torchft's wrapper let the optimizer step through: should_commit() passed
            self.dataloader.ft_applied()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = super().state_dict()
        state[TRAIN_STATE_KEY] = json.dumps(self.dataloader.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        loader_state = state.pop(TRAIN_STATE_KEY, None)
        super().load_state_dict(state)
        if loader_state:  # a heal from a peer, or a checkpoint of this trainer
            self.dataloader.load_state_dict(json.loads(loader_state))
