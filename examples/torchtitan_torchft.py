"""TorchTitan 0.3.0's torchft trainer (``torchtitan.experiments.torchft``) on CPU, fed through FtSlices.

    python examples/torchtitan_torchft.py --groups 2 --steps 3              # rows through FtSlices (use_torchft)
    python examples/torchtitan_torchft.py --groups 2 --steps 3 --fixed      # the trainer's own fixed dp rank

TorchTitan's ``FaultTolerantTrainer`` builds the data loader once with a fixed ``dp_world_size = dp x group_size``
and ``dp_rank = dp x replica_id + r``. :class:`ZephonFTTrainer` calls ``ZephonRayDataLoader.use_torchft`` after
building, so every step is read after the quorum as ``slice(step, p, P)`` of ``manager.current_step()`` for the P
live groups (cut into the trainer's fixed number of microbatches). A Lighthouse runs in this process; each replica
group is a ``torchrun --nproc_per_node 1`` of ``torchtitan.train`` with the CPU shims of examples/torchtitan_cpu.py.
Rows come from a materialised directory of recipes/tiny.toml (made here on a private Ray).

What it took to run on CPU here (all in :func:`zephon_ft_cpu`): TorchFT's optimizer container and checkpoint
manager (the latter registers the state-dict functions a healing group needs; without it the first heal fails with
"user state_dict is not initialized"), a plain ``CrossEntropyLoss`` (the FT trainer never sets ``lm_head``, so
``ChunkedLossWrapper`` asserts "Set lm_head before calling ChunkedLossWrapper"), dataset mode (local mode's lanes
cannot follow a quorum), and ``local_batch_size = B / groups``.

Measured (torch 2.13 CPU, torchft 0.2.0, 2 groups, 3 steps): through FtSlices 7 of 7 runs trained, each group's
losses (8.18254 / 8.22260 at step 1) averaging to the single-group loss of the whole batch (8.20257); a group that
healed at step 0 under torchft's async quorum got participant 0's rows, whose gradients torchft zeroes. With
``--fixed`` (TorchTitan's own fixed dp rank) 4 of 6 runs failed: the group that serves the step-0 heal checkpoint
crashed at its next step with ``RuntimeError: aten.mm.default got mixed torch.Tensor and DTensor`` (once a SIGSEGV).
A likely reason, not proven: FtSlices reads the quorum (``num_participants()`` waits for it) before the forward
pass, while the fixed loader lets the forward run while torchft's quorum thread still reads the state dict for the
peer. Kills and rejoins were not run through TorchTitan's trainer (time; they go through the same heal path):
examples/torchft_churn.py shows them with a plain torch loop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.toml")


def zephon_ft_cpu():
    """Config registry function (``--module examples.torchtitan_torchft --config zephon_ft_cpu``)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

    from examples.torchtitan_cpu import zephon_llama3_debugmodel_cpu

    base = zephon_llama3_debugmodel_cpu()
    kw = {f.name: getattr(base, f.name) for f in fields(base) if f.init}
    kw["optimizer"] = TorchFTOptimizersContainer.Config(param_groups=base.optimizer.param_groups)
    kw["loss"] = base.loss.loss_fn
    kw["checkpoint"] = TorchFTCheckpointManager.Config(enable=True, interval=1000, folder="ckpt")
    kw["parallelism"] = ParallelismConfig(data_parallel_replicate_degree=1, data_parallel_shard_degree=1,
                                          spmd_backend="partial_dtensor")
    kw["fault_tolerance"] = FaultTolerance(enable=True, process_group="gloo", min_replica_size=1,
                                           replica_id=int(os.environ["ZR_FT_REPLICA"]),
                                           group_size=int(os.environ["ZR_FT_GROUPS"]))
    loader = base.dataloader
    kw["dataloader"] = type(loader)(**{**{f.name: getattr(loader, f.name) for f in fields(loader) if f.init},
                                       "mode": "dataset", "dataset_dir": os.environ["ZR_FT_DATASET"],
                                       "aggregate_store": None})
    return _trainer_class().Config(**kw)


def _trainer_class():
    from dataclasses import dataclass

    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

    global _TRAINER
    if _TRAINER is None:
        class ZephonFTTrainer(FaultTolerantTrainer):
            """FaultTolerantTrainer whose loader reads each step through FtSlices after the quorum."""

            @dataclass(kw_only=True, slots=True)
            class Config(FaultTolerantTrainer.Config):  # its own Config: build() makes this class
                pass

            def __init__(self, config):
                super().__init__(config)
                if os.environ.get("ZR_FT_FIXED") != "1":
                    self.dataloader.use_torchft(self.ft_manager.manager,
                                                group_size=config.fault_tolerance.group_size)
                    print("zephon-ray: the loader reads through FtSlices", flush=True)

        _TRAINER = ZephonFTTrainer
    return _TRAINER


_TRAINER = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fixed", action="store_true", help="the trainer's fixed dp rank instead of FtSlices")
    args = parser.parse_args()

    # torchft's Rust Lighthouse (in this process) logs every quorum poll at INFO, harmless and most of the output;
    # torchft reads RUST_LOG at import, so default it to warn first (warnings and errors still show; a RUST_LOG you
    # set wins). The groups get your setting: their logs are files, read when something fails.
    user_rust_log = os.environ.get("RUST_LOG")
    os.environ.setdefault("RUST_LOG", "warn")

    import ray
    from torchft.coordination import LighthouseServer

    from zephon_ray import Recipe
    from zephon_ray.jobs.materialize import materialize

    work = Path(tempfile.mkdtemp(prefix="zr-titan-ft-"))
    try:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(work / "ray"))
        materialize(Recipe.from_toml(TINY), work / "rows", range(0, args.steps + 1), producers=1, progress=False)
        ray.shutdown()
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000)
        procs = []
        B = Recipe.from_toml(TINY).global_batch_rows
        for g in range(args.groups):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHFT_LIGHTHOUSE": lighthouse.address(),
                   "ZR_FT_REPLICA": str(g), "ZR_FT_GROUPS": str(args.groups), "ZR_FT_DATASET": str(work / "rows"),
                   "ZEPHON_RAY_RECIPE": TINY, "ZR_FT_FIXED": "1" if args.fixed else "0"}
            if user_rust_log is None:
                env.pop("RUST_LOG")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                   "-m", "torchtitan.train", "--module", "examples.torchtitan_torchft", "--config", "zephon_ft_cpu",
                   "--training.steps", str(args.steps), "--training.local_batch_size", str(B // args.groups),
                   "--dump_folder", str(work / f"dump{g}")]
            procs.append(subprocess.Popen(cmd, env=env, stdout=open(work / f"group{g}.log", "w"),
                                          stderr=subprocess.STDOUT, cwd=work))
        codes = [p.wait() for p in procs]
        lighthouse.shutdown()
        for g, code in enumerate(codes):
            log = (work / f"group{g}.log").read_text()
            losses = [line.split("loss:")[1].split()[0] for line in log.splitlines() if "step:" in line
                      and "loss:" in line]
            errors = sorted({line.strip()[:160] for line in log.splitlines() if "Error:" in line and "lspci" not in line})
            print(f"group {g}: exit {code}, losses {losses}" + (f", errors {errors[:2]}" if errors else ""))
        return 0 if all(c == 0 for c in codes) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
