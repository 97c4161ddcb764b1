"""Run a training loop on zephon-ray batches under Ray Train's ``TorchTrainer``, elastically.

Ray Train v2 restarts the whole worker group from the latest registered checkpoint on every resize and after
every worker failure; the steps after that checkpoint are replayed. Because global batch s is a pure function of
(recipe, s), the replayed and resumed steps see exactly the rows they would have seen at any other W.

Two loops:

* :func:`torch_train_loop`: a plain torch loop (a tiny bigram LM, gradients summed over gloo), cheap enough for
  tests and the demo. Every ``checkpoint_every`` steps it reports a checkpoint holding the loader state
  (``loader.json``: JSON, identical on every rank), the model and the optimizer, and it resumes from
  ``ray.train.get_checkpoint()`` at whatever W the new group has.
* :func:`torchtitan_train_loop`: TorchTitan's real ``Trainer``, built in Python from a config-registry function.
  TorchTitan writes its DCP checkpoints into a shared folder; each save is also reported to Ray Train.

Inside a worker, Ray Train has already initialised the gloo process group and set MASTER_ADDR/MASTER_PORT to a
TCPStore hosted by rank 0 (a new port after every restart), which is what ``aggregate_store="torch://"`` uses.

Per-step records (step, W, global digest, loss) are appended by rank 0 to ``log_path`` (JSON lines), replayed
steps included. The global digest is computed from every rank's slice, gathered over gloo in rank order.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LOADER_STATE_FILE = "loader.json"
MODEL_FILE = "model.pt"
OPTIM_FILE = "optim.pt"


@dataclass(kw_only=True)
class _LoaderSource:
    """Where a run's loader reads from; shared by :class:`ElasticRun` and :class:`TitanRun`."""

    recipe: str
    run_id: str
    mode: str = "service"
    service_name: str = "zephon-ray"
    service_namespace: str = "zephon-ray"
    aggregate_store: str | None = None
    aggregate_dir: str | None = None
    checkpoint_every: int = 2

    def loader_config(self, **extra: Any) -> Any:
        from zephon_ray.torchtitan.loader import ZephonRayDataLoader

        return ZephonRayDataLoader.Config(
            recipe=self.recipe, mode=self.mode, service_name=self.service_name,
            service_namespace=self.service_namespace, run_id=self.run_id, aggregate_store=self.aggregate_store,
            aggregate_dir=self.aggregate_dir, checkpoint_every=self.checkpoint_every, **extra,
        )

    def to_config(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class ElasticRun(_LoaderSource):
    """What one ``fit()`` of :func:`torch_train_loop` does. Plain data: it travels as ``train_loop_config``."""

    log_path: str
    steps: int = 8
    """Train until this many global steps are done in total (a resumed fit continues from its checkpoint)."""
    local_batch_size: int = 0
    """Rows per microbatch; 0 means B / W (one microbatch per step)."""
    prefetch: int = 2
    lr: float = 0.05
    dim: int = 32
    seed: int = 0
    kill: dict[str, Any] = field(default_factory=dict)
    """Failure injection: {"step": s, "rank": r, "marker": path, "after_s": t}: rank r SIGKILLs itself before step
    s, once, after t seconds (default 5). Ray Train v2 registers a reported checkpoint at its next poll of the worker
    group (about every 2 s); a worker dying sooner after a report loses that checkpoint and the restart replays
    from an older one (still the same batches, only more replay)."""


def _bigram_model(vocab: int, dim: int, seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab))


