"""Ray Train's own data API over zephon-ray global batches.

::

    from ray.train.torch import TorchTrainer
    from zephon_ray.integrations.ray_train import ZephonDataConfig, ZephonDataset

    def train_loop(config):
        shard = ray.train.get_dataset_shard("train")        # a ZephonDatasetShard
        shard.restore(ray.train.get_checkpoint())            # no-op on a fresh run
        for batch in shard.iter_steps(until=config["steps"]):
            for inputs, labels in batch.microbatches: ...    # this rank's rows of global batch `batch.step`
            ...                                              # every N steps, in every rank:
            with tempfile.TemporaryDirectory() as d:
                shard.save(d)                                # identical on every rank; store it once
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)

    TorchTrainer(train_loop, datasets={"train": ZephonDataset("recipes/elastic.toml")},
                 dataset_config=ZephonDataConfig(run_id="run7"), scaling_config=...).fit()

:class:`ZephonDataset` names where the batches come from: a recipe (``mode="local"``: every worker runs Zephon
for its own lanes and aggregates Zephon's collective checkpoint through Ray Train's own TCPStore) or a running
:class:`~zephon_ray.DataService` (``mode="service"``). :class:`ZephonDataConfig` is the ``DataConfig`` whose
:meth:`~ZephonDataConfig.configure` Ray Train runs each time it starts a worker group (first start, every elastic
resize, every restart after a failure), with that group's world size; it hands rank r of W a
:class:`ZephonDatasetShard`. Other (plain Ray Data) datasets of the same trainer are configured by Ray's own
``DataConfig`` as usual.

Each shard runs the framework-free loader core (:class:`zephon_ray.stream.loader.Loader`): this module imports
neither TorchTitan nor triton, so a plain Ray Train user installs neither.

Guarantee: rank r of any W in [1, B] yields, for every step s from its ``next_step`` on, rows ``[floor(r*B/W),
floor((r+1)*B/W))`` of global batch s (B rows), the rows ``GlobalBatchSource(recipe).batch(s)`` holds at those
positions, cut into ``local_batch_size``-row microbatches ``({"input", "positions"}, labels)`` (padded to equal shapes
with ``ZephonDataConfig(pad_slices=True)``; :mod:`zephon_ray.stream.geometry`). So an elastic run resumes at whatever
worker count the cluster has, 56 of 64 included. Scale each rank's summed token loss by ``batch.loss_scale()`` and DDP's
averaging all-reduce gives the fixed-W gradient at any W. :meth:`ZephonDatasetShard.state_dict` is the loader state (layout:
:mod:`zephon_ray.formats.loader_state`): JSON, identical on every rank, so one copy in a Ray Train checkpoint
resumes any W with the same global batches: after an elastic resize, inside one ``fit()`` or across fits, after a
worker is killed, and on a cluster that lost a node.

Limits:

* W must be at most B (service mode) or divide the recipe's lanes L (local mode: each worker runs Zephon for whole
  lanes), and ``local_batch_size`` must divide every rank's rows unless slices are padded;
  :meth:`~ZephonDataConfig.configure` refuses anything else, naming the dataset and the numbers.
* State exists only at step boundaries, and a shard's state is whatever it has yielded: take it after the step
  is trained. In local mode :meth:`~ZephonDatasetShard.state_dict` is collective (every rank calls it at the same
  step); its Zephon checkpoint is taken every ``checkpoint_every`` steps, and a resume between checkpoints replays
  the steps in between.
* Nothing here restores itself: the loop calls :meth:`~ZephonDatasetShard.restore` (or ``load_state_dict``). A
  fresh shard starts at step 0.
* Ray Train does not decide the batch contents (Ray Data's ``streaming_split`` would: its splits change with the
  worker count), so ``DataConfig.execution_options`` and locality hints do not apply to a Zephon dataset.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ray.train import DataConfig

from zephon_ray import storage
from zephon_ray.checks import MAX_STEP, check_int
from zephon_ray.recipe import Recipe
from zephon_ray.stream.geometry import StepShape, check_geometry
from zephon_ray.stream.loader import Loader, LoaderConfig, StepBatch

__all__ = ["Microbatch", "StepBatch", "ZephonDataConfig", "ZephonDataset", "ZephonDatasetShard", "STATE_FILE"]

STATE_FILE = "zephon_loader.json"
"""The loader state's file inside a Ray Train checkpoint directory (see :meth:`ZephonDatasetShard.save`)."""


