"""``locate``: every (step, row, span) of a step range that holds a given record, as a Ray Data job.

    RECIPE, record (source, shard, index), steps [A, B)
        │   one input row per lane group (jobs/lane_groups.py: M actors at once, fractional CPUs)
        ▼
    LocateWorker g = lane group g of M, owning lanes [g·L/M, (g+1)·L/M)
        provenance-mode pipeline (zephon_ray.provenance) from step 0: steps 0..A-1 replayed without looking,
        steps A..B-1 matched piece by piece; a report every REPORT_STEPS steps
        │
        ▼
    driver: the hits sorted by (step, row, start); a bar over the slowest group's progress

Why a scan: where a record lands depends on the token counts of everything its lane packed before it (and, with
phases, on every lane's position at each boundary), so no index short of running the pipeline maps a record to a
step. A lane group's lanes are a pure function of (recipe, lane) and need no other group's data (except the lane
positions exchanged at a phase boundary, through ``work_dir``), so M groups split the scan M ways with no
coordination. Cost: B steps of the provenance-mode pipeline, divided over M groups (M must divide L; more groups
than free cores only queue); measured in docs/benchmarks.md ("Provenance and locate", benchmarks/bench_provenance.py).

Guarantee: the hits are exactly the pieces of the record in steps [A, B) that :class:`zephon_ray.provenance.
ProvenanceSource` names, for any M: the same as a brute-force scan of the rows.

Steps are data steps (what ``GlobalBatchSource.batch`` and ``show`` take). With ``[[skips]]`` (or a run's recorded
ones, ``--schedule-from``) :func:`training_step` names the training step that read each, or the skip entry that
skipped it (never trained on); ``zephon-ray locate`` prints both.

Limits: the scan always starts at step 0 (no checkpoint is read), so a range far from 0 costs its end, not its
length. With M > 1 and phases, ``work_dir`` must be on storage every node reaches (the boundary exchange meets there);
without phases it is never written.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_ray import storage
from zephon_ray.checks import check_int
from zephon_ray.errors import UserInputError
from zephon_ray.identity import verify_on_node
from zephon_ray.jobs.lane_groups import run_lane_groups
from zephon_ray.recipe import Recipe

MAX_LOCATE_STEPS = 10**8
"""The end of a locate range is bounded: a typo must not start years of work."""
REPORT_STEPS = 64
"""A lane group reports its progress (and its hits so far) every this many steps."""


@dataclass(frozen=True)
class RecordRef:
    """Record ``record`` (0-based, in file order) of shard ``shard`` (its name as the recipe's fingerprint lists
    it) of source ``source``."""

    source: str
    shard: str
    record: int

    def describe(self) -> str:
        return f"record {self.record} of {self.source}/{self.shard}"


@dataclass(frozen=True)
class Hit:
    """Tokens ``[start, end)`` of row ``row`` of step ``step`` are tokens from ``offset`` on of the record."""

    step: int
    row: int
    start: int
    end: int
    offset: int

    def to_json(self) -> dict[str, int]:
        return {"step": self.step, "row": self.row, "start": self.start, "end": self.end, "offset": self.offset}


def record_ref(recipe: Recipe, source: str, shard: str, record: int) -> RecordRef:
    """Check a record reference against the recipe: one :class:`UserInputError` naming the flag at fault. ``shard``
    is the shard's name (``shard-00000.jsonl``) or its full path or URI."""
    by_name = {s.name: s for s in recipe.sources}
    if source not in by_name:
        raise UserInputError(
            f"--source {source!r}: the recipe has no such source (sources: {', '.join(recipe.source_names)})"
        )
    src = by_name[source]
    base = storage.location(src.path)
    names = {x.name: x for x in src.shards}
    name = (
        shard
        if shard in names
        else next((n for n in names if base.join(n).uri == storage.location(shard).uri), None)
        if shard
        else None
    )
    if name is None:
        shown = ", ".join(list(names)[:4]) + (" ..." if len(names) > 4 else "")
        raise UserInputError(
            f"--shard {shard!r}: source {source!r} has no such shard (its {len(names)} shards: {shown})"
        )
    rows = names[name].rows
    check_int(
        "--record",
        record,
        low=0,
        high=(rows - 1) if rows is not None else MAX_LOCATE_STEPS * 1000,
        error=UserInputError,
        why=f"{rows} records in {name}" if rows is not None else "",
    )
    return RecordRef(source, name, record)


def training_step(recipe: Recipe, data_step: int) -> tuple[int | None, str | None]:
    """``(training step, None)`` of the training step that reads data step ``data_step`` under ``recipe``'s
    ``[[skips]]`` (itself when there are none), or ``(None, skip name)`` when a declared skip skipped it: that data
    was never trained on. The inverse of ``Recipe.data_step``."""
    shift = 0
    for skip, first, end in recipe.skipped_data():
        if first <= data_step < end:
            return None, skip.name
        if end <= data_step:
            shift += end - first
    step = data_step - shift
    assert recipe.data_step(step) == data_step, (data_step, step)
    return step, None


def check_range(steps: range) -> range:
    if not isinstance(steps, range) or steps.step != 1 or steps.start < 0 or len(steps) == 0:
        raise UserInputError(f"--steps {steps!r}: expected A:B with 0 <= A < B")
    check_int("--steps end", steps.stop, low=1, high=MAX_LOCATE_STEPS, error=UserInputError)
    return steps