def _gather_digest(piece: Any, world: int) -> str | None:
    """Global digest of the step whose slice this rank holds: gather every slice in rank order (gloo)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from zephon_ray.batch import compute_digest

    local = torch.from_numpy(np.stack([np.asarray(piece.tokens), np.asarray(piece.positions)]).astype(np.int64))
    if world == 1:
        parts = [local]
    else:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    full = torch.cat(parts, dim=1).numpy()
    return compute_digest(full[0], full[1])


def torch_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker``: see the module docstring."""
    import ray.train
    import torch
    import torch.distributed as dist

    from zephon_ray.recipe import Recipe
    from zephon_ray.tokenizers import build_tokenizer

    run = ElasticRun(**config)
    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    recipe = Recipe.from_toml(run.recipe)
    B = recipe.global_batch_rows
    lbs = run.local_batch_size or B // world
    loader = run.loader_config(prefetch=run.prefetch, global_batch_size=B).build(dp_world_size=world, dp_rank=rank, seq_len=recipe.seq_len, local_batch_size=lbs)
    vocab = int(build_tokenizer(recipe.tokenizer).vocab_size)
    model = _bigram_model(vocab, run.dim, run.seed)
    optim = torch.optim.SGD(model.parameters(), lr=run.lr)

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            loader.load_state_dict(json.loads((Path(d) / LOADER_STATE_FILE).read_text()))
            model.load_state_dict(torch.load(Path(d) / MODEL_FILE, weights_only=True))
            optim.load_state_dict(torch.load(Path(d) / OPTIM_FILE, weights_only=True))
    start = loader.next_step
    tokens_per_step = B * recipe.seq_len
    it = iter(loader)
    try:
        for step in range(start, run.steps):
            if run.kill and rank == run.kill.get("rank") and step == run.kill.get("step") \
                    and not os.path.exists(run.kill["marker"]):
                time.sleep(float(run.kill.get("after_s", 5.0)))
                Path(run.kill["marker"]).write_text(f"killed rank {rank} pid {os.getpid()} before step {step}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            optim.zero_grad(set_to_none=True)
            local_loss = torch.zeros(())
            for _ in range(loader.microbatches_per_step):
                inputs, labels = next(it)
                logits = model(inputs["input"])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
                ) / tokens_per_step
                loss.backward()
                local_loss += loss.detach()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                dist.all_reduce(local_loss, op=dist.ReduceOp.SUM)
            optim.step()
            digest = _gather_digest(loader.last_slice, world)
            done = step + 1
            if rank == 0:
                with open(run.log_path, "a") as fh:
                    fh.write(json.dumps({"step": step, "world": world, "digest": digest,
                                         "loss": float(local_loss), "pid": os.getpid(),
                                         "time": time.time()}) + "\n")
            if done % run.checkpoint_every == 0 or done == run.steps:
                state = loader.state_dict()
                metrics = {"step": step, "next_step": done, "loss": float(local_loss), "world": world}
                if rank == 0:
                    with tempfile.TemporaryDirectory(prefix="zr-ckpt-") as d:
                        (Path(d) / LOADER_STATE_FILE).write_text(json.dumps(state))
                        torch.save(model.state_dict(), Path(d) / MODEL_FILE)
                        torch.save(optim.state_dict(), Path(d) / OPTIM_FILE)
                        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
                else:
                    ray.train.report(metrics)
    finally:
        loader.close()


@dataclass(kw_only=True)
class TitanRun(_LoaderSource):
    """What one ``fit()`` of :func:`torchtitan_train_loop` does."""

    dump_folder: str
    """Shared by every fit of the run: TorchTitan's DCP checkpoints live in ``<dump_folder>/checkpoint``."""
    log_path: str
    config: str = "zephon_ray.torchtitan.config_registry:zephon_llama3_debugmodel_cpu"
    """``module:function`` returning a ``Trainer.Config`` (a config-registry function)."""
    steps: int = 4