class ZephonDataset:
    """The ``datasets`` value of a ``TorchTrainer`` that reads zephon-ray global batches.

    ``ZephonDataset(recipe_path)`` runs Zephon inside the workers (``mode="local"``, aggregating through Ray
    Train's TCPStore ``torch://`` unless ``aggregate_dir`` is given); ``ZephonDataset(service)`` reads from a
    running :class:`~zephon_ray.DataService` (``mode="service"``; the service's recipe file must be readable by
    the workers at the same path). The recipe is parsed and fingerprinted here, in the driver, so a bad recipe
    fails before any worker starts. Plain data: it travels to Ray Train's dataset manager by pickle.
    """

    def __init__(self, source: Any, *, aggregate_store: str | None = None, aggregate_dir: str | None = None) -> None:
        from zephon_ray.service.client import DataService

        self.service_name: str | None
        self.service_namespace: str | None
        if isinstance(source, DataService):
            if source.recipe.path is None:
                raise ValueError(
                    f"ZephonDataset: service {source.name!r} runs a recipe with no file path; the "
                    "workers' loader reads the recipe from a file"
                )
            self.mode = "service"
            self.recipe_path = _recipe_location(source.recipe.path)
            self.service_name, self.service_namespace = source.name, source.namespace
        elif isinstance(source, (str, os.PathLike)):
            self.mode = "local"
            self.recipe_path = _recipe_location(source)
            self.service_name = self.service_namespace = None
        else:
            raise TypeError(f"ZephonDataset: expected a recipe path or a DataService, got {type(source).__name__}")
        if self.mode == "service" and (aggregate_store or aggregate_dir):
            raise ValueError(
                "ZephonDataset: aggregate_store/aggregate_dir apply to a recipe (local mode); the "
                f"service {self.service_name!r} aggregates its own checkpoints"
            )
        if aggregate_store and aggregate_dir:
            raise ValueError(
                f"ZephonDataset: set at most one of aggregate_store ({aggregate_store!r}) and "
                f"aggregate_dir ({aggregate_dir!r})"
            )
        self.recipe = Recipe.from_toml(self.recipe_path)
        _ = self.recipe.fingerprint  # fail here, in the driver, on unreadable data
        if self.mode == "local" and not aggregate_dir:
            aggregate_store = aggregate_store or "torch://"
        self.aggregate_store, self.aggregate_dir = aggregate_store, aggregate_dir

    def check_world(self, world: int, local_batch_size: int, *, name: str, pad: bool = False) -> StepShape:
        """How a W-worker group cuts its steps (``local_batch_size`` 0: one microbatch per step); raises
        ValueError naming the dataset and the numbers."""
        B, L = self.recipe.global_batch_rows, self.recipe.lanes
        where = f"dataset {name!r} ({self.recipe.describe()}, {self.mode} mode)"
        if self.mode == "local" and world >= 1 and L % world:
            raise ValueError(
                f"{where}: local mode needs the worker count to divide the recipe's {L} lanes, got "
                f"{world} workers (each runs Zephon for whole lanes); read from a DataService (any W up "
                f"to B={B}) or use a W dividing {L}"
            )
        try:
            return check_geometry(
                self.recipe,
                global_batch_size=None,
                local_batch_size=local_batch_size,
                dp_world_size=world,
                seq_len=None,
                pad=pad,
            )
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def __repr__(self) -> str:
        where = f"service {self.service_name!r}" if self.mode == "service" else self.recipe_path
        return f"ZephonDataset({where}, mode={self.mode!r})"