def check_groups(recipe: Recipe, groups: int) -> int:
    check_int("--groups", groups, low=1, high=recipe.lanes, error=UserInputError)
    if recipe.lanes % groups:
        raise UserInputError(f"--groups {groups} does not divide the recipe's {recipe.lanes} lanes")
    return groups


def scan(recipe: Recipe, target: RecordRef, steps: range, *, group: Any = None) -> Iterator[tuple[int, list[Hit]]]:
    """Scan one lane group's rows (default: every lane, in this process) for ``target`` in ``steps``: yields
    ``(steps done, counted from step 0; the hits since the last report)`` every :data:`REPORT_STEPS` steps and at
    the end."""
    from zephon_ray.pipeline import LaneGroup
    from zephon_ray.provenance import ProvenanceStepper

    stepper = ProvenanceStepper(recipe, group if group is not None else LaneGroup())
    key = (target.source, target.shard, target.record)
    per_lane = recipe.rows_per_lane
    fresh: list[Hit] = []
    stepper.collect_from = steps.start  # the steps before the range are replayed without looking
    try:
        while stepper.position < steps.stop:
            step = stepper.position
            stepper.next_step()
            if step >= steps.start:
                for lane in stepper.lanes:
                    for i, pieces in enumerate(stepper.pieces[lane]):
                        fresh.extend(
                            Hit(step, lane * per_lane + i, p.start, p.end, p.offset)
                            for p in pieces
                            if (p.source, p.shard, p.record) == key
                        )
            if (step + 1) % REPORT_STEPS == 0 or step + 1 == steps.stop:
                yield step + 1, fresh
                fresh = []
    finally:
        stepper.close(background=True)


def scan_all(recipe: Recipe, target: RecordRef, steps: range) -> list[Hit]:
    """Every hit of ``target`` in ``steps``, scanned in this process (no Ray): :func:`locate`'s answer."""
    return sorted(
        (h for _, hits in scan(recipe, target, check_range(steps)) for h in hits),
        key=lambda h: (h.step, h.row, h.start),
    )


class LocateWorker:
    """A Ray Data actor: lane group ``group`` of ``groups`` scanning for one record (see the module docstring)."""

    def __init__(
        self, recipe: Recipe, target: RecordRef, first: int, end: int, groups: int, run_id: str, aggregate_dir: str
    ) -> None:
        self.recipe, self.target, self.steps, self.groups = recipe, target, range(first, end), groups
        self.run_id, self.aggregate_dir = run_id, aggregate_dir
        verify_on_node(recipe, recipe.fingerprint, where="locate lane-group worker")

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        from zephon_ray.pipeline import LaneGroup

        for group in batch["group"]:
            group = int(group)
            lane_group = (
                LaneGroup(count=self.groups, index=group, run_id=self.run_id, aggregate_dir=self.aggregate_dir)
                if self.groups > 1
                else LaneGroup()
            )
            for done, hits in scan(self.recipe, self.target, self.steps, group=lane_group):
                yield {
                    "group": np.asarray([group], dtype=np.int64),
                    "done": np.asarray([done], dtype=np.int64),
                    "hits": np.asarray([json.dumps([h.to_json() for h in hits])], dtype=object),
                }


def locate(
    recipe: Recipe,
    target: RecordRef,
    steps: range,
    *,
    groups: int = 1,
    cpus_per_actor: float = 0.5,
    work_dir: str | None = None,
    progress: bool = True,
) -> list[Hit]:
    """Every hit of ``target`` in ``steps``, on the current Ray cluster (``ray.init`` first), with ``groups`` lane
    groups (must divide the recipe's lanes)."""
    from tqdm import tqdm

    steps = check_range(steps)
    check_groups(recipe, groups)
    base = storage.location(work_dir or tempfile.gettempdir())
    work = base.join(f".locate-{uuid.uuid4().hex[:12]}")
    kwargs = {
        "recipe": recipe,
        "target": target,
        "first": steps.start,
        "end": steps.stop,
        "groups": groups,
        "run_id": f"locate-{work.name}",
        "aggregate_dir": work.join("aggregate").uri,
    }
    done = dict.fromkeys(range(groups), 0)
    hits: list[Hit] = []
    bar = tqdm(
        total=steps.stop,
        unit="step",
        desc=f"locate ({groups} group{'s' if groups > 1 else ''})",
        disable=None if progress else True,
        dynamic_ncols=True,
    )
    try:
        for block in run_lane_groups(LocateWorker, kwargs, groups=groups, cpus_per_actor=cpus_per_actor):
            for g, d, found in zip(block["group"], block["done"], block["hits"]):
                done[int(g)] = max(done[int(g)], int(d))
                hits.extend(Hit(**h) for h in json.loads(str(found)))
            bar.update(min(done.values()) - bar.n)
    finally:
        bar.close()
        if not work.remote and os.path.isdir(work.path):
            storage.delete_tree(work)
    if min(done.values()) != steps.stop:
        raise RuntimeError(f"locate: lane groups stopped at steps {done}, expected {steps.stop}")
    return sorted(hits, key=lambda h: (h.step, h.row, h.start))
