"""``zephon-ray audit``: from a checkpoint's ledger segment back to step 0, was every step trained exactly once, on
the recipe's rows, split consistently across the ranks?

Usage: ``zephon-ray audit CHECKPOINT_OR_LEDGER [--recipe R]``, or ``audit(ledger_dir, head, reference=...)`` for an
:class:`AuditReport`.

:func:`audit` reads the ledger once, streaming (:func:`zephon_ray.formats.ledger.scan`: loose parts, torchft
batches and spools, compacted packs), follows ``parent`` links from the head segment (the one a loader state names,
or the newest head of a ledger directory) and reports one :class:`Finding` per step and kind:

* ``skipped``: a step of ``[0, s)`` that no rank's record holds, or that a rank was handed but never confirmed
  (``Loader.commit``), or a gap between a segment and its parent;
* ``trained twice``: a step a rank confirmed more than once, or two segments of the lineage that both hold it;
* ``other rows``: a rank's slice digest differs from the same rows of the recipe's global batch (computed in-process
  from the recipe, read from a materialised directory, or asked of a running service);
* ``other recipe`` / ``other run``: a segment of the lineage written under another recipe fingerprint or run_id,
  or one that another segment of the same run_id also continues without a resume (two runs under one run_id: a
  rollback always starts its branch with a resume);
* ``split``: a rank of W with no part, or a record naming another rank or W than its segment;
* ``lineage``: a parent segment missing from the ledger;
* ``schedule``: a segment whose mixture schedule does not continue its parent's: over the data steps the parent
  recorded (``[0, data_next)`` of its ``schedule``), a phase of the parent's is rewritten (other weights or name),
  dropped or moved, or a phase is added, named with the step where the two first differ. A segment may add phases
  that start at or after its parent's ``data_next``, as a resume or ``add_phase`` may. Phases count data steps (the
  training steps unless the run skips data). A segment of ledger format version 1 records no schedule: a note says
  which boundaries were not checked. A lineage written under another base recipe is the ``other recipe`` finding
  alone.

Segments of the same run outside the lineage are notes, never findings or duplicates: a **discarded branch** (what
a resume from an older state abandoned), another branch resumed from a state of the lineage, a segment written
after the audited state, or, past a missing parent, an **unverifiable** segment. The second run under one run_id is
the ``other run`` finding alone. The **newest head** of a directory is the furthest-reaching head that no resume
abandoned (a head is abandoned when a resumed segment outside its lineage continues a state of it); it is never
called abandoned. Exit status (the CLI): 0 clean, 1 findings.

Cost: one pass over the ledger; a pack's digests are read only with a reference. Memory: one row group of records
(:data:`~zephon_ray.formats.ledger.ROW_GROUP_RECORDS`), every segment header, and 4 bytes per part
(``benchmarks/bench_ledger_scale.py``).

Limits: the ledger proves which rows were handed to the trainer, and with ``commit`` which steps the loop says it
trained, not that the optimizer applied them. A checkpoint whose weights are older than its loader state is refused
at load (``Loader.load_state_dict(state, trainer_step=...)``), not found here. Without a reference (no ``--recipe``
or ``--dataset``) the rows themselves are not checked, only the structure. Of two resumes from the same state the
newest head is the one reaching furthest (the ledger records no time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from zephon_ray import storage
from zephon_ray.batch import slice_bounds
from zephon_ray.formats import ledger
from zephon_ray.formats.ledger import LedgerError, Segment

Reference = Callable[[int], tuple[np.ndarray, np.ndarray]]
"""step -> (tokens, positions) of the recipe's global batch."""


def skip_notes(recipe, next_step: int) -> list[str]:
    """One note per deliberate skip (``[[skips]]``, or one a loader state records) of the steps ``[0, next_step)``:
    training steps count on, the data jumps, and the skipped data steps are declared, not found."""
    return [
        f"step {skip.start_step}: data steps {first}..{end - 1} skipped by schedule entry '{skip.name}' "
        f"(training step {skip.start_step} on reads data step {recipe.data_step(skip.start_step)} on)"
        for skip, first, end in recipe.skipped_data()
        if skip.start_step < next_step
    ]


