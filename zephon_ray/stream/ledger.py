"""One reader's side of the ledger (:mod:`zephon_ray.formats.ledger`): the records of the steps it handed out since
the last loader-state save, sealed into a segment at each save and linked to the state it resumed from.

Guarantee: every step the loader yields is recorded with the digest of the rows it yielded, before the trainer sees
it; at each ``state_dict`` the pending records become this rank's part of one segment (written when the loader has
a ``ledger_dir``), and the state names that segment, so the segments of a checkpoint's lineage hold every step it
was handed. A loop that confirms its steps with ``Loader.commit(step)`` turns "handed out" into "trained": a step
handed out but never confirmed is recorded as skipped (``trained`` 0), one confirmed twice as trained twice.

Limits: the records prove which rows were handed to the trainer (and, with ``commit``, which steps the loop says it
trained), not that the optimizer applied them. A TP/PP/CP peer records nothing (its leader records the rank). The
hashing costs one sha256 pass over the slice per step, done by the prefetch thread (``RankSlice.ledger_digest``) so
the trainer waits for it only when the source falls behind (``benchmarks/bench_ledger.py``).
"""

from __future__ import annotations

from zephon_ray.batch import RankSlice
from zephon_ray.formats import ledger


class LedgerRecorder:
    def __init__(self, *, run_id: str, fingerprint: str, rank: int, world: int, ledger_dir: str | None) -> None:
        self.run_id, self.fingerprint, self.rank, self.world = run_id, fingerprint, rank, world
        self.ledger_dir = ledger_dir
        self.head = ""  # the segment ending at the last save or load ("" at step 0)
        self._first = 0  # the step the pending records start at
        self._resumed = False
        self._pending: dict[int, list] = {}  # step -> [digest, attempt, trained]
        self._confirms = False  # the loop calls commit(): unconfirmed steps are skipped ones

    def handed(self, piece: RankSlice, attempt: int = 0) -> None:
        self._pending[piece.step] = [piece.ledger_digest, attempt, 0]

    def commit(self, step: int) -> None:
        entry = self._pending.get(step)
        if entry is None:
            handed = f"[{self._first}, {self._first + len(self._pending)})" if self._pending else "none"
            raise ValueError(f"commit: step {step} was not handed out by this loader since its last save (steps "
                             f"handed out: {handed})")
        self._confirms = True
        entry[2] += 1

    def resume(self, head: str, step: int) -> None:
        self.head, self._first, self._resumed, self._pending = head, step, True, {}

    def seal(self, next_step: int) -> str:
        """Close the segment ``[first, next_step)``: write this rank's part (with a ledger_dir) and return the id the
        state carries. No new segment when nothing was handed out since the last save or load."""
        if next_step == self._first:
            return self.head
        segment = ledger.segment_id(run_id=self.run_id, fingerprint=self.fingerprint, parent=self.head,
                                    first_step=self._first, next_step=next_step, world=self.world,
                                    resumed=self._resumed)
        if self.ledger_dir:
            records = [ledger.Record(step, self.world, self.rank, digest, attempt,
                                     trained if self._confirms else max(trained, 1))
                       for step, (digest, attempt, trained) in sorted(self._pending.items())]
            ledger.write_part(self.ledger_dir, ledger.make_part(
                run_id=self.run_id, fingerprint=self.fingerprint, segment=segment, parent=self.head,
                first_step=self._first, next_step=next_step, world=self.world, rank=self.rank,
                resumed=self._resumed, records=records))
        self.head, self._first, self._resumed, self._pending = segment, next_step, False, {}
        return segment
