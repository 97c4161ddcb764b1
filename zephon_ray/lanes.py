"""Turn one Zephon pipeline's lane-pure microbatches into per-step lane shards.

A :class:`LaneStepper` owns some lanes of a recipe (all of them in-process, L/M of them in a producer). Step s
of lane l is lane l's microbatches ``s*k .. s*k+k-1``. Microbatches are filed **by their ``lane_ids``**, never
by stream position, because a restored pipeline may start its round-robin at a different lane.

Guarantee: ``next_step()`` returns the same shards for a given (recipe, lane, step) whichever Zephon rank owns
the lane and however often the stepper was checkpointed and restored (``tests/test_lanes.py``; the order of a lane's
k microbatches inside a step against the independent oracle: ``tests/test_oracle.py``, k = 2). Limits: checkpoints
exist only at step boundaries with no microbatch buffered ahead (``checkpoint()`` raises otherwise), and a
collective (multi-rank) checkpoint must be taken by every rank at the same step.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_ray.pipeline import LaneGroup, build_pipeline
from zephon_ray.recipe import Recipe

ROW_DTYPE = np.int32
"""Dtype of stored rows (tokens and positions). Every tokenizer here has fewer than 2**31 ids."""

STATE_VERSION = 1
KEY_VERSION = "version"
KEY_NEXT_STEP = "next_step"
KEY_FINGERPRINT = "fingerprint"
KEY_ZEPHON = "zephon"


class StepStateError(ValueError):
    """A checkpoint that cannot be taken or restored; the message says what differs."""


@dataclass(frozen=True)
class LaneShard:
    """One lane's rows of one step: k*m rows of seq_len+1 tokens, in the lane's own order."""

    lane: int
    tokens: np.ndarray
    positions: np.ndarray
    source_tokens: np.ndarray
    """Tokens per recipe source (recipe order) in these rows, from Zephon's per-record accounting."""


class LaneStepper:
    def __init__(self, recipe: Recipe, group: LaneGroup = LaneGroup()) -> None:
        self.recipe = recipe
        self.group = group
        self.lanes = group.owned_lanes(recipe.lanes)
        self._pipeline = build_pipeline(recipe, group)
        self._iter: Any = None
        self._pending: dict[int, deque] = {lane: deque() for lane in self.lanes}
        self._next_step = 0

    @property
    def position(self) -> int:
        """The step that the next call to :meth:`next_step` returns."""
        return self._next_step

    def next_step(self) -> dict[int, LaneShard]:
        k = self.recipe.microbatches_per_lane
        if self._iter is None:
            self._iter = iter(self._pipeline)
        while any(len(q) < k for q in self._pending.values()):
            try:
                mb = next(self._iter)
            except StopIteration:
                raise StopIteration(
                    f"the recipe's data ran out before step {self._next_step} (set repeat = true to keep training)"
                ) from None
            lane = int(mb.lane_ids[0])
            if lane not in self._pending:
                raise RuntimeError(f"Zephon emitted lane {lane}, which this lane group does not own ({self.lanes})")
            self._pending[lane].append(mb)
        shards = {lane: self._shard(lane, [self._pending[lane].popleft() for _ in range(k)]) for lane in self.lanes}
        self._next_step += 1
        return shards

    def _shard(self, lane: int, microbatches: list[Any]) -> LaneShard:
        recipe = self.recipe
        records = [rec for mb in microbatches for rec in mb.records]
        tokens = np.stack([rec.payload["input_ids"] for rec in records]).astype(ROW_DTYPE, copy=False)
        positions = np.stack([rec.payload["positions"] for rec in records]).astype(ROW_DTYPE, copy=False)
        if tokens.shape != (recipe.rows_per_lane, recipe.row_length):
            raise RuntimeError(f"lane {lane}: rows of shape {tokens.shape}, expected "
                               f"{(recipe.rows_per_lane, recipe.row_length)}")
        composition = np.zeros(len(recipe.sources), dtype=np.int64)
        for rec in records:
            for source_index, count in rec.meta.component_token_counts.items():
                composition[int(source_index)] += count
        for array in (tokens, positions, composition):
            array.setflags(write=False)  # fresh copies (np.stack), shared by the slices cut from them: never written
        return LaneShard(lane=lane, tokens=tokens, positions=positions, source_tokens=composition)

    # ------------------------------------------------------------------ state
    def checkpoint(self) -> dict[str, Any]:
        """JSON-safe state at the current step boundary. Collective when the lane group has ``count > 1``."""
        if any(self._pending.values()):
            buffered = {lane: len(q) for lane, q in self._pending.items() if q}
            raise StepStateError(
                f"cannot checkpoint at step {self._next_step}: microbatches of the next step are already buffered "
                f"({buffered}); Zephon checkpoints are only exact at step boundaries"
            )
        # A JSON round trip makes the state exactly what a durable copy will restore (int keys become str).
        zephon_state = json.loads(json.dumps(self._pipeline.checkpoint()))
        return {
            KEY_VERSION: STATE_VERSION,
            KEY_FINGERPRINT: self.recipe.fingerprint,
            KEY_NEXT_STEP: self._next_step,
            KEY_ZEPHON: zephon_state,
        }

    def restore(self, state: dict[str, Any]) -> None:
        check_step_state(state, self.recipe)
        self.close(background=True)
        self._next_step = int(state[KEY_NEXT_STEP])
        # A fresh pipeline object: the old one may still be shutting down its threads in the background.
        self._pipeline = build_pipeline(self.recipe, self.group)
        if self._next_step > 0:
            # Zephon 0.2.0 cannot restore a step-0 checkpoint (it reads lane_next_cid 0 as missing: "Lane 0 does
            # not have next cid"); a fresh pipeline is exactly that state.
            self._pipeline.restore(state[KEY_ZEPHON])

    def close(self, *, background: bool = False) -> None:
        """Stop Zephon's threads. ``background=True`` does not wait for them (a graceful join costs ~0.5 s)."""
        if self._iter is not None:
            close = getattr(self._iter, "close", None)
            if close is not None:
                if background:
                    threading.Thread(target=close, name="zephon-ray-close", daemon=True).start()
                else:
                    close()
            self._iter = None
        for q in self._pending.values():
            q.clear()


def check_step_state(state: dict[str, Any], recipe: Recipe) -> None:
    """Fail loudly on a state from another format, another recipe, or not at a step boundary."""
    if not isinstance(state, dict) or state.get(KEY_VERSION) != STATE_VERSION:
        got = state.get(KEY_VERSION) if isinstance(state, dict) else type(state).__name__
        raise StepStateError(f"step state version {got!r} is not supported (expected {STATE_VERSION})")
    if state.get(KEY_FINGERPRINT) != recipe.fingerprint:
        raise StepStateError(
            f"step state belongs to recipe fingerprint {str(state.get(KEY_FINGERPRINT))[:12]}, "
            f"not {recipe.describe()}"
        )
    step = int(state[KEY_NEXT_STEP])
    emitted = state[KEY_ZEPHON].get("lane_emitted", {})
    want = step * recipe.microbatches_per_lane
    off = {lane: n for lane, n in emitted.items() if int(n) != want}
    if off:
        raise StepStateError(
            f"step state for step {step} is not at a step boundary: lanes {off} emitted a count other than {want}"
        )