class ZephonDataConfig(DataConfig):
    """A Ray Train ``DataConfig`` handing each worker its :class:`ZephonDatasetShard` of a :class:`ZephonDataset`.

    ``run_id`` names the run: it is checked on resume and is the service consumer (one cursor for the whole job).
    ``local_batch_size`` is rows per microbatch (0: one microbatch per step, the rank's rows); ``pad_slices`` pads
    every rank's rows to the same count (rows whose labels are all ignored) when W does not divide B; ``prefetch``
    steps are read ahead in a background thread; ``checkpoint_every`` (local mode) is how often Zephon checkpoints
    are taken: align it with the loop's checkpoint interval. ``ledger_dir`` (a path or URI every worker reaches, one
    per run) receives every rank's ledger segment at each save (``zephon-ray audit``,
    :mod:`zephon_ray.formats.ledger`). Remaining keyword arguments go to Ray's ``DataConfig`` and apply to plain Ray
    Data datasets of the same trainer. Validated here, when built.
    """

    def __init__(
        self,
        *,
        run_id: str = "ray-train",
        local_batch_size: int = 0,
        prefetch: int = 2,
        checkpoint_every: int = 0,
        pad_slices: bool = False,
        ledger_dir: str | None = None,
        **data_config: Any,
    ) -> None:
        super().__init__(**data_config)
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"ZephonDataConfig: 'run_id' must be a non-empty string, got {run_id!r}")
        if not isinstance(pad_slices, bool):
            raise ValueError(f"ZephonDataConfig: 'pad_slices' must be True or False, got {pad_slices!r}")
        if ledger_dir is not None and (not isinstance(ledger_dir, str) or not ledger_dir):
            raise ValueError(f"ZephonDataConfig: 'ledger_dir' must be a non-empty path or URI, got {ledger_dir!r}")
        self.pad_slices, self.ledger_dir = pad_slices, ledger_dir
        for key, value, low in (
            ("local_batch_size", local_batch_size, 0),
            ("prefetch", prefetch, 1),
            ("checkpoint_every", checkpoint_every, 0),
        ):
            check_int(f"ZephonDataConfig: '{key}'", value, low=low, high=1_000_000)
        self.run_id, self.local_batch_size = run_id, local_batch_size
        self.prefetch, self.checkpoint_every = prefetch, checkpoint_every

    def configure(
        self,
        datasets: dict[str, Any],
        world_size: int,
        worker_handles: Any = None,
        worker_node_ids: Any = None,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        """Ray Train calls this at every worker-group start, with the new group's ``world_size``."""
        zephon = {k: v for k, v in datasets.items() if isinstance(v, ZephonDataset)}
        others = {k: v for k, v in datasets.items() if k not in zephon}
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        if others:
            output = super().configure(others, world_size, worker_handles, worker_node_ids, **kwargs)
        for name, dataset in zephon.items():
            dataset.check_world(world_size, self.local_batch_size, name=name, pad=self.pad_slices)
            for rank in range(world_size):
                output[rank][name] = self.shard(dataset, rank=rank, world=world_size, name=name)
        return output

    def shard(
        self, dataset: ZephonDataset, *, rank: int = 0, world: int = 1, name: str = "train"
    ) -> ZephonDatasetShard:
        """The shard :meth:`configure` hands rank ``rank`` of ``world``, built directly. For a loop that cannot use
        ``ray.train.get_dataset_shard``: under Ray Train's torchft mode (Ray 2.60's ``TorchftConfig``) a replaced
        replica group's worker gets a new dataset manager sized to its group, and its ``get_dataset_shard`` waits
        forever for that manager's rank 0, which does not exist there; pass the dataset in ``train_loop_config`` and
        read through :meth:`ZephonDatasetShard.ft` instead (``examples/ray_train_torchft.py``)."""
        if not isinstance(dataset, ZephonDataset):
            raise TypeError(f"ZephonDataConfig.shard: expected a ZephonDataset, got {type(dataset).__name__}")
        return ZephonDatasetShard(
            dataset,
            _ShardSettings(
                run_id=self.run_id,
                local_batch_size=self.local_batch_size,
                prefetch=self.prefetch,
                checkpoint_every=self.checkpoint_every,
                pad_slices=self.pad_slices,
                ledger_dir=self.ledger_dir,
            ),
            rank=rank,
            world=world,
            name=name,
        )


@dataclass(frozen=True)
class _ShardSettings:
    run_id: str
    local_batch_size: int
    prefetch: int
    checkpoint_every: int
    pad_slices: bool = False
    ledger_dir: str | None = None


class Microbatch(NamedTuple):
    """One microbatch of ``iter_torch_batches``; ``last`` marks the step's final one (time for the optimizer)."""

    inputs: dict[str, Any]
    labels: Any
    step: int
    last: bool


class ZephonDatasetShard:
    """Rank ``rank`` of ``world``'s view of a :class:`ZephonDataset`: what ``ray.train.get_dataset_shard``
    returns. Built by :class:`ZephonDataConfig` in Ray Train's dataset manager and shipped to the worker; the
    loader (the core :class:`~zephon_ray.stream.loader.Loader`) is created in the worker at first use."""

    def __init__(self, dataset: ZephonDataset, settings: _ShardSettings, *, rank: int, world: int, name: str) -> None:
        self.dataset, self.settings = dataset, settings
        self.rank, self.world, self.name = rank, world, name
        self._loader: Loader | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loader": None}  # a loader (threads, connections) never travels

    # ------------------------------------------------------------------ the loader
    @property
    def loader(self) -> Loader:
        """The loader core of this rank (created at first use, in the worker)."""
        if self._loader is None:
            self._loader = Loader(
                self._config(),
                rank=self.rank,
                world=self.world,
                local_batch_size=self.settings.local_batch_size,
                recipe=self.dataset.recipe,
            )
        return self._loader

    def _config(self) -> LoaderConfig:
        d, s = self.dataset, self.settings
        extra: dict[str, Any] = (
            {"service_name": d.service_name, "service_namespace": d.service_namespace} if d.mode == "service" else {}
        )
        return LoaderConfig(
            recipe=d.recipe_path,
            mode=d.mode,
            run_id=s.run_id,
            aggregate_store=d.aggregate_store,
            aggregate_dir=d.aggregate_dir,
            prefetch=s.prefetch,
            checkpoint_every=s.checkpoint_every,
            pad_slices=s.pad_slices,
            ledger_dir=s.ledger_dir,
            **extra,
        )

    def ft(self, manager: Any, *, dp: int = 1, dp_rank: int = 0) -> Any:
        """Ray Train's torchft mode (``ray.train.v2.torch.torchft_config.TorchftConfig``, Ray 2.60): this worker's
        :class:`~zephon_ray.stream.ft.FtSlices` on the torchft ``manager`` its loop built, reading every step after the
        quorum as ``slice(s, p·dp + dp_rank, P·dp)`` of ``s = manager.current_step()`` for the P live replica groups,
        so a committed step trains the fixed global batch whatever P is, and a replaced group's worker needs no data
        checkpoint. ``dp``/``dp_rank``: workers per replica group and this worker's rank in it (Ray's example: each
        worker its own group, 1 and 0). Service mode only (FtSlices' modes; local mode's lanes cannot follow a
        quorum). The ledger is the shard's ``ledger_dir``: call ``commit(step)`` after the optimizer step that
        ``should_commit()`` allowed and carry ``state_dict()`` in the Manager's state (``examples/ray_train_torchft.py``). The shard's own fixed-W iteration is not used on this route."""
        from zephon_ray.stream.ft import FtSlices

        if self.dataset.mode != "service":
            raise ValueError(
                f"{self._where()}: torchft needs a DataService (service mode); a recipe runs Zephon in "
                "the workers, whose lanes cannot follow a quorum (zephon_ray.stream.ft)"
            )
        return FtSlices(
            self._config(),
            manager=manager,
            dp=dp,
            dp_rank=dp_rank,
            local_batch_size=self.settings.local_batch_size,
            recipe=self.dataset.recipe,
        )

    @property
    def recipe(self) -> Recipe:
        return self.dataset.recipe

    @property
    def next_step(self) -> int:
        """The first global step this shard has not yielded yet."""
        return self.loader.next_step

    @property
    def microbatches_per_step(self) -> int:
        """This rank's microbatches per step (ranks of a W that does not divide B differ unless padded)."""
        s = self.settings
        return self.dataset.check_world(self.world, s.local_batch_size, name=self.name, pad=s.pad_slices).microbatches(
            self.rank
        )

    # ------------------------------------------------------------------ iteration
    def iter_steps(self, until: int | None = None, *, device: Any = None) -> Iterator[StepBatch]:
        """Yield this rank's :class:`StepBatch` of every step from ``next_step`` up to ``until`` (exclusive; None:
        while the recipe has data). Tensors move to ``device`` when given."""
        until = self._check_until(until)
        loader = self.loader
        if until is not None and loader.next_step >= until:
            return
        for batch in loader:
            yield (
                batch
                if device is None
                else StepBatch(batch.step, batch.slice, [_to(mb, device) for mb in batch.microbatches])
            )
            if until is not None and loader.next_step >= until:
                return

    def iter_torch_batches(self, until: int | None = None, *, device: Any = None) -> Iterator[Microbatch]:
        """Like ``ray.data.DataIterator.iter_torch_batches``: one :class:`Microbatch` at a time, with its step."""
        for batch in self.iter_steps(until, device=device):
            n = len(batch.microbatches)
            for i, (inputs, labels) in enumerate(batch.microbatches):
                yield Microbatch(inputs, labels, batch.step, i + 1 == n)

    def _check_until(self, until: int | None) -> int | None:
        if until is None:
            return None
        return check_int(f"{self._where()}: 'until'", until, low=0, high=MAX_STEP)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The loader state at ``next_step`` (local mode: collective, every rank calls it at the same step)."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, trainer_step: int | None = None) -> None:
        """Resume at the state's ``next_step`` (``trainer_step``: see :meth:`Loader.load_state_dict`)."""
        self.loader.load_state_dict(state, trainer_step=trainer_step)

    def commit(self, step: int) -> None:
        """Confirm that ``step`` was trained, after the optimizer step (see :meth:`Loader.commit`: the ledger then
        records a step handed out but not confirmed as skipped)."""
        self.loader.commit(step)

    def save(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Write :meth:`state_dict` to ``<directory>/zephon_loader.json`` (JSON); returns the state."""
        state = self.state_dict()
        storage.write_json(storage.location(directory).join(STATE_FILE), state)  # atomic; a path or a URI
        return state

    def restore(self, checkpoint: Any, *, trainer_step: int | None = None) -> int:
        """Load the state a :meth:`save` left in a ``ray.train.Checkpoint`` (None: start at step 0); returns
        ``next_step``. A checkpoint without ``zephon_loader.json``, or of another recipe or run, is refused, and so is
        one whose ``next_step`` is not ``trainer_step`` (the step of the weights restored from it), naming both."""
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                path = Path(d, STATE_FILE)
                if not path.is_file():
                    raise FileNotFoundError(
                        f"{self._where()}: checkpoint {checkpoint.path} holds no {STATE_FILE} "
                        "(was it written with ZephonDatasetShard.save?)"
                    )
                self.load_state_dict(storage.read_json(path, what="loader state"), trainer_step=trainer_step)
        return self.next_step

    def close(self) -> None:
        """Stop the loader's background threads; the shard can be iterated again afterwards."""
        if self._loader is not None:
            self._loader.close()

    def _where(self) -> str:
        return f"dataset {self.name!r} shard (rank {self.rank} of {self.world})"

    def __repr__(self) -> str:
        return f"ZephonDatasetShard({self.dataset!r}, rank={self.rank}, world={self.world})"


def _recipe_location(path: Any) -> str:
    """An object-store URI as it is (the workers read it from the bucket), a local path made absolute."""
    return storage.location(path).uri if storage.is_uri(path) else str(Path(path).resolve())


def _to(microbatch: tuple[dict[str, Any], Any], device: Any) -> tuple[dict[str, Any], Any]:
    if device is None:
        return microbatch
    inputs, labels = microbatch
    return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}, labels.to(device, non_blocking=True)
