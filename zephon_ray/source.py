"""In-process global batches: one Zephon pipeline that owns all L lanes.

Guarantee: ``GlobalBatchSource(recipe).batch(s)`` is a pure function of (recipe, s). It gives the same rows in
the same lane-major order as the data service and as W in-process Zephon ranks together, for any access order
and however often it is restored: the rows that plain Zephon ranks driven through Zephon's public API give.

Random access is served from Zephon checkpoints taken every ``checkpoint_every`` steps: the most recent
``recent_checkpoints`` of them, plus anchors every ``anchor_every`` steps that are kept for good. ``batch(s)`` for an
s behind the current position restores the nearest kept checkpoint <= s and replays forward.

Memory: each kept checkpoint is held as compressed JSON (4-5 KB for recipes/tiny.toml, about 9 KB with what holds
it, where the decoded state takes about 500 KB), so the anchors of a source that reads 1,000,000 steps of it take
about 35 MB (benchmarks/bench_source_memory.py). They still grow with the steps read, one per ``anchor_every``.

Limits: a step behind costs one Zephon restore, which replays the open epoch of every lane (its price grows with
lanes x chunk_size x flush_every_k_chunks; about 1.3 s for recipes/mixture.toml here) plus up to ``checkpoint_every``
steps of replay (``anchor_every`` once the step has left the recent ring). A step far ahead is reached by producing
every step in between. Why not a checkpoint every step: measured on recipes/mixture.toml, one Zephon checkpoint
costs about 13 ms plus 9 ms for the JSON round trip, half of a 45 ms step, while a restore costs over a second
anyway, so per-step checkpoints would halve throughput to save a few steps of replay.
"""

from __future__ import annotations

import bisect
import json
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon_ray.batch import GlobalBatch
from zephon_ray.checks import check_int
from zephon_ray.lanes import LaneShard, LaneStepper, StepStateError
from zephon_ray.recipe import Recipe
from zephon_ray.tokenizers import build_tokenizer

if TYPE_CHECKING:
    from zephon_ray.provenance import ProvenanceSource, StepProvenance


def assemble(recipe: Recipe, step: int, shards: dict[int, LaneShard]) -> GlobalBatch:
    """Concatenate lane shards in lane order into a read-only GlobalBatch."""
    if sorted(shards) != list(range(recipe.lanes)):
        raise ValueError(f"step {step}: lane shards {sorted(shards)} do not cover lanes 0..{recipe.lanes - 1}")
    ordered = [shards[lane] for lane in range(recipe.lanes)]
    tokens = np.concatenate([s.tokens for s in ordered])
    positions = np.concatenate([s.positions for s in ordered])
    lanes = np.repeat(np.arange(recipe.lanes, dtype=np.int16), recipe.rows_per_lane)
    composition = np.sum([s.source_tokens for s in ordered], axis=0)
    for array in (tokens, positions, lanes):
        array.setflags(write=False)
    return GlobalBatch(
        step=step,
        tokens=tokens,
        positions=positions,
        lanes=lanes,
        source_tokens={name: int(n) for name, n in zip(recipe.source_names, composition)},
        fingerprint=recipe.fingerprint,
        pad_token_id=pad_token_id(recipe),
    )


def pad_token_id(recipe: Recipe) -> int | None:
    """Only padding packers put pad ids in rows; 'wrap' never does, so its labels need no mask."""
    return None if recipe.packing == "wrap" else build_tokenizer(recipe.tokenizer).pad_token_id


def fixed_valid_tokens(recipe: Recipe) -> int | None:
    """The global batch's valid-token count when it is the same at every step, with no read: B x seq_len for
    'wrap' packing (no pad ids, every label counts). None for padding packers, whose count depends on the rows."""
    return recipe.global_batch_rows * recipe.seq_len if recipe.packing == "wrap" else None


def packed_state(state: dict[str, Any]) -> bytes:
    """A JSON-safe state as compressed JSON (zlib level 1: about 1 ms to pack or unpack a state of recipes/tiny.toml,
    about 10x smaller than its JSON; benchmarks/bench_source_memory.py)."""
    return zlib.compress(json.dumps(state, separators=(",", ":")).encode(), 1)


