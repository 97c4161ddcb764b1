"""Test scaffolding for the Ray Train tests: failure injection and one ``TorchTrainer.fit()`` of the bigram example.

The model, its loop and its reference losses belong to ``examples/bigram.py`` (tests import them from there). This
module is pickled by value into Ray Train workers (they cannot import ``tests/`` by name).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.cloudpickle

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `examples` is a namespace package under the repository root
    sys.path.insert(0, str(ROOT))

from examples import bigram  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True)
class KillOnce:
    """A ``before_step`` hook: rank ``rank`` SIGKILLs itself before step ``step``, once (``marker`` records it).

    It waits ``after_s`` first: Ray Train v2 registers a reported checkpoint at its next poll of the worker group
    (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``: 0.25 s in the tests, conftest.py); a worker dying sooner after a
    report loses that checkpoint, and the restart then replays from an older one (still the same batches, only
    more replay)."""

    step: int
    rank: int
    marker: str
    after_s: float = 2.0

    def __call__(self, step: int, rank: int) -> None:
        if step == self.step and rank == self.rank and not os.path.exists(self.marker):
            time.sleep(self.after_s)
            Path(self.marker).write_text(f"killed rank {rank} pid {os.getpid()} before step {step}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def fit_bigram(dataset: Any, *, workers: int | tuple[int, int], name: str, storage_path: str, log_path: str,
               steps: int, run_id: str, max_failures: int = 0, cpu_per_worker: float = 0.25,
               checkpoint_every: int = 2, before_step: Any = None, worker_resources: dict | None = None,
               **scaling: Any) -> Any:
    """One ``TorchTrainer.fit()`` of ``examples/bigram.py`` reading ``dataset`` through ``get_dataset_shard``.
    Reuse ``name``/``storage_path`` to resume from the latest checkpoint at a new W."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from zephon_ray.integrations.ray_train import ZephonDataConfig

    trainer = TorchTrainer(
        bigram.train_loop,
        train_loop_config={"log_path": log_path, "steps": steps, "checkpoint_every": checkpoint_every,
                           "before_step": before_step},
        datasets={"train": dataset},
        dataset_config=ZephonDataConfig(run_id=run_id, checkpoint_every=checkpoint_every),
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": cpu_per_worker,
                                                                                **(worker_resources or {})},
                                     **scaling),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    return trainer.fit()


WEIGHTINGS = ("token", "mean_of_means")


def ddp_segment(rank: int, world: int, init_file: str, dataset_dir: str, recipe_path: str, work: str,
                until: int) -> None:
    """One rank of a DDP run over gloo (a process of its own) that trains ``examples/bigram.py``'s model on this
    rank's slices of a materialised run, from the state in ``work`` (models, optimizers, loader state) up to step
    ``until``, then saves that state (rank 0). It trains one model per weighting (:data:`WEIGHTINGS`) on the same
    slices: ``"token"`` scales the summed token loss by ``batch.loss_scale()`` (exact at any W),
    ``"mean_of_means"`` uses each rank's own mean loss. DDP's all-reduce averages the gradients over the W ranks
    either way."""
    import json

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from zephon_ray.stream.loader import Loader, LoaderConfig
    from zephon_ray.tokenizers import build_tokenizer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        work_dir = Path(work)
        config = LoaderConfig(recipe=recipe_path, mode="dataset", dataset_dir=dataset_dir, run_id="ddp")
        loader = Loader(config, rank=rank, world=world)
        cfg, vocab = bigram.DEFAULTS, int(build_tokenizer(loader.recipe.tokenizer).vocab_size)
        models, optims, wrapped = {}, {}, {}
        for name in WEIGHTINGS:
            models[name] = bigram.bigram_model(vocab, cfg["dim"], cfg["seed"])
            optims[name] = torch.optim.SGD(models[name].parameters(), lr=cfg["lr"])
            if (work_dir / f"{name}.pt").exists():
                saved = torch.load(work_dir / f"{name}.pt", weights_only=True)
                models[name].load_state_dict(saved["model"])
                optims[name].load_state_dict(saved["optim"])
            wrapped[name] = DistributedDataParallel(models[name])
        if (work_dir / "loader.json").exists():
            loader.load_state_dict(json.loads((work_dir / "loader.json").read_text()))
        batches = iter(loader)
        while loader.next_step < until:
            batch = next(batches)
            (inputs, labels), = batch.microbatches
            for name in WEIGHTINGS:
                optims[name].zero_grad(set_to_none=True)
                logits = wrapped[name](inputs["input"]).reshape(-1, vocab)
                if name == "token":
                    loss = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), reduction="sum",
                                                             ignore_index=-100) * batch.loss_scale("mean")
                else:
                    loss = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)
                loss.backward()
                optims[name].step()
        state = loader.state_dict()
        loader.close()
        if rank == 0:
            for name in WEIGHTINGS:
                torch.save({"model": models[name].state_dict(), "optim": optims[name].state_dict()},
                           work_dir / f"{name}.pt")
            (work_dir / "loader.json").write_text(json.dumps(state))
        dist.barrier()
    finally:
        dist.destroy_process_group()