@dataclass(frozen=True)
class Finding:
    first: int
    last: int
    kind: str
    detail: str

    @property
    def line(self) -> str:
        steps = f"step {self.first}" if self.first == self.last else f"steps {self.first}..{self.last}"
        return f"{steps}: {self.kind}: {self.detail}"


@dataclass
class AuditReport:
    head: str
    next_step: int
    lineage: list[Segment]
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    digests_checked: int = 0
    records: int = 0

    @property
    def clean(self) -> bool:
        return not self.findings

    def verdict(self) -> str:
        worlds = " -> ".join(str(w) for w in _dedupe([s.world for s in self.lineage])) or "-"
        checked = (
            f"; {self.digests_checked} slice digests matched the recipe's global batches"
            if self.digests_checked
            else "; rows not checked (no --recipe or --dataset)"
        )
        if self.clean:
            return (
                f"audit: clean: steps [0, {self.next_step}) each trained exactly once in a lineage of "
                f"{len(self.lineage)} segment(s) (W {worlds}){checked}"
            )
        return f"audit: {len(self.findings)} finding(s) in steps [0, {self.next_step}) (W {worlds})"


def _dedupe(values: list[int]) -> list[int]:
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def _chain(segments: dict[str, Segment], start: str) -> list[str]:
    """``start`` and its ancestors present in ``segments``, then ``""`` if the walk reached step 0."""
    out, seen, cur = [], set(), start
    while cur in segments and cur not in seen:
        seen.add(cur)
        out.append(cur)
        cur = segments[cur].parent
    if cur in seen:
        raise LedgerError(f"ledger segment {cur!r} is its own ancestor: the ledger is corrupt")
    return out + ([""] if cur == "" else [])


def newest_head(segments: dict[str, Segment]) -> str:
    """The head a ledger directory's audit follows: of the segments no other continues, those that no resume
    abandoned (see the module docstring), the one ending last."""
    parents = {s.parent for s in segments.values()}
    heads = [s for s in segments.values() if s.id not in parents]
    if not heads:
        raise LedgerError("the ledger's segments form a cycle: no head to audit")
    resumes: dict[str, list[str]] = {}
    for s in segments.values():
        if s.resumed:
            resumes.setdefault(s.parent, []).append(s.id)

    def abandoned(head: Segment) -> bool:
        chain = _chain(segments, head.id)
        members = set(chain)
        return any(r not in members for point in chain for r in resumes.get(point, ()))

    live = [h for h in heads if not abandoned(h)] or heads
    return max(live, key=lambda s: (s.next_step, s.id)).id


