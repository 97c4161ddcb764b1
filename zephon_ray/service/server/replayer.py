"""The Replayer: a Ray actor with its own CPU that serves steps outside the live window (past, or far ahead), started
and called by the coordinator's replay scheduling (replay_scheduler.py).

It holds one world-size-1 Zephon pipeline over all lanes. ``replay(step, checkpoint_step, state)`` restores the
given durable checkpoint (the nearest one <= step, chosen by the coordinator) unless its pipeline already sits at
most ``reuse_within`` steps before ``step``, then steps forward and puts the L lane shards of ``step`` into its own
object store (this actor owns them, as a producer owns its shards:
:func:`~zephon_ray.service.server.producer.put_shards`), returning their meta and refs. With a materialised prefix
(``ServiceConfig.materialized_dir``), ``read(step)`` returns a step of it in the same form, read from the directory
with pyarrow and checked against its recorded digest (one row-group read, no Zephon).

Guarantee: the shards equal the same lanes of ``GlobalBatchSource(recipe).batch(step)`` (a world-size-1 pipeline
restored from a merged checkpoint at a step boundary gives the same lane batches as any topology). The coordinator
never runs this work itself and shares one replay among every rank asking for the same step. A replayer that dies
(it is restarted by Ray) loses the shards it owned; a client that finds them lost has the step replayed again.

Limits: one call at a time per actor (sequential), so a prefix read waits behind a replay in the same actor; a
cold replay costs one restore plus up to ``anchor_every`` steps for a step older than the newest checkpoints;
sequential past reads are cheap (reuse). The materialised manifest records per-step source counts only, so a
prefix step's lane 0 shard carries the whole step's ``source_tokens`` and the others zeros: sums over the lanes
(what ``GlobalBatch.source_tokens`` reports) are exact, per-lane counts are not.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from zephon_ray.formats.materialized import MaterializedSource
from zephon_ray.identity import verify_on_node
from zephon_ray.lanes import KEY_NEXT_STEP, LaneShard, LaneStepper, first_step
from zephon_ray.recipe import Recipe
from zephon_ray.service.errors import describe
from zephon_ray.service.server.producer import node_name, put_shards, worker_id

log = logging.getLogger("zephon_ray.service")


class Replayer:
    """Plain class; the coordinator wraps it with ``ray.remote`` and its own CPUs."""

    def __init__(
        self,
        recipe: Recipe,
        materialized_dir: str | None = None,
        *,
        storage_retry_s: float | None = None,
        pack_bytes: int = 0,
    ) -> None:
        from zephon_ray import storage

        if storage_retry_s is not None:
            storage.set_retry_budget(storage_retry_s)
        self.recipe = recipe
        self.pack_bytes = pack_bytes
        self.init_error: str | None = None
        self._stepper: LaneStepper | None = None
        self._materialized: MaterializedSource | None = None
        self.stats = {"replays": 0, "restores": 0, "steps_replayed": 0, "materialized_reads": 0}

        def start() -> None:
            verify_on_node(recipe, where="replayer")
            LaneStepper(recipe).close(background=True)  # fail at start (missing data, tokenizer), not mid-replay
            if materialized_dir is not None:
                self._materialized = MaterializedSource(materialized_dir, recipe=recipe)

        try:
            storage.retry(start, "replayer")  # a storage outage while starting is waited out (storage budget)
        except Exception as exc:
            log.warning("start failed", exc_info=True)  # the trace stays in the log; the message is one line
            last = describe(exc)
            self.init_error = f"replayer on node {node_name()} failed to start: {last}"

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node": node_name(),
            "worker_id": worker_id(),
            "error": self.init_error,
            "position": None if self._stepper is None else self._stepper.position,
            **self.stats,
        }

    def replay(self, step: int, checkpoint_step: int, state: dict[str, Any] | None, reuse_within: int) -> dict:
        if self.init_error:
            raise RuntimeError(self.init_error)
        stepper = self._stepper
        reusable = (
            stepper is not None
            and stepper.position <= step
            and (step - stepper.position <= reuse_within or stepper.position >= checkpoint_step)
        )
        shards = None
        if stepper is None or not reusable:
            if stepper is not None:
                stepper.close(background=True)
            self._stepper = None

            def build() -> LaneStepper:
                fresh = LaneStepper(self.recipe)
                if state is not None:
                    fresh.restore(state)
                return fresh

            # A new stepper opens Zephon's storage at its first step: an outage there, or during the replay up to
            # step, is waited out (first_step).
            stepper, shards = first_step(build, f"replayer at step {step}", through=step)
            self._stepper = stepper
            self.stats["restores"] += 1
            made = step + 1 - (0 if state is None else int(state[KEY_NEXT_STEP]))
        else:
            made = step + 1 - stepper.position
            while stepper.position <= step:
                shards = stepper.next_step()
        self.stats["replays"] += 1
        self.stats["steps_replayed"] += made
        assert shards is not None  # the stepper was at or before step
        return put_shards(step, [shards[lane] for lane in range(self.recipe.lanes)], self.pack_bytes)

    def read(self, step: int) -> dict:
        """Step ``step`` of the materialised prefix as L lane shards plus their meta (see module doc)."""
        if self.init_error:
            raise RuntimeError(self.init_error)
        if self._materialized is None:
            raise RuntimeError("this replayer has no materialized_dir")
        batch = self._materialized.batch(step)
        rows, counts = self.recipe.rows_per_lane, np.asarray(list(batch.source_tokens.values()), dtype=np.int64)
        out = [
            LaneShard(
                lane=lane,
                tokens=batch.tokens[lane * rows : (lane + 1) * rows],
                positions=batch.positions[lane * rows : (lane + 1) * rows],
                source_tokens=counts if lane == 0 else np.zeros_like(counts),
            )
            for lane in range(self.recipe.lanes)
        ]
        self.stats["materialized_reads"] += 1
        return put_shards(step, out, self.pack_bytes)

    def close(self) -> None:
        if self._stepper is not None:
            self._stepper.close(background=True)
