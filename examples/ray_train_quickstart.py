"""python examples/ray_train_quickstart.py [W] [STEPS] [STORAGE]; rerun with another W and more STEPS to resume, same batches.

Needs neither TorchTitan nor triton (tests/test_ray_train_quickstart.py runs it with both imports blocked)."""
import sys
import tempfile
from pathlib import Path

import ray
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig, get_checkpoint, get_context, get_dataset_shard, report
from ray.train.torch import TorchTrainer, get_device, prepare_model

from zephon_ray.integrations.ray_train import ZephonDataConfig, ZephonDataset


def train_loop(config):
    shard, checkpoint, rank = get_dataset_shard("train"), get_checkpoint(), get_context().get_world_rank()
    torch.manual_seed(0)  # the same initial weights on every run
    model = torch.nn.Sequential(torch.nn.Embedding(259, 32), torch.nn.Linear(32, 259))  # the bytes tokenizer's ids
    if checkpoint:
        with checkpoint.as_directory() as d:
            model.load_state_dict(torch.load(Path(d, "model.pt"), weights_only=True))
    shard.restore(checkpoint)  # the loader state (None: step 0); loads at any worker count
    ddp, optim = prepare_model(model), torch.optim.SGD(model.parameters(), lr=0.05)  # SGD: no optimizer state
    for batch in shard.iter_steps(until=config["steps"], device=get_device()):  # this rank's rows of each step
        for inputs, labels in batch.microbatches:
            torch.nn.functional.cross_entropy(ddp(inputs["input"]).flatten(0, 1), labels.flatten()).backward()
        optim.step(), optim.zero_grad()
        with tempfile.TemporaryDirectory() as d:
            shard.save(d)  # on every rank: a collective in local mode
            torch.save(model.state_dict(), Path(d, "model.pt"))
            report({"step": batch.step}, checkpoint=None if rank else Checkpoint.from_directory(d))


if __name__ == "__main__":
    workers, steps = (int(a) for a in (sys.argv[1:] + ["2", "4"])[:2])
    storage = sys.argv[3] if len(sys.argv) > 3 else "/tmp/zr-quickstart"
    ray.init(address="local", num_cpus=4)  # on a Ray cluster: ray.init()
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "elastic.toml"  # B = 24 rows, 12 lanes: W | 12
    scaling = ScalingConfig(num_workers=workers, use_gpu=torch.cuda.is_available(), resources_per_worker={"CPU": 0.5})
    result = TorchTrainer(train_loop, train_loop_config={"steps": steps}, datasets={"train": ZephonDataset(recipe)},
                          dataset_config=ZephonDataConfig(run_id="quickstart"), scaling_config=scaling,
                          run_config=RunConfig(name="quickstart", storage_path=storage)).fit()
    print(result.metrics, result.checkpoint.path if result.checkpoint else None)