class _Checks:
    """Per-part checks as the parts stream by: each part's records against its segment (numpy over a whole batch;
    a part that is not exactly one trained record per step of its segment is explained record by record), the ranks
    that wrote a part of each segment, and (with a reference) the digests."""

    def __init__(self, table: ledger.SegmentTable, keep_digests: bool) -> None:
        self.table, self.keep_digests = table, keep_digests
        self.ranks: dict[int, list[np.ndarray]] = {}
        self.problems: dict[int, dict[tuple[int, str], list[tuple[int, str]]]] = {}
        self.digests: dict[int, dict[int, dict[int, str]]] = {}
        self.records = 0

    def add(self, parts: ledger.Parts) -> None:
        n = len(parts)
        if not n:
            return
        self.records += parts.records
        uniq, inv = np.unique(parts.code, return_inverse=True)
        segs = [self.table.segments[c] for c in uniq.tolist()]
        first = np.array([s.first_step for s in segs], dtype=np.int64)[inv]
        end = np.array([s.next_step for s in segs], dtype=np.int64)[inv]
        world = np.array([s.world for s in segs], dtype=np.int64)[inv]
        order = np.argsort(inv, kind="stable")
        for code, ranks in zip(uniq.tolist(), np.split(parts.rank[order], np.cumsum(np.bincount(inv))[:-1])):
            self.ranks.setdefault(code, []).append(ranks.astype(np.int32))
        counts = np.diff(parts.offsets)  # materialised records; a dense part has none and is exact by its encoding
        pos = np.arange(int(parts.offsets[-1]), dtype=np.int64) - np.repeat(parts.offsets[:-1], counts)
        wrong = (
            (parts.steps != np.repeat(first, counts) + pos)
            | (parts.trained != 1)
            | (parts.worlds != np.repeat(world, counts))
            | (parts.ranks != np.repeat(parts.rank, counts))
        )
        bad = counts != end - first
        if parts.dense is not None:
            bad &= parts.dense == 0
        bad[np.repeat(np.arange(n), counts)[wrong]] = True
        for i in np.flatnonzero(bad).tolist():
            self._explain(self.table.segments[int(parts.code[i])], int(parts.rank[i]), parts.record_list(i))
        if self.keep_digests:
            for i in range(n):
                seg, rank = self.table.segments[int(parts.code[i])], int(parts.rank[i])
                mine = self.digests.setdefault(int(parts.code[i]), {}).setdefault(rank, {})
                for rec in parts.record_list(i):
                    if rec.step in seg.steps and rec.world == seg.world and rec.rank == rank:
                        mine[rec.step] = rec.digest

    def _explain(self, seg: Segment, rank: int, records: list[ledger.Record]) -> None:
        W = seg.world
        problems = self.problems.setdefault(self.table.codes[seg.id], {})

        def note(step: int, kind: str, what: str) -> None:
            problems.setdefault((step, kind), []).append((rank, what))

        by_step: dict[int, int] = {}
        attempts: dict[int, int] = {}
        for rec in records:
            if rec.step not in seg.steps:
                note(
                    rec.step,
                    "split",
                    f"rank {rank} of {W} recorded it in segment {seg.id}, which holds steps "
                    f"{seg.first_step}..{seg.next_step - 1}",
                )
                continue
            if rec.world != W or rec.rank != rank:
                note(
                    rec.step,
                    "split",
                    f"the part of rank {rank} of {W} holds a record of rank {rec.rank} of {rec.world}",
                )
            by_step[rec.step] = by_step.get(rec.step, 0) + rec.trained
            attempts[rec.step] = max(attempts.get(rec.step, 0), rec.attempt)
        for step in seg.steps:
            trained = by_step.get(step)
            if trained is None:
                note(step, "skipped", f"rank {rank} of {W} has no record of it")
            elif trained == 0:
                note(step, "skipped", f"rank {rank} of {W} was handed it but never trained it")
            elif trained > 1:
                served_again = (
                    f" (its record is attempt {attempts[step]}: an earlier attempt that torchft "
                    "rejected was applied too)"
                    if attempts[step]
                    else ""
                )
                note(step, "trained twice", f"rank {rank} of {W} trained it {trained} times{served_again}")

    def findings(self, seg: Segment) -> list[Finding]:
        code = self.table.codes[seg.id]
        present, copies = np.unique(np.concatenate(self.ranks.get(code, [np.zeros(0, np.int32)])), return_counts=True)
        out = (
            [
                Finding(
                    seg.first_step,
                    seg.next_step - 1,
                    "split",
                    f"rank {rank} of {seg.world} wrote no part of segment {seg.id}: its records are lost",
                )
                for rank in sorted(set(range(seg.world)) - set(present.tolist()))
            ]
            if len(present) < seg.world
            else []
        )
        out += [
            Finding(
                seg.first_step,
                seg.next_step - 1,
                "trained twice",
                f"rank {rank} of {seg.world} has {n} parts of segment {seg.id} (two packs hold it)",
            )
            for rank, n in zip(present[copies > 1].tolist(), copies[copies > 1].tolist())
        ]
        for (step, kind), whats in sorted(self.problems.get(code, {}).items()):
            out.append(Finding(step, step, kind, "; ".join(w for _, w in sorted(whats, key=lambda rw: rw[0]))))
        return out


