"""``zephon-ray audit``: from a checkpoint's ledger segment back to step 0, was every step trained exactly once, on
the recipe's rows, split consistently across the ranks?

:func:`audit` follows ``parent`` links from the head segment (the one a loader state names, or the newest head of a
ledger directory) and reports one :class:`Finding` per step and kind:

* ``skipped``: a step of ``[0, s)`` that no rank's record holds, or that a rank was handed but never confirmed
  (``Loader.commit``), or a gap between a segment and its parent;
* ``trained twice``: a step a rank confirmed more than once, or two segments of the lineage that both hold it;
* ``other rows``: a rank's slice digest differs from the same rows of the recipe's global batch (computed in-process
  from the recipe, read from a materialised directory, or asked of a running service);
* ``other recipe`` / ``other run``: a segment of the lineage written under another recipe fingerprint or run_id,
  or one that another segment of the same run_id also continues without a resume (two runs under one run_id: a
  rollback always starts its branch with a resume);
* ``split``: a rank of W with no part, or a record naming another rank or W than its segment;
* ``lineage``: a parent segment missing from the ledger.

Segments of the same run that are not in the lineage are a **discarded branch** (what a resume from an older
checkpoint abandoned): listed as notes, never as duplicates. Exit status (the CLI): 0 clean, 1 findings.

Limits: the ledger proves which rows were handed to the trainer, and with ``commit`` which steps the loop says it
trained, not that the optimizer applied them. A checkpoint whose weights are older than its loader state is refused
at load (``Loader.load_state_dict(state, trainer_step=...)``), not found here. Without a reference (no ``--recipe``
or ``--dataset``) the rows themselves are not checked, only the structure. Tests: ``tests/test_audit.py``; cost:
``benchmarks/bench_ledger.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from zephon_ray import files
from zephon_ray.batch import slice_bounds
from zephon_ray.formats import ledger
from zephon_ray.formats.ledger import LedgerError, Segment

Reference = Callable[[int], tuple[np.ndarray, np.ndarray]]
"""step -> (tokens, positions) of the recipe's global batch."""


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

    @property
    def clean(self) -> bool:
        return not self.findings

    def verdict(self) -> str:
        worlds = " -> ".join(str(w) for w in _dedupe([s.world for s in self.lineage])) or "-"
        checked = f"; {self.digests_checked} slice digests matched the recipe's global batches" \
            if self.digests_checked else "; rows not checked (no --recipe or --dataset)"
        if self.clean:
            return (f"audit: clean: steps [0, {self.next_step}) each trained exactly once in a lineage of "
                    f"{len(self.lineage)} segment(s) (W {worlds}){checked}")
        return f"audit: {len(self.findings)} finding(s) in steps [0, {self.next_step}) (W {worlds})"


def _dedupe(values: list[int]) -> list[int]:
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def find_head(segments: dict[str, Segment]) -> str:
    """The newest head of a ledger directory: of the segments no other names as parent, the one ending last."""
    parents = {s.parent for s in segments.values()}
    heads = [s for s in segments.values() if s.id not in parents]
    if not heads:
        raise LedgerError("the ledger's segments form a cycle: no head to audit")
    return max(heads, key=lambda s: (s.next_step, s.id)).id


def read_ledger(ledger_dir: str) -> dict[str, Segment]:
    return {sid: ledger.read_segment(ledger_dir, sid) for sid in ledger.list_segments(ledger_dir)}


def audit(segments: dict[str, Segment], head: str, *, fingerprint: str | None = None, run_id: str | None = None,
          reference: Reference | None = None, rows: int | None = None) -> AuditReport:
    """Audit the lineage ending at ``head`` (see the module docstring). ``fingerprint``/``run_id``: what the
    lineage must have been written under (default: the head's). ``reference`` and ``rows`` (B): check every slice's
    digest against the recipe's global batch."""
    if head not in segments:
        raise LedgerError(f"ledger segment {head!r} (the checkpoint's) is not in the ledger directory")
    lineage: list[Segment] = []
    findings: list[Finding] = []
    seen: set[str] = set()
    cur = head
    while cur:
        if cur in seen:
            raise LedgerError(f"ledger segment {cur!r} is its own ancestor: the ledger is corrupt")
        seen.add(cur)
        seg = segments.get(cur)
        if seg is None:
            child = lineage[-1]
            findings.append(Finding(0, child.first_step - 1, "lineage",
                                    f"segment {cur} (parent of {child.id}) is missing from the ledger: these steps "
                                    "cannot be checked"))
            break
        lineage.append(seg)
        cur = seg.parent
    lineage.reverse()
    top = segments[head]
    fingerprint = fingerprint or top.fingerprint
    run_id = top.run_id if run_id is None else run_id
    report = AuditReport(head, top.next_step, lineage, findings)

    continuing: dict[str, list[Segment]] = {}  # parent -> the segments that continue it without a resume
    for other in segments.values():
        if not other.resumed:
            continuing.setdefault(other.parent, []).append(other)
    expected = 0 if not findings else lineage[0].first_step
    for seg in lineage:
        rivals = [o for o in continuing.get(seg.parent, []) if o.id != seg.id and o.run_id == seg.run_id] \
            if not seg.resumed else []
        if rivals:
            since = f"segment {seg.parent}" if seg.parent else "step 0"
            findings.append(Finding(seg.first_step, seg.next_step - 1, "other run",
                                    f"segments {seg.id} and {rivals[0].id} both continue {since} without a resume: "
                                    f"two runs write under run_id {seg.run_id!r}"))
        if seg.first_step > expected:
            findings.append(Finding(expected, seg.first_step - 1, "skipped",
                                    f"in no segment of the lineage (segment {seg.id} starts at {seg.first_step})"))
        elif seg.first_step < expected:
            findings.append(Finding(seg.first_step, expected - 1, "trained twice",
                                    f"segment {seg.id} repeats steps its parent already holds"))
        expected = seg.next_step
        if seg.fingerprint != fingerprint:
            findings.append(Finding(seg.first_step, seg.next_step - 1, "other recipe",
                                    f"segment {seg.id} was trained on recipe fingerprint {seg.fingerprint[:12]}, not "
                                    f"{fingerprint[:12]}"))
        if seg.run_id != run_id:
            findings.append(Finding(seg.first_step, seg.next_step - 1, "other run",
                                    f"segment {seg.id} belongs to run_id {seg.run_id!r}, not {run_id!r}"))
        _check_segment(seg, findings)
        if reference is not None and rows is not None:
            report.digests_checked += _check_rows(seg, reference, rows, findings)

    in_lineage = {s.id for s in lineage}
    for seg in sorted(segments.values(), key=lambda s: (s.first_step, s.id)):
        if seg.id in in_lineage:
            continue
        if seg.run_id == run_id:
            report.notes.append(f"discarded branch: steps {seg.first_step}..{seg.next_step - 1} at W={seg.world} "
                                f"(segment {seg.id}): abandoned by a resume from an older state, not in this "
                                "checkpoint's lineage")
        else:
            report.notes.append(f"other run in this ledger: run_id {seg.run_id!r}, steps {seg.first_step}.."
                                f"{seg.next_step - 1} (segment {seg.id}); not audited")
    findings.sort(key=lambda f: (f.first, f.kind))
    return report


