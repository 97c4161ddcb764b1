"""Per-step elasticity with torchft: a slice stream driven by a torchft ``Manager`` (the ``ft`` extra).

torchft forms a quorum of live replica groups at every step; a dead group does not stop the others, and a group
that comes back heals its model from a peer. :class:`FtSlices` gives every step's global batch to whichever groups
are live now::

    manager.start_quorum()
    batch = slices.next()          # after the quorum: this group's part of global batch manager.current_step()
    loss(batch.microbatches).backward(); [manager.allreduce(p.grad).wait() for p in params]  # Manager(timeout) bounds
    if manager.should_commit(): optimizer.step()   # a rejected step is served again by the next next()

Guarantee: at each step, after the quorum, replica group p of the P live participants, rank r of its ``dp`` ranks, reads
``slice(s, p·dp + r, P·dp)`` of global batch ``s = manager.current_step()``: the P·dp slices joined in order are exactly
the fixed-W run's global batch s, whatever P is (P·dp need not divide B), so every committed step trains on the same
global batch (each group's share changes with P). A step that ``should_commit()`` rejects is asked for again (torchft
does not advance ``current_step()``) and served again; a group that rejoins starts at ``current_step()`` with no data
checkpoint: the step is the state, and the model comes from a peer, as torchft heals it. Shown by
``examples/torchft_churn.py`` (3 replica groups as processes, SIGKILL kills and rejoins: every committed step's global
digest equals the reference, final weights equal the failure-free run's).

Ledger (``config.ledger_dir`` and ``run_id``; :class:`~zephon_ray.stream.ledger_recorder.FtLedger`): call
``slices.commit(step)`` after the optimizer step that ``should_commit()`` allowed, and put ``slices.state_dict()`` in
the Manager's ``state_dict`` (``slices.load_state_dict`` in its ``load_state_dict``) so a healing group continues
the lineage. Only committed steps enter the ledger, one segment per step at its W, appended to the reader's spool when
it commits and moved into one batch file per reader every ``ledger_flush_records`` parts or ``ledger_flush_seconds``
(and at ``close``); a step served again is recorded with its attempt number; an attempt applied though torchft rejected it is recorded as trained twice; a request for
a step other than the one last served or the one after is one :class:`~zephon_ray.stream.ledger_recorder.FtLedgerError`
line (docs/audit.md).

Prefetch assumes the membership stays as it is: one prefetch thread (:mod:`zephon_ray.stream.prefetch`) reads the
next ``depth`` steps at the current (rank, world); when the quorum changes the membership, the stream for the new
(rank, world) is reset at the current step and fetches again. The cost of the membership check itself (reading the
quorum from the manager and comparing) is recorded per step in :attr:`FtSlices.check_seconds`, the cost of a
change in :attr:`FtSlices.change_seconds` (``benchmarks/bench_ft.py`` measures both).

Sources: the data service (``mode="service"``, any step at any (rank, world)) or a materialised directory
(``mode="dataset"``). **Local mode is out of scope**: there reader r of W is Zephon lane group r of W, owning lanes
[r·L/W, (r+1)·L/W) and their Zephon state. A change of P moves lanes between groups, so every membership change
would need a collective Zephon checkpoint and a restore that replays the lanes' open epoch (seconds), W would have
to divide L (not only B), and a group that dies takes its lanes' state since the last collective checkpoint with
it. That is restart-based elasticity (Ray Train's path), not per-step.

Loss weighting: groups hold different row counts when P·dp does not divide B, and padding packers (``packing``
other than ``"wrap"``, whose pad labels are masked) and loss masks make token counts differ anyway, so the mean over
groups of their mean gradients (``manager.allreduce``'s default AVG) is biased. Two exact ways: scale each group's
*summed* token loss by ``batch.loss_scale()`` (``P·dp / N`` for N global valid tokens, which the batch carries:
the AVG all-reduce then yields the global mean), or backpropagate the summed loss and all-reduce the gradients and
the valid-token count with ``ReduceOp.SUM`` (:func:`token_weighted`).

Limits: at most B readers (P·dp <= B); a quorum beyond that, or one whose rows cannot be cut into the trainer's
microbatches, raises :class:`FtMembershipError`, one line, before the step runs (:func:`supported_participants`;
``zephon-ray validate`` lists the counts and the padding each costs). With ``microbatches`` (a trainer's fixed
gradient accumulation) or ``pad_slices``, each group's rows are padded to equal shapes (rows whose labels are all
ignored, never in a digest). A group that is not participating (healing under ``use_async_quorum=True``) gets None
(or, asked for a placeholder, participant 0's rows, whose gradients torchft zeroes): it trains nothing at that
step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from zephon_ray.batch import padded_rows
from zephon_ray.checks import check_int, check_reader
from zephon_ray.errors import best_effort
from zephon_ray.formats.loader_state import KEY_LEDGER, check_state, make_state, run_recipe, schedule_of
from zephon_ray.recipe import Recipe
from zephon_ray.stream.geometry import StepShape, check_geometry
from zephon_ray.stream.ledger_recorder import FLUSH_RECORDS, FLUSH_SECONDS, FtLedger
from zephon_ray.stream.loader import GET_TIMEOUT_S, LoaderConfig, StepBatch
from zephon_ray.stream.prefetch import PrefetchedSlices
from zephon_ray.stream.slice_stream import stream_state

if TYPE_CHECKING:
    from zephon_ray.stream.dataset import DatasetSlices
    from zephon_ray.stream.service import ServiceSlices

log = logging.getLogger("zephon_ray")

FT_MODES = ("service", "dataset")
_KEEP_STREAMS = 4  # (rank, world) memberships whose streams are kept (threads stopped) for a quick return


class FtMembershipError(ValueError):
    """The quorum's participant count cannot share the global batch; raised before the step runs."""


