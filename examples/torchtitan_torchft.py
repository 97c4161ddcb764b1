"""TorchTitan 0.3.0's torchft trainer on CPU through zephon-ray, with kills, rejoins and the ledger's audit.

    python examples/torchtitan_torchft.py --groups 2 --steps 8 --kill 1@2 --rejoin 1@4 --ledger /tmp/ledger
    python examples/torchtitan_torchft.py --groups 1 --steps 4 --apply-rejected 1 --ledger /tmp/ledger2

Each replica group is a ``torchrun --nproc_per_node 1`` of ``torchtitan.train`` with the config :func:`zephon_ft_cpu`:
the wheel's :class:`~zephon_ray.integrations.torchtitan.torchft.ZephonFTTrainer` (TorchTitan's
``FaultTolerantTrainer`` whose loader reads every step through ``FtSlices`` after the quorum and records every step
the optimizer applied in the ledger), with the CPU shims of examples/torchtitan_cpu.py, TorchFT's optimizer container
and checkpoint manager (the latter registers the state a healing group receives), a plain ``CrossEntropyLoss``
(TorchTitan's torchft trainer never sets ``lm_head``, so ``ChunkedLossWrapper`` asserts "Set lm_head before calling
ChunkedLossWrapper") and dataset mode (rows of recipes/tiny.toml materialised here on a private Ray; local mode's lanes
cannot follow a quorum). A torchft Lighthouse runs in this process.

``--kill G@S``: group G SIGKILLs itself at step S, after reading its rows and before its forward pass (so before the
gradient all-reduce): the others' attempt of step S fails, ``should_commit()`` rejects it and step S is served again to
the groups left. ``--rejoin G@S``: the live groups wait at the start of step S until a new process of group G has
built its trainer; it joins the quorum and torchft heals it from a peer under TorchTitan's async quorum (it trains
placeholder rows, gradients zeroed, in that step; its ledger head comes with the peer's ``train_state``).
``--apply-rejected S``: at step S group 0's optimizer container reports an error to torchft (as a failed all-reduce
does), so ``should_commit()`` rejects the attempt, and then applies the optimizer step anyway: the bug the audit must
name. ``--ledger DIR``: the groups write the ledger there and the run ends with ``zephon-ray audit DIR --recipe
--dataset``, whose lines are printed; ``--json FILE``: the groups' losses, exit codes and the audit's lines.

Exits 0 when every group process ended as planned (0, or SIGKILLed where asked) and, with ``--ledger``, the audit's
exit code otherwise. Measured here: ``tests/test_torchtitan_torchft.py`` runs both commands above.

Why this trainer reads through FtSlices and not TorchTitan's fixed dp rank: with the fixed loader (``--fixed``, no
ledger) a group that serves the step-0 heal checkpoint crashed at its next step in 4 of 6 runs here with
``RuntimeError: aten.mm.default got mixed torch.Tensor and DTensor`` (once a SIGSEGV); likely because FtSlices reads the
quorum (``num_participants()`` waits for it) before the forward pass, while the fixed loader lets the forward run while
torchft's quorum thread still reads the state dict for the peer (not proven).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.toml")
EVENT_TIMEOUT_S = 300.0  # a group's start (TorchTitan's imports) on a busy 2-core machine, a wait at a rejoin
RUN_ID = "titan-ft"


# ---------------------------------------------------------------------------------------------- in each group
def zephon_ft_cpu():
    """Config registry function (``--module examples.torchtitan_torchft --config zephon_ft_cpu``)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance

    from examples.torchtitan_cpu import zephon_llama3_debugmodel_cpu

    base = zephon_llama3_debugmodel_cpu()
    kw = {f.name: getattr(base, f.name) for f in fields(base) if f.init}
    kw["optimizer"] = _optimizers_class().Config(param_groups=base.optimizer.param_groups)
    kw["loss"] = base.loss.loss_fn
    kw["checkpoint"] = TorchFTCheckpointManager.Config(enable=True, interval=1000, folder="ckpt")
    kw["parallelism"] = ParallelismConfig(
        data_parallel_replicate_degree=1, data_parallel_shard_degree=1, spmd_backend="partial_dtensor"
    )
    kw["fault_tolerance"] = FaultTolerance(
        enable=True,
        process_group="gloo",
        min_replica_size=1,
        replica_id=int(os.environ["ZR_FT_REPLICA"]),
        group_size=int(os.environ["ZR_FT_GROUPS"]),
    )
    loader = base.dataloader
    kw["dataloader"] = type(loader)(
        **{
            **{f.name: getattr(loader, f.name) for f in fields(loader) if f.init},
            "mode": "dataset",
            "dataset_dir": os.environ["ZR_FT_DATASET"],
            "aggregate_store": None,
            "run_id": RUN_ID,
            "ledger_dir": os.environ.get("ZR_FT_LEDGER") or None,
        }
    )
    return _trainer_class().Config(**kw)


_CLASSES: dict = {}


