"""Materialisation: Ray Data lane-group actors precompute a run's global batches into step-keyed Parquet.

    driver                                   Ray Data: map_batches on ActorPoolStrategy(size=M)
    ──────                                   ───────────────────────────────────────────────────
    plan steps [E, B) ──► M rows {group g} ─► LaneGroupWorker g = Zephon rank g of M, owns lanes [g·L/M, (g+1)·L/M)
                                               restore DIR/checkpoints/step-E.json, yield its lanes step by step,
                                               collective Zephon checkpoint at every segment boundary
    assemble lane-major ◄── streamed blocks ◄─┘
    digest, one row group per step into segments/.tmp-…, fsync, rename; checkpoint file; manifest.json LAST

Ray Data runs and scales the work; it never decides batch contents. Each worker is one Zephon rank whose lanes
are a pure function of (recipe, lane), and the driver files rows by (step, group), never by arrival order.

Guarantee: the rows and digests written for step s equal ``GlobalBatchSource(recipe).batch(s)`` for any M
(tests/test_materialize.py). A directory only ever grows: committed steps are never rewritten, and a run killed at
any point leaves the last committed manifest intact; re-running the same command resumes from the newest
committed checkpoint and leaves the manifest and every segment byte-identical to an uninterrupted run
(tests/test_materialize.py::test_killed_and_resumed_is_byte_identical). The checkpoint files are resume points,
not data: Zephon 0.2.0 records its read-ahead in them (cursor positions, chunk indices), which depends on timing,
so their bytes differ between runs while each restores the same batches; the manifest lists them without a hash. The manifest, segments and checkpoints
do not record M, so M may change between runs.

Limits: DIR must be on storage every node of the cluster reaches when M > 1 (the collective Zephon checkpoint
meets in ``DIR/.work-*``); the driver alone writes segments and manifest. A new directory starting at step A > 0 produces (and discards) steps 0..A-1 first. Steps can only be
appended: ``--steps`` must start inside or right at the end of what is there. Segments are cut at multiples of
``segment_steps`` counted from step 0, plus at the end of each run, so extending in pieces gives the same
batches in more files. Work since the last committed segment is redone after a kill.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from zephon_ray.batch import compute_digest
from zephon_ray.formats.materialized import (
    CHECKPOINTS_DIR, KEY_CHECKPOINTS, KEY_DIGESTS, KEY_END, KEY_FINGERPRINT, KEY_FIRST, KEY_FORMAT, KEY_GEOMETRY,
    KEY_SEGMENT_STEPS, KEY_SEGMENTS, KEY_SOURCE_TOKENS, MANIFEST_FORMAT, MANIFEST_NAME, MAX_STEP, SEGMENTS_DIR,
    MaterializedError, checkpoint_name, load_checkpoint, read_manifest, segment_name,
)
from zephon_ray.jobs.pretokenize import atomic_write_bytes, fsync_dir, json_bytes, sha256_file
from zephon_ray.recipe import Recipe

WORK_PREFIX = ".work-"
TMP_PREFIX = ".tmp-"
PARQUET_COMPRESSION = "zstd"
MAX_SEGMENT_STEPS = 4096


@dataclass(frozen=True)
class MaterializeResult:
    directory: Path
    first_step: int
    end_step: int
    written: range
    """Steps this call computed and committed (empty when everything asked for was already there)."""
    tokens: int


# ---------------------------------------------------------------------- the Ray Data worker
class LaneGroupWorker:
    """A Ray Data actor that is Zephon rank ``group`` of ``groups``; one input row = one whole run of steps."""

    def __init__(self, recipe: Recipe, groups: int, start_state: dict[str, Any] | None, first: int, end: int,
                 segment_steps: int, run_id: str, aggregate_dir: str) -> None:
        self.recipe = recipe
        self.groups = groups
        self.start_state = start_state  # shipped by value: a worker on another node need not see DIR
        self.first, self.end, self.segment_steps = first, end, segment_steps
        self.run_id, self.aggregate_dir = run_id, aggregate_dir
        try:
            from zephon_ray.identity import verify_on_node
        except ImportError:  # identity checks land with zephon_ray/identity.py
            verify_on_node = None
        if verify_on_node is not None:
            verify_on_node(recipe, recipe.fingerprint, where="materialize lane-group worker")

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        from zephon_ray.lanes import LaneStepper
        from zephon_ray.pipeline import LaneGroup

        for group in batch["group"]:
            group = int(group)
            lane_group = LaneGroup(count=self.groups, index=group, run_id=self.run_id if self.groups > 1 else None,
                                   aggregate_dir=self.aggregate_dir if self.groups > 1 else None)
            stepper = LaneStepper(self.recipe, lane_group)
            try:
                if self.start_state is not None:
                    stepper.restore(self.start_state)
                while stepper.position < self.first:
                    stepper.next_step()
                for step in range(self.first, self.end):
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
        "lanes": recipe.lanes, "microbatches_per_lane": recipe.microbatches_per_lane,
        "rows_per_microbatch": recipe.rows_per_microbatch, "rows": recipe.global_batch_rows,
        "seq_len": recipe.seq_len, "row_length": recipe.row_length, "sources": list(recipe.source_names),
        "pad_token_id": pad_token_id(recipe),
    }


def _schema(width: int) -> Any:
    import pyarrow as pa

    return pa.schema([
        ("step", pa.int64()), ("lane", pa.int16()), ("row", pa.int32()),
        ("tokens", pa.list_(pa.int32(), width)), ("positions", pa.list_(pa.int32(), width)),
    ])


def _step_table(schema: Any, step: int, tokens: np.ndarray, positions: np.ndarray, lanes: np.ndarray) -> Any:
    import pyarrow as pa

    rows, width = tokens.shape
    return pa.table({
        "step": pa.array(np.full(rows, step, dtype=np.int64)),
        "lane": pa.array(lanes),
        "row": pa.array(np.arange(rows, dtype=np.int32)),
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), width),
        "positions": pa.FixedSizeListArray.from_arrays(pa.array(positions.reshape(-1)), width),
    }, schema=schema)


def _prepare_directory(directory: Path, recipe: Recipe, segment_steps: int) -> dict[str, Any] | None:
    """The committed manifest (None for a new directory), after removing leftovers of a killed run."""
    if directory.exists() and not directory.is_dir():
        raise MaterializedError(f"--out {directory}: exists and is not a directory")
    manifest = None
    if (directory / MANIFEST_NAME).exists():
        manifest = read_manifest(directory)
        if manifest[KEY_FINGERPRINT] != recipe.fingerprint:
            raise MaterializedError(
                f"{directory}: holds a materialisation of recipe fingerprint {manifest[KEY_FINGERPRINT][:12]}, not "
                f"{recipe.describe()}; use another --out"
            )
        if manifest[KEY_GEOMETRY] != _geometry(recipe):
            raise MaterializedError(f"{directory / MANIFEST_NAME}: geometry differs from {recipe.describe()}")
    elif directory.is_dir():
        ours = {SEGMENTS_DIR, CHECKPOINTS_DIR}
        foreign = sorted(p.name for p in directory.iterdir() if p.name not in ours and not p.name.startswith(
            (WORK_PREFIX, TMP_PREFIX)))
        if foreign:
            raise MaterializedError(f"--out {directory}: not empty and holds no {MANIFEST_NAME} (found {foreign[0]})")
    directory.mkdir(parents=True, exist_ok=True)
    # Leftovers of a killed run: temp files and aggregation dirs. Committed files are never touched.
    for leftover in list(directory.glob(f"{WORK_PREFIX}*")):
        shutil.rmtree(leftover, ignore_errors=True)
    for sub in (directory, directory / SEGMENTS_DIR, directory / CHECKPOINTS_DIR):
        for tmp in sub.glob(f"{TMP_PREFIX}*") if sub.is_dir() else ():
            tmp.unlink(missing_ok=True)
    return manifest


def materialize(recipe: Recipe, directory: str | Path, steps: range, *, producers: int = 1,
                segment_steps: int = 16, cpus_per_actor: float = 0.5, progress: bool = True) -> MaterializeResult:
    """Materialise ``steps`` of ``recipe`` into ``directory`` on the current Ray cluster (``ray.init`` first)."""
    from tqdm import tqdm

    steps = parse_step_range(steps)
    for name, value, high in (("producers", producers, recipe.lanes), ("segment_steps", segment_steps,
                                                                        MAX_SEGMENT_STEPS)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise MaterializedError(f"{name} must be an integer in [1, {high}], got {value!r}")
    if recipe.lanes % producers:
        raise MaterializedError(f"--producers {producers} does not divide the recipe's {recipe.lanes} lanes")
    directory = Path(directory).resolve()
    manifest = _prepare_directory(directory, recipe, segment_steps)
    if manifest is None:
        manifest = {
            KEY_FORMAT: MANIFEST_FORMAT, KEY_FINGERPRINT: recipe.fingerprint, KEY_GEOMETRY: _geometry(recipe),
            KEY_FIRST: steps.start, KEY_END: steps.start, KEY_SEGMENT_STEPS: segment_steps, KEY_SEGMENTS: [],
            KEY_DIGESTS: [], KEY_SOURCE_TOKENS: [], KEY_CHECKPOINTS: {},
        }
    first, end = int(manifest[KEY_FIRST]), int(manifest[KEY_END])
    segment_steps = int(manifest[KEY_SEGMENT_STEPS])  # an existing directory keeps its layout
    if steps.start < first:
        raise MaterializedError(f"--steps {steps.start}:{steps.stop}: {directory} starts at step {first}; steps can "
                                "only be appended (use a new --out for earlier steps)")
    if steps.start > end:
        raise MaterializedError(f"--steps {steps.start}:{steps.stop}: {directory} ends at step {end}; starting at "
                                f"{steps.start} would leave a gap (use --steps {end}:{steps.stop})")
    todo = range(end, steps.stop)
    if len(todo) == 0:
        return MaterializeResult(directory, first, end, todo, 0)
    start_state = None
    if end > 0 and manifest[KEY_SEGMENTS]:
        entry = manifest[KEY_CHECKPOINTS].get(str(end))
        if entry is None:
            raise MaterializedError(f"{directory / MANIFEST_NAME}: no checkpoint recorded for step {end}")
        start_state = load_checkpoint(directory / entry["file"], recipe, end)

    work_dir = directory / f"{WORK_PREFIX}{uuid.uuid4().hex[:12]}"
    work_dir.mkdir()
    writer = _SegmentWriter(directory, manifest, recipe, segment_steps)
    bar = tqdm(total=len(todo), unit="step", desc="materialize", disable=not progress, dynamic_ncols=True)
    try:
        for step, rows in _stream(recipe, todo, producers=producers, start_state=start_state,
                                  segment_steps=segment_steps, work_dir=work_dir, cpus_per_actor=cpus_per_actor):
            writer.add(step, *rows)
            bar.update(1)
    finally:
        bar.close()
        writer.abort()
        shutil.rmtree(work_dir, ignore_errors=True)
    return MaterializeResult(directory, first, int(manifest[KEY_END]), todo,
                             len(todo) * recipe.tokens_per_step)


def _stream(recipe: Recipe, todo: range, *, producers: int, start_state: dict[str, Any] | None, segment_steps: int,
            work_dir: Path, cpus_per_actor: float) -> Iterator[tuple[int, tuple]]:
    """Yield (step, (tokens, positions, source_tokens, state)) in step order, assembled from every lane group."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    dataset = ray.data.from_items([{"group": g} for g in range(producers)], override_num_blocks=producers)
    dataset = dataset.map_batches(
        LaneGroupWorker,
        fn_constructor_kwargs={
            "recipe": recipe, "groups": producers, "start_state": start_state, "first": todo.start,
            "end": todo.stop, "segment_steps": segment_steps, "run_id": f"materialize-{work_dir.name}",
            "aggregate_dir": str(work_dir / "aggregate"),
        },
        # One task per actor at a time and exactly M actors: all M ranks run at once, as collective checkpoints need.
        compute=ray.data.ActorPoolStrategy(size=producers, max_tasks_in_flight_per_actor=1),
        batch_size=1,
        num_cpus=cpus_per_actor,
    )
    pending: dict[int, dict[int, tuple]] = {}
    states: dict[int, str] = {}
    next_step = todo.start
    for block in dataset.iter_batches(batch_size=None, batch_format="numpy"):
        for i in range(len(block["step"])):
            step, group = int(block["step"][i]), int(block["group"][i])
            pending.setdefault(step, {})[group] = (block["tokens"][i], block["positions"][i],
                                                   block["source_tokens"][i])
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


