"""``ZephonRayDataLoader``: a TorchTitan 0.3.0 data loader whose global batch s is a pure function of (recipe, s).

Guarantee: for a recipe with B rows per global batch, rank r of W (W dividing B) yields, for every step s, the
rows ``[r*B/W, (r+1)*B/W)`` of global batch s, cut into ``({"input", "positions"}, labels)`` microbatches of
``local_batch_size`` rows. The rows are the same whether they come from the data service (``mode="service"``) or
from an in-process Zephon rank (``mode="local"``), and whatever W was before a resume: concatenating every rank's
slice in rank order gives the batch that ``zephon-ray digest`` describes (tests: ``test_torchtitan_loader.py``,
``test_torchtitan_train.py`` with the real Trainer, ``test_ray_train_elastic.py`` through the service).

State (see :mod:`zephon_ray.formats.loader_state`) is ``{version, run_id, fingerprint, next_step, zephon,
replayed_steps}``, JSON-safe and identical on every rank, so DCP stores it once and it loads at any W
(``test_dcp_save_and_load_at_another_world``). ``state_dict()`` works before iteration.

``dp_world_size`` and ``dp_rank`` are what TorchTitan's Trainer passes (its "batch" mesh): W is the data-parallel
degree, never ``WORLD_SIZE``. TP/PP/CP ranks that share a dp_rank get the same slice: in local mode only the lowest
of them runs Zephon and broadcasts each slice (and the state) to the others (:mod:`zephon_ray.stream.mesh`,
``test_torchtitan_mesh.py``). In service mode every rank reads its dp slice from the service, which serves the
same rows to every reader. All sources implement :class:`~zephon_ray.stream.prefetch.SliceSource`.

Limits, each rejected with a clear error rather than worked around:

* the trainer's global batch must be the recipe's B (one optimizer step = one global batch), its seq_len the
  recipe's, ``local_batch_size * W`` must divide B, and its tokenizer must agree with the recipe's
  (:mod:`zephon_ray.integrations.torchtitan.trainer_checks`, checked on every route: ``test_torchtitan_overrides.py``); an
  unknown build keyword (a renamed TorchTitan argument) is a TypeError naming it;
* a checkpoint may only be taken at a step boundary (not after some of a step's microbatches were consumed);
* local mode needs W dividing L, and a distributed local-mode run needs a ``run_id`` and exactly one of
  ``aggregate_store`` and ``aggregate_dir``. Its state carries the newest Zephon checkpoint at or before
  ``next_step`` (taken every ``checkpoint_every`` steps; TorchTitan's checkpoint interval is picked up
  automatically); a resume between checkpoints, or from a state without one, replays the steps in between: it logs
  a warning with the count, and ``stats`` / the state's ``replayed_steps`` report it
  (``test_resume_without_a_zephon_checkpoint_warns_and_reports_the_replay``).

TorchTitan never closes its data loader: the background threads are daemons, and :meth:`close` (also run at
interpreter exit) stops them and releases the service connection.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchtitan.components.dataloader import BaseDataLoader

from zephon_ray.batch import RankSlice
from zephon_ray.pipeline import LaneGroup
from zephon_ray.recipe import Recipe
from zephon_ray.stream import aggregate
from zephon_ray.stream.mesh import DpPeers, dp_peers
from zephon_ray.stream.prefetch import (
    STAT_MODE,
    STAT_NEXT_STEP,
    STAT_REPLAYED_STEPS,
    STAT_RESUME_REPLAY,
    STAT_RESUMED_FROM,
    SliceSource,
)
from zephon_ray.formats.loader_state import (
    LoaderStateError,
    check_state,
    make_state,
    replayed_steps,
    zephon_state,
)
from zephon_ray.integrations.torchtitan.trainer_checks import check_geometry, check_tokenizer

logger = logging.getLogger(__name__)

MODES = ("service", "local", "dataset")
ENV_RECORD_DIR = "ZEPHON_RAY_RECORD_DIR"
"""Debug aid: when set, every rank writes each step's slice rows to ``<dir>/step-<s>-rank-<r>-of-<W>.npz``."""

