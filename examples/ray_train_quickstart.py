"""python examples/ray_train_quickstart.py W STEPS [--storage DIR] [--name RUN]: train steps [resume, STEPS) on W workers.

Rerun with another W, more STEPS and the same --storage and --name to resume from the run's last checkpoint: the
same global batches. Each run prints ``step <s> <sha256>`` for every step it trained (the global batch's digest,
gathered from the ranks' slices; equal to ``zephon-ray digest recipes/elastic.toml --steps 0:STEPS``), then where
its checkpoints are and the command that resumes it. Without --storage a new directory is made, so two runs never
share one by accident; a run that has trained to STEPS already refuses, naming its last step, rather than train
nothing. Needs neither TorchTitan nor triton (tests/test_ray_train_quickstart.py runs it with both imports blocked;
tests/test_docs_run.py runs examples/README.md's two commands as written)."""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import ray
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig, get_checkpoint, get_context, get_dataset_shard, report
from ray.train.torch import TorchTrainer, get_device, prepare_model

from zephon_ray import compute_digest
from zephon_ray.integrations.ray_train import ZephonDataConfig, ZephonDataset


def global_digest(piece) -> str:
    """The digest of the global batch whose rows ``piece`` (this rank's RankSlice) holds: every rank's rows, in rank
    order, gathered to every rank (a collective: every rank calls it for the same step)."""
    import numpy as np
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.asarray(piece.tokens), np.asarray(piece.positions)))
    return compute_digest(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


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
        digest = global_digest(batch.slice)
        with tempfile.TemporaryDirectory() as d:
            shard.save(d)  # on every rank: a collective in local mode
            torch.save(model.state_dict(), Path(d, "model.pt"))
            report({"step": batch.step, "digest": digest}, checkpoint=None if rank else Checkpoint.from_directory(d))


def trained_until(run_dir: Path) -> int:
    """The step a run resumes at: the newest loader state among its checkpoints (0 for a new run)."""
    states = [json.loads(p.read_text())["next_step"] for p in run_dir.glob("checkpoint_*/zephon_loader.json")]
    return max(states, default=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workers", type=int, nargs="?", default=2, help="W, the Ray Train workers (W divides 24)")
    parser.add_argument("steps", type=int, nargs="?", default=4, help="train until this step")
    parser.add_argument("--storage", default=None, help="the run's storage_path (default: a new temporary dir)")
    parser.add_argument("--name", default="quickstart", help="the run's name and the loader's run_id")
    args = parser.parse_args()
    storage = Path(args.storage or tempfile.mkdtemp(prefix="zr-quickstart-")).resolve()
    start = trained_until(storage / args.name)
    if start >= args.steps:
        parser.error(f"run {args.name!r} in {storage} has trained to step {start} already; ask for more than "
                     f"{start} steps, or pass a new --storage or --name")
    ray.init(address="local", num_cpus=4)  # on a Ray cluster: ray.init()
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "elastic.toml"  # B = 24 rows, 12 lanes: W | 12
    scaling = ScalingConfig(num_workers=args.workers, use_gpu=torch.cuda.is_available(),
                            resources_per_worker={"CPU": 0.5})
    result = TorchTrainer(train_loop, train_loop_config={"steps": args.steps},
                          datasets={"train": ZephonDataset(recipe)},
                          dataset_config=ZephonDataConfig(run_id=args.name), scaling_config=scaling,
                          run_config=RunConfig(name=args.name, storage_path=str(storage))).fit()
    trained = sorted((m["step"], m["digest"]) for _, m in result.best_checkpoints if m["step"] >= start)
    for step, digest in trained:
        print(f"step {step} {digest}")
    print(f"run {args.name!r}: W={args.workers}, steps {start}..{args.steps - 1}; checkpoints in {storage / args.name}")
    print(f"resume: python examples/ray_train_quickstart.py W STEPS --storage {storage} --name {args.name}")
    return 0 if [s for s, _ in trained] == list(range(start, args.steps)) else 1


if __name__ == "__main__":
    sys.exit(main())