def torchtitan_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` running TorchTitan's real ``Trainer`` on zephon-ray batches.

    TorchTitan saves DCP checkpoints (model, optimizer, schedulers, train state and the loader state, stored once)
    under the shared ``dump_folder`` every ``checkpoint_every`` steps; after each save the loader state and the
    TorchTitan step are also reported to Ray Train. A new worker group (any W) resumes from the step named by
    ``ray.train.get_checkpoint()``. Rank 0 appends ``{step, world, digest, loss}`` to ``log_path`` per step.
    """
    import importlib

    import ray.train

    run = TitanRun(**config)
    ctx = ray.train.get_context()
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    os.environ.setdefault("LOCAL_RANK", str(ctx.get_local_rank()))
    module, _, fn = run.config.partition(":")
    trainer_config = getattr(importlib.import_module(module), fn)()
    trainer_config.dataloader = run.loader_config(global_batch_size=trainer_config.training.global_batch_size)
    trainer_config.training.steps = run.steps
    trainer_config.dump_folder = run.dump_folder
    trainer_config.checkpoint.enable = True
    trainer_config.checkpoint.interval = run.checkpoint_every
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            trainer_config.checkpoint.load_step = int(json.loads((Path(d) / "torchtitan.json").read_text())["step"])

    trainer = trainer_config.build()
    loader = trainer.dataloader
    save, log = trainer.checkpointer.save, trainer.metrics_processor.log

    def log_step(step, global_avg_loss, *args, **kwargs):
        digest = _gather_digest(loader.last_slice, world)
        if rank == 0:
            with open(run.log_path, "a") as fh:
                fh.write(json.dumps({"step": step - 1, "world": world, "digest": digest,
                                     "loss": float(global_avg_loss), "pid": os.getpid()}) + "\n")
        return log(step, global_avg_loss, *args, **kwargs)

    def save_and_report(curr_step, last_step=False, **kwargs):
        save(curr_step, last_step=last_step, **kwargs)
        if curr_step % run.checkpoint_every and not last_step:
            return
        metrics = {"step": curr_step, "world": world}
        state = loader.state_dict()
        if rank == 0:
            with tempfile.TemporaryDirectory(prefix="zr-titan-") as d:
                (Path(d) / LOADER_STATE_FILE).write_text(json.dumps(state))
                (Path(d) / "torchtitan.json").write_text(json.dumps({"step": curr_step, "folder": run.dump_folder}))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)

    trainer.metrics_processor.log = log_step
    trainer.checkpointer.save = save_and_report
    try:
        trainer.train()
    finally:
        trainer.close()
        loader.close()


def fit(run: "ElasticRun | TitanRun", *, workers: int | tuple[int, int], name: str, storage_path: str,
        max_failures: int = 0, cpu_per_worker: float = 0.25, train_loop: Any = None,
        resize_monitor_interval_s: float | None = None) -> Any:
    """One ``TorchTrainer.fit()``. Reuse ``name``/``storage_path`` across fits to resume from the latest checkpoint
    at a new W. ``workers`` is a fixed W or ``(min, max)`` for Ray Train's elastic scaling.

    ``resize_monitor_interval_s``: with ``(min, max)`` workers, how often Ray Train checks the cluster for a resize
    of the running group (``ScalingConfig(elastic_resize_monitor_interval_s)``); None keeps Ray's default (60 s)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    elastic = {}
    if resize_monitor_interval_s is not None:
        elastic["elastic_resize_monitor_interval_s"] = resize_monitor_interval_s
    trainer = TorchTrainer(
        train_loop_per_worker=train_loop or (torchtitan_train_loop if isinstance(run, TitanRun) else torch_train_loop),
        train_loop_config=run.to_config(),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": cpu_per_worker},
                                     **elastic),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    return trainer.fit()


def read_log(log_path: str) -> list[dict[str, Any]]:
    """Every step record rank 0 wrote, in order, replayed steps included."""
    path = Path(log_path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reference_losses(run: ElasticRun) -> list[float]:
    """The losses :func:`torch_train_loop` must report, computed in-process at W=1 from ``GlobalBatchSource``."""
    import torch

    from zephon_ray.recipe import Recipe
    from zephon_ray.source import GlobalBatchSource
    from zephon_ray.tokenizers import build_tokenizer

    recipe = Recipe.from_toml(run.recipe)
    model = _bigram_model(int(build_tokenizer(recipe.tokenizer).vocab_size), run.dim, run.seed)
    optim = torch.optim.SGD(model.parameters(), lr=run.lr)
    tokens_per_step = recipe.global_batch_rows * recipe.seq_len
    losses = []
    with GlobalBatchSource(recipe) as source:
        for step in range(run.steps):
            optim.zero_grad(set_to_none=True)
            (inputs, labels), = source.batch(step).slice(0, 1).microbatches(recipe.global_batch_rows)
            logits = model(inputs["input"])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
            ) / tokens_per_step
            loss.backward()
            optim.step()
            losses.append(float(loss.detach()))
    return losses