def _check_segment(seg: Segment, findings: list[Finding]) -> None:
    W = seg.world
    problems: dict[tuple[int, str], list[str]] = {}

    def note(step: int, kind: str, what: str) -> None:
        problems.setdefault((step, kind), []).append(what)

    for rank in range(W):
        records = seg.parts.get(rank)
        if records is None:
            findings.append(Finding(seg.first_step, seg.next_step - 1, "split",
                                    f"rank {rank} of {W} wrote no part of segment {seg.id}: its records are lost"))
            continue
        by_step: dict[int, int] = {}
        attempts: dict[int, int] = {}
        for rec in records:
            if rec.step not in seg.steps:
                note(rec.step, "split", f"rank {rank} of {W} recorded it in segment {seg.id}, which holds steps "
                                        f"{seg.first_step}..{seg.next_step - 1}")
                continue
            if rec.world != W or rec.rank != rank:
                note(rec.step, "split", f"the part of rank {rank} of {W} holds a record of rank {rec.rank} of "
                                        f"{rec.world}")
            by_step[rec.step] = by_step.get(rec.step, 0) + rec.trained
            attempts[rec.step] = max(attempts.get(rec.step, 0), rec.attempt)
        for step in seg.steps:
            trained = by_step.get(step)
            if trained is None:
                note(step, "skipped", f"rank {rank} of {W} has no record of it")
            elif trained == 0:
                note(step, "skipped", f"rank {rank} of {W} was handed it but never trained it")
            elif trained > 1:
                served_again = f" (its record is attempt {attempts[step]}: an earlier attempt that torchft " \
                    "rejected was applied too)" if attempts[step] else ""
                note(step, "trained twice", f"rank {rank} of {W} trained it {trained} times{served_again}")
    for (step, kind), whats in sorted(problems.items()):
        findings.append(Finding(step, step, kind, "; ".join(whats)))


def _check_rows(seg: Segment, reference: Reference, rows: int, findings: list[Finding]) -> int:
    checked = 0
    wanted: dict[int, dict[int, str]] = {}
    for rank, records in seg.parts.items():
        for rec in records:
            if rec.step in seg.steps and rec.world == seg.world and rec.rank == rank:
                wanted.setdefault(rec.step, {})[rank] = rec.digest
    for step in sorted(wanted):
        tokens, positions = reference(step)
        bad = []
        for rank, digest in sorted(wanted[step].items()):
            lo, hi = slice_bounds(rows, rank, seg.world)
            if ledger.slice_digest(tokens[lo:hi], positions[lo:hi]) != digest:
                bad.append(rank)
            checked += 1
        if bad:
            findings.append(Finding(step, step, "other rows",
                                    f"rank(s) {', '.join(map(str, bad))} of {seg.world} trained rows that are not "
                                    "the recipe's global batch of this step"))
    return checked


def locate(path: str, ledger_dir: str | None) -> tuple[str, str | None, dict | None]:
    """``(ledger_dir, head, state)`` for the audit's argument: a loader state file, a directory holding
    ``zephon_loader.json`` (a Ray Train checkpoint), or a ledger directory (head: its newest)."""
    from zephon_ray.formats.loader_state import KEY_LEDGER, check_state

    loc = files.location(path)
    state_file = loc if files.is_file(loc) else loc.join("zephon_loader.json")
    if files.is_file(state_file):
        state = files.read_json(state_file, error=LedgerError, what="loader state")
        if not isinstance(state, dict):
            raise LedgerError(f"{state_file.uri}: a loader state must be a JSON object")
        try:
            check_state(state, run_id=state.get("run_id"), fingerprint=state.get("fingerprint"),
                        recipe_name="the state's own")
        except ValueError as exc:
            raise LedgerError(f"{state_file.uri}: {exc}") from None
        if not ledger_dir:
            raise LedgerError(f"{state_file.uri} is a loader state: name the run's ledger directory with --ledger")
        if not state[KEY_LEDGER]:
            raise LedgerError(f"{state_file.uri}: the state names no ledger segment (taken at step 0, or before "
                              "the ledger existed)")
        return ledger_dir, state[KEY_LEDGER], state
    return ledger_dir or path, None, None