def audit(
    ledger_dir: str | storage.Location,
    head: str | None = None,
    *,
    fingerprint: str | None = None,
    run_id: str | None = None,
    reference: Reference | None = None,
    rows: int | None = None,
) -> AuditReport:
    """Audit the lineage ending at ``head`` (default: the ledger's newest head; see the module docstring).
    ``fingerprint``/``run_id``: what the lineage must have been written under (default: the head's). ``reference``
    and ``rows`` (B): check every slice's digest against the recipe's global batch."""
    table = ledger.SegmentTable()
    checks = _Checks(table, keep_digests=reference is not None and rows is not None)
    for parts in ledger.scan(ledger_dir, table, digests=checks.keep_digests):
        checks.add(parts)
    segments = {s.id: s for s in table.segments}
    explicit = head is not None
    head = head if explicit else newest_head(segments)
    if head not in segments:
        raise LedgerError(f"ledger segment {head!r} (the checkpoint's) is not in the ledger directory")
    chain = _chain(segments, head)
    lineage = [segments[sid] for sid in reversed(chain) if sid]
    findings: list[Finding] = []
    if chain[-1] != "":
        missing = segments[chain[-1]].parent
        findings.append(
            Finding(
                0,
                lineage[0].first_step - 1,
                "lineage",
                f"segment {missing} (parent of {chain[-1]}) is missing from the ledger: these steps cannot be checked",
            )
        )
    top = segments[head]
    fingerprint = fingerprint or top.fingerprint
    run_id = top.run_id if run_id is None else run_id
    report = AuditReport(head, top.next_step, lineage, findings, records=checks.records)

    continuing: dict[str, list[Segment]] = {}  # parent -> the segments that continue it without a resume
    for other in segments.values():
        if not other.resumed:
            continuing.setdefault(other.parent, []).append(other)
    expected = 0 if not findings else lineage[0].first_step
    for seg in lineage:
        rivals = (
            [o for o in continuing.get(seg.parent, []) if o.id != seg.id and o.run_id == seg.run_id]
            if not seg.resumed
            else []
        )
        if rivals:
            since = f"segment {seg.parent}" if seg.parent else "step 0"
            findings.append(
                Finding(
                    seg.first_step,
                    seg.next_step - 1,
                    "other run",
                    f"segments {seg.id} and {rivals[0].id} both continue {since} without a resume: "
                    f"two runs write under run_id {seg.run_id!r}",
                )
            )
        if seg.first_step > expected:
            findings.append(
                Finding(
                    expected,
                    seg.first_step - 1,
                    "skipped",
                    f"in no segment of the lineage (segment {seg.id} starts at {seg.first_step})",
                )
            )
        elif seg.first_step < expected:
            findings.append(
                Finding(
                    seg.first_step,
                    expected - 1,
                    "trained twice",
                    f"segment {seg.id} repeats steps its parent already holds",
                )
            )
        expected = seg.next_step
        if seg.fingerprint != fingerprint:
            findings.append(
                Finding(
                    seg.first_step,
                    seg.next_step - 1,
                    "other recipe",
                    f"segment {seg.id} was trained on recipe fingerprint {seg.fingerprint[:12]}, not "
                    f"{fingerprint[:12]}",
                )
            )
        if seg.run_id != run_id:
            findings.append(
                Finding(
                    seg.first_step,
                    seg.next_step - 1,
                    "other run",
                    f"segment {seg.id} belongs to run_id {seg.run_id!r}, not {run_id!r}",
                )
            )
        findings.extend(checks.findings(seg))
        if checks.keep_digests:
            # keep_digests: a reference and its rows were given
            report.digests_checked += _check_rows(
                seg, checks.digests.get(table.codes[seg.id], {}), cast(Reference, reference), cast(int, rows), findings
            )
    unchecked = []  # boundaries where a segment of ledger format version 1 records no schedule
    for parent, child in zip(lineage, lineage[1:]):
        if parent.schedule is None or child.schedule is None:
            unchecked.append(child)
            continue
        broken = schedule_break(parent, child)
        if broken is not None:
            findings.append(broken)
    report.notes = _notes(segments, lineage, head, run_id, explicit=explicit, gap=chain[-1] != "")
    if unchecked:
        old = next(s for s in lineage if s.schedule is None)
        report.notes.append(
            f"schedule not checked at {len(unchecked)} segment boundary(ies) (the first: segment "
            f"{unchecked[0].id}, from step {unchecked[0].first_step}): segment {old.id} (steps "
            f"{old.first_step}..{old.next_step - 1}) is of ledger format version 1, which records no "
            "schedule"
        )
    findings.sort(key=lambda f: (f.first, f.kind))
    return report


