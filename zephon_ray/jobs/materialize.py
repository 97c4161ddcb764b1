"""Materialisation: Ray Data lane-group actors precompute a run's global batches into step-keyed Parquet.

    driver                                   Ray Data: map_batches on ActorPoolStrategy(size=M)
    ──────                                   ───────────────────────────────────────────────────
    plan steps [E, B) ──► M rows {group g} ─► LaneGroupWorker g = Zephon rank g of M, owns lanes [g·L/M, (g+1)·L/M)
                                               restore DIR/checkpoints/step-E.json, yield its lanes step by step,
                                               collective Zephon checkpoint at every segment boundary
    assemble lane-major ◄── streamed blocks ◄─┘
    digest, one row group per step into a spooled segment; segment whole, checkpoint, manifest.json LAST
    (formats/materialized.py's SegmentWriter; DIR is a local directory or an object-store prefix)

Ray Data runs and scales the work; it never decides batch contents. Each worker is one Zephon rank whose lanes
are a pure function of (recipe, lane), and the driver files rows by (step, group), never by arrival order.

Guarantee: the rows and digests written for step s equal ``GlobalBatchSource(recipe).batch(s)`` for any M.
A directory only ever grows: committed steps are never rewritten, and a run killed at
any point leaves the last committed manifest intact; re-running the same command resumes from the newest
committed checkpoint and leaves the manifest and every segment byte-identical to an uninterrupted run. The checkpoint files are resume points,
not data: Zephon 0.2.0 records its read-ahead in them (cursor positions, chunk indices), which depends on timing,
so their bytes differ between runs while each restores the same batches; the manifest lists them without a hash. The manifest, segments and checkpoints
do not record M, so M may change between runs.

DIR may be an object-store URI (``s3://bucket/run7``): the segments, checkpoints and manifest are then one
upload each, the manifest last, and nothing needs a shared filesystem.

Limits: DIR must be on storage every node of the cluster reaches when M > 1 (the collective Zephon checkpoint
meets in ``DIR/.work-*``, which Zephon's aggregation reads and writes through its own storage router, an object
store included); the driver alone writes segments and manifest. A new directory starting at step A > 0 produces
(and discards) steps 0..A-1 first. Steps can only be appended: ``--steps`` must start inside or right at the end
of what is there. Segments are cut at multiples of ``segment_steps`` counted from step 0, plus at the end of each
run, so extending in pieces gives the same batches in more files. Work since the last committed segment is redone
after a kill.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_ray import storage
from zephon_ray.checks import MAX_STEP, check_int
from zephon_ray.formats.materialized import (
    CHECKPOINTS_DIR,
    KEY_CHECKPOINTS,
    KEY_DIGESTS,
    KEY_END,
    KEY_FINGERPRINT,
    KEY_FIRST,
    KEY_FORMAT,
    KEY_GEOMETRY,
    KEY_PHASES,
    KEY_SEGMENT_STEPS,
    KEY_SEGMENTS,
    KEY_SOURCE_TOKENS,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    SEGMENTS_DIR,
    TMP_PREFIX,
    WORK_PREFIX,
    MaterializedError,
    SegmentWriter,
    clean_leftovers,
    load_checkpoint,
    read_manifest,
    recipe_of,
)
from zephon_ray.identity import verify_on_node
from zephon_ray.jobs.lane_groups import run_lane_groups
from zephon_ray.recipe import Recipe

MAX_SEGMENT_STEPS = 4096


@dataclass(frozen=True)
class MaterializeResult:
    directory: str
    """The directory (an absolute local path or a URI)."""
    first_step: int
    end_step: int
    written: range
    """Steps this call computed and committed (empty when everything asked for was already there)."""
    tokens: int


# ---------------------------------------------------------------------- the Ray Data worker
class LaneGroupWorker:
    """A Ray Data actor that is Zephon rank ``group`` of ``groups``; one input row = one whole run of steps."""

    def __init__(
        self,
        recipe: Recipe,
        groups: int,
        start_state: dict[str, Any] | None,
        first: int,
        end: int,
        segment_steps: int,
        run_id: str,
        aggregate_dir: str,
    ) -> None:
        self.recipe = recipe
        self.groups = groups
        self.start_state = start_state  # shipped by value: a worker on another node need not see DIR
        self.first, self.end, self.segment_steps = first, end, segment_steps
        self.run_id, self.aggregate_dir = run_id, aggregate_dir
        verify_on_node(recipe, recipe.fingerprint, where="materialize lane-group worker")

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        from zephon_ray.lanes import LaneStepper, first_step
        from zephon_ray.pipeline import LaneGroup

        for group in batch["group"]:
            group = int(group)
            lane_group = LaneGroup(
                count=self.groups,
                index=group,
                run_id=self.run_id if self.groups > 1 else None,
                aggregate_dir=self.aggregate_dir if self.groups > 1 else None,
            )

            def build(lane_group: LaneGroup = lane_group) -> LaneStepper:
                stepper = LaneStepper(self.recipe, lane_group)
                if self.start_state is not None:
                    stepper.restore(self.start_state)
                return stepper

            # Zephon opens its storage at the first step: an outage there is waited out (first_step).
            stepper, shards = first_step(build, f"materialize lane group {group} of {self.groups}")
            try:
                while stepper.position <= self.first:  # replay up to the range's first step
                    shards = stepper.next_step()
                for step in range(self.first, self.end):
                    if step > self.first:
                        shards = stepper.next_step()
                    boundary = (step + 1) % self.segment_steps == 0 or step + 1 == self.end
                    # Collective with M > 1: every group checkpoints at the same boundaries; group 0 reports it.
                    state = json.dumps(stepper.checkpoint(), sort_keys=True) if boundary else ""
                    ordered = [shards[lane] for lane in stepper.lanes]
                    yield {
                        "step": np.asarray([step], dtype=np.int64),
                        "group": np.asarray([group], dtype=np.int64),
                        "tokens": np.concatenate([s.tokens for s in ordered])[None],
                        "positions": np.concatenate([s.positions for s in ordered])[None],
                        "source_tokens": np.sum([s.source_tokens for s in ordered], axis=0)[None],
                        "state": np.asarray([state if group == 0 else ""], dtype=object),
                    }
            finally:
                stepper.close(background=True)


# ---------------------------------------------------------------------- the driver
def parse_step_range(steps: range) -> range:
    if not isinstance(steps, range) or steps.step != 1 or steps.start < 0 or len(steps) == 0:
        raise MaterializedError(f"steps {steps!r}: expected A:B with 0 <= A < B")
    if steps.stop > MAX_STEP:
        raise MaterializedError(f"steps {steps.start}:{steps.stop}: end is beyond the limit of {MAX_STEP} steps")
    return steps


def _geometry(recipe: Recipe) -> dict[str, Any]:
    from zephon_ray.source import pad_token_id

    return {
        "lanes": recipe.lanes,
        "microbatches_per_lane": recipe.microbatches_per_lane,
        "rows_per_microbatch": recipe.rows_per_microbatch,
        "rows": recipe.global_batch_rows,
        "seq_len": recipe.seq_len,
        "row_length": recipe.row_length,
        "sources": list(recipe.source_names),
        "pad_token_id": pad_token_id(recipe),
    }


def _prepare_directory(directory: storage.Location, recipe: Recipe) -> tuple[dict[str, Any] | None, Recipe]:
    """The committed manifest (None for a new directory), after removing leftovers of a killed run, and the recipe
    to extend it with: ``recipe``, or ``recipe`` with the run-time phases the directory was made under."""
    if not directory.remote and os.path.exists(directory.path) and not os.path.isdir(directory.path):
        raise MaterializedError(f"--out {directory}: exists and is not a directory")
    manifest = None
    if storage.exists(directory.join(MANIFEST_NAME)):
        manifest = read_manifest(directory)
        joined = recipe_of(manifest, recipe)  # the run-time phases the directory was made under
        recipe = joined if joined is not None and joined.fingerprint == manifest[KEY_FINGERPRINT] else recipe
        if manifest[KEY_FINGERPRINT] != recipe.fingerprint:
            raise MaterializedError(
                f"{directory}: holds a materialisation of recipe fingerprint {manifest[KEY_FINGERPRINT][:12]}, not "
                f"{recipe.describe()}; use another --out"
            )
        if manifest[KEY_GEOMETRY] != _geometry(recipe):
            raise MaterializedError(f"{directory.join(MANIFEST_NAME)}: geometry differs from {recipe.describe()}")
    else:
        ours = {SEGMENTS_DIR, CHECKPOINTS_DIR}
        tops = {name.split("/", 1)[0] for name in storage.listing(directory, recursive=True)}
        if not directory.remote and os.path.isdir(directory.path):
            tops |= set(os.listdir(directory.path))
        foreign = sorted(t for t in tops if t not in ours and not t.startswith((WORK_PREFIX, TMP_PREFIX)))
        if foreign:
            raise MaterializedError(f"--out {directory}: not empty and holds no {MANIFEST_NAME} (found {foreign[0]})")
    storage.make_dirs(directory)
    clean_leftovers(directory)  # committed files are never touched
    return manifest, recipe


def materialize(
    recipe: Recipe,
    directory: str | os.PathLike[str],
    steps: range,
    *,
    producers: int = 1,
    segment_steps: int = 16,
    cpus_per_actor: float = 0.5,
    progress: bool = True,
) -> MaterializeResult:
    """Materialise ``steps`` of ``recipe`` into ``directory`` on the current Ray cluster (``ray.init`` first)."""
    from tqdm import tqdm

    steps = parse_step_range(steps)
    for name, value, high in (
        ("producers", producers, recipe.lanes),
        ("segment_steps", segment_steps, MAX_SEGMENT_STEPS),
    ):
        check_int(name, value, low=1, high=high, error=MaterializedError)
    if recipe.lanes % producers:
        raise MaterializedError(f"--producers {producers} does not divide the recipe's {recipe.lanes} lanes")
    directory = storage.location(directory)
    manifest, recipe = _prepare_directory(directory, recipe)
    if manifest is None:
        manifest = {
            KEY_FORMAT: MANIFEST_FORMAT,
            KEY_FINGERPRINT: recipe.fingerprint,
            KEY_GEOMETRY: _geometry(recipe),
            KEY_PHASES: [p.canonical(recipe.source_names) for p in recipe.phases],
            KEY_FIRST: steps.start,
            KEY_END: steps.start,
            KEY_SEGMENT_STEPS: segment_steps,
            KEY_SEGMENTS: [],
            KEY_DIGESTS: [],
            KEY_SOURCE_TOKENS: [],
            KEY_CHECKPOINTS: {},
        }
    first, end = int(manifest[KEY_FIRST]), int(manifest[KEY_END])
    segment_steps = int(manifest[KEY_SEGMENT_STEPS])  # an existing directory keeps its layout
    if steps.start < first:
        raise MaterializedError(
            f"--steps {steps.start}:{steps.stop}: {directory} starts at step {first}; steps can "
            "only be appended (use a new --out for earlier steps)"
        )
    if steps.start > end:
        raise MaterializedError(
            f"--steps {steps.start}:{steps.stop}: {directory} ends at step {end}; starting at "
            f"{steps.start} would leave a gap (use --steps {end}:{steps.stop})"
        )
    todo = range(end, steps.stop)
    if len(todo) == 0:
        return MaterializeResult(directory.uri, first, end, todo, 0)
    start_state = None
    if end > 0 and manifest[KEY_SEGMENTS]:
        entry = manifest[KEY_CHECKPOINTS].get(str(end))
        if entry is None:
            raise MaterializedError(f"{directory.join(MANIFEST_NAME)}: no checkpoint recorded for step {end}")
        start_state = load_checkpoint(directory.join(entry["file"]), recipe, end)

    work_dir = directory.join(f"{WORK_PREFIX}{uuid.uuid4().hex[:12]}")
    storage.make_dirs(work_dir)
    writer = SegmentWriter(
        directory, manifest, lanes=recipe.lanes, rows_per_lane=recipe.rows_per_lane, row_length=recipe.row_length
    )
    bar = tqdm(
        total=len(todo), unit="step", desc="materialize", dynamic_ncols=True, disable=None if progress else True
    )  # None: a bar only on a terminal
    try:
        for step, rows in _stream(
            recipe,
            todo,
            producers=producers,
            start_state=start_state,
            segment_steps=segment_steps,
            work_dir=work_dir,
            cpus_per_actor=cpus_per_actor,
        ):
            writer.add(step, *rows)
            bar.update(1)
    finally:
        bar.close()
        writer.abort()
        storage.delete_tree(work_dir)
    return MaterializeResult(directory.uri, first, int(manifest[KEY_END]), todo, len(todo) * recipe.tokens_per_step)


def _stream(
    recipe: Recipe,
    todo: range,
    *,
    producers: int,
    start_state: dict[str, Any] | None,
    segment_steps: int,
    work_dir: storage.Location,
    cpus_per_actor: float,
) -> Iterator[tuple[int, tuple]]:
    """Yield (step, (tokens, positions, source_tokens, state)) in step order, assembled from every lane group."""
    kwargs = {
        "recipe": recipe,
        "groups": producers,
        "start_state": start_state,
        "first": todo.start,
        "end": todo.stop,
        "segment_steps": segment_steps,
        "run_id": f"materialize-{work_dir.name}",
        "aggregate_dir": work_dir.join("aggregate").uri,
    }
    pending: dict[int, dict[int, tuple]] = {}
    states: dict[int, str] = {}
    next_step = todo.start
    for block in run_lane_groups(LaneGroupWorker, kwargs, groups=producers, cpus_per_actor=cpus_per_actor):
        for i in range(len(block["step"])):
            step, group = int(block["step"][i]), int(block["group"][i])
            pending.setdefault(step, {})[group] = (block["tokens"][i], block["positions"][i], block["source_tokens"][i])
            if block["state"][i]:
                states[step] = str(block["state"][i])
        while len(pending.get(next_step, ())) == producers:
            groups = pending.pop(next_step)
            parts = [groups[g] for g in range(producers)]
            tokens = np.concatenate([p[0] for p in parts]).astype(np.int32, copy=False)
            positions = np.concatenate([p[1] for p in parts]).astype(np.int32, copy=False)
            source_tokens = np.sum([p[2] for p in parts], axis=0)
            yield next_step, (tokens, positions, source_tokens, states.pop(next_step, ""))
            next_step += 1
    if next_step != todo.stop:
        raise RuntimeError(f"materialize: lane groups stopped at step {next_step}, expected {todo.stop}")
