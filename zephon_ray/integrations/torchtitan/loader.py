"""``ZephonRayDataLoader``: TorchTitan 0.3.0's ``BaseDataLoader`` as a thin adapter over the loader core.

Everything but TorchTitan's contract lives in :class:`zephon_ray.stream.loader.Loader` (the guarantee, the modes,
the loader state, TP/PP/CP peers, the geometry checks). This adapter maps TorchTitan's build keywords onto it
(``dp_world_size`` -> W, ``dp_rank`` -> rank), checks TorchTitan's tokenizer against the recipe's
(:mod:`zephon_ray.integrations.torchtitan.trainer_checks`), yields the core's trainer microbatches one at a time,
and refuses a checkpoint in the middle of a step (TorchTitan pulls every microbatch of a step before it saves).

Guarantee (the core's): dp rank r of any W in [1, B] yields, for every step s, the microbatches of rows ``[floor(r*B/W),
floor((r+1)*B/W))`` of global batch s, padded to equal shapes on every rank when W does not divide B (rows whose labels
are all ignored: TorchTitan's loss, normalised by the all-reduced valid-token count with gradients summed, is then the
fixed-dp loss; set ``training.global_batch_size`` to the padded batch the error names, or -1 with ``local_batch_size =
ceil(B/dp)``), whatever W, mode and resume history. Its ``state_dict`` is the loader state (layout:
:mod:`zephon_ray.formats.loader_state`), identical on every rank, so DCP stores it once and it loads at any W; it
works before iteration.

Limits: the build keywords are exactly TorchTitan 0.3.0's (the ones its ``Trainer.__init__`` passes); an unknown one is a TypeError naming it, a bad value (``dp_world_size=None``) one
ValueError naming it. TorchTitan counts its checkpoint interval (``snapshot_every_n_steps``) in microbatches of this
rank; with ``checkpoint_every = 0`` the loader takes its local-mode Zephon checkpoints at that interval.
TorchTitan never closes its data loader: :meth:`close` runs at garbage collection and interpreter exit.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from zephon_ray.checks import check_int, check_reader
from zephon_ray.formats.loader_state import LoaderStateError
from zephon_ray.integrations.torchtitan.trainer_checks import check_tokenizer
from zephon_ray.recipe import Recipe
from zephon_ray.stream.geometry import check_geometry
from zephon_ray.stream.loader import Loader, LoaderConfig, StepBatch

logger = logging.getLogger("zephon_ray")

_CORE_FIELDS = tuple(f.name for f in fields(LoaderConfig))


class ZephonRayDataLoader(BaseDataLoader):
    """TorchTitan data loader over zephon-ray global batches. See the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """:class:`zephon_ray.stream.loader.LoaderConfig`'s fields, types, defaults and docs, plus TorchTitan's.
        Declared, so that type checkers and TorchTitan's CLI (tyro) read it as written;
        a test fails when it and LoaderConfig differ beyond the fields marked "TorchTitan:"."""

        recipe: str = ""
        """TorchTitan: path to the recipe TOML (or a packaged recipe's name, e.g. "tiny"); required (the empty
        default only lets TorchTitan's CLI fill it in)."""

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
        """TorchTitan: local mode, a Zephon checkpoint every N steps; 0: TorchTitan's checkpoint interval when
        checkpointing is on, else none."""

        ledger_dir: str | None = None
        """Where every reader writes its part of a ledger segment at each ``state_dict()`` (a path or object-storage
        URI every reader can reach; one directory per run). None: records are kept and the lineage is carried in the
        state, but nothing is written (``zephon-ray audit`` then has nothing to read)."""

        ledger_compact_every: int = 64
        """Reader 0 merges the ledger directory's files every this many saves, in a child process (0: never; then run
        ``zephon-ray ledger compact DIR`` yourself): a long run keeps a few files, not one per rank per save."""

        pad_slices: bool = True
        """TorchTitan: on by default here. TorchTitan takes the same number of microbatches on every dp rank, so at a
        dp degree that does not divide B each rank's rows are padded to ``ceil(B/dp)`` (rounded up to
        ``local_batch_size``) with rows whose labels are all ignored. TorchTitan 0.3 divides the summed loss by the
        all-reduced count of valid labels and sums gradients, so the padding changes no gradient. A no-op when dp
        divides B evenly."""

        source_ids: bool = False
        """Give every slice ``source_ids``: each token's source index (recipe order; -1 for pad tokens and padding rows),
        derived from the step's provenance (:mod:`zephon_ray.provenance`), and every microbatch's inputs a
        ``"source_ids"`` tensor aligned with its labels, for per-source losses. Off: nothing of it runs. On, it costs a
        provenance-mode pipeline: the reader's own (local mode), or one over every lane beside the reads (service and
        dataset mode). Never in a digest or the loader state."""

        global_batch_size: int | None = None
        """TorchTitan: the trainer's ``training.global_batch_size`` (-1: TorchTitan's default, local_batch_size x
        dp), copied in by the config registry and the ``--override.imports`` hook and checked against the recipe's B
        when the loader is built. None: no trainer (standalone use); a step is then B rows by definition."""

        infinite: bool = True
        """TorchTitan: kept for TorchTitan's validator contract; a recipe with ``repeat = true`` never runs out."""

        def __post_init__(self) -> None:
            self.core()  # validate now, when the config is built (after CLI overrides)

        def core(self) -> LoaderConfig:
            """The loader core's config (validated; a bad value is one ValueError naming the field)."""
            return LoaderConfig(**{name: getattr(self, name) for name in _CORE_FIELDS})

        def resolved_aggregation(self) -> tuple[str | None, str | None, str]:
            return self.core().resolved_aggregation()

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        local_batch_size: int,
        tokenizer: Any = None,
        seq_len: int | None = None,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        # The keywords are exactly TorchTitan 0.3.0's (Trainer.__init__); no **kwargs, so a renamed one fails here.
        where = "ZephonRayDataLoader.build"
        rank, world = check_reader(
            dp_rank, dp_world_size, rank_name="dp_rank", world_name="dp_world_size", where=f"{where}: "
        )
        lbs = check_int(f"{where}: local_batch_size", local_batch_size, low=1)
        if seq_len is not None:
            check_int(f"{where}: seq_len", seq_len, low=1)
        if snapshot_every_n_steps is not None:
            check_int(f"{where}: snapshot_every_n_steps", snapshot_every_n_steps, low=1)
        self.config = config
        core = config.core()
        recipe = Recipe.from_toml(core.recipe)
        per_step = check_geometry(
            recipe,
            global_batch_size=config.global_batch_size,
            local_batch_size=lbs,
            dp_world_size=world,
            seq_len=seq_len,
            pad=core.pad_slices,
        ).microbatches(rank)
        check_tokenizer(recipe, tokenizer)
        every = core.checkpoint_every
        if not every and snapshot_every_n_steps:
            every = max(1, snapshot_every_n_steps // per_step)  # TorchTitan counts microbatches of this rank
        self.core = Loader(
            core,
            rank=rank,
            world=world,
            local_batch_size=lbs,
            global_batch_size=config.global_batch_size,
            seq_len=seq_len,
            checkpoint_every=every,
            recipe=recipe,
        )
        self.dp_world_size, self.dp_rank, self.local_batch_size = world, rank, lbs
        self._partial = 0
        self._ft: Any = None
        self._trainer_step: int | None = None
        self._source_ids: deque[torch.Tensor] = deque()  # at most one step's microbatches: cleared at each step
        self._trainer_step_checker: str | None = None

    # ------------------------------------------------------------------ what the core knows
    @property
    def recipe(self) -> Recipe:
        return self.core.recipe

    @property
    def microbatches_per_step(self) -> int:
        return self.core.microbatches_per_step

    @property
    def checkpoint_every(self) -> int:
        return self.core.checkpoint_every

    @property
    def next_step(self) -> int:
        """The first global step not yet handed out."""
        return self.core.next_step

    @property
    def stats(self) -> dict[str, Any]:
        """See :attr:`zephon_ray.stream.loader.Loader.stats`."""
        return self.core.stats

    def add_phase(self, name: str, start_step: int, weights: dict[str, float]) -> int:
        """A mixture phase decided while training, recorded in every loader state from now on: see
        :meth:`zephon_ray.stream.loader.Loader.add_phase` (in local mode, call it on every rank)."""
        return self.core.add_phase(name, start_step, weights)

    # ------------------------------------------------------------------ iteration
    def steps(self) -> Iterator[StepBatch]:
        """Whole steps, each with its RankSlice (``StepBatch``): what :meth:`__iter__` cuts into microbatches."""
        self._check_trainer_step()
        if self._ft is None and self._trainer_step_checker is None:
            _warn_unchecked_once(self.dp_rank)
        return iter(self.core) if self._ft is None else self._ft_steps()

    def register_trainer_step_check(self, owner: str) -> None:
        """``owner`` (``ZephonTrainer``, ``ZephonCheckpointManager``) will call :meth:`expect_trainer_step` after
        every checkpoint load. Without one, the first batch logs one warning that a checkpoint whose weights and loader
        state come from different steps cannot be caught on this route (docs/torchtitan.md, "Which route checks
        what")."""
        self._trainer_step_checker = str(owner)

    def expect_trainer_step(self, step: int) -> None:
        """The trainer restored its weights at ``step`` (``ZephonTrainer.load_state_dict`` calls this): before the
        first batch, a ``next_step`` other than ``step`` is one LoaderStateError naming both. Checked lazily, so it
        holds whichever of the trainer's and the loader's states DCP loads first, and when the loader's is not
        loaded at all."""
        self._trainer_step = check_int("expect_trainer_step: step", step, low=0)

    def _check_trainer_step(self) -> None:
        trainer, self._trainer_step = self._trainer_step, None
        loader = self.core.next_step
        if trainer is not None and trainer != loader:
            raise LoaderStateError(
                f"the trainer's checkpoint is at step {trainer} but the data loader's next_step is {loader}: "
                f"resuming would {'skip' if loader > trainer else 'repeat'} {abs(loader - trainer)} step(s); load the "
                "loader state saved with those weights (is 'dataloader' in checkpoint.exclude_from_loading?)"
            )

    def use_torchft(self, manager: Any, *, group_size: int) -> None:
        """Per-step elasticity under TorchTitan's torchft trainer (``torchtitan.experiments.torchft``), which builds
        the loader with a fixed ``dp_world_size = dp x group_size`` and ``dp_rank = dp x replica_id + r``: from now on
        each step is read through :class:`zephon_ray.stream.ft.FtSlices` after the quorum (the trainer's
        ``optimizers.zero_grad()`` starts it), as ``slice(step, p x dp + r, P x dp)`` of ``manager.current_step()``
        for the P live groups, cut into the trainer's fixed ``microbatches_per_step``; ``state_dict`` and
        ``load_state_dict`` are then FtSlices' (the ledger head; a healing group receives it). Service or dataset
        mode only. With ``ledger_dir``, a step enters the ledger when the trainer calls :meth:`ft_applied`:
        :class:`~zephon_ray.integrations.torchtitan.torchft.ZephonFTTrainer` does, after every optimizer step that
        torchft's ``should_commit()`` let through."""
        from zephon_ray.stream.ft import FtSlices

        size = check_int("use_torchft: group_size", group_size, low=1)
        if self.dp_world_size % size:
            raise ValueError(f"use_torchft: group_size {size} does not divide dp_world_size {self.dp_world_size}")
        dp = self.dp_world_size // size
        self._ft = FtSlices(
            self.core.config,
            manager=manager,
            dp=dp,
            dp_rank=self.dp_rank % dp,
            microbatches=self.microbatches_per_step,
            recipe=self.recipe,
        )

    def ft_applied(self) -> None:
        """Under :meth:`use_torchft`: the trainer applied the optimizer step of the rows handed out last (see
        :meth:`zephon_ray.stream.ft.FtSlices.applied`)."""
        if self._ft is None:
            raise RuntimeError("ft_applied: the loader does not read through torchft (call use_torchft first)")
        self._ft.applied()

    def _ft_steps(self) -> Iterator[StepBatch]:
        while True:  # a group that heals under torchft's async quorum still runs the step: rows it never trains on
            yield self._ft.next(placeholder=True)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.steps():
            n = len(batch.microbatches)
            self._source_ids.clear()  # a step's ids are popped within the step; older ones are stale
            for i, (inputs, labels) in enumerate(batch.microbatches):
                self._partial = 0 if i + 1 == n else i + 1
                # TorchTitan 0.3 passes every key of the dict to model.forward, whose Decoder takes only tokens,
                # positions and attention_masks: the ids wait in a queue.
                ids = inputs.pop("source_ids", None)
                if ids is not None:
                    self._source_ids.append(ids)
                yield inputs, labels

    def pop_source_ids(self) -> torch.Tensor:
        """With ``source_ids = true``: the ``[local_batch_size, seq_len]`` source ids (recipe order, aligned with the
        labels, -1 for pad tokens and padding rows) of the oldest microbatch this loader yielded that was not popped
        yet. TorchTitan's ``train_step`` takes every microbatch of a step from the loader, then runs
        ``forward_backward_step`` on them in that order: pop once per microbatch there (a trainer subclass) to pair
        each with its labels, e.g. for per-source losses with one ``scatter_add`` (docs/operations.md)."""
        if not self._source_ids:
            raise LookupError(
                "pop_source_ids: no microbatch's source ids are waiting (set source_ids = true; pop at "
                "most once per microbatch, within its step)"
            )
        return self._source_ids.popleft()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        if self._partial:
            raise LoaderStateError(
                f"checkpoint requested in the middle of step {self.core.next_step - 1}: {self._partial} of "
                f"{self.microbatches_per_step} microbatches of this rank's slice were consumed; loader state "
                "exists only at step boundaries (does the trainer's global batch equal the recipe's "
                f"{self.recipe.global_batch_rows} rows?)"
            )
        return self.core.state_dict() if self._ft is None else self._ft.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._ft is None:
            self.core.load_state_dict(state_dict)
        elif state_dict:  # TorchTitan passes {} for a component with nothing saved
            self._ft.load_state_dict(state_dict)
        self._partial = 0

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop background threads and release the service connection. Idempotent."""
        if self._ft is not None:
            self._ft.close()
        self.core.close()

    def __enter__(self) -> ZephonRayDataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_WARNED_UNCHECKED = False


def _warn_unchecked_once(dp_rank: int) -> None:
    global _WARNED_UNCHECKED
    if _WARNED_UNCHECKED or dp_rank:
        return
    _WARNED_UNCHECKED = True
    logger.warning(
        "zephon-ray: nothing on this route checks the trainer's restored step against the data loader's next_step "
        "(a checkpoint whose weights and loader state come from different steps would skip or repeat steps "
        "unseen); use the config registry (ZephonTrainer) or add "
        "zephon_ray.integrations.torchtitan.overrides.zephon_checkpoint to --override.imports"
    )