def ft_shape(
    recipe: Recipe,
    participants: int,
    *,
    dp: int = 1,
    local_batch_size: int = 0,
    microbatches: int = 0,
    pad: bool = False,
) -> StepShape:
    """How P = ``participants`` groups of ``dp`` readers cut a step; :class:`~zephon_ray.stream.geometry.
    TrainerMismatchError` (a ValueError) when they cannot. With ``microbatches`` (a fixed count per step) every
    reader's rows are padded to that many microbatches of ``ceil(ceil(B/(P·dp)) / microbatches)`` rows; with
    ``local_batch_size`` and ``pad``, to a multiple of ``local_batch_size``."""
    world = participants * dp
    if not microbatches:
        return check_geometry(
            recipe,
            global_batch_size=None,
            local_batch_size=local_batch_size,
            dp_world_size=world,
            seq_len=None,
            pad=pad,
        )
    shape = check_geometry(recipe, global_batch_size=None, local_batch_size=0, dp_world_size=world, seq_len=None)
    rows = -(-padded_rows(recipe.global_batch_rows, world) // microbatches)
    return replace(shape, local_batch_size=rows, padded_to=rows * microbatches)


def supported_participants(
    recipe: Recipe, *, dp: int = 1, local_batch_size: int = 0, microbatches: int = 0, pad: bool = False
) -> list[int]:
    """The participant counts P for which P·dp readers can share the recipe's B rows: every P with P·dp <= B, less
    those whose rows ``local_batch_size`` cannot cut without padding (see :func:`ft_shape`)."""
    out = []
    for p in range(1, recipe.global_batch_rows // dp + 1):
        try:
            ft_shape(recipe, p, dp=dp, local_batch_size=local_batch_size, microbatches=microbatches, pad=pad)
        except ValueError:
            continue
        out.append(p)
    return out


def token_weighted(grads_summed: Any, tokens: Any, all_reduce_sum: Any) -> Any:
    """The global mean gradient from per-group *summed* losses, whatever rows each group held (uneven slices,
    padding rows, masks): all-reduce (SUM) each summed gradient and the group's valid-token count, then divide.
    ``all_reduce_sum(tensor)`` reduces in place, e.g.
    ``lambda t: manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()``. Returns the reduced gradients."""
    count = tokens.clone().double()
    all_reduce_sum(count)
    for grad in grads_summed:
        all_reduce_sum(grad)
        grad.div_(count.to(grad.dtype))
    return grads_summed


class FtSlices:
    """Replica group ``manager.participating_rank()``'s slices of ``manager.current_step()``'s global batch.

    ``config``: where the rows come from (a :class:`~zephon_ray.stream.loader.LoaderConfig` with ``mode`` "service"
    or "dataset"; ``prefetch`` is the read-ahead depth). ``manager``: a torchft ``Manager`` (anything with
    ``current_step()``, ``num_participants()`` and ``participating_rank()``). ``dp``/``dp_rank``: the data-parallel
    ranks inside one replica group. ``local_batch_size``: rows per trainer microbatch (0: one microbatch), or
    ``microbatches``: a fixed number of equal microbatches per step whatever P is (a trainer with a fixed gradient
    accumulation, such as TorchTitan's, pulls the same count every step; their row count then changes with P).
    ``ledger_flush_records``/``ledger_flush_seconds``: how often the ledger's spool becomes a batch file
    (:class:`~zephon_ray.stream.ledger_recorder.FtLedger`). See the module docstring for the guarantee and its
    limits."""

    def __init__(
        self,
        config: LoaderConfig,
        *,
        manager: Any,
        dp: int = 1,
        dp_rank: int = 0,
        local_batch_size: int = 0,
        microbatches: int = 0,
        recipe: Recipe | None = None,
        ledger_flush_records: int = FLUSH_RECORDS,
        ledger_flush_seconds: float = FLUSH_SECONDS,
    ) -> None:
        if not isinstance(config, LoaderConfig):
            raise TypeError(f"FtSlices: expected a LoaderConfig, got {type(config).__name__}")
        if config.mode not in FT_MODES:
            raise ValueError(
                f"FtSlices: mode {config.mode!r} is not supported; use one of {FT_MODES} (local mode "
                "ties a reader to its lanes' Zephon state: see zephon_ray.stream.ft)"
            )
        for name in ("current_step", "num_participants", "participating_rank"):
            if not callable(getattr(manager, name, None)):
                raise TypeError(f"FtSlices: 'manager' has no {name}() (expected a torchft Manager)")
        self.config, self.manager = config, manager
        self.dp_rank, self.dp = check_reader(dp_rank, dp, rank_name="dp_rank", world_name="dp", where="FtSlices: ")
        self.local_batch_size = check_int("FtSlices: local_batch_size", local_batch_size, low=0)
        self.microbatches = check_int("FtSlices: microbatches", microbatches, low=0)
        if self.local_batch_size and self.microbatches:
            raise ValueError("FtSlices: set at most one of 'local_batch_size' and 'microbatches'")
        self.base_recipe = recipe if recipe is not None else Recipe.from_toml(config.recipe)
        self.recipe = self.base_recipe
        """The run's schedule: the recipe file's plus the run-time phases its state or its stream carries."""
        self.pad = config.pad_slices
        self.supported = supported_participants(
            self.recipe,
            dp=self.dp,
            local_batch_size=self.local_batch_size,
            microbatches=self.microbatches,
            pad=self.pad,
        )
        if not self.supported:
            raise ValueError(
                f"FtSlices: no participant count works for dp {dp} and local_batch_size "
                f"{local_batch_size} with the recipe's global batch of {self.recipe.global_batch_rows} "
                f"rows ({self.recipe.describe()}); set pad_slices = true"
            )
        self._streams: OrderedDict[tuple[int, int], PrefetchedSlices] = OrderedDict()
        self._active: tuple[int, int] | None = None
        self._last: StepBatch | None = None
        self._last_key: tuple[int, int, int] | None = None
        self._placeholder = False  # the rows handed out last were a non-participant's placeholder
        self.check_seconds: list[float] = []
        """Per call of :meth:`next`: seconds spent reading the quorum and checking the membership."""
        self.change_seconds: list[float] = []
        """Per membership change: seconds spent switching to (and resetting) the new membership's stream."""
        self.membership_changes = 0
        self.served_again = 0
        self.ledger: FtLedger | None = None
        """With ``config.ledger_dir``: this reader's records (see :meth:`commit`, :meth:`state_dict`)."""
        if config.ledger_dir:
            self.ledger = FtLedger(
                run_id=config.run_id or "",
                fingerprint=self.recipe.fingerprint,
                ledger_dir=config.ledger_dir,
                schedule=self._ledger_schedule,
                flush_records=check_int("FtSlices: ledger_flush_records", ledger_flush_records, low=1),
                flush_seconds=float(ledger_flush_seconds),
            )

    # ------------------------------------------------------------------ the step
    def membership(self) -> tuple[int, int, int] | None:
        """``(step, rank, world)`` this group reads now, or None when it does not participate. Raises
        :class:`FtMembershipError` for a participant count outside :attr:`supported`."""
        # num_participants() and participating_rank() wait for the quorum (torchft's async quorum included), and a
        # healing group's step is only set by then: read current_step() last.
        participants = int(self.manager.num_participants())
        p = self.manager.participating_rank()
        step = int(self.manager.current_step())
        if p is None:
            return None
        if participants not in self.supported:
            raise FtMembershipError(
                f"step {step}: a quorum of {participants} participants x dp {self.dp} = {participants * self.dp} "
                f"readers cannot share the recipe's global batch of {self.recipe.global_batch_rows} rows "
                f"({self.recipe.describe()}); it supports {_ranges(self.supported)} participants (zephon-ray "
                "validate); the step was not run"
            )
        return step, int(p) * self.dp + self.dp_rank, participants * self.dp

    def next(self, timeout: float = GET_TIMEOUT_S, *, placeholder: bool = False) -> StepBatch | None:
        """This group's part of global batch ``manager.current_step()``; call it after ``start_quorum()``.

        A group that does not participate gets None, or with ``placeholder=True`` participant 0's rows of the step
        (for a trainer that must run its forward and backward anyway: torchft zeroes that group's gradients in
        ``manager.allreduce``, so they never reach the global batch)."""
        t0 = time.perf_counter()
        key = self.membership()
        if key is None and placeholder:
            participants = int(self.manager.num_participants())
            if participants not in self.supported:
                raise FtMembershipError(
                    f"step {self.manager.current_step()}: a quorum of {participants} "
                    f"participants; this recipe supports {_ranges(self.supported)}"
                )
            key = (int(self.manager.current_step()), self.dp_rank, participants * self.dp)
        if key is None:
            self.check_seconds.append(time.perf_counter() - t0)
            if self.ledger is not None:
                self.ledger.placeholder()
            return None
        step, rank, world = key
        self._placeholder = False
        if self.ledger is not None:
            if placeholder and self.manager.participating_rank() is None:
                self.ledger.placeholder(step, world)
                placeholder_rows = self._placeholder = True
            else:
                self.ledger.check(step)
                placeholder_rows = False
        if key == self._last_key:  # should_commit() rejected it: the same rows again
            self.check_seconds.append(time.perf_counter() - t0)
            self.served_again += 1
            # fresh tensors: the trainer may have written into the first
            batch = self._batch(cast(StepBatch, self._last).slice, step)
            if self.ledger is not None and not placeholder_rows:
                self.ledger.served(step, rank, world, batch.slice.ledger_digest)
            return batch
        changed = (rank, world) != self._active
        self.check_seconds.append(time.perf_counter() - t0)
        data = self.recipe.data_step(step)  # the data it reads: later than the step after a deliberate skip
        if changed:
            t1 = time.perf_counter()
            stream = self._stream_for(rank, world, data)
            self.change_seconds.append(time.perf_counter() - t1)
        else:
            stream = self._stream_for(rank, world, data)
        batch = self._batch(stream.next(timeout), step)
        self._last, self._last_key = batch, key
        if self.ledger is not None and not placeholder_rows:
            self.ledger.served(step, rank, world, batch.slice.ledger_digest)
        return batch

    # ------------------------------------------------------------------ the ledger
    def _ledger_schedule(self, next_step: int) -> dict:
        """The run's schedule up to ``next_step`` as a ledger segment records it (read when the segment is written:
        a heal or restore may have brought the run's phases since)."""
        from zephon_ray.formats.ledger import schedule_record

        return schedule_record(self.recipe, next_step)

    def commit(self, step: int) -> None:
        """Confirm that the trainer applied ``step`` (call it when ``manager.should_commit()`` is True, after the
        optimizer step). With a ``ledger_dir`` it writes this reader's part of the step's segment (a rejected
        attempt never comes here, unless the loop applies it anyway: see :class:`~zephon_ray.stream.ledger_recorder.
        FtLedger`); without one it does nothing."""
        if self.ledger is not None:
            self.ledger.commit(step)

    def applied(self) -> None:
        """The trainer applied the optimizer step of the rows :meth:`next` handed out last, whatever they were (for a
        trainer that learns it from its optimizer, as TorchTitan's torchft trainer does through
        :class:`~zephon_ray.integrations.torchtitan.torchft.ZephonFTTrainer`): :meth:`commit` of that step, or, for
        placeholder rows (a group healing under torchft's async quorum), the ledger follows the participants' segment
        of the step (:meth:`FtLedger.commit_placeholder`). Does nothing before the first :meth:`next`."""
        if self.ledger is None or self._last_key is None and not self._placeholder:
            return
        if self._placeholder:
            self.ledger.commit_placeholder()
        else:
            self.ledger.commit(cast("tuple[int, int, int]", self._last_key)[0])  # not a placeholder: a step was served

    def state_dict(self) -> dict[str, Any]:
        """The loader state (format v4) at the first step this reader's trainer has not confirmed, naming its
        ledger head. Put it in the torchft Manager's ``state_dict`` so that a healing group continues the lineage
        (torchft heals a group from a peer: the step is the data state, the head is the ledger's)."""
        ledger = self.ledger
        step = 0 if ledger is None else int(ledger.next_step or 0)
        return make_state(
            run_id=self.config.run_id,
            fingerprint=self.recipe.history_fingerprint(self.recipe.data_next(step)),
            next_step=step,
            zephon=None,
            ledger="" if ledger is None else ledger.head,
            schedule=schedule_of(self.recipe, self.base_recipe),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a peer's (or a checkpoint's) state: another run's or recipe's state is one
        :class:`~zephon_ray.formats.loader_state.LoaderStateError` naming the key."""
        base = self.base_recipe
        step = check_state(
            state,
            run_id=self.config.run_id,
            fingerprint=base.fingerprint,
            recipe=base,
            recipe_name=str(base.path or "<recipe>"),
        )
        recipe = run_recipe(state, base)
        if recipe.fingerprint != self.recipe.fingerprint:  # streams made under the old schedule go
            self.close()
        self.recipe = recipe
        if self.ledger is not None:
            self.ledger.resume(state[KEY_LEDGER], step)

    def _batch(self, piece: Any, step: int) -> StepBatch:
        shape = ft_shape(
            self.recipe,
            piece.world // self.dp,
            dp=self.dp,
            local_batch_size=self.local_batch_size,
            microbatches=self.microbatches,
            pad=self.pad,
        )
        rows = shape.microbatch_rows(piece.rank)
        return StepBatch(step, piece, list(piece.microbatches(rows, pad_to=shape.padded_to)))

    def _stream_for(self, rank: int, world: int, step: int) -> PrefetchedSlices:
        member = (rank, world)
        if member != self._active:
            if self._active is not None:
                self._streams[self._active].close_thread()  # a service stream keeps its connection and cursors
                self.membership_changes += 1
            stream = self._streams.pop(member, None) or self._make_stream(rank, world)
            self._streams[member] = stream
            while len(self._streams) > _KEEP_STREAMS:
                _, old = self._streams.popitem(last=False)
                old.close_thread()
            self._active = member
            stream.reset(stream_state(step))
            return stream
        stream = self._streams[member]
        if stream.position != step:  # a jump (healed to a later step, or a rejected step at a new membership)
            stream.reset(stream_state(step))
        return stream

    def _make_stream(self, rank: int, world: int) -> PrefetchedSlices:
        cfg = self.config
        if cfg.mode == "dataset":
            from zephon_ray.stream.dataset import DatasetSlices

            stream: DatasetSlices | ServiceSlices = DatasetSlices(
                self.recipe, cast(str, cfg.dataset_dir), rank=rank, world=world, depth=cfg.prefetch
            )
        else:
            from zephon_ray.stream.service import ServiceSlices

            stream = ServiceSlices(
                self.recipe,
                rank=rank,
                world=world,
                name=cfg.service_name,
                namespace=cfg.service_namespace,
                run_id=cfg.run_id,
                depth=cfg.prefetch,
                base=self.base_recipe,
            )
        self.recipe = stream.recipe  # the stream's schedule: ours plus the run-time phases it runs under
        return stream

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop every prefetch thread, release the service connection and flush the ledger's spool. Idempotent."""
        if self.ledger is not None:
            self.ledger.close()
        streams, self._streams, self._active = self._streams, OrderedDict(), None
        for stream in streams.values():
            with best_effort(log, "best effort at shutdown"):
                stream.close()

    def __enter__(self) -> FtSlices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ranges(counts: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``"1-3, 5"``: a supported list can hold thousands of counts."""
    out, start = [], None
    for i, n in enumerate(counts):
        if start is None:
            start = n
        if i + 1 == len(counts) or counts[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out) or "none"
