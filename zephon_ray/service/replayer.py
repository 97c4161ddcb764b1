"""The Replayer: a Ray actor with its own CPU that serves steps outside the live window (past, or far ahead).

It holds one world-size-1 Zephon pipeline over all lanes. ``replay(step, checkpoint_step, state)`` restores the
given durable checkpoint (the nearest one <= step, chosen by the coordinator) unless its pipeline already sits at
most ``reuse_within`` steps before ``step``, then steps forward and returns the L lane shards of ``step`` plus
:func:`~zephon_ray.service.producer.shard_meta`, as ``num_returns = L + 1`` values owned by the caller.

Guarantee: the shards equal the same lanes of ``GlobalBatchSource(recipe).batch(step)`` (a world-size-1 pipeline
restored from a merged checkpoint at a step boundary gives the same lane batches as any topology; see shared notes).
The coordinator never runs this work itself and shares one replay among every rank asking for the same step
(tests/test_service.py::test_replays_run_in_the_replayer_and_are_shared).
Limits: one replay at a time per actor (sequential); a cold replay costs one restore plus up to
``anchor_every`` steps for a step older than the newest checkpoints; sequential past reads are cheap (reuse).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from zephon_ray.identity import verify_on_node
from zephon_ray.lanes import LaneStepper
from zephon_ray.recipe import Recipe
from zephon_ray.service.producer import node_name, shard_meta


class Replayer:
    """Plain class; the coordinator wraps it with ``ray.remote`` and its own CPUs."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.init_error: str | None = None
        self._stepper: LaneStepper | None = None
        self.stats = {"replays": 0, "restores": 0, "steps_replayed": 0}
        try:
            verify_on_node(recipe, where="replayer")
            LaneStepper(recipe).close(background=True)  # fail at start (missing data, tokenizer), not at a read
        except Exception as exc:  # noqa: BLE001 - reported once, with the node
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            self.init_error = f"replayer on node {node_name()} failed to start: {last}"

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": node_name(), "error": self.init_error,
                "position": None if self._stepper is None else self._stepper.position, **self.stats}

    def replay(self, step: int, checkpoint_step: int, state: dict[str, Any] | None, reuse_within: int) -> tuple:
        if self.init_error:
            raise RuntimeError(self.init_error)
        stepper = self._stepper
        reusable = stepper is not None and stepper.position <= step and (
            step - stepper.position <= reuse_within or stepper.position >= checkpoint_step)
        if not reusable:
            if stepper is not None:
                stepper.close(background=True)
            stepper = self._stepper = LaneStepper(self.recipe)
            if state is not None:
                stepper.restore(state)
            self.stats["restores"] += 1
        self.stats["replays"] += 1
        self.stats["steps_replayed"] += step - stepper.position + 1
        while True:
            position = stepper.position
            shards = stepper.next_step()
            if position == step:
                break
        out = [shards[lane] for lane in range(self.recipe.lanes)]
        return (*out, shard_meta(step, out))

    def close(self) -> None:
        if self._stepper is not None:
            self._stepper.close(background=True)