def _trainer_class():
    """``ZephonFTTrainer`` with this script's faults (``--kill``, ``--rejoin``), or with ``--fixed`` TorchTitan's own
    ``FaultTolerantTrainer`` and its fixed dp rank."""
    if "trainer" in _CLASSES:
        return _CLASSES["trainer"]
    if os.environ.get("ZR_FT_FIXED") == "1":
        from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer as base
    else:
        from zephon_ray.integrations.torchtitan.torchft import ZephonFTTrainer as base

    class ChurnTrainer(base):
        """The faults of ``--kill`` and ``--rejoin``, driven by environment variables the parent sets."""

        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):  # its own Config: build() makes this class
            pass

        def __init__(self, config):
            super().__init__(config)
            _marker("ready").write_text(str(os.getpid()))  # a rejoining group is up: the others may go on

        def train_step(self, data_iterator):
            step = self.ft_manager.manager.current_step()  # before the quorum: the step about to be tried
            hold = Path(os.environ["ZR_FT_WORK"]) / f"hold-{step}"
            if hold.exists():
                _marker(f"waiting-{step}").touch()
                deadline = time.monotonic() + EVENT_TIMEOUT_S
                while hold.exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"waited {EVENT_TIMEOUT_S:.0f} s at step {step} for a group to rejoin")
                    time.sleep(0.05)
            return super().train_step(data_iterator)

        def forward_backward_step(self, **kwargs):
            step = self.ft_manager.manager.current_step()  # after the quorum: the step being tried
            if str(step) in os.environ.get("ZR_FT_KILL_AT", "").split(","):
                _marker(f"dying-{step}").touch()
                os.kill(os.getpid(), signal.SIGKILL)  # in the middle of the step, before its all-reduce
            return super().forward_backward_step(**kwargs)

    _CLASSES["trainer"] = ChurnTrainer
    return ChurnTrainer


def _optimizers_class():
    """TorchTitan's ``TorchFTOptimizersContainer``, which with ``--apply-rejected S`` applies step S though torchft
    rejected it (once): the fault the ledger's audit must name."""
    if "optimizers" in _CLASSES:
        return _CLASSES["optimizers"]
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

    class VerdictIgnoringOptimizers(TorchFTOptimizersContainer):
        @dataclass(kw_only=True, slots=True)
        class Config(TorchFTOptimizersContainer.Config):
            pass

        done = False

        def step(self, *args, **kwargs):
            manager = self._ft_optimizer.manager
            at = os.environ.get("ZR_FT_APPLY_REJECTED_AT")
            if self._use_ft_optimizer and at and int(at) == manager.current_step() and not self.done:
                type(self).done = True
                manager.report_error(RuntimeError("injected: a failed all-reduce"))
                committed = manager.should_commit()  # False: torchft rejects the attempt
                print(f"zephon-ray example: step {at}: should_commit() = {committed}; applied anyway", flush=True)
                OptimizersContainer.step(self)  # the bug: the optimizer steps whatever the vote said
                return None
            return super().step(*args, **kwargs)

    _CLASSES["optimizers"] = VerdictIgnoringOptimizers
    return VerdictIgnoringOptimizers


def _marker(name: str) -> Path:
    return Path(os.environ["ZR_FT_WORK"]) / f"{name}-g{os.environ['ZR_FT_REPLICA']}-life{os.environ['ZR_FT_LIFE']}"


# ---------------------------------------------------------------------------------------------- the parent
def _event(text: str) -> tuple[int, int]:
    group, _, step = text.partition("@")
    try:
        return int(group), int(step)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GROUP@STEP (e.g. 1@4), got {text!r}") from None