_GET_TIMEOUT_S = 600.0


class ZephonRayDataLoader(BaseDataLoader):
    """TorchTitan data loader over zephon-ray global batches. See the module docstring for the guarantee."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        recipe: str = ""
        """Path to the recipe TOML."""

        mode: str = "service"
        """``"service"``: read slices from a running DataService; ``"local"``: run Zephon in this process;
        ``"dataset"``: read a directory written by ``zephon-ray materialize`` (``dataset_dir``)."""

        dataset_dir: str | None = None
        """Dataset mode: the materialised directory (local or shared storage), from the same recipe."""

        service_name: str = "zephon-ray"
        service_namespace: str = "zephon-ray"

        run_id: str | None = None
        """Names the run; checked on resume. Required for a distributed local-mode run."""

        aggregate_store: str | None = None
        """Local mode: ``"torch://"`` (MASTER_ADDR:MASTER_PORT) or ``"torch://host:port"``."""

        aggregate_dir: str | None = None
        """Local mode: a directory every rank can reach. ``$ZEPHON_RAY_AGGREGATE_DIR`` overrides both."""

        prefetch: int = 2
        """Steps fetched (service) or produced (local) ahead of the trainer, in a background thread."""

        checkpoint_every: int = 0
        """Local mode: take a Zephon checkpoint every N steps (align it with the trainer's checkpoint interval).
        0: TorchTitan's checkpoint interval when checkpointing is on, else none (a resume then replays from the
        start, or from the checkpoint it was resumed from)."""

        global_batch_size: int | None = None
        """The trainer's ``training.global_batch_size`` (-1: TorchTitan's default, local_batch_size x dp), copied
        in by the config registry and the ``--override.imports`` hook and checked against the recipe's B when the
        loader is built. None: no trainer (standalone use); a step is then B rows by definition."""

        record_dir: str | None = None
        """Debug: write every consumed slice here (also ``$ZEPHON_RAY_RECORD_DIR``)."""

        infinite: bool = True
        """Kept for TorchTitan's validator contract; a recipe with ``repeat = true`` never runs out."""

        def __post_init__(self) -> None:
            if not self.recipe:
                raise ValueError("ZephonRayDataLoader.Config: 'recipe' (path to a recipe TOML) is required")
            if self.mode not in MODES:
                raise ValueError(f"ZephonRayDataLoader.Config: 'mode' must be one of {MODES}, got {self.mode!r}")
            if self.prefetch < 1:
                raise ValueError(f"ZephonRayDataLoader.Config: 'prefetch' must be >= 1, got {self.prefetch}")
            if (self.mode == "dataset") != bool(self.dataset_dir):
                raise ValueError("ZephonRayDataLoader.Config: 'dataset_dir' is required with mode='dataset' and "
                                 f"only used by it (mode {self.mode!r}, dataset_dir {self.dataset_dir!r})")
            if self.checkpoint_every < 0:
                raise ValueError(
                    f"ZephonRayDataLoader.Config: 'checkpoint_every' must be >= 0, got {self.checkpoint_every}")
            store, agg_dir, origin = self.resolved_aggregation()
            if store is not None and agg_dir is not None:
                raise ValueError(
                    f"ZephonRayDataLoader.Config: set exactly one of 'aggregate_store' and 'aggregate_dir', got "
                    f"both ({store!r} and {agg_dir!r}, from {origin})"
                )
            # The dp degree is only known when TorchTitan builds the loader: the checks that depend on it (run_id
            # and an aggregation point for a distributed local-mode run) are in check_distributed_local().

        def check_distributed_local(self, dp_world_size: int) -> None:
            """A local-mode run with dp_world_size > 1 takes collective Zephon checkpoints: it needs a run_id and
            exactly one reachable aggregation point."""
            if self.mode != "local" or dp_world_size <= 1:
                return
            store, agg_dir, _ = self.resolved_aggregation()
            if not self.run_id:
                raise ValueError(
                    f"ZephonRayDataLoader.Config: a distributed local-mode run (data-parallel degree "
                    f"{dp_world_size}) needs 'run_id': it names the collective Zephon checkpoint")
            if store is None and agg_dir is None:
                raise ValueError(
                    f"ZephonRayDataLoader.Config: a distributed local-mode run (data-parallel degree "
                    f"{dp_world_size}) needs exactly one of 'aggregate_store' (e.g. 'torch://') and 'aggregate_dir' "
                    f"(or ${aggregate.ENV_AGGREGATE_DIR}, or the recipe's [aggregate] table); neither is set")
            if store is not None:
                aggregate.check_store_reachable(store)

        def resolved_aggregation(self) -> tuple[str | None, str | None, str]:
            return aggregate.resolve(self.aggregate_store, self.aggregate_dir, self.recipe)

    # ------------------------------------------------------------------ construction
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
        self.config = config
        self.recipe = recipe = Recipe.from_toml(config.recipe)
        self.dp_world_size = world = int(dp_world_size)
        self.dp_rank = rank = int(dp_rank)
        self.local_batch_size = lbs = int(local_batch_size)
        B = recipe.global_batch_rows
        where = f"ZephonRayDataLoader (recipe {recipe.describe()})"
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"{where}: dp_rank {rank} is not in a data-parallel world of {world}")
        self.microbatches_per_step = check_geometry(recipe, global_batch_size=config.global_batch_size,
                                                    local_batch_size=lbs, dp_world_size=world, seq_len=seq_len)
        check_tokenizer(recipe, tokenizer)
        if config.mode == "local" and recipe.lanes % world:
            raise ValueError(
                f"{where}: local mode needs the data-parallel degree to divide the recipe's {recipe.lanes} lanes, "
                f"got {world}; use mode='service' (any W dividing B={B}) or a W dividing {recipe.lanes}"
            )
        config.check_distributed_local(world)
        every = config.checkpoint_every
        if not every and snapshot_every_n_steps:
            # TorchTitan counts its checkpoint interval in microbatches of this rank.
            every = max(1, snapshot_every_n_steps // self.microbatches_per_step)
        self.checkpoint_every = every
        record = config.record_dir or os.environ.get(ENV_RECORD_DIR)
        self._record_dir = Path(record) if record else None
        # TP/PP/CP peers sharing this dp_rank (collective when the job has more ranks than the dp degree).
        self._peers: DpPeers | None = dp_peers(dp_rank=rank, dp_world_size=world) if config.mode == "local" else None

        self._next_step = 0
        self._partial = 0
        self._loaded_zephon: dict[str, Any] | None = None
        self._source: SliceSource | None = None
        self._source_step: int | None = None
        self.last_slice: RankSlice | None = None
        """The slice the most recent microbatch came from (for digests and debugging)."""
        self._loaded_at = 0
        self._replayed_before = 0  # replayed steps carried by the loaded state (earlier resumes)
        self._replaying = 0  # steps the current resume replays
        self._replay_started = False  # counted in replayed_steps once the source started (and so replays)
        # Runs at garbage collection and at interpreter exit: TorchTitan never calls close().
        self._finalizer = weakref.finalize(self, _close_source, self.__dict__)
        if config.mode == "dataset":
            self._source = self._make_source()  # a missing or mismatched directory fails when the loader is built

    # ------------------------------------------------------------------ iteration
    @property
    def next_step(self) -> int:
        """The first global step not yet fully consumed."""
        return self._next_step

    @property
    def stats(self) -> dict[str, Any]:
        """What this loader did: ``mode``, ``next_step``, ``replayed_steps`` (steps re-produced to resume without an
        exact Zephon checkpoint, summed over this run's resumes, counting the last resume's once iteration started;
        always 0 in service mode, whose service replays on its own), ``resume_replay`` (the steps the last resume
        replays) and ``resumed_from_checkpoint`` (the step of the Zephon checkpoint it started from; None: none)."""
        resumed = None
        if self._loaded_zephon is not None:
            resumed = int(self._loaded_zephon["next_step"])
        return {STAT_MODE: self.config.mode, STAT_NEXT_STEP: self._next_step,
                STAT_REPLAYED_STEPS: self._replayed_steps(), STAT_RESUME_REPLAY: self._replaying,
                STAT_RESUMED_FROM: resumed}

    def _replayed_steps(self) -> int:
        return self._replayed_before + (self._replaying if self._replay_started else 0)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            step = self._next_step
            piece = self._take(step)
            self.last_slice = piece
            if self._record_dir is not None:
                self._record(piece)
            n = self.microbatches_per_step
            for i, microbatch in enumerate(piece.microbatches(self.local_batch_size)):
                if i + 1 == n:
                    self._next_step, self._partial = step + 1, 0
                    if self._source is not None:
                        self._source.advance(step + 1)
                else:
                    self._partial = i + 1
                yield microbatch

    @property
    def _produces(self) -> bool:
        """Whether this rank runs a source (False for a TP/PP/CP peer, which receives its leader's slices)."""
        return self._peers is None or self._peers.is_leader

    def _ensure_source(self, step: int) -> SliceSource:
        if self._source is not None and self._source_step == step:
            return self._source
        if self._source is None:
            self._source = self._make_source()
        self._source.start(step, self._loaded_zephon if step == self._loaded_at else None)
        self._source_step = step
        self._replay_started = True
        return self._source

    def _take(self, step: int) -> RankSlice:
        peers = self._peers
        if peers is None:
            piece = self._ensure_source(step).get(step, timeout=_GET_TIMEOUT_S)
            self._source_step = step + 1
            return piece
        rows = self.recipe.global_batch_rows // self.dp_world_size
        shape = (rows, self.recipe.seq_len + 1)
        if not peers.is_leader:
            self._replay_started = True  # the leader's source started: keep the states identical
            tokens, positions = peers.share_slice(step, None, None, shape)
            return RankSlice(step, self.dp_rank, self.dp_world_size, tokens, positions, self._pad_token_id())
        try:
            piece = self._ensure_source(step).get(step, timeout=_GET_TIMEOUT_S)
        except BaseException as exc:
            peers.share_slice(step, None, None, shape, error=exc)  # tell the peers, then raise here
            raise
        self._source_step = step + 1
        peers.share_slice(step, piece.tokens, piece.positions, shape)
        return piece

    def _pad_token_id(self) -> int | None:
        from zephon_ray.source import pad_token_id

        return pad_token_id(self.recipe)

    def _make_source(self) -> SliceSource:
        """The slice source of ``config.mode``; a new mode adds one branch here and one SliceSource class."""
        cfg, recipe = self.config, self.recipe
        if cfg.mode == "local":
            from zephon_ray.stream.local import LocalSlices

            store, agg_dir, _ = cfg.resolved_aggregation()
            if self.dp_world_size > 1:
                lane_group = LaneGroup(count=self.dp_world_size, index=self.dp_rank, run_id=cfg.run_id,
                                   aggregate_store=store, aggregate_dir=agg_dir)
            else:
                lane_group = LaneGroup()
            return LocalSlices(recipe, rank=self.dp_rank, world=self.dp_world_size, lane_group=lane_group,
                               depth=cfg.prefetch, checkpoint_every=self.checkpoint_every)
        if cfg.mode == "dataset":
            from zephon_ray.stream.dataset import DatasetSlices

            return DatasetSlices(recipe, cfg.dataset_dir, rank=self.dp_rank, world=self.dp_world_size,
                                 depth=cfg.prefetch)
        from zephon_ray.stream.service import ServiceSlices

        return ServiceSlices(recipe, rank=self.dp_rank, world=self.dp_world_size, name=cfg.service_name,
                             namespace=cfg.service_namespace, run_id=cfg.run_id, depth=cfg.prefetch)

    def _record(self, piece: RankSlice) -> None:
        self._record_dir.mkdir(parents=True, exist_ok=True)
        path = self._record_dir / f"step-{piece.step:06d}-rank-{piece.rank:03d}-of-{piece.world:03d}.npz"
        if self._peers is not None and not self._peers.is_leader:
            return  # the peers' rows are the leader's (broadcast), recorded once per dp rank
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=piece.tokens, positions=piece.positions)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        if self._partial:
            raise LoaderStateError(
                f"checkpoint requested in the middle of step {self._next_step}: {self._partial} of "
                f"{self.microbatches_per_step} microbatches of this rank's slice were consumed; loader state "
                "exists only at step boundaries (does the trainer's global batch equal the recipe's "
                f"{self.recipe.global_batch_rows} rows?)"
            )
        if not self._produces:
            return self._peers.share_object(None)  # the leader's state, bit for bit
        step = self._next_step
        zephon: dict[str, Any] | None = None
        if step > 0 and self._source is not None and self._source.running:
            zephon = self._source.state(step, timeout=_GET_TIMEOUT_S)
        elif self.config.mode == "local" and step > 0 and step == self._loaded_at:
            zephon = self._loaded_zephon
        state = make_state(run_id=self.config.run_id, fingerprint=self.recipe.fingerprint, next_step=step,
                           zephon=zephon, replayed_steps=self._replayed_steps())
        if self._peers is not None:
            self._peers.share_object(state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # TorchTitan passes an empty state for a component with nothing saved
        step = check_state(state_dict, run_id=self.config.run_id, fingerprint=self.recipe.fingerprint,
                           recipe_name=str(self.recipe.path or "<recipe>"))
        self._loaded_zephon = zephon_state(state_dict) if self.config.mode == "local" else None
        if self._loaded_zephon is not None:
            from zephon_ray.lanes import check_step_state

            try:
                check_step_state(self._loaded_zephon, self.recipe)
            except ValueError as exc:
                raise LoaderStateError(f"loader state key 'zephon': {exc}") from None
            if int(self._loaded_zephon["next_step"]) > step:
                raise LoaderStateError(f"loader state: the Zephon checkpoint is at step "
                                       f"{self._loaded_zephon['next_step']}, after next_step {step}")
        self._replayed_before = replayed_steps(state_dict)
        self._replaying = 0
        self._replay_started = False
        if self.config.mode == "local" and step > 0:
            start = 0 if self._loaded_zephon is None else int(self._loaded_zephon["next_step"])
            self._replaying = step - start  # the same on every rank: the state is
        if self._replaying and self._produces:
            if self._loaded_zephon is None:
                logger.warning("zephon-ray loader (dp rank %d of %d): the loaded state at step %d has no Zephon "
                               "checkpoint (checkpointing was off, or the state came from service mode); replaying "
                               "%d steps from step 0 to resume", self.dp_rank, self.dp_world_size, step, step)
            elif self._replaying:
                logger.warning("zephon-ray loader (dp rank %d of %d): resuming at step %d from the Zephon checkpoint "
                               "of step %d; replaying %d steps", self.dp_rank, self.dp_world_size, step,
                               step - self._replaying, self._replaying)
        self._loaded_at = step
        self._next_step, self._partial = step, 0
        if self._source is not None:
            self._source.close()
            self._source = None
        self._source_step = None

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop background threads and release the service connection. Idempotent."""
        _close_source(self.__dict__)

    def __enter__(self) -> "ZephonRayDataLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_source(attrs: dict[str, Any]) -> None:
    source = attrs.get("_source")
    attrs["_source"] = None
    attrs["_source_step"] = None
    if source is not None:
        try:
            source.close()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            logger.debug("closing the zephon-ray source failed", exc_info=True)