class _SegmentWriter:
    """Writes steps in order into temp segment files; commits segment, checkpoint and manifest (last)."""

    def __init__(self, directory: Path, manifest: dict[str, Any], recipe: Recipe, segment_steps: int) -> None:
        self.directory = directory
        self.manifest = manifest
        self.segment_steps = segment_steps
        self.schema = _schema(recipe.row_length)
        self.lanes = np.repeat(np.arange(recipe.lanes, dtype=np.int16), recipe.rows_per_lane)
        self.rows = recipe.global_batch_rows
        self._writer: Any = None
        self._tmp: Path | None = None
        self._segment_first = 0
        self._digests: list[str] = []
        self._source_tokens: list[list[int]] = []

    def add(self, step: int, tokens: np.ndarray, positions: np.ndarray, source_tokens: np.ndarray,
            state: str) -> None:
        import pyarrow.parquet as pq

        if self._writer is None:
            (self.directory / SEGMENTS_DIR).mkdir(exist_ok=True)
            self._segment_first = step
            self._tmp = self.directory / SEGMENTS_DIR / f"{TMP_PREFIX}{step:012d}.{os.getpid()}.parquet"
            self._writer = pq.ParquetWriter(self._tmp, self.schema, compression=PARQUET_COMPRESSION)
        self._writer.write_table(_step_table(self.schema, step, tokens, positions, self.lanes),
                                 row_group_size=self.rows)
        self._digests.append(compute_digest(tokens, positions))
        self._source_tokens.append([int(x) for x in source_tokens])
        if state:
            self._commit(step + 1, state)

    def _commit(self, end: int, state: str) -> None:
        self._writer.close()
        self._writer = None
        with open(self._tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        name = segment_name(self._segment_first, end)
        final = self.directory / name
        os.replace(self._tmp, final)
        fsync_dir(final.parent)
        ckpt_name = checkpoint_name(end)
        ckpt_bytes = (state + "\n").encode()
        atomic_write_bytes(self.directory / ckpt_name, ckpt_bytes)
        m = self.manifest
        m[KEY_SEGMENTS].append({"file": name, "first_step": self._segment_first, "end_step": end,
                                "bytes": final.stat().st_size, "sha256": sha256_file(final)})
        m[KEY_DIGESTS].extend(self._digests)
        m[KEY_SOURCE_TOKENS].extend(self._source_tokens)
        # No hash of the checkpoint: its bytes record Zephon's read-ahead, which is not a function of the step.
        m[KEY_CHECKPOINTS][str(end)] = {"file": ckpt_name}
        m[KEY_END] = end
        self._digests, self._source_tokens = [], []
        atomic_write_bytes(self.directory / MANIFEST_NAME, json_bytes(m))  # the commit point

    def abort(self) -> None:
        """Drop an unfinished segment (the run failed or was interrupted): committed files stay as they are."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._tmp is not None and self._tmp.exists():
            self._tmp.unlink()
