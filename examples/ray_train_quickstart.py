"""python examples/ray_train_quickstart.py W STEPS STORAGE: train to step STEPS on W Ray Train workers.

Rerun with any other W (1 to 24, the recipe's rows per step), more STEPS and the same STORAGE directory to resume
from the run's last checkpoint with the same global batches. The batches come from a DataService this script starts
on its own local Ray, so W need not divide anything. Needs neither TorchTitan nor triton.
"""

import sys
import tempfile
from pathlib import Path

import ray
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig, get_checkpoint, get_context, get_dataset_shard, report
from ray.train.torch import TorchTrainer, get_device, prepare_model

from zephon_ray import DataService, ray_train


def train_loop(steps):
    shard, checkpoint, rank = get_dataset_shard("train"), get_checkpoint(), get_context().get_world_rank()
    torch.manual_seed(0)  # the same initial weights on every run
    model = torch.nn.Sequential(torch.nn.Embedding(259, 32), torch.nn.Linear(32, 259))  # the bytes tokenizer's ids
    if checkpoint:
        with checkpoint.as_directory() as d:
            model.load_state_dict(torch.load(Path(d, "model.pt"), weights_only=True))
    shard.restore(checkpoint)  # the loader state (None: step 0), at any worker count
    ddp, optim = prepare_model(model), torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in shard.iter_steps(until=steps, device=get_device()):  # this rank's rows of each step
        for inputs, labels in batch.microbatches:
            logits = ddp(inputs["input"]).flatten(0, 1)
            loss = torch.nn.functional.cross_entropy(logits, labels.flatten(), reduction="sum")
            (loss * batch.loss_scale()).backward()  # the global batch's mean gradient, also when W does not divide B
        optim.step(), optim.zero_grad()
        with tempfile.TemporaryDirectory() as d:
            shard.save(d), torch.save(model.state_dict(), Path(d, "model.pt"))  # equal on all ranks: keep rank 0's
            report({"step": batch.step}, checkpoint=None if rank else Checkpoint.from_directory(d))


if __name__ == "__main__":
    if len(sys.argv) != 4 or not sys.argv[1].isdigit() or not 1 <= int(sys.argv[1]) <= 24 or not sys.argv[2].isdigit():
        sys.exit("usage: ray_train_quickstart.py W STEPS STORAGE, W from 1 to 24 (the recipe's rows per step)")
    workers, steps, storage = int(sys.argv[1]), int(sys.argv[2]), str(Path(sys.argv[3]).resolve())
    ray.init(address="local", num_cpus=workers + 2)  # 0.5 CPU a worker and the service; on a cluster: ray.init()
    with DataService.start(Path(__file__).resolve().parents[1] / "recipes/elastic.toml", name="quickstart") as service:
        result = TorchTrainer(
            lambda: train_loop(steps),  # runs on every worker
            datasets={"train": ray_train.ZephonDataset(service)},
            dataset_config=ray_train.ZephonDataConfig(run_id="quickstart"),
            run_config=RunConfig("quickstart", storage, logging_config=ray.train.LoggingConfig("WARNING")),
            scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
        ).fit()
    print(f"last step trained: {(result.metrics or {}).get('step')}; resume: python {sys.argv[0]} W STEPS {storage}")