def schedule_break(parent: Segment, child: Segment) -> Finding | None:
    """The ``schedule`` finding when ``child``'s schedule does not continue ``parent``'s (see the module docstring),
    at the first step where they differ over the data steps the parent recorded; None when it does. Both must
    record a schedule (ledger format version 2)."""
    end, theirs = ledger.parse_schedule(cast(str, parent.schedule))
    _, mine = ledger.parse_schedule(cast(str, child.schedule))
    where = f"segment {child.id} (steps {child.first_step}..{child.next_step - 1} at W={child.world}, every rank)"
    past = f"its parent segment {parent.id} recorded steps 0..{end - 1}"

    def phase(entry: tuple[int, str, str]) -> str:
        return f"phase '{entry[1]}' (start_step {entry[0]}, schedule fingerprint {entry[2][:12]})"

    for i, entry in enumerate(theirs):
        # a chain entry hashes every entry before it: the first one that differs is where the schedules part
        other = mine[i] if i < len(mine) else None
        if other is not None and (other[0], other[2]) == (entry[0], entry[2]):
            continue
        if i == 0:
            return None  # another base recipe: its fingerprint differs too, and "other recipe" names that
        if other is None or other[0] > entry[0]:
            return Finding(
                entry[0],
                entry[0],
                "schedule",
                f"{where} drops {phase(entry)}, under which {past}; a resume may only change phases "
                f"starting at or after step {end}",
            )
        if other[0] == entry[0]:
            return Finding(
                entry[0],
                entry[0],
                "schedule",
                f"{where} rewrites {phase(entry)} as {phase(other)}, though {past} under it; a resume "
                f"may only change phases starting at or after step {end}",
            )
        return Finding(
            other[0],
            other[0],
            "schedule",
            f"{where} adds {phase(other)} before its parent's {phase(entry)}, though {past} without it; "
            f"a resume may only add phases starting at or after step {end}",
        )
    if len(mine) > len(theirs) and mine[len(theirs)][0] < end:
        extra = mine[len(theirs)]
        last = "the sources' weights" if len(theirs) == 1 else f"phase '{theirs[-1][1]}'"
        return Finding(
            extra[0],
            extra[0],
            "schedule",
            f"{where} adds {phase(extra)}, though {past} without it (under {last}); a resume may only "
            f"add phases starting at or after step {end}",
        )
    return None