def _spawn(args, work: Path, group: int, life: int, lighthouse: str, dataset: str) -> subprocess.Popen:
    B = 16  # recipes/tiny.toml's global batch
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "TORCHFT_LIGHTHOUSE": lighthouse,
        "ZR_FT_REPLICA": str(group),
        "ZR_FT_GROUPS": str(args.groups),
        "ZR_FT_DATASET": dataset,
        "ZEPHON_RAY_RECIPE": TINY,
        "ZR_FT_WORK": str(work),
        "ZR_FT_LIFE": str(life),
        "ZR_FT_FIXED": "1" if args.fixed else "0",
        "ZR_FT_LEDGER": args.ledger or "",
        "ZR_FT_KILL_AT": ",".join(str(s) for g, s in args.kill if g == group) if life == 0 else "",
        "ZR_FT_APPLY_REJECTED_AT": "" if args.apply_rejected is None or group else str(args.apply_rejected),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "torchtitan.train",
        "--module",
        "examples.torchtitan_torchft",
        "--config",
        "zephon_ft_cpu",
        "--training.steps",
        str(args.steps),
        "--training.local_batch_size",
        str(B // args.groups),
        "--dump_folder",
        str(work / f"dump{group}"),
    ]
    log = open(work / f"group{group}-life{life}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {EVENT_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


def run(args, work: Path, dataset: str) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    try:
        for step in [0] + [step for _, step in args.rejoin]:  # step 0: every group is up before the first quorum
            (work / f"hold-{step}").touch()
        for g in range(args.groups):
            procs[(g, 0)] = _spawn(args, work, g, 0, lighthouse.address(), dataset)
        _wait(
            lambda: all((work / f"waiting-0-g{g}-life0").exists() for g in range(args.groups)),
            "every group's first process to build its trainer",
        )
        (work / "hold-0").unlink()
        for g, step in sorted(args.rejoin, key=lambda e: e[1]):
            live = [x for x in range(args.groups) if x != g]
            _wait(lambda g=g: procs[(g, 0)].poll() is not None, f"group {g}'s first process to end")
            _wait(
                lambda step=step, live=live: all(
                    (work / f"waiting-{step}-g{x}-life0").exists() or procs[(x, 0)].poll() is not None for x in live
                ),
                f"the live groups to wait at step {step}",
            )
            procs[(g, 1)] = _spawn(args, work, g, 1, lighthouse.address(), dataset)
            _wait(
                lambda g=g: (work / f"ready-g{g}-life1").exists() or procs[(g, 1)].poll() is not None,
                f"group {g}'s new process to build its trainer",
            )
            (work / f"hold-{step}").unlink()
            print(f"  group {g} rejoined at step {step} (a new process)", flush=True)
        codes = {key: proc.wait(timeout=EVENT_TIMEOUT_S * 2) for key, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()
    groups = {}
    for (g, life), code in sorted(codes.items()):
        log = (work / f"group{g}-life{life}.log").read_text(errors="replace")
        losses = {}
        for line in log.splitlines():
            if "step:" in line and "loss:" in line:
                text = line.split("step:")[1]
                losses[int(text.split()[0])] = float(text.split("loss:")[1].split()[0].replace("\x1b[39m", ""))
        killed = any((work / f"dying-{s}-g{g}-life{life}").exists() for _, s in args.kill)
        errors = sorted({line.strip()[:200] for line in log.splitlines() if "Error" in line and "lspci" not in line})
        groups[f"{g}/{life}"] = {"exit": code, "killed": killed, "losses": losses, "errors": errors[:3]}
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kill", type=_event, action="append", default=[], metavar="G@S")
    parser.add_argument("--rejoin", type=_event, action="append", default=[], metavar="G@S")
    parser.add_argument("--apply-rejected", type=int, default=None, metavar="S")
    parser.add_argument("--ledger", default=None, help="the ledger directory; audited at the end")
    parser.add_argument("--dataset-dir", default=None, help="a materialised run of recipes/tiny.toml (else made here)")
    parser.add_argument("--fixed", action="store_true", help="TorchTitan's own trainer and fixed dp rank (no ledger)")
    parser.add_argument("--json", default=None, help="write the groups' results and the audit's lines here")
    args = parser.parse_args(argv)
    if args.fixed and (args.ledger or args.kill or args.apply_rejected is not None):
        parser.error("--fixed runs TorchTitan's own trainer: no --ledger, --kill or --apply-rejected")
    for g, step in args.rejoin:
        if g not in {k for k, _ in args.kill}:
            parser.error(f"--rejoin {g}@{step}: group {g} is never killed")
        if step < 1:
            parser.error(f"--rejoin {g}@{step}: a rejoin happens at step 1 or later")

    # torchft's Rust Lighthouse (in this process) logs every quorum poll at INFO; torchft reads RUST_LOG at import.
    os.environ.setdefault("RUST_LOG", "warn")
    work = Path(tempfile.mkdtemp(prefix="zr-titan-ft-"))
    t0 = time.time()
    try:
        dataset = args.dataset_dir
        if dataset is None:
            import ray

            from zephon_ray import Recipe
            from zephon_ray.jobs.materialize import materialize

            ray.init(
                address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(work / "ray")
            )
            try:
                materialize(
                    Recipe.from_toml(TINY), work / "rows", range(0, args.steps + 1), producers=1, progress=False
                )
            finally:
                ray.shutdown()
            dataset = str(work / "rows")
        groups = run(args, work, dataset)
        ok = True
        for key, result in groups.items():
            planned = result["exit"] == 0 or result["killed"]
            ok &= planned
            print(
                f"group {key}: exit {result['exit']}{' (killed)' if result['killed'] else ''}, losses "
                f"{[round(v, 5) for _, v in sorted(result['losses'].items())]}"
                + (f", errors {result['errors']}" if result["errors"] and not planned else "")
            )
        audit_lines: list[str] = []
        audited = 0
        if args.ledger:
            import contextlib
            import io

            from zephon_ray.cli import main as cli

            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                audited = cli(["audit", args.ledger, "--recipe", TINY, "--dataset", dataset])
            audit_lines = [line for line in out.getvalue().splitlines() if line]
            print("zephon-ray audit of the ledger:\n  " + "\n  ".join(audit_lines))
        print(f"({time.time() - t0:.0f} s)")
        if args.json:
            Path(args.json).write_text(
                json.dumps({"groups": groups, "audit": audit_lines, "audit_exit": audited}, indent=1)
            )
        return 0 if ok and not audited else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
