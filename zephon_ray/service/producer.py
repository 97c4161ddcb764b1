"""A producer: one Ray actor that is one Zephon rank owning L/M contiguous lanes of the recipe.

Guarantee: ``produce(s)`` returns this rank's lane shards of step s, one Ray return value per owned lane in lane
order, bit-identical to the same lanes of ``GlobalBatchSource(recipe).batch(s)``. The values are *returned* from
the actor call, so the caller (the coordinator) owns them and they outlive this actor (a ``kill -9`` of the
producer loses only calls still running). Limits: calls must come in step order (the actor is sequential and
checks it); a producer cannot go back, the coordinator replaces the whole group instead (see coordinator.py).
"""

from __future__ import annotations

import os
from typing import Any

from zephon_ray.lanes import LaneShard, LaneStepper
from zephon_ray.pipeline import ZephonRank
from zephon_ray.recipe import Recipe


class Producer:
    """Plain class; the coordinator wraps it with ``ray.remote`` and fractional CPUs."""

    def __init__(self, recipe: Recipe, rank: ZephonRank, state: dict[str, Any] | None = None) -> None:
        self._stepper = LaneStepper(recipe, rank)
        if state is not None:
            self._stepper.restore(state)
        self.lanes = self._stepper.lanes

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(), "lanes": list(self.lanes),
                "position": self._stepper.position}

    def _expect(self, step: int) -> None:
        if step != self._stepper.position:
            raise RuntimeError(f"producer for lanes {self.lanes} is at step {self._stepper.position}, asked for {step}")

    def produce(self, step: int) -> LaneShard | tuple[LaneShard, ...]:
        self._expect(step)
        shards = self._stepper.next_step()
        out = tuple(shards[lane] for lane in self.lanes)
        return out[0] if len(out) == 1 else out  # Ray's num_returns=1 takes the value itself

    def skip(self, step: int) -> int:
        """Advance past a step that nobody needs stored (already held, or behind every consumer)."""
        self._expect(step)
        self._stepper.next_step()
        return step

    def checkpoint(self, step: int) -> dict[str, Any]:
        """The merged state at the boundary before ``step``. Collective with M > 1: every producer of the group
        must be called at the same step; each receives the same merged state (measured)."""
        self._expect(step)
        return self._stepper.checkpoint()

    def close(self) -> None:
        self._stepper.close(background=True)
