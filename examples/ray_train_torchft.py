"""Ray Train's torchft mode (``TorchftConfig``, Ray 2.60) reading zephon-ray global batches per quorum.

    python examples/ray_train_torchft.py --workers 2 --steps 6 --kill 1@2 --ledger /tmp/zr-rt-ledger

Ray Train's ``TorchftConfig`` (``ray.train.v2.torch.torchft_config``) starts a torchft Lighthouse actor and makes
every worker its own replica group; Ray replaces a failed group's worker without stopping the others. Ray's own
example (``ray/train/v2/examples/pytorch/torchft_linear_example.py``) cuts its data with torchft's
``DistributedSampler`` for a fixed number of groups, so a step trained while a group is missing covers part of the
global batch. Here the loop builds the shard of a :class:`ZephonDataset` of a running
:class:`~zephon_ray.DataService` with ``ZephonDataConfig.shard`` and reads it through ``shard.ft(manager)``: after each
quorum, group p of the P live groups reads ``slice(s, p, P)`` of ``s = manager.current_step()``, so every committed
step trains the whole global batch s whatever P is, and a step torchft rejects is served again. The dataset travels in
``train_loop_config``, not ``datasets=``: in Ray 2.60 a replaced group's worker waits forever in
``ray.train.get_dataset_shard`` (Ray gives it a new dataset manager sized to its replica group of 1, and that
manager's barrier waits for a rank 0 the group does not have), whatever the dataset.

The loop is Ray's example's, with a bigram model on the recipe's tokens: a torchft ``Manager`` on
``ProcessGroupGloo`` with a ``PGTransport``, the summed token loss times ``batch.loss_scale()`` (torchft's AVG
all-reduce over the P groups then gives the global mean), ``manager.allreduce`` of every gradient, and
``should_commit()`` before the optimizer step; ``slices.commit(step)`` after it writes the step to the ledger, and the
Manager's ``state_dict`` carries ``slices.state_dict()`` so a healed group continues the ledger's lineage.

Every worker waits until all are up before step 0, so every group trains it. ``--kill G@S``: the first worker of group
G SIGKILLs itself at step S, after reading its rows and before the all-reduce: the survivors' attempt is rejected and
step S is served again to them; Ray starts a new worker for group G (``FailureConfig(max_failures=2)``), the
survivors wait for it at step S + 2, torchft heals it from a peer and it takes part again. Each worker appends one
JSON line per committed step to ``<out>/steps.jsonl`` (step, rank, world, the slice's ledger digest, its pid). With ``--ledger`` the run ends with
``zephon-ray audit``. ``tests/test_ray_train_torchft.py`` runs it and checks the digests against the oracle's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.toml")
NAMESPACE = "zr-ray-train-ft"
JOIN_TIMEOUT_MS = 20_000
"""How long the Lighthouse waits for the last quorum's members before it forms a quorum without them. Too short and a
replaced worker asking while the survivors are mid-step gets a quorum of its own and trains from step 0 alone (two
lineages under one run_id: the audit's 'other run' finding; seen with 10 s on a 2-core machine at load 130)."""
WAIT_S = 300.0  # a worker's start on a busy 2-core machine, a replaced worker's start


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker``: ``steps``, ``out``, ``kill`` ([group, step] or None), ``lr``, ``dataset``
    (a ZephonDataset) and ``data_config`` (a ZephonDataConfig)."""
    from datetime import timedelta

    import ray.train
    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from examples.bigram import _loss, bigram_model
    from zephon_ray.tokenizers import build_tokenizer

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()  # each worker is its own replica group (Ray's TorchftConfig)
    out = Path(config["out"])
    life = len(list(out.glob(f"life-{rank}-*")))
    (out / f"life-{rank}-{life}").write_text(str(os.getpid()))
    # Not ray.train.get_dataset_shard: under TorchftConfig a replaced worker's call waits forever in Ray 2.60 (it gets
    # a new dataset manager sized to its replica group, whose rank 0 never calls); the shard is built here instead.
    shard = config["data_config"].shard(config["dataset"], rank=rank, world=ctx.get_world_size())
    model = bigram_model(int(build_tokenizer(shard.recipe.tokenizer).vocab_size), 32, 0)
    optim = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.05))
    box: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optim": optim.state_dict(),
            "zephon": json.dumps(box["slices"].state_dict()),
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        box["slices"].load_state_dict(json.loads(state["zephon"]))

    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        world_size=1,
        rank=0,
        replica_id=f"zephon_{rank}",
        timeout=timedelta(seconds=60),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu")),
        use_async_quorum=False,
    )
    slices = box["slices"] = shard.ft(manager)
    kill, world = config.get("kill"), ctx.get_world_size()
    (out / f"ready-{rank}-{life}").touch()  # this group's Manager is up (it heartbeats to the Lighthouse)
    if life == 0:  # every group is up before the first quorum, so all of them train step 0
        _wait(lambda: all((out / f"ready-{r}-0").exists() for r in range(world)), "every worker's first start")
    try:
        while manager.current_step() < config["steps"]:
            if (
                kill
                and rank != kill[0]
                and manager.current_step() == kill[1] + 2
                and not (out / f"ready-{kill[0]}-1").exists()
            ):  # the survivors wait for the new worker
                _wait(lambda: (out / f"ready-{kill[0]}-1").exists(), f"group {kill[0]}'s new worker")
                time.sleep(2.0)  # let it ask for the quorum first, so that this quorum holds it
            manager.start_quorum()
            batch = slices.next()
            if kill and life == 0 and rank == kill[0] and batch.step == kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step, before the all-reduce
            optim.zero_grad(set_to_none=True)
            scale = batch.loss_scale()  # "mean": torchft averages the gradients over the P participants
            loss = sum(_loss(model, inputs, labels, scale) for inputs, labels in batch.microbatches)
            loss.backward()
            for p in model.parameters():
                manager.allreduce(p.grad).wait()
            if manager.should_commit():
                optim.step()
                slices.commit(batch.step)
                piece = batch.slice
                with open(out / "steps.jsonl", "a") as fh:
                    fh.write(
                        json.dumps(
                            {
                                "step": batch.step,
                                "rank": piece.rank,
                                "world": piece.world,
                                "digest": piece.ledger_digest,
                                "pid": os.getpid(),
                                "loss": loss.item(),
                            }
                        )
                        + "\n"
                    )
    finally:
        manager.shutdown()  # Ray's example: no split brain when a group dies and another finishes
        slices.close()


def _wait(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.1)


def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.torch.torchft_config import TorchftConfig

    from zephon_ray import DataService, ray_train

    service = DataService.start(
        TINY, name="ray-train-ft", namespace=NAMESPACE, state_dir=str(out / "state"), window=4, checkpoint_every=4
    )
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={
                "steps": args.steps,
                "out": str(out),
                "kill": args.kill,
                "dataset": ray_train.ZephonDataset(service),
                "data_config": ray_train.ZephonDataConfig(run_id="ray-train-ft", ledger_dir=args.ledger),
            },
            scaling_config=ScalingConfig(num_workers=args.workers, resources_per_worker={"CPU": 0.5}),
            torch_config=TorchftConfig(
                lighthouse_kwargs={"min_replicas": 1, "join_timeout_ms": JOIN_TIMEOUT_MS}, backend="gloo"
            ),
            run_config=RunConfig(
                name="ray-train-ft", storage_path=str(out / "results"), failure_config=FailureConfig(max_failures=2)
            ),
        )
        result = trainer.fit()
        error = None if result.error is None else f"{type(result.error).__name__}: {result.error}"[:500]
    finally:
        service.stop()
    steps = (
        [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
        if (out / "steps.jsonl").exists()
        else []
    )
    return {"error": error, "steps": steps, "lives": sorted(p.name for p in out.glob("life-*")), "ray": ray.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill", default=None, metavar="G@S", help="group G's first worker dies at step S")
    parser.add_argument("--ledger", default=None, help="the ledger directory; audited at the end")
    parser.add_argument("--json", default=None, help="write the committed steps, the lives and the audit here")
    args = parser.parse_args(argv)
    if args.kill:
        group, _, step = args.kill.partition("@")
        args.kill = [int(group), int(step)]
    import ray

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse logs every quorum at INFO
    work = Path(tempfile.mkdtemp(prefix="zr-rt-ft-"))
    out = work / "out"
    out.mkdir()
    t0 = time.time()
    try:
        try:
            _start_ray(work)
            summary = run(args, out)
        finally:
            ray.shutdown()
        return _report(args, summary, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _start_ray(work: Path) -> None:
    """A private Ray; once more if it hit Ray's fixed start-up timeout (a loaded machine), after killing what the
    failed start left (this process's new children)."""
    import psutil
    import ray

    kwargs = dict(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(work / "ray"),
        runtime_env={
            "env_vars": {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "RUST_LOG": "warn"}
        },
    )
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    try:
        ray.init(**kwargs)
        return
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
    left = [child for child in me.children(recursive=True) if child.pid not in before]
    for child in left:
        child.kill()
    psutil.wait_procs(left, timeout=30)
    ray.shutdown()
    print("Ray did not start within its fixed 30 s (a loaded machine); starting it again", flush=True)
    ray.init(**kwargs)


def _report(args: argparse.Namespace, summary: dict[str, Any], t0: float) -> int:
    audit_lines: list[str] = []
    audited = 0
    if args.ledger:
        import contextlib
        import io

        from zephon_ray.cli import main as cli

        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            audited = cli(["audit", args.ledger, "--recipe", TINY])
        audit_lines = [line for line in buffer.getvalue().splitlines() if line]
    summary.update(audit=audit_lines, audit_exit=audited, seconds=round(time.time() - t0))
    for record in summary["steps"]:
        print(f"step {record['step']}: rank {record['rank']} of {record['world']} (pid {record['pid']})")
    print("\n".join(audit_lines) + f"\nerror: {summary['error']}; lives {summary['lives']}; {summary['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if summary["error"] is None and not audited else 1


if __name__ == "__main__":
    sys.exit(main())
