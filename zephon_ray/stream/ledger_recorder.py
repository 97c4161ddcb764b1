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

:class:`FtLedger` is the torchft side: a segment per committed step, spooled at each commit and batched into one file
per reader per flush interval (its docstring says how a killed group loses nothing it committed).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from zephon_ray.batch import RankSlice
from zephon_ray.formats import ledger

logger = logging.getLogger(__name__)


COMPACT_EVERY = 64
"""Reader 0 compacts the ledger directory every this many saves (``LoaderConfig.ledger_compact_every``)."""
_COMPACTING = threading.Lock()
"""One compaction at a time in a process (two of one directory at once are not supported: formats/ledger.py)."""
COMPACT_TIMEOUT_S = 600.0
"""The longest reader 0 lets one compaction run; past it the child is killed (a killed compaction loses nothing)."""


def compact_in_child(ledger_dir: str, timeout_s: float = COMPACT_TIMEOUT_S) -> str:
    """``zephon-ray ledger compact`` in a child process of this interpreter; returns its one-line result. A merge
    holds up to a row group of records (about 100 MB of columns at most) and the allocator of the process that ran it
    keeps that memory; in a child it goes back to the system when the child exits, so a trainer process stays flat
    (``benchmarks/bench_ledger_scale.py --parts reader0``). Raises ``RuntimeError`` with the child's last line if it
    fails, ``TimeoutError`` if it runs past ``timeout_s`` (then it is killed)."""
    package_root = str(Path(__file__).resolve().parents[2])  # the zephon_ray this process imported, for the child
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "zephon_ray.cli", "ledger", "compact", ledger_dir],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": path},
        )
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{ledger_dir}: compaction killed after {timeout_s:.0f} s (nothing is lost)") from None
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"{ledger_dir}: compaction exited with status {done.returncode}: {last}")
    return done.stdout.strip()


