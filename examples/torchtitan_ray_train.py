"""Run TorchTitan's real ``Trainer`` on zephon-ray batches under Ray Train's ``TorchTrainer``, elastically.

Ray Train v2 restarts the whole worker group from the latest registered checkpoint on every resize and after
every worker failure; the steps after that checkpoint are replayed. Because global batch s is a pure function of
(recipe, s), the replayed and resumed steps see exactly the rows they would have seen at any other W.

:func:`torchtitan_train_loop` builds TorchTitan's ``Trainer`` in Python from a config-registry function; its data
loader is :class:`~zephon_ray.torchtitan.ZephonRayDataLoader` (TorchTitan builds and checkpoints it itself, so
this loop does not use ``ray.train.get_dataset_shard``: for a plain torch loop see :mod:`zephon_ray.ray_train`).
TorchTitan writes its DCP checkpoints into a shared folder; each save is also reported to Ray Train.

Inside a worker, Ray Train has already initialised the gloo process group and set MASTER_ADDR/MASTER_PORT to a
TCPStore hosted by rank 0 (a new port after every restart), which is what ``aggregate_store="torch://"`` uses.

Per-step records (step, W, global digest, loss) are appended by rank 0 to ``log_path`` (JSON lines), replayed
steps included; :func:`read_log` reads them. The global digest is computed from every rank's slice (taken from the
loader's ``steps()``, the core's whole steps), gathered over gloo in rank order (:func:`examples.bigram.global_digest`).
Shown by tests/test_ray_train_torchtitan.py (slow; 2 -> 1 workers) and
``examples/elastic_resume.py --trainer torchtitan`` (4 -> 2 -> 3).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LOADER_STATE_FILE = "loader.json"
TORCHTITAN_STEP_FILE = "torchtitan.json"


@dataclass(kw_only=True)
class _LoaderSource:
    """Where a run's loader reads from."""

    recipe: str
    run_id: str
    mode: str = "service"
    service_name: str = "zephon-ray"
    service_namespace: str = "zephon-ray"
    aggregate_store: str | None = None
    aggregate_dir: str | None = None
    checkpoint_every: int = 2

    def loader_config(self, **extra: Any) -> Any:
        from zephon_ray.integrations.torchtitan.loader import ZephonRayDataLoader

        return ZephonRayDataLoader.Config(
            recipe=self.recipe,
            mode=self.mode,
            service_name=self.service_name,
            service_namespace=self.service_namespace,
            run_id=self.run_id,
            aggregate_store=self.aggregate_store,
            aggregate_dir=self.aggregate_dir,
            checkpoint_every=self.checkpoint_every,
            **extra,
        )

    def to_config(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class TitanRun(_LoaderSource):
    """What one ``fit()`` of :func:`torchtitan_train_loop` does."""

    dump_folder: str
    """Shared by every fit of the run: TorchTitan's DCP checkpoints live in ``<dump_folder>/checkpoint``."""
    log_path: str
    config: str = "examples.torchtitan_cpu:zephon_llama3_debugmodel_cpu"
    """``module:function`` returning a ``Trainer.Config`` (a config-registry function)."""
    steps: int = 4
    """This fit trains until this many global steps are done in total (a resumed fit continues from its checkpoint)
    and saves a checkpoint there."""
    total_steps: int | None = None
    """The whole run's length: TorchTitan's ``training.steps``, which its LR schedule spans. Set it when a run is
    split over several fits (each stopping at its own ``steps``), so that every fit follows the same schedule; None:
    ``steps`` (then a later fit with more steps changes the schedule of the steps it resumes)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.checkpoint_every < 1:
            raise ValueError(
                f"TitanRun: 'steps' ({self.steps}) and 'checkpoint_every' ({self.checkpoint_every}) must be >= 1"
            )
        if self.total_steps is not None and self.total_steps < self.steps:
            raise ValueError(f"TitanRun: 'total_steps' {self.total_steps} is less than 'steps' {self.steps}")


def torchtitan_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` running TorchTitan's real ``Trainer`` on zephon-ray batches.

    TorchTitan saves DCP checkpoints (model, optimizer, schedulers, train state and the loader state, stored once)
    under the shared ``dump_folder`` every ``checkpoint_every`` steps; after each save the loader state and the
    TorchTitan step are also reported to Ray Train. A new worker group (any W) resumes from the step named by
    ``ray.train.get_checkpoint()``. Rank 0 appends ``{step, world, digest, loss}`` to ``log_path`` per step.
    """
    import importlib

    import ray.train

    from examples.bigram import global_digest
    from zephon_ray.recipe import Recipe

    run = TitanRun(**config)
    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    os.environ.setdefault("LOCAL_RANK", str(ctx.get_local_rank()))
    module, _, fn = run.config.partition(":")
    trainer_config = getattr(importlib.import_module(module), fn)()
    # The run's recipe fixes the batch geometry, whatever recipe the registry function defaulted to.
    recipe = Recipe.from_toml(run.recipe)
    B = recipe.global_batch_rows
    # At a W that does not divide B the loader pads every rank to ceil(B/W) rows whose padding labels are ignored;
    # the trainer's batch counts them (one microbatch of ceil(B/W) rows per rank).
    rows = -(-B // world)
    trainer_config.training.global_batch_size = rows * world
    trainer_config.training.local_batch_size = rows
    trainer_config.training.seq_len = recipe.seq_len
    trainer_config.dataloader = run.loader_config(global_batch_size=rows * world)
    trainer_config.training.steps = run.total_steps or run.steps
    trainer_config.dump_folder = run.dump_folder
    trainer_config.checkpoint.enable = True
    trainer_config.checkpoint.interval = run.checkpoint_every
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = json.loads((Path(d) / TORCHTITAN_STEP_FILE).read_text())
            trainer_config.checkpoint.load_step = int(saved["step"])

    trainer = trainer_config.build()
    loader = trainer.dataloader
    save, log = trainer.checkpointer.save, trainer.metrics_processor.log
    steps, taken = loader.steps, {}

    def recorded_steps():  # the loader's whole steps, each with its RankSlice: keep the latest for log_step
        for batch in steps():
            taken["slice"] = batch.slice
            yield batch

    def log_step(step, global_avg_loss, *args, **kwargs):
        digest = global_digest(taken["slice"])
        if rank == 0:
            with open(run.log_path, "a") as fh:
                fh.write(
                    json.dumps(
                        {
                            "step": step - 1,
                            "world": world,
                            "digest": digest,
                            "loss": float(global_avg_loss),
                            "pid": os.getpid(),
                        }
                    )
                    + "\n"
                )
        return log(step, global_avg_loss, *args, **kwargs)

    def save_and_report(curr_step, last_step=False, **kwargs):
        last_step = last_step or curr_step == run.steps  # this fit's last step: always saved
        save(curr_step, last_step=last_step, **kwargs)
        if curr_step % run.checkpoint_every and not last_step:
            return
        metrics = {"step": curr_step, "world": world}
        state = loader.state_dict()
        if rank == 0:
            with tempfile.TemporaryDirectory(prefix="zr-titan-") as d:
                (Path(d) / LOADER_STATE_FILE).write_text(json.dumps(state))
                saved = {"step": curr_step, "folder": run.dump_folder}
                (Path(d) / TORCHTITAN_STEP_FILE).write_text(json.dumps(saved))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)

    loader.steps = recorded_steps
    trainer.metrics_processor.log = log_step
    trainer.checkpointer.save = save_and_report
    trainer.should_continue_training = lambda: trainer.step < run.steps  # stop this fit at run.steps
    try:
        trainer.train()
    finally:
        trainer.close()
        loader.close()


def fit(
    run: TitanRun,
    *,
    workers: int | tuple[int, int],
    name: str,
    storage_path: str,
    max_failures: int = 0,
    cpu_per_worker: float = 0.25,
    use_gpu: bool = False,
    train_loop: Any = None,
    resize_monitor_interval_s: float | None = None,
) -> Any:
    """One ``TorchTrainer.fit()`` of :func:`torchtitan_train_loop` (or ``train_loop``, given the run's config).
    Reuse ``name``/``storage_path`` across fits to resume from the latest checkpoint at a new W. ``workers`` is a
    fixed W or ``(min, max)`` for Ray Train's elastic scaling. ``use_gpu`` reserves one GPU per worker (pair it
    with a GPU config such as ``zephon_ray.integrations.torchtitan.config_registry:zephon_llama3_debugmodel``).

    ``resize_monitor_interval_s``: with ``(min, max)`` workers, how often Ray Train checks the cluster for a resize
    of the running group (``ScalingConfig(elastic_resize_monitor_interval_s)``); None keeps Ray's default (60 s)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    elastic = {}
    if resize_monitor_interval_s is not None:
        elastic["elastic_resize_monitor_interval_s"] = resize_monitor_interval_s
    trainer = TorchTrainer(
        train_loop_per_worker=train_loop or torchtitan_train_loop,
        train_loop_config=run.to_config(),
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": cpu_per_worker}, **elastic
        ),
        run_config=RunConfig(
            name=name, storage_path=storage_path, failure_config=FailureConfig(max_failures=max_failures)
        ),
    )
    return trainer.fit()


def read_log(log_path: str) -> list[dict[str, Any]]:
    """Every step record rank 0 wrote, in order, replayed steps included."""
    path = Path(log_path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
