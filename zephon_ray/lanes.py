"""Turn one Zephon pipeline's lane-pure microbatches into per-step lane shards.

A :class:`LaneStepper` owns some lanes of a recipe (all of them in-process, L/M of them in a producer). Step s
of lane l is lane l's microbatches ``s*k .. s*k+k-1``. Microbatches are filed **by their ``lane_ids``**, never
by stream position, because a restored pipeline may start its round-robin at a different lane.

Guarantee: ``next_step()`` returns the same shards for a given (recipe, lane, step) whichever Zephon rank owns
the lane and however often the stepper was checkpointed and restored, with a lane's k microbatches in Zephon's own order. Limits: checkpoints
exist only at step boundaries with no microbatch buffered ahead (``checkpoint()`` raises otherwise), and a
collective (multi-rank) checkpoint must be taken by every rank at the same step.

Phases (a recipe's ``[[phases]]``): the run is cut into *segments*, one per phase, each drawn by its own Zephon
pipeline. Zephon's work source emits one global chunk stream that every lane computes (it keeps the chunks routed
to it); the segment that starts at step S continues that stream, with the new weights, at global chunk G_S = one
past the last chunk that any lane's rows up to step S drew from (read from each emitted row's contributing source
records). Each source's read position (Zephon's per-dataset cursors and allocation accumulators) therefore carries
across the boundary, so no record drawn before S is drawn again after it within that source's epoch; G_S depends only on the emitted rows, never on
how far Zephon had prefetched, so step s stays a pure function of (recipe, s). Limits: records in chunks that lanes
had drawn but not yet emitted at S (at most about one chunk per lane, plus the rest of a record cut by packing) are
skipped, never repeated. Finding G_S does not grow with the phase: the stepper follows the chunk stream with its rows
(to within ``STREAM_LAG`` chunks) and its checkpoints record the stream's state, so a boundary walks a bounded number
of chunks, whatever the phase's length. With several
lane groups (producers, local-mode ranks, materialise groups) each knows only
its own lanes' chunks: at a boundary, and at every checkpoint of a phased recipe, the groups exchange them over
their checkpoint channel (:mod:`zephon_ray.lane_exchange`), so any group's state can cross the next boundary.

Memory over a long run: Zephon feeds a pipeline's lanes one source record each in turn and hands their microbatches
out one lane each in turn, buffering the microbatches of lanes that run ahead. A lane runs ahead by the tokens of its
records, so the lanes' lead wanders like a random walk, and the buffers with it, without a bound. The stepper
therefore restarts its pipeline from its own checkpoint once every ``restart_every`` steps (:data:`RESTART_TOKENS`
tokens of the recipe's global batches): a restored pipeline starts every lane at its delivered position, with
nothing buffered. A restart changes no row, since a restored Zephon pipeline continues each lane exactly. A lane group
that is one of several restarts only at its collective checkpoints (every group takes them at the same step), at the
first one ``restart_every`` steps after the last; a group that never checkpoints never restarts.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from zephon_ray.pipeline import LaneGroup, build_pipeline, build_work_source
from zephon_ray.recipe import Recipe, ScheduleError
from zephon_ray.zephon_io import ChunkStream, contributing_chunks, last_contributing_chunk

ROW_DTYPE = np.int32
"""Dtype of stored rows (tokens and positions). Every tokenizer here has fewer than 2**31 ids."""

STATE_VERSION = 1
KEY_VERSION = "version"
KEY_NEXT_STEP = "next_step"
KEY_FINGERPRINT = "fingerprint"
KEY_ZEPHON = "zephon"
KEY_SCHEDULE = "schedule"
"""``Recipe.schedule_history(next_step)``: the phases that produced the steps before ``next_step``."""
KEY_SEGMENT = "segment"
"""``{"index": i, "start_state": work-source state where segment i starts (None: a fresh stream), "last_chunk":
{lane: highest lane chunk id any emitted row of this segment drew from}, "stream": {"index": G, "state": the
stream's state at G} or None}``, where G is one past the highest global chunk that any lane's rows drew from (the
chunk where a phase starting at this step would start), recorded wherever ``last_chunk`` covers every lane."""

RESTART_TOKENS = 2**27
"""Tokens of global batches (about 134 million) between two restarts of a stepper's pipeline (the module docstring,
"Memory over a long run"): about 1,000 steps at seq_len 8,192 and 16 rows, 129,000 steps of ``tiny``. Zephon's
buffers stay within what the lanes drift apart over that many tokens (docs/benchmarks.md, "Memory over a long run")."""

STREAM_LAG = 256
"""How far (global chunks) the stepper lets its chunk stream trail its own lanes' rows: the most a boundary or a
checkpoint walks beyond the other lane groups' lead, whatever the phase's length (about 6 ms at 25 us a chunk)."""


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
        self._segment = 0
        self._segment_state: dict[str, Any] | None = None
        self._stream: ChunkStream | None = None
        self._stream_state: dict[str, Any] | None = None
        """Where this segment's stream is to be rebuilt from (a restored state's ``stream``; None: the segment's
        start)."""
        self.boundary_walk = 0
        """Global chunks the last boundary walked (the part of its cost that a long phase could make grow)."""
        self._last_chunk: dict[int, int] | None = {lane: -1 for lane in self.lanes}
        self.contributors: dict[int, list[tuple[int, ...]]] = {}
        """With ``record_contributors`` set: the sample ids ``(dataset id, shard id, index)`` of the source records in
        each lane's rows of the last step, in row order (a record cut across rows appears in each)."""
        self.record_contributors = False
        self.keep_positions = False
        """With several lane groups and no phases, checkpoints record every lane's position (an exchange) anyway,
        so that a phase added later (a running service's ``add_phase``) can start from them."""
        self._pipeline = self._build_pipeline()
        self._iter: Any = None
        self._pending: dict[int, deque] = {lane: deque() for lane in self.lanes}
        self._next_step = 0
        self.restart_every = max(1, RESTART_TOKENS // (recipe.global_batch_rows * recipe.row_length))
        """Steps between two restarts of the pipeline from its own checkpoint (the module docstring)."""
        self._restarted_at = 0
        self.restarts = 0
        self._exchanged: str | None = None
        """The key of this group's last checkpoint exchange, to forget at the next checkpoint."""

    before_packing: Any = None
    """``pipeline -> pipeline`` applied just before packing (:func:`zephon_ray.pipeline.build_pipeline`): None here;
    :class:`zephon_ray.provenance.ProvenanceStepper` sets it."""

    def _build_pipeline(self, work: Any = None) -> Any:
        return build_pipeline(self.recipe, self.group, work, before_packing=self.before_packing)

    @property
    def position(self) -> int:
        """The step that the next call to :meth:`next_step` returns."""
        return self._next_step

    @property
    def segment(self) -> int:
        """The mixture segment the last step came from (0: the sources' weights; i: ``recipe.phases[i-1]``)."""
        return self._segment

    def next_step(self) -> dict[int, LaneShard]:
        k = self.recipe.microbatches_per_lane
        if self.recipe.phase_index(self._next_step) != self._segment:
            self._enter_segment(self.recipe.phase_index(self._next_step))
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
        if self._last_chunk is not None:
            # Follow the rows with the stream, so that a boundary walks STREAM_LAG chunks at most, not the phase.
            frontier = self._frontier(self._last_chunk)
            if frontier - self._segment_stream().index >= STREAM_LAG:
                self._segment_stream().advance(frontier)
        if self.group.count == 1 and self._restart_due():
            self._restart(self._zephon_checkpoint())
        return shards

    def _restart_due(self) -> bool:
        """A restart is due, and possible: ``restart_every`` steps since the last one, inside a segment (Zephon cannot
        restore a segment's first step, and a new segment starts a fresh pipeline anyway), nothing buffered."""
        return (
            self._next_step - self._restarted_at >= self.restart_every
            and self.recipe.segment_start(self._segment) < self._next_step
            and self.recipe.phase_index(self._next_step) == self._segment
            and not any(self._pending.values())
        )

    def _zephon_checkpoint(self) -> dict[str, Any]:
        # A JSON round trip makes the state exactly what a durable copy will restore (int keys become str).
        return json.loads(json.dumps(self._pipeline.checkpoint()))

    def _segment_pipeline(self) -> Any:
        """A fresh pipeline drawing from the current segment's work source, from the segment's start."""
        return self._build_pipeline(build_work_source(self.recipe, self._segment, self._segment_state))

    def _restart(self, zephon_state: dict[str, Any]) -> None:
        """Replace the pipeline by one restored from ``zephon_state``, this step boundary's checkpoint: it drops the
        microbatches Zephon buffered for lanes that ran ahead (the module docstring, "Memory over a long run")."""
        self.close(background=True)
        self._pipeline = self._segment_pipeline()
        self._pipeline.restore(zephon_state)
        self._restarted_at = self._next_step
        self.restarts += 1

    def _segment_stream(self) -> ChunkStream:
        """The current segment's global chunk stream, built on first use from the restored state's stream, or from the
        segment's start."""
        if self._stream is None:
            start = self._stream_state if self._stream_state is not None else self._segment_state
            self._stream = ChunkStream(build_work_source(self.recipe, self._segment, start), self.recipe.lanes)
        return self._stream

    def _frontier(self, last_chunk: dict[int, int]) -> int:
        """One past the highest global chunk that the rows of ``last_chunk``'s lanes drew from in this segment (the
        segment's first chunk when they drew none)."""
        first = int(self._segment_state["global_chunk_index"]) if self._segment_state is not None else 0
        used = {lane: cid for lane, cid in last_chunk.items() if cid >= 0}
        return max(self._segment_stream().global_index(first, used).values()) + 1 if used else first

    def _enter_segment(self, index: int) -> None:
        """Switch to segment ``index`` at its start step: continue the global chunk stream one past the last chunk
        any lane's emitted rows drew from, with the segment's weights, in a fresh pipeline."""
        if index != self._segment + 1 or self.recipe.segment_start(index) != self._next_step:
            raise StepStateError(
                f"cannot enter mixture segment {index} at step {self._next_step} from segment {self._segment}"
            )
        if self._last_chunk is None:
            raise StepStateError(
                f"cannot start phase '{self.recipe.segment_name(index)}' at step {self._next_step}: the state this "
                "run resumed from predates mixture phases (it does not record which chunks the rows drew from)"
            )
        last_chunk = self._all_last_chunks(
            f"boundary-{self.recipe.schedule_fingerprints[self._segment][:16]}-{self._next_step}"
        )
        stream = self._segment_stream()
        boundary = self._frontier(last_chunk)
        self.boundary_walk = boundary - stream.index
        stream.advance(boundary)
        start_state = stream.state()
        self.close(background=True)
        self._segment, self._segment_state = index, start_state
        self._stream, self._stream_state = None, None
        self._last_chunk = {lane: -1 for lane in self.lanes}
        self._pipeline = self._build_pipeline(build_work_source(self.recipe, index, start_state))
        self._restarted_at = self._next_step

    def _all_last_chunks(self, key: str) -> dict[int, int]:
        """Every lane's last contributing chunk of this segment: this group's own, and with several lane groups the
        others' through their checkpoint channel (:mod:`zephon_ray.lane_exchange`). ``key`` names a value that is a
        pure function of the run."""
        assert self._last_chunk is not None
        if self.group.count == 1:
            return dict(self._last_chunk)
        from zephon_ray.lane_exchange import gather

        merged: dict[int, int] = {}
        for part in gather(self.group, key, {str(k): v for k, v in self._last_chunk.items()}):
            merged.update({int(k): int(v) for k, v in part.items()})
        return merged

    def _shard(self, lane: int, microbatches: list[Any]) -> LaneShard:
        recipe = self.recipe
        records = [rec for mb in microbatches for rec in mb.records]
        if self._last_chunk is not None:
            self._last_chunk[lane] = max(self._last_chunk[lane], last_contributing_chunk(records))
        if self.record_contributors:
            self.contributors[lane] = [sample for rec in records for _, sample in contributing_chunks(rec)]
        tokens = np.stack([rec.payload["input_ids"] for rec in records]).astype(ROW_DTYPE, copy=False)
        positions = np.stack([rec.payload["positions"] for rec in records]).astype(ROW_DTYPE, copy=False)
        if tokens.shape != (recipe.rows_per_lane, recipe.row_length):
            raise RuntimeError(
                f"lane {lane}: rows of shape {tokens.shape}, expected {(recipe.rows_per_lane, recipe.row_length)}"
            )
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
        zephon_state = self._zephon_checkpoint()
        last_chunk = self._last_chunk
        if last_chunk is not None and self.group.count > 1:
            # The state must be the same in every group and able to cross the next boundary: with phases, every
            # lane's position (exchanged); without, none unless keep_positions (a phase added to a run without them
            # is refused at its boundary). The key names the whole schedule, future phases included: groups that
            # disagree on it (a phase added while running on some of them only) never meet, and every one of them
            # stops here with one line before any step of that phase is made.
            if self._exchanged is not None:
                # Every group has finished the checkpoint that wrote it: none finishes Zephon's before all have
                from zephon_ray.lane_exchange import forget

                forget(self.group, self._exchanged)
                self._exchanged = None
            key = (
                f"checkpoint-{self.recipe.history_fingerprint(self._next_step)[:16]}-"
                f"{self.recipe.fingerprint[:16]}-{self._next_step}"
            )
            try:
                last_chunk = self._all_last_chunks(key) if self.recipe.phases or self.keep_positions else None
                self._exchanged = key if last_chunk is not None else None
            except RuntimeError as exc:  # the exchange's timeout: a group that is gone, or on another schedule
                raise StepStateError(
                    f"checkpoint at step {self._next_step}: the lane groups did not all arrive with this schedule "
                    f"({self.recipe.describe()}, phases: {', '.join(p.name for p in self.recipe.phases) or 'none'}); "
                    f"a phase added while running must be added by every group before this step: {exc}"
                ) from None
        stream = None
        if last_chunk is not None and len(last_chunk) == self.recipe.lanes:
            at = self._frontier(last_chunk)
            self._segment_stream().advance(at)
            stream = {"index": at, "state": self._segment_stream().state()}
        if self._restart_due():
            self._restart(zephon_state)
        return {
            KEY_VERSION: STATE_VERSION,
            KEY_FINGERPRINT: self.recipe.history_fingerprint(self._next_step),
            KEY_NEXT_STEP: self._next_step,
            KEY_ZEPHON: zephon_state,
            KEY_SCHEDULE: self.recipe.schedule_history(self._next_step),
            KEY_SEGMENT: {
                "index": self._segment,
                "start_state": self._segment_state,
                "last_chunk": None if last_chunk is None else {str(k): v for k, v in sorted(last_chunk.items())},
                "stream": stream,
            },
        }

    def restore(self, state: dict[str, Any]) -> None:
        check_step_state(state, self.recipe)
        self.close(background=True)
        self._next_step = self._restarted_at = int(state[KEY_NEXT_STEP])
        segment = state.get(KEY_SEGMENT) or {"index": 0, "start_state": None, "last_chunk": None}
        self._segment, self._segment_state = int(segment["index"]), segment["start_state"]
        self._stream, self._stream_state = None, (segment.get("stream") or {}).get("state")
        last = segment["last_chunk"]
        self._last_chunk = (
            None
            if last is None or any(str(lane) not in last for lane in self.lanes)
            else {lane: int(last[str(lane)]) for lane in self.lanes}
        )
        # A fresh pipeline object: the old one may still be shutting down its threads in the background.
        self._pipeline = self._segment_pipeline()
        # At the first step of the next phase the pipeline is replaced anyway (next_step): skip Zephon's restore.
        if (
            self.recipe.segment_start(self._segment) < self._next_step
            and self.recipe.phase_index(self._next_step) == self._segment
        ):
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


S = TypeVar("S", bound=LaneStepper)


def first_step(
    build: Callable[[], S],
    what: str,
    *,
    built: S | None = None,
    stop: threading.Event | None = None,
    through: int | None = None,
) -> tuple[S, dict[int, LaneShard]]:
    """A stepper from ``build()`` (or ``built``, already made) and its first step, with a transient storage fault
    waited out within the storage budget (:func:`zephon_ray.storage.retry`); with ``through``, the stepper goes on,
    inside the same retry, until it has made step ``through``, and that step's shards are returned (the steps from
    the state ``build()`` restores up to ``through`` are replayed: batch s is a pure function of s).

    Zephon opens its storage at a pipeline's first step, not when the pipeline is built or restored: the engine
    attaches its dataset catalogs then, reading each source's index or listing it. A stepper made before an outage
    therefore fails at its first step, however long its start was retried. A failed attempt may have consumed part
    of Zephon's stream, so each retry closes the stepper and calls ``build()`` again. A permanent fault, or a budget
    spent, is raised as :func:`retry` raises it; ``stop``, once set, ends the wait before the next attempt or
    replayed step (a final ``StorageError``), so that a closed reader's thread does not go on rebuilding pipelines
    for the rest of the budget. A later step is the caller's: a pipeline that has opened its storage reads through
    Zephon's own retries, and a caller whose read fails past them rebuilds from a checkpoint with this function
    (a local-mode reader that is the run's only lane group) or restarts its producer group (service mode)."""
    from zephon_ray import storage

    pending = [] if built is None else [built]

    def stopped() -> None:
        if stop is not None and stop.is_set():
            raise storage.StorageError(f"{what}: stopped while waiting for storage", transient=False)

    def attempt() -> tuple[S, dict[int, LaneShard]]:
        stopped()
        stepper = pending.pop() if pending else build()
        try:
            shards = stepper.next_step()
            while through is not None and stepper.position <= through:
                stopped()
                shards = stepper.next_step()
            return stepper, shards
        except BaseException:
            stepper.close(background=True)
            raise

    return storage.retry(attempt, what)


def check_step_state(state: dict[str, Any], recipe: Recipe) -> None:
    """Fail loudly on a state from another format, another recipe, or not at a step boundary."""
    if not isinstance(state, dict) or state.get(KEY_VERSION) != STATE_VERSION:
        got = state.get(KEY_VERSION) if isinstance(state, dict) else type(state).__name__
        raise StepStateError(f"step state version {got!r} is not supported (expected {STATE_VERSION})")
    step = int(state[KEY_NEXT_STEP])
    history = state.get(KEY_SCHEDULE) or [[0, "sources", state.get(KEY_FINGERPRINT)]]
    try:
        recipe.check_history(history, step, what="step state")
    except ScheduleError as exc:
        raise StepStateError(str(exc)) from None
    if state.get(KEY_FINGERPRINT) != recipe.history_fingerprint(step):
        raise StepStateError(
            f"step state belongs to recipe fingerprint {str(state.get(KEY_FINGERPRINT))[:12]}, not {recipe.describe()}"
        )
    segment = int((state.get(KEY_SEGMENT) or {}).get("index", 0))
    if segment != len(history) - 1:
        raise StepStateError(
            f"step state for step {step} is in mixture segment {segment}, which its schedule "
            f"history ({len(history)} entries) does not reach"
        )
    emitted = state[KEY_ZEPHON].get("lane_emitted", {})
    want = (step - recipe.segment_start(segment)) * recipe.microbatches_per_lane
    off = {lane: n for lane, n in emitted.items() if int(n) != want}
    if off:
        raise StepStateError(
            f"step state for step {step} is not at a step boundary: lanes {off} emitted a count other than {want}"
        )