def unpacked_state(packed: bytes) -> dict[str, Any]:
    state: dict[str, Any] = json.loads(zlib.decompress(packed))
    return state


class GlobalBatchSource:
    def __init__(
        self,
        recipe: Recipe,
        *,
        checkpoint_every: int = 8,
        recent_checkpoints: int = 32,
        anchor_every: int = 256,
        cache_steps: int = 4,
    ) -> None:
        for name, value in (
            ("checkpoint_every", checkpoint_every),
            ("recent_checkpoints", recent_checkpoints),
            ("anchor_every", anchor_every),
            ("cache_steps", cache_steps),
        ):
            check_int(f"GlobalBatchSource: {name}", value, low=1)
        if anchor_every % checkpoint_every:
            raise ValueError(
                f"GlobalBatchSource: anchor_every ({anchor_every}) must be a multiple of checkpoint_every "
                f"({checkpoint_every})"
            )
        self._checkpoint_every = checkpoint_every
        self.recipe = recipe
        self._stepper = LaneStepper(recipe)
        self._recent_checkpoints = recent_checkpoints
        self._anchor_every = anchor_every
        self._checkpoints: dict[int, bytes] = {}  # step -> packed_state(); decoded only to restore
        self._checkpoint_steps: list[int] = []
        self._cache: OrderedDict[int, GlobalBatch] = OrderedDict()
        self._cache_steps = cache_steps
        self._provenance: ProvenanceSource | None = None  # built at the first provenance() call
        self._checkpoint()  # step 0

    @property
    def position(self) -> int:
        return self._stepper.position

    def batch(self, step: int) -> GlobalBatch:
        step = check_int("step", step, low=0, numpy_ok=True)
        cached = self._cache.get(step)
        if cached is not None:
            self._cache.move_to_end(step)
            return cached
        if step < self._stepper.position:
            self._seek(step)
        while True:
            current = self._stepper.position
            batch = assemble(self.recipe, current, self._stepper.next_step())
            self._checkpoint()
            if current == step:
                self._remember(batch)
                return batch

    def provenance(self, step: int) -> StepProvenance:
        """Which document pieces every row of ``batch(step)`` holds (:mod:`zephon_ray.provenance`): computed on
        demand by a provenance-mode pipeline restored from this source's nearest checkpoint, and checked against
        ``batch(step)``'s rows. Nothing of it runs on the ``batch`` path."""
        from zephon_ray.provenance import ProvenanceSource

        batch = self.batch(step)
        if self._provenance is None:
            self._provenance = ProvenanceSource(
                self.recipe, checkpoints=self._nearest_checkpoint, reuse_within=self._checkpoint_every
            )
        return self._provenance.provenance(batch.step, rows=(batch.tokens, batch.positions))

    def _nearest_checkpoint(self, step: int) -> tuple[int, dict[str, Any]]:
        """The newest kept checkpoint at or before ``step`` (step 0's is always kept)."""
        kept = self._checkpoint_steps[bisect.bisect_right(self._checkpoint_steps, step) - 1]
        return kept, unpacked_state(self._checkpoints[kept])

    def _seek(self, step: int) -> None:
        self._stepper.restore(self._nearest_checkpoint(step)[1])

    def _checkpoint(self) -> None:
        step = self._stepper.position
        if step % self._checkpoint_every or step in self._checkpoints:
            return
        try:
            self._checkpoints[step] = packed_state(self._stepper.checkpoint())
        except StepStateError:
            return  # microbatches of the next step are buffered: not a clean boundary, keep older checkpoints
        bisect.insort(self._checkpoint_steps, step)
        # Drop the oldest non-anchor checkpoint once the recent ring is full; anchors are kept for good.
        recent = [s for s in self._checkpoint_steps if s % self._anchor_every]
        while len(recent) > self._recent_checkpoints:
            drop = recent.pop(0)
            del self._checkpoints[drop]
            self._checkpoint_steps.remove(drop)

    def _remember(self, batch: GlobalBatch) -> None:
        self._cache[batch.step] = batch
        while len(self._cache) > self._cache_steps:
            self._cache.popitem(last=False)

    def close(self) -> None:
        self._stepper.close()
        if self._provenance is not None:
            self._provenance.close()

    def __enter__(self) -> GlobalBatchSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