class LedgerRecorder:
    """One reader's records (see the module docstring). Reader 0 also keeps the directory's file count bounded: every
    ``compact_every`` saves (0: never) it compacts the ledger in a child process (:func:`compact_in_child`), watched
    by a background thread, so a long run leaves a few packs and at most ``compact_every`` saves' loose parts, not one
    file per rank per save. A compaction that fails is logged and tried again at the next interval: the parts it left
    are still read."""

    def __init__(
        self,
        *,
        run_id: str,
        fingerprint: str,
        rank: int,
        world: int,
        ledger_dir: str | None,
        compact_every: int = COMPACT_EVERY,
    ) -> None:
        self.run_id, self.fingerprint, self.rank, self.world = run_id, fingerprint, rank, world
        self.ledger_dir = ledger_dir
        self.compact_every = compact_every
        self._saves = 0
        self._compactor: threading.Thread | None = None
        self.head = ""  # the segment ending at the last save or load ("" at step 0)
        self._first = 0  # the step the pending records start at
        self._resumed = False
        self._pending: dict[int, list] = {}  # step -> [digest, attempt, trained]
        self._confirms = False  # the loop calls commit(): unconfirmed steps are skipped ones

    def handed(self, piece: RankSlice, attempt: int = 0, *, step: int | None = None) -> None:
        """Record ``piece`` as handed out at training step ``step`` (default: its own step; they differ after a
        deliberate skip, where the rows are a later data step's)."""
        self._pending[piece.step if step is None else step] = [piece.ledger_digest, attempt, 0]

    def commit(self, step: int) -> None:
        entry = self._pending.get(step)
        if entry is None:
            handed = f"[{self._first}, {self._first + len(self._pending)})" if self._pending else "none"
            raise ValueError(
                f"commit: step {step} was not handed out by this loader since its last save (steps "
                f"handed out: {handed})"
            )
        self._confirms = True
        entry[2] += 1

    def resume(self, head: str, step: int) -> None:
        self.head, self._first, self._resumed, self._pending = head, step, True, {}

    def seal(self, next_step: int, recipe: Any) -> str:
        """Close the segment ``[first, next_step)``: write this rank's part (with a ledger_dir) and return the id the
        state carries. ``recipe``: the run's schedule (the file's phases plus the run-time ones), which the segment
        records (:func:`~zephon_ray.formats.ledger.schedule_record`) so the audit can check it continues its
        parent's. No new segment when nothing was handed out since the last save or load."""
        if next_step == self._first:
            return self.head
        schedule = ledger.schedule_record(recipe, next_step)
        segment = ledger.segment_id(
            run_id=self.run_id,
            fingerprint=self.fingerprint,
            parent=self.head,
            first_step=self._first,
            next_step=next_step,
            world=self.world,
            resumed=self._resumed,
            schedule=schedule,
        )
        if self.ledger_dir:
            records = [
                ledger.Record(
                    step, self.world, self.rank, digest, attempt, trained if self._confirms else max(trained, 1)
                )
                for step, (digest, attempt, trained) in sorted(self._pending.items())
            ]
            ledger.write_part(
                self.ledger_dir,
                ledger.make_part(
                    run_id=self.run_id,
                    fingerprint=self.fingerprint,
                    segment=segment,
                    parent=self.head,
                    first_step=self._first,
                    next_step=next_step,
                    world=self.world,
                    rank=self.rank,
                    resumed=self._resumed,
                    schedule=schedule,
                    records=records,
                ),
            )
        self.head, self._first, self._resumed, self._pending = segment, next_step, False, {}
        if self.ledger_dir and self.rank == 0 and self.compact_every:
            self._saves += 1
            if self._saves % self.compact_every == 0:
                self._compact()
        return segment

    def _compact(self) -> None:
        if self._compactor is not None and self._compactor.is_alive():
            return  # the last one still runs: this interval's parts wait for the next

        def run() -> None:
            with _COMPACTING:
                try:
                    logger.info("%s", compact_in_child(cast(str, self.ledger_dir)))  # set: only then does it compact
                except Exception as exc:  # noqa: BLE001 - never the trainer's failure; the next interval retries
                    logger.warning(
                        "ledger %s: compaction failed (tried again in %d saves): %s",
                        self.ledger_dir,
                        self.compact_every,
                        exc,
                    )

        self._compactor = threading.Thread(target=run, name="zephon-ray-ledger-compact", daemon=True)
        self._compactor.start()

    def wait_compacted(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for a compaction this recorder started."""
        if self._compactor is not None:
            self._compactor.join(timeout_s)


class FtLedgerError(ValueError):
    """A torchft group asked for a step its ledger cannot follow, or confirmed one it was not served."""


FLUSH_RECORDS = 1024
"""A torchft reader's parts per batch file at most (a flush starts once more are waiting)."""
FLUSH_SECONDS = 300.0
"""A torchft reader flushes its spool into a batch file at least this often while it commits steps."""


class FtLedger:
    """A torchft replica group's side of the ledger (:class:`~zephon_ray.stream.ft.FtSlices` with a ``ledger_dir``).

    torchft decides at every step whether it counts (``manager.should_commit()``), and a group can die or heal at any
    step, so each committed step is its own segment ``[s, s+1)`` at that step's W = P·dp, and each reader records its
    part when its trainer confirms the step (``FtSlices.commit``): appended to the reader's **spool** (an append-only
    file, :class:`~zephon_ray.formats.ledger.Spool`) before ``commit`` returns, then moved with the others of its
    interval into one **batch** file per reader every ``flush_records`` parts or ``flush_seconds`` (whichever comes
    first; and at ``close``). A group killed between two flushes loses nothing it committed: on a local ledger the
    spool is in ``<ledger_dir>/spool`` and the audit reads it there; on object storage it is a local file that the
    next FtLedger (or ``zephon-ray ledger compact``) on the same host flushes once its writer is dead
    (:func:`~zephon_ray.formats.ledger.adopt_spools`). The segments of the live groups chain by ``parent`` as the
    loader's do.

    Only confirmed steps enter the ledger: an attempt that ``should_commit()`` rejected and the trainer did not apply
    is served again (``attempt`` counts the times the step was served to this reader) and leaves no record. An
    attempt the trainer applied though torchft rejected it (the step is then served again) is the fault this
    records: a warning is logged, and the step's final part, appended later to the same spool, replaces the rejected
    attempt's and counts both applications (``trained`` 2: the audit's ``trained twice``). A flush never moves the
    part of the step in flight out of the spool, so that replacement stays possible.

    A group that heals receives the peer's state (``FtSlices.state_dict`` in the Manager's ``state_dict``) and
    continues its head; a request for any step other than the one it last served (served again) or the one after
    (torchft moved on) is one :class:`FtLedgerError` line, before any row is handed out. Under torchft's async quorum
    (TorchTitan's torchft trainer) a group heals *during* a step it does not participate in (placeholder rows, their
    gradients zeroed): the peer's state is the one from before that step, and once the trainer applies the step
    (:meth:`commit_placeholder`) the head moves to the segment the participants wrote for it, which every reader
    computes alike from (parent, step, W), so the group's next part names the same parent as theirs.

    Limits: on object storage, the spool of a group whose host is lost is lost with it (at most ``flush_records``
    parts or ``flush_seconds`` of them); a spool survives a SIGKILL of its process, not a crash of its machine
    (appends are not fsynced). The audit reads every committed step's part: its cost grows with readers x steps
    (``benchmarks/bench_ledger_scale.py``).
    """

    def __init__(
        self,
        *,
        run_id: str,
        fingerprint: str,
        ledger_dir: str,
        schedule: Callable[[int], dict],
        flush_records: int = FLUSH_RECORDS,
        flush_seconds: float = FLUSH_SECONDS,
        spool_dir: str | None = None,
    ) -> None:
        self.run_id, self.fingerprint, self.ledger_dir = run_id, fingerprint, ledger_dir
        self.schedule = schedule
        """next_step -> the run's :func:`~zephon_ray.formats.ledger.schedule_record` there (each segment records it)."""
        self.flush_records, self.flush_seconds = flush_records, flush_seconds
        self._spool_dir = ledger.spool_dir(ledger_dir, spool_dir)
        ledger.adopt_spools(ledger_dir, spool_dir)  # what a killed reader on this host left: flushed on restart
        self._spool: ledger.Spool | None = None
        self._unflushed: dict[int, dict] = {}  # step -> this reader's part of it, in the spool
        self._flushed_at = time.monotonic()
        self.batches_written = 0
        self.head = ""  # the segment of the last step this reader's trainer confirmed
        self.next_step: int | None = 0  # the step after it (None: unknown until a heal, after a placeholder)
        self._served: dict | None = None  # the step handed out and not yet moved past
        self._placeholder: tuple[int, int] | None = None  # (step, W) of placeholder rows handed out, not moved past
        self._carried = 0  # applications of earlier attempts of that step that torchft rejected
        self.rejected_attempts = 0
        self.applied_rejected = 0

    def check(self, step: int) -> None:
        """Before a step is handed out: it must be the served step again or the one after."""
        cur = self._served
        allowed = (
            {cur["step"], cur["step"] + 1}
            if cur is not None
            else ({self.next_step} if self.next_step is not None else None)
        )
        if allowed is not None and step not in allowed:
            last = f"last served step {cur['step']}" if cur is not None else f"next step {self.next_step}"
            raise FtLedgerError(
                f"FtSlices: asked for step {step}, but this reader's ledger is at its {last}: steps would be skipped "
                "or repeated unseen (a healing group must receive FtSlices.state_dict() through the torchft "
                "Manager's state_dict / load_state_dict)"
            )

    def served(self, step: int, rank: int, world: int, digest: str) -> None:
        cur = self._served
        if cur is not None and cur["step"] == step:  # torchft rejected the attempt: served again
            self.rejected_attempts += 1
            attempt = cur["attempt"] + 1
            if cur["trained"]:
                self.applied_rejected += 1
                logger.warning(
                    "zephon-ray FtSlices (reader %d of %d): step %d attempt %d was applied (commit) "
                    "though torchft rejected it; it is served again and the ledger records the step as "
                    "trained %d times",
                    cur["rank"],
                    cur["world"],
                    step,
                    cur["attempt"],
                    cur["trained"] + self._carried + 1,
                )
                self.head, self.next_step = cur["parent"], step
                self._carried += cur["trained"]
        else:
            if cur is not None and not cur["trained"]:  # torchft moved on but the trainer never confirmed it
                self._write(cur, trained=self._carried)
            self._carried, attempt = 0, 0
        self._served = {
            "step": step,
            "rank": rank,
            "world": world,
            "digest": digest,
            "attempt": attempt,
            "trained": 0,
            "parent": self.head,
        }

    def placeholder(self, step: int | None = None, world: int | None = None) -> None:
        """Not participating this step (rows that torchft zeroes): nothing is recorded; torchft heals the group.
        ``step``/``world``: the step and the participants' W, for :meth:`commit_placeholder`."""
        self._served, self._carried, self.next_step = None, 0, None
        self._placeholder = None if step is None or world is None else (int(step), int(world))

    def commit_placeholder(self) -> bool:
        """The trainer applied the step it held placeholder rows for (torchft's async quorum healed this group during
        it, so its weights are now the participants' after that step). If the heal brought a state at that step
        (:meth:`resume`), the head moves to the participants' segment of it and nothing is written; returns whether
        it did. Without a heal the position stays unknown (checked again after the next heal or restore)."""
        held, self._placeholder = self._placeholder, None
        if held is None or self.next_step != held[0]:
            return False
        step, world = held
        self.head = ledger.segment_id(
            run_id=self.run_id,
            fingerprint=self.fingerprint,
            parent=self.head,
            first_step=step,
            next_step=step + 1,
            world=world,
            resumed=False,
            schedule=self.schedule(step + 1),
        )
        self.next_step = step + 1
        return True

    def commit(self, step: int) -> None:
        cur = self._served
        if cur is None or cur["step"] != step:
            raise FtLedgerError(
                f"FtSlices.commit: step {step} is not the step this reader last served "
                f"({'none' if cur is None else cur['step']})"
            )
        cur["trained"] += 1
        self._write(cur, trained=cur["trained"] + self._carried)

    def _write(self, cur: dict, *, trained: int) -> None:
        step, world = cur["step"], cur["world"]
        schedule = self.schedule(step + 1)
        segment = ledger.segment_id(
            run_id=self.run_id,
            fingerprint=self.fingerprint,
            parent=cur["parent"],
            first_step=step,
            next_step=step + 1,
            world=world,
            resumed=False,
            schedule=schedule,
        )
        record = ledger.Record(step, world, cur["rank"], cur["digest"], cur["attempt"], trained)
        part = ledger.make_part(
            run_id=self.run_id,
            fingerprint=self.fingerprint,
            segment=segment,
            parent=cur["parent"],
            first_step=step,
            next_step=step + 1,
            world=world,
            rank=cur["rank"],
            resumed=False,
            schedule=schedule,
            records=[record],
        )
        if self._spool is None:
            self._spool = ledger.Spool(self._spool_dir)
        self._spool.append(part)  # durable before commit returns: a kill from here on loses nothing
        self._unflushed[step] = part
        self.head, self.next_step = segment, step + 1
        if len(self._unflushed) > self.flush_records or time.monotonic() - self._flushed_at >= self.flush_seconds:
            self.flush(before=step)

    def flush(self, before: int | None = None) -> None:
        """Move the spooled parts of the steps before ``before`` (all: None) into one batch file, then start a new
        spool with the rest. Killed in between, both copies are read as one."""
        out = [p for s, p in sorted(self._unflushed.items()) if before is None or s < before]
        if not out:
            return
        ledger.write_batch(self.ledger_dir, out)
        self.batches_written += 1
        keep = {s: p for s, p in self._unflushed.items() if before is not None and s >= before}
        old, self._spool = self._spool, None
        if keep:
            self._spool = ledger.Spool(self._spool_dir)
            for part in keep.values():
                self._spool.append(part)
        if old is not None:
            old.close(remove=True)
        self._unflushed, self._flushed_at = keep, time.monotonic()

    def close(self) -> None:
        """Flush every spooled part (the trainer is done with them). Idempotent."""
        self.flush()
        if self._spool is not None:
            self._spool.close(remove=not self._unflushed)
            self._spool = None

    def resume(self, head: str, next_step: int) -> None:
        """A heal (or a restore): continue the peer's head. An attempt this reader applied though torchft rejected
        it stays recorded: the peer's weights replace the ones it went into. A heal at the very step this reader
        was served and participates in (torchft's ``init_sync`` at step 0, and any heal under the async quorum that
        lets the group train the step) keeps that step's rows: they are trained with the healed weights, and the
        part names the peer's head as its parent."""
        cur = self._served
        self.head, self.next_step, self._carried = head, next_step, 0
        if cur is not None and cur["step"] == next_step and not cur["trained"]:
            cur["parent"] = head
        else:
            self._served = None
