"""Test scaffolding for the Ray Train tests: failure injection and one ``TorchTrainer.fit()`` of the bigram example.

The model, its loop and its reference losses belong to ``examples/bigram.py`` (tests import them from there). This
module is pickled by value into Ray Train workers (they cannot import ``tests/`` by name).
"""

from __future__ import annotations

import json
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

    With ``snapshot`` (Ray Train's ``<storage_path>/<name>/checkpoint_manager_snapshot.json``) it first waits, at
    most ``timeout_s``, until Ray Train has registered the checkpoint reported with metric ``step`` =
    ``registered_step``: Ray Train v2 registers a reported checkpoint at its next poll of the worker group, and a
    worker dying before that loses it (the restart would replay from an older one). A condition, not a sleep, so the
    restart point is the same on any machine; past ``timeout_s`` it is a RuntimeError naming the checkpoint."""

    step: int
    rank: int
    marker: str
    snapshot: str = ""
    registered_step: int = -1
    timeout_s: float = 120.0

    def __call__(self, step: int, rank: int) -> None:
        if step == self.step and rank == self.rank and not os.path.exists(self.marker):
            if self.snapshot:
                deadline = time.monotonic() + self.timeout_s
                while registered_step(self.snapshot) < self.registered_step:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"Ray Train did not register the checkpoint of step {self.registered_step} "
                            f"within {self.timeout_s:.0f} s ({self.snapshot})"
                        )
                    time.sleep(0.05)
            Path(self.marker).write_text(f"killed rank {rank} pid {os.getpid()} before step {step}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def registered_step(snapshot: str) -> int:
    """The ``step`` metric of the latest checkpoint Ray Train registered (its checkpoint manager's snapshot file);
    -1 while there is none (or the file is being rewritten)."""
    try:
        latest = json.loads(Path(snapshot).read_text()).get("latest_checkpoint_result") or {}
        return int(latest.get("metrics", {}).get("step", -1))
    except (OSError, ValueError):
        return -1


@dataclass(frozen=True)
class HoldForRestart:
    """A ``before_digest`` hook that makes a restart happen at a chosen point of a chosen step, and audits the slices.

    Every rank appends its slice's digest at the end of every step to ``<directory>/slices.jsonl`` (one line each,
    ``phase`` "end"). In the group of ``world`` ranks, each rank then holds step ``step`` (after its all-reduce and
    optimizer step, before the digest gather) until Ray Train tears the group down: Ray Train's
    ``TorchBackend.on_shutdown`` destroys the process group in every worker first, then kills the workers. It writes
    ``<directory>/holding.r<rank>`` when it starts holding (the test adds the new node only then), records the slice's
    digest again once the group is gone (phase "teardown"), and returns: the loop then gathers the step's digest from
    a destroyed group, the moment issue 30's wrong digest came from. A group not torn down within ``timeout_s`` is
    a RuntimeError (Ray Train noticed no new node: the only time bound of the test, far above the ~25 s measured)."""

    step: int
    world: int
    directory: str
    timeout_s: float = 300.0

    def __call__(self, step: int, rank: int, piece: Any) -> None:
        import torch.distributed as dist

        from zephon_ray.batch import compute_digest

        def record(phase: str) -> None:
            line = {
                "step": step,
                "rank": rank,
                "world": piece.world,
                "phase": phase,
                "pid": os.getpid(),
                "digest": compute_digest(piece.tokens, piece.positions),
            }
            with open(Path(self.directory, "slices.jsonl"), "a") as fh:  # one short line per write: no tearing
                fh.write(json.dumps(line) + "\n")

        record("end")
        if step != self.step or piece.world != self.world:
            return
        Path(self.directory, f"holding.r{rank}").write_text(json.dumps({"step": step, "time": time.time()}))
        deadline = time.monotonic() + self.timeout_s
        while dist.is_initialized():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"step {step}: Ray Train did not tear the {self.world}-worker group down within "
                    f"{self.timeout_s:.0f} s of holding it (no resize decision)"
                )
            time.sleep(0.02)
        record("teardown")


def fit_bigram(
    dataset: Any,
    *,
    workers: int | tuple[int, int],
    name: str,
    storage_path: str,
    log_path: str,
    steps: int,
    run_id: str,
    max_failures: int = 0,
    cpu_per_worker: float = 0.25,
    checkpoint_every: int = 2,
    before_step: Any = None,
    before_digest: Any = None,
    worker_resources: dict | None = None,
    **scaling: Any,
) -> Any:
    """One ``TorchTrainer.fit()`` of ``examples/bigram.py`` reading ``dataset`` through ``get_dataset_shard``.
    Reuse ``name``/``storage_path`` to resume from the latest checkpoint at a new W."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from zephon_ray.integrations.ray_train import ZephonDataConfig

    trainer = TorchTrainer(
        bigram.train_loop,
        train_loop_config={
            "log_path": log_path,
            "steps": steps,
            "checkpoint_every": checkpoint_every,
            "before_step": before_step,
            "before_digest": before_digest,
        },
        datasets={"train": dataset},
        dataset_config=ZephonDataConfig(run_id=run_id, checkpoint_every=checkpoint_every),
        scaling_config=ScalingConfig(
            num_workers=workers, resources_per_worker={"CPU": cpu_per_worker, **(worker_resources or {})}, **scaling
        ),
        run_config=RunConfig(
            name=name, storage_path=storage_path, failure_config=FailureConfig(max_failures=max_failures)
        ),
    )
    return trainer.fit()


WEIGHTINGS = ("token", "mean_of_means")


def ddp_segment(
    rank: int, world: int, init_file: str, dataset_dir: str, recipe_path: str, work: str, until: int
) -> None:
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
            ((inputs, labels),) = batch.microbatches
            for name in WEIGHTINGS:
                optims[name].zero_grad(set_to_none=True)
                logits = wrapped[name](inputs["input"]).reshape(-1, vocab)
                if name == "token":
                    loss = torch.nn.functional.cross_entropy(
                        logits, labels.reshape(-1), reduction="sum", ignore_index=-100
                    ) * batch.loss_scale("mean")
                else:
                    loss = torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)
                loss.backward()
                optims[name].step()
        state = loader.state_dict()
        loader.close()
        if rank == 0:
            for name in WEIGHTINGS:
                torch.save(
                    {"model": models[name].state_dict(), "optim": optims[name].state_dict()}, work_dir / f"{name}.pt"
                )
            (work_dir / "loader.json").write_text(json.dumps(state))
        dist.barrier()
    finally:
        dist.destroy_process_group()