def _notes(
    segments: dict[str, Segment], lineage: list[Segment], head: str, run_id: str, *, explicit: bool, gap: bool
) -> list[str]:
    """One note per segment outside the lineage (see the module docstring), by first step."""
    in_lineage = {s.id for s in lineage}
    lineage_child = {s.parent: s for s in lineage}  # a state of the lineage -> the lineage segment continuing it
    fork: dict[str, tuple[str | None, Segment | None]] = {}  # segment -> (state it branches from, branch start)

    def branch_of(sid: str) -> tuple[str | None, Segment | None]:
        path, cur = [], sid
        while True:
            if cur in fork:
                result = fork[cur]
                break
            seg = segments[cur]
            path.append(cur)
            parent = seg.parent
            if parent in in_lineage or (parent == "" and not gap):
                result = (parent, seg)
                break
            if parent == "" or parent not in segments or parent in path:
                result = (None, None)  # past a missing segment, or before it: not connected to the lineage
                break
            cur = parent
        for p in path:
            fork[p] = result
        return result

    notes = []
    for seg in sorted(segments.values(), key=lambda s: (s.first_step, s.id)):
        if seg.id in in_lineage:
            continue
        where = f"steps {seg.first_step}..{seg.next_step - 1} at W={seg.world} (segment {seg.id})"
        if seg.run_id != run_id:
            notes.append(
                f"other run in this ledger: run_id {seg.run_id!r}, steps {seg.first_step}.."
                f"{seg.next_step - 1} (segment {seg.id}); not audited"
            )
            continue
        point, start = branch_of(seg.id)
        if point is None or start is None:  # (both or neither)
            missing = lineage[0].parent
            notes.append(
                f"unverifiable: {where}: not connected to the audited lineage, whose parent segment "
                f"{missing} is missing"
            )
            continue
        since = f"segment {point}" if point else "step 0"
        if point == head:
            notes.append(f"after this checkpoint: {where} continues its state; not in its lineage")
            continue
        continued = lineage_child[point]
        if continued.resumed and (explicit or not start.resumed):
            notes.append(
                f"discarded branch: {where}: abandoned by a resume from an older state, not in this "
                "checkpoint's lineage"
            )
        elif start.resumed:
            notes.append(
                f"other branch: {where}: resumed from {since}; not in the audited lineage (audit its "
                "loader state to check it)"
            )
        # else: both continue the point without a resume: the "other run" finding names it
    return notes


def _check_rows(
    seg: Segment, digests: dict[int, dict[int, str]], reference: Reference, rows: int, findings: list[Finding]
) -> int:
    checked = 0
    wanted: dict[int, dict[int, str]] = {}
    for rank, by_step in digests.items():
        for step, digest in by_step.items():
            wanted.setdefault(step, {})[rank] = digest
    for step in sorted(wanted):
        tokens, positions = reference(step)
        bad = []
        for rank, digest in sorted(wanted[step].items()):
            lo, hi = slice_bounds(rows, rank, seg.world)
            if ledger.slice_digest(tokens[lo:hi], positions[lo:hi]) != digest:
                bad.append(rank)
            checked += 1
        if bad:
            findings.append(
                Finding(
                    step,
                    step,
                    "other rows",
                    f"rank(s) {', '.join(map(str, bad))} of {seg.world} trained rows that are not "
                    "the recipe's global batch of this step",
                )
            )
    return checked


def locate(path: str, ledger_dir: str | None) -> tuple[str, str | None, dict | None]:
    """``(ledger_dir, head, state)`` for the audit's argument: a loader state file, a directory holding
    ``zephon_loader.json`` (a Ray Train checkpoint), or a ledger directory (head: its newest). A path that does not
    exist, or (with ``ledger_dir``) one that is not a loader state, is one LedgerError naming it."""
    from zephon_ray.formats.loader_state import KEY_LEDGER, check_state

    loc = storage.location(path)
    if not storage.exists(loc):
        raise LedgerError(f"{loc.uri}: no such file or directory (expected a loader state or a ledger directory)")
    state_file = loc if storage.is_file(loc) else loc.join("zephon_loader.json")
    if not storage.is_file(state_file):
        if ledger_dir:
            raise LedgerError(
                f"{loc.uri} is not a loader state (no zephon_loader.json in it); --ledger names the "
                "ledger of a checkpoint's loader state"
            )
        return path, None, None
    state = storage.read_json(state_file, error=LedgerError, what="loader state")
    if not isinstance(state, dict):
        raise LedgerError(f"{state_file.uri}: not a loader state (a JSON {type(state).__name__}, not an object)")
    try:
        check_state(
            state,
            run_id=state.get("run_id"),
            fingerprint=cast(str, state.get("fingerprint")),
            recipe_name="the state's own",
        )
    except ValueError as exc:
        raise LedgerError(f"{state_file.uri}: not a loader state: {exc}") from None
    if not ledger_dir:
        raise LedgerError(f"{state_file.uri} is a loader state: name the run's ledger directory with --ledger")
    if not state[KEY_LEDGER]:
        raise LedgerError(
            f"{state_file.uri}: the state names no ledger segment (taken at step 0, or before the ledger existed)"
        )
    return ledger_dir, state[KEY_LEDGER], state
