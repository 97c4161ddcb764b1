"""The framework-free loader core: reader r of W yields, per step, its slice of the global batch cut into trainer
microbatches, and keeps the loader state. TorchTitan's ``ZephonRayDataLoader`` and Ray Train's ``ZephonDatasetShard``
are thin adapters over it; neither framework is imported here.

::

    loader = Loader(LoaderConfig(recipe="recipes/tiny.toml", mode="local"), rank=0, world=1, local_batch_size=4)
    loader.load_state_dict(saved)          # optional: resume (identical on every reader)
    for batch in loader:                   # StepBatch(step, slice, microbatches), forever (repeat = true recipes)
        for inputs, labels in batch.microbatches: ...
        saved = loader.state_dict()        # at a step boundary: after the step was trained
    loader.close()

Guarantee: reader r of any W in [1, B] yields, for every step s from ``next_step`` on, rows
``[floor(r*B/W), floor((r+1)*B/W))`` of global batch s as ``({"input", "positions"}, labels)`` microbatches of
``local_batch_size`` rows: the same rows from the data service (``mode="service"``), an in-process Zephon lane group
(``"local"``) and a materialised directory (``"dataset"``), whatever W and mode were before a resume.
:meth:`StepBatch.loss_scale` turns a rank's summed token loss into its share of the global mean, so the gradient
all-reduce gives the fixed-W gradient at any W. The state (layout: :mod:`zephon_ray.formats.loader_state`) is the
same on every reader, loads at any W and in any mode, carries the run's schedule beyond the recipe file, and names
the ledger segment (:mod:`zephon_ray.stream.ledger_recorder`) that ``zephon-ray audit`` checks. Readers that share a dp rank
(TP/PP/CP peers) get the same slice (:mod:`zephon_ray.stream.mesh`).

Limits, each refused with a one-line error: W <= B; ``local_batch_size`` divides every reader's rows unless
``pad_slices`` pads them; a trainer's global batch and seq_len must be the recipe's (:mod:`zephon_ray.stream.geometry`);
local mode needs W dividing L and, distributed, a ``run_id`` and one of ``aggregate_store`` and ``aggregate_dir``. A
local-mode resume between Zephon checkpoints replays the steps in between (a warning, and ``replayed_steps``). Take
the state after the step was trained. :meth:`close` (also run at garbage collection and exit) stops the daemon
threads and releases the service connection.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from zephon_ray.batch import RankSlice
from zephon_ray.checks import check_int, check_reader
from zephon_ray.formats.loader_state import (
    KEY_LEDGER,
    LoaderStateError,
    check_state,
    make_state,
    replayed_steps,
    run_recipe,
    schedule_of,
    zephon_state,
)
from zephon_ray.recipe import Recipe
from zephon_ray.stream import checkpoint_rendezvous
from zephon_ray.stream.geometry import check_geometry
from zephon_ray.stream.ledger_recorder import LedgerRecorder
from zephon_ray.stream.mesh import DpPeers, dp_peers
from zephon_ray.stream.prefetch import MAX_DEPTH, PrefetchedSlices
from zephon_ray.stream.slice_stream import STATE_CHECKPOINT, stream_state

if TYPE_CHECKING:
    import torch

    from zephon_ray.stream.dataset import DatasetSlices
    from zephon_ray.stream.local import LocalSlices
    from zephon_ray.stream.service import ServiceSlices

logger = logging.getLogger(__name__)

MODES = ("service", "local", "dataset")

# Keys of Loader.stats, named once.
STAT_MODE = "mode"
STAT_NEXT_STEP = "next_step"
STAT_REPLAYED_STEPS = "replayed_steps"
STAT_RESUME_REPLAY = "resume_replay"
STAT_RESUMED_FROM = "resumed_from_checkpoint"

GET_TIMEOUT_S = 960.0
"""How long a reader waits for one step's slice (or a local-mode checkpoint) before a TimeoutError: longer than a
service read's own deadline (``ServiceConfig.read_timeout_s``, 900 s), whose one line says what it waited for."""


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Where the batches come from. Validated when built (a bad value is one ValueError naming the field)."""

    recipe: str
    """Path to the recipe TOML (or a packaged recipe's name, e.g. "tiny")."""

    mode: str = "service"
    """``"service"``: read slices from a running DataService; ``"local"``: run Zephon in this process;
    ``"dataset"``: read a directory written by ``zephon-ray materialize`` (``dataset_dir``)."""

    dataset_dir: str | None = None
    """Dataset mode: the materialised directory (local or shared storage), from the same recipe."""

    service_name: str = "zephon-ray"
    """Service mode: the DataService's Ray actor name (``zephon-ray serve --name``)."""

    service_namespace: str = "zephon-ray"
    """Service mode: the Ray namespace the DataService runs in (``zephon-ray serve --namespace``)."""

    run_id: str | None = None
    """Names the run; checked on resume; the service consumer. Required for a distributed local-mode run."""

    aggregate_store: str | None = None
    """Local mode: ``"torch://"`` (MASTER_ADDR:MASTER_PORT) or ``"torch://host:port"``."""

    aggregate_dir: str | None = None
    """Local mode: a directory every reader can reach. ``$ZEPHON_RAY_AGGREGATE_DIR`` overrides both."""

    aggregate_timeout_s: float = 120.0
    """Local mode: how long a collective checkpoint (and the readers' exchange with it) waits for every reader
    before it fails with one line naming the readers missing."""

    prefetch: int = 2
    """Steps fetched (service, dataset) or produced (local) ahead of the trainer, in a background thread."""

    checkpoint_every: int = 0
    """Local mode: take a Zephon checkpoint every N steps (align it with the trainer's checkpoint interval);
    0: none (a resume then replays from the start, or from the checkpoint it was resumed from)."""

    ledger_dir: str | None = None
    """Where every reader writes its part of a ledger segment at each ``state_dict()`` (a path or object-storage
    URI every reader can reach; one directory per run). None: records are kept and the lineage is carried in the
    state, but nothing is written (``zephon-ray audit`` then has nothing to read)."""

    ledger_compact_every: int = 64
    """Reader 0 merges the ledger directory's files every this many saves, in a child process (0: never; then run
    ``zephon-ray ledger compact DIR`` yourself): a long run keeps a few files, not one per rank per save."""

    pad_slices: bool = False
    """Pad every reader's slice to the same row count (``ceil(B/W)`` rounded up to a multiple of
    ``local_batch_size``) with rows whose labels are all ignored: equal shapes and microbatch counts on every
    reader when W does not divide B (fixed gradient accumulation, torch.compile, CUDA graphs). A no-op when W and
    ``local_batch_size`` divide B evenly."""

    source_ids: bool = False
    """Give every slice ``source_ids``: each token's source index (recipe order; -1 for pad tokens and padding rows),
    derived from the step's provenance (:mod:`zephon_ray.provenance`), and every microbatch's inputs a
    ``"source_ids"`` tensor aligned with its labels, for per-source losses. Off: nothing of it runs. On, it costs a
    provenance-mode pipeline: the reader's own (local mode), or one over every lane beside the reads (service and
    dataset mode). Never in a digest or the loader state."""

    def __post_init__(self) -> None:
        where = "loader config"
        if not isinstance(self.recipe, str) or not self.recipe:
            raise ValueError(f"{where}: 'recipe' (path to a recipe TOML) is required, got {self.recipe!r}")
        if self.mode not in MODES:
            raise ValueError(f"{where}: 'mode' must be one of {MODES}, got {self.mode!r}")
        check_int(f"{where}: 'prefetch'", self.prefetch, low=1, high=MAX_DEPTH)
        check_int(f"{where}: 'checkpoint_every'", self.checkpoint_every, low=0)
        check_int(f"{where}: 'ledger_compact_every'", self.ledger_compact_every, low=0)
        if (
            isinstance(self.aggregate_timeout_s, bool)
            or not isinstance(self.aggregate_timeout_s, (int, float))
            or not 0 < self.aggregate_timeout_s <= 86400
        ):
            raise ValueError(
                f"{where}: 'aggregate_timeout_s' must be a number of seconds in (0, 86400], got "
                f"{self.aggregate_timeout_s!r}"
            )
        for key in ("pad_slices", "source_ids"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{where}: '{key}' must be true or false, got {getattr(self, key)!r}")
        if self.ledger_dir is not None and (not isinstance(self.ledger_dir, str) or not self.ledger_dir):
            raise ValueError(f"{where}: 'ledger_dir' must be a non-empty path or URI, got {self.ledger_dir!r}")
        if (self.mode == "dataset") != bool(self.dataset_dir):
            raise ValueError(
                f"{where}: 'dataset_dir' is required with mode='dataset' and only used by it "
                f"(mode {self.mode!r}, dataset_dir {self.dataset_dir!r})"
            )
        store, agg_dir, origin = self.resolved_aggregation()
        if store is not None and agg_dir is not None:
            raise ValueError(
                f"{where}: set exactly one of 'aggregate_store' and 'aggregate_dir', got both "
                f"({store!r} and {agg_dir!r}, from {origin})"
            )

    def resolved_aggregation(self) -> tuple[str | None, str | None, str]:
        return checkpoint_rendezvous.resolve(self.aggregate_store, self.aggregate_dir, self.recipe)

    def check_distributed_local(self, world: int) -> None:
        """A local-mode run with W > 1 takes collective Zephon checkpoints: it needs a run_id and exactly one
        reachable aggregation point."""
        if self.mode != "local" or world <= 1:
            return
        store, agg_dir, _ = self.resolved_aggregation()
        if not self.run_id:
            raise ValueError(
                f"loader config: a distributed local-mode run (data-parallel degree {world}) needs "
                "'run_id': it names the collective Zephon checkpoint"
            )
        if store is None and agg_dir is None:
            raise ValueError(
                f"loader config: a distributed local-mode run (data-parallel degree {world}) needs exactly one of "
                f"'aggregate_store' (e.g. 'torch://') and 'aggregate_dir' "
                f"(or ${checkpoint_rendezvous.ENV_AGGREGATE_DIR}, or "
                "the recipe's [aggregate] table); neither is set"
            )
        if store is not None:
            checkpoint_rendezvous.check_store_reachable(store)


LOSS_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class StepBatch:
    """Reader r's part of training step ``step``: its ``slice`` (a RankSlice: the real rows only, of data step
    ``slice.step``, which is ``step`` unless the schedule skips data: ``Recipe.data_step``) and ``microbatches`` (one
    optimizer step's worth of ``({"input", "positions"}, labels)``, padding rows included when slices are
    padded)."""

    step: int
    slice: RankSlice
    microbatches: list[tuple[dict[str, torch.Tensor], torch.Tensor]]

    @property
    def global_valid_tokens(self) -> int | None:
        """Labels of the whole global batch that reach the loss (None: the source cannot know it without another
        read; all-reduce the ranks' ``slice.valid_tokens`` instead, as TorchTitan does)."""
        return self.slice.global_valid_tokens

    def loss_scale(self, reduce: str = "mean") -> float:
        """The factor for this rank's **summed** token loss (``cross_entropy(..., reduction="sum",
        ignore_index=-100)`` over its microbatches) that makes the gradient all-reduce yield the global batch's mean
        token gradient, at any W and with uneven or padded slices:

        * ``"mean"``: the all-reduce averages over the W readers (DDP's default, FSDP's default): ``W / N``;
        * ``"sum"``: it sums (TorchTitan 0.3 disables FSDP's division; torchft ``ReduceOp.SUM``): ``1 / N``;

        where N is :attr:`global_valid_tokens`. Each rank's own mean loss averaged over ranks ("mean of means") is
        not the global mean when ranks hold different row counts; this is."""
        if reduce not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_scale: reduce must be one of {LOSS_REDUCTIONS}, got {reduce!r}")
        count = self.global_valid_tokens
        if not count:
            raise ValueError(
                f"step {self.step}: the global valid-token count is not known to this source (a padding "
                "packer in local or service mode); all-reduce the ranks' slice.valid_tokens instead"
            )
        return (self.slice.world if reduce == "mean" else 1) / count


class Loader:
    """Reader ``rank`` of ``world`` over zephon-ray global batches. See the module docstring for the guarantee.

    ``local_batch_size``: rows per trainer microbatch (0: one microbatch of B/W rows per step).
    ``global_batch_size``/``seq_len``: the trainer's, checked against the recipe when given (-1: local_batch_size
    x W). ``checkpoint_every``: overrides ``config.checkpoint_every`` (the TorchTitan adapter derives it from the
    trainer's checkpoint interval). ``recipe``: an already parsed ``Recipe`` of ``config.recipe`` (saves a parse).
    """

    def __init__(
        self,
        config: LoaderConfig,
        *,
        rank: int,
        world: int,
        local_batch_size: int = 0,
        global_batch_size: int | None = None,
        seq_len: int | None = None,
        checkpoint_every: int | None = None,
        recipe: Recipe | None = None,
    ) -> None:
        if not isinstance(config, LoaderConfig):
            raise TypeError(f"Loader: expected a LoaderConfig, got {type(config).__name__}")
        self.config = config
        self.rank, self.world = check_reader(rank, world)
        lbs = check_int("local_batch_size", local_batch_size, low=0)
        self.base_recipe = recipe if recipe is not None else Recipe.from_toml(config.recipe)
        self.recipe = self.base_recipe
        """The run's schedule: the recipe file's, plus the phases the run decided (a loaded state's, a service's)."""
        B = self.recipe.global_batch_rows
        self.shape = check_geometry(
            self.recipe,
            global_batch_size=global_batch_size,
            local_batch_size=lbs,
            dp_world_size=self.world,
            seq_len=seq_len,
            pad=config.pad_slices,
        )
        self.local_batch_size = self.shape.microbatch_rows(self.rank)
        self.microbatches_per_step = self.shape.microbatches(self.rank)
        if config.mode == "local" and self.recipe.lanes % self.world:
            raise ValueError(
                f"recipe {self.recipe.describe()}: local mode needs the data-parallel degree to divide the recipe's "
                f"{self.recipe.lanes} lanes, got {self.world} (each reader runs Zephon for whole lanes); mode="
                f"'service' or 'dataset' serves any W up to B={B}"
            )
        config.check_distributed_local(self.world)
        self.checkpoint_every = (
            config.checkpoint_every
            if checkpoint_every is None
            else check_int("checkpoint_every", checkpoint_every, low=0)
        )
        # TP/PP/CP peers sharing this rank (collective when the job has more processes than readers).
        self.peers: DpPeers | None = (
            dp_peers(dp_rank=self.rank, dp_world_size=self.world) if config.mode == "local" else None
        )
        if config.source_ids and self.peers is not None:
            raise ValueError(
                "loader config: 'source_ids' in local mode with TP/PP/CP peers sharing a dp rank is not "
                "supported (the peers receive the leader's rows only); use mode='service' or 'dataset'"
            )

        self._next_step = 0
        self._loaded_zephon: dict[str, Any] | None = None
        self._loaded_at = 0
        self._stream: PrefetchedSlices | None = None
        self._active = False  # the stream was reset at _next_step and is serving
        self._replayed_before = 0  # replayed steps carried by the loaded state (earlier resumes)
        self._replaying = 0  # steps the current resume replays
        self._replay_started = False  # counted in replayed_steps once the stream started (and so replays)
        self._ledger = LedgerRecorder(
            run_id=config.run_id or "",
            fingerprint=self.base_recipe.fingerprint,
            rank=self.rank,
            world=self.world,
            ledger_dir=config.ledger_dir,
            compact_every=config.ledger_compact_every,
        )
        # Runs at garbage collection and at interpreter exit: a trainer may never call close().
        self._finalizer = weakref.finalize(self, _close_stream, self.__dict__)
        if config.mode == "dataset":
            self._stream = self._make_stream()  # a missing or mismatched directory fails when the loader is built

    # ------------------------------------------------------------------ iteration
    @property
    def next_step(self) -> int:
        """The first global step not yet handed out."""
        return self._next_step

    @property
    def stats(self) -> dict[str, Any]:
        """What this loader did: ``mode``, ``next_step``, ``replayed_steps`` (steps re-produced to resume without an
        exact Zephon checkpoint, summed over this run's resumes, counting the last resume's once iteration started;
        always 0 outside local mode, where the service replays on its own), ``resume_replay`` (the steps the last
        resume replays) and ``resumed_from_checkpoint`` (the step of the Zephon checkpoint it started from)."""
        resumed = None if self._loaded_zephon is None else int(self._loaded_zephon["next_step"])
        return {
            STAT_MODE: self.config.mode,
            STAT_NEXT_STEP: self._next_step,
            STAT_REPLAYED_STEPS: self._replayed_steps(),
            STAT_RESUME_REPLAY: self._replaying,
            STAT_RESUMED_FROM: resumed,
        }

    def _replayed_steps(self) -> int:
        return self._replayed_before + (self._replaying if self._replay_started else 0)

    def __iter__(self) -> Iterator[StepBatch]:
        """Every step from ``next_step`` on (re-read at each step, so a ``load_state_dict`` moves it)."""
        while True:
            step = self._next_step
            piece = self._take(step)
            if self._produces:
                self._ledger.handed(piece, step=step)
            self._next_step = step + 1
            yield StepBatch(step, piece, list(piece.microbatches(self.local_batch_size, pad_to=self.shape.padded_to)))

    def commit(self, step: int) -> None:
        """Confirm that the trainer trained ``step`` (optional; call it once per step, after the optimizer step). Once
        a loop confirms, a step it was handed but never confirmed enters the ledger as skipped, and one confirmed
        twice as trained twice; without it the ledger records what was handed out. A step not handed out since the
        last save is one ValueError naming it."""
        if self._produces:
            self._ledger.commit(step)

    @property
    def _produces(self) -> bool:
        """Whether this reader runs a stream (False for a TP/PP/CP peer, which receives its leader's slices)."""
        return self.peers is None or self.peers.is_leader

    def _started_stream(self, step: int) -> PrefetchedSlices:
        """The stream, serving data step ``recipe.data_step(step)`` next: started there, or moved there at a
        deliberate skip (local mode replays from its newest Zephon checkpoint, the others read it directly)."""
        data = self.recipe.data_step(step)
        if self._stream is not None and self._active:
            if self._stream.position != data:  # a skip starts at this step: the data jumps ahead
                checkpoint = (
                    self._stream.state(timeout=GET_TIMEOUT_S)[STATE_CHECKPOINT] if self.config.mode == "local" else None
                )
                self._stream.reset(stream_state(data, checkpoint))
            return self._stream
        if self._stream is None:
            self._stream = self._make_stream()
        self._stream.reset(stream_state(data, self._loaded_zephon if step == self._loaded_at else None))
        self._active = True
        self._replay_started = True
        return self._stream

    def _take(self, step: int) -> RankSlice:
        peers = self.peers
        if peers is None:
            return self._started_stream(step).next(timeout=GET_TIMEOUT_S)
        shape = (self.shape.rows(self.rank), self.recipe.seq_len + 1)
        if not peers.is_leader:
            self._replay_started = True  # the leader's stream started: keep the states identical
            tokens, positions = peers.share_slice(step, None, None, shape)
            from zephon_ray.source import fixed_valid_tokens, pad_token_id

            return RankSlice(
                step,
                self.rank,
                self.world,
                tokens,
                positions,
                pad_token_id(self.recipe),
                fixed_valid_tokens(self.recipe),
            )
        try:
            piece = self._started_stream(step).next(timeout=GET_TIMEOUT_S)
        except BaseException as exc:
            peers.share_slice(step, None, None, shape, error=exc)  # tell the peers, then raise here
            raise
        peers.share_slice(step, piece.tokens, piece.positions, shape)
        return piece

    def _make_stream(self) -> PrefetchedSlices:
        """The slice stream of ``config.mode``; a new mode adds one branch here and one SliceStream class."""
        cfg, recipe = self.config, self.recipe
        if cfg.mode == "local":
            from zephon_ray.pipeline import LaneGroup
            from zephon_ray.stream.local import LocalSlices

            store, agg_dir, _ = cfg.resolved_aggregation()
            lane_group = (
                LaneGroup(
                    count=self.world,
                    index=self.rank,
                    run_id=cfg.run_id,
                    aggregate_store=store,
                    aggregate_dir=agg_dir,
                    aggregate_timeout_s=cfg.aggregate_timeout_s,
                )
                if self.world > 1
                else LaneGroup()
            )
            return LocalSlices(
                recipe,
                rank=self.rank,
                world=self.world,
                lane_group=lane_group,
                depth=cfg.prefetch,
                checkpoint_every=self.checkpoint_every,
                source_ids=cfg.source_ids,
            )
        if cfg.mode == "dataset":
            from zephon_ray.stream.dataset import DatasetSlices

            stream: DatasetSlices | ServiceSlices = DatasetSlices(
                recipe,
                cast(str, cfg.dataset_dir),
                rank=self.rank,
                world=self.world,
                depth=cfg.prefetch,
                source_ids=cfg.source_ids,
            )
            self.recipe = stream.recipe  # the directory's schedule: ours plus the run-time phases it was made under
            return stream
        from zephon_ray.stream.service import ServiceSlices

        stream = ServiceSlices(
            recipe,
            rank=self.rank,
            world=self.world,
            name=cfg.service_name,
            namespace=cfg.service_namespace,
            run_id=cfg.run_id,
            depth=cfg.prefetch,
            base=self.base_recipe,
            source_ids=cfg.source_ids,
        )
        if not getattr(self, "_closes_before_ray", False):
            # Ray is attached now, and its own exit hook is registered: atexit runs in reverse order, so this closes
            # the stream (its threads and Ray calls) before Ray shuts down. The finalizer alone runs after that hook
            # when it was created first, and a Ray call after ray.shutdown() can crash the process at exit (SIGSEGV
            # seen with 4 torchrun ranks reading a service).
            atexit.register(self._finalizer)
            self._closes_before_ray = True
        self.recipe = stream.recipe  # the service's schedule: ours plus the phases it accepted while running
        return stream

    # ------------------------------------------------------------------ the schedule
    def add_phase(self, name: str, start_step: int, weights: dict[str, float]) -> int:
        """Add mixture phase ``name`` (``weights`` by source name; unnamed sources get 0) from ``start_step`` on to
        the run's schedule, and record it in every loader state from now on, so every resume replays it. Returns
        the earliest step a phase could have started at. Refused in one line (ValueError): an invalid phase (as
        ``[[phases]]``), one that starts too early, or dataset mode (a materialised directory's schedule is fixed).

        - Service mode: the service takes it (``DataService.add_phase``: durable, for every consumer), refused from
          a step some consumer has read.
        - Local mode: call it **on every reader**, with the same phase, before reaching the step it returns: the
          phase must start past what the producer thread can have made (``next_step + prefetch + 1``) and, with
          W > 1, at or after the next collective checkpoint (``checkpoint_every`` must be set). At that checkpoint
          the readers check that they agree on the whole schedule: a reader that missed the call, or made another,
          stops every reader with one line (after the checkpoint channel's timeout), before any of them makes a
          step of the phase; no reader is ever served other rows."""
        mode = self.config.mode
        if mode == "dataset":
            raise ValueError(
                "add_phase: dataset mode reads a materialised directory, whose schedule is fixed; "
                "materialise the later steps with the phase (zephon-ray materialize --schedule-from) "
                "or read them from the service"
            )
        new = self.recipe.with_phase(name, start_step, weights)  # one RecipeError naming the key
        if mode == "service":
            if self._stream is None:
                self._stream = self._make_stream()  # connects; iteration starts it
            stream = cast("ServiceSlices", self._stream)
            stream.service.add_phase(name, start_step, weights)
            self.recipe = stream.sync_recipe()
            return self._next_step
        earliest = self.recipe.data_step(self._next_step) + self.config.prefetch + 1  # phases count data steps
        if self.world > 1:
            if not self.checkpoint_every:
                raise ValueError(
                    "add_phase: a distributed local-mode run needs checkpoint_every > 0: the readers "
                    "check that they agree on a phase added while running at a collective checkpoint"
                )
            earliest = -(-earliest // self.checkpoint_every) * self.checkpoint_every
        if start_step < earliest:
            raise ValueError(
                f"add_phase: phase {name!r} from step {start_step} is too early: this reader is at step "
                f"{self._next_step} and may have made steps up to {self._next_step + self.config.prefetch}"
                + (f"; the readers check the schedule at the checkpoint of step {earliest}" if self.world > 1 else "")
                + f"; start it at step {earliest} or later"
            )
        if self._stream is not None and self._active:
            cast("LocalSlices", self._stream).adopt(new, start_step)
        self.recipe = new
        return earliest

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The loader state at ``next_step`` (format v4, identical on every reader). In local mode with W > 1 it
        may wait for the collective Zephon checkpoint of that boundary: call it on every reader."""
        if not self._produces:
            return cast("dict[str, Any]", cast(DpPeers, self.peers).share_object(None))  # the leader's, bit for bit
        step = self._next_step
        zephon: dict[str, Any] | None = None
        if step > 0 and self._stream is not None and self._active:
            zephon = self._stream.state(timeout=GET_TIMEOUT_S)[STATE_CHECKPOINT]
        elif self.config.mode == "local" and step > 0 and step == self._loaded_at:
            zephon = self._loaded_zephon
        if hasattr(self._stream, "sync_recipe"):  # a service may have accepted a phase since: record it too
            self.recipe = cast("ServiceSlices", self._stream).sync_recipe()
        state = make_state(
            run_id=self.config.run_id,
            fingerprint=self.recipe.history_fingerprint(self.recipe.data_next(step)),
            next_step=step,
            zephon=zephon,
            replayed_steps=self._replayed_steps(),
            ledger=self._ledger.seal(step, self.recipe),
            schedule=schedule_of(self.recipe, self.base_recipe),
        )
        if self.peers is not None:
            self.peers.share_object(state)
        return state

    def load_state_dict(self, state: dict[str, Any], *, trainer_step: int | None = None) -> None:
        """Resume at the state's ``next_step``; a state from another recipe or run, or of another format, is one
        :class:`~zephon_ray.formats.loader_state.LoaderStateError` naming the key, and so is a ``trainer_step`` (the
        step of the weights restored with it) other than ``next_step``: a trainer checkpoint older or newer than its
        loader state would skip or repeat steps. An empty dict is ignored (TorchTitan passes one for a component
        with nothing saved)."""
        if isinstance(state, dict) and not state:
            return
        base = self.base_recipe
        step = check_state(
            state,
            run_id=self.config.run_id,
            fingerprint=base.fingerprint,
            recipe=base,
            recipe_name=str(base.path or "<recipe>"),
        )
        recipe = run_recipe(state, base)  # the run's schedule, which the resume serves whatever the file says
        if recipe.fingerprint != self.recipe.fingerprint:
            logger.info(
                "zephon-ray loader (reader %d of %d): resuming under the run's schedule: %s",
                self.rank,
                self.world,
                ", ".join(f"{p['name']} from step {p['start_step']}" for p in recipe.run_phases(base))
                or "the recipe file's",
            )
        self.recipe = recipe
        if trainer_step is not None and trainer_step != step:
            raise LoaderStateError(
                f"loader state key 'next_step' is {step} but the trainer's checkpoint is at step "
                f"{trainer_step}: resuming would {'skip' if step > trainer_step else 'repeat'} "
                f"{abs(step - trainer_step)} step(s); restore the loader state saved with those "
                "weights"
            )
        loaded = zephon_state(state, next_step=recipe.data_next(step)) if self.config.mode == "local" else None
        if loaded is not None:
            from zephon_ray.lanes import check_step_state

            try:
                check_step_state(loaded, recipe)
            except ValueError as exc:
                raise LoaderStateError(f"loader state key 'zephon': {exc}") from None
        self._loaded_zephon = loaded
        self._replayed_before = replayed_steps(state)
        self._replaying = 0
        self._replay_started = False
        if self.config.mode == "local" and step > 0:
            start = 0 if loaded is None else int(loaded["next_step"])
            self._replaying = recipe.data_step(step) - start  # the same on every reader: the state is
        if self._replaying and self._produces:
            if loaded is None:
                logger.warning(
                    "zephon-ray loader (reader %d of %d): the loaded state at step %d has no Zephon "
                    "checkpoint (checkpointing was off, or the state came from another mode); replaying "
                    "%d steps from step 0 to resume",
                    self.rank,
                    self.world,
                    step,
                    step,
                )
            else:
                logger.warning(
                    "zephon-ray loader (reader %d of %d): resuming at step %d from the Zephon checkpoint "
                    "of step %d; replaying %d steps",
                    self.rank,
                    self.world,
                    step,
                    step - self._replaying,
                    self._replaying,
                )
        self._loaded_at = step
        self._next_step = step
        self._ledger.resume(state[KEY_LEDGER], step)
        _close_stream(self.__dict__)

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop background threads and release the service connection. Idempotent; iterating again restarts at
        ``next_step``."""
        _close_stream(self.__dict__)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_stream(attrs: dict[str, Any]) -> None:
    stream = attrs.get("_stream")
    attrs["_stream"], attrs["_active"] = None, False
    if stream is None:
        return
    try:
        stream.close()
    except Exception:
        logger.debug("closing the zephon-ray slice stream failed", exc_info=True)
