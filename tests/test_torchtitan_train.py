"""The real TorchTitan Trainer (llama3 debug model, CPU) on zephon-ray batches, launched by torchrun.

2 -> 1 (and 1 -> 2, slow): 2 steps at W1 with a DCP checkpoint at step 2, resumed at W2 to step 4. Per-step global
digests (every rank's recorded slice, concatenated in rank order) must equal the session's in-process reference
and the committed golden digests (tests/golden/tiny.json, made by the independent oracle); losses must equal the
committed W=1 losses REFERENCE_LOSSES. The slow test_reference_run_matches_its_committed_losses_and_digests runs
W=1 itself and checks those losses and ``zephon-ray digest``. The config is the test-side registry
``tests/titan_helpers.py`` (the CPU config of examples/torchtitan_cpu.py, recording each rank's slices).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zephon_ray import compute_digest

pytestmark = pytest.mark.spawns  # Ray, torchrun or other process trees (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"
STEPS = 4
LOSS_RE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def torchtitan(
    nproc: int,
    steps: int,
    dump: Path,
    record: Path,
    *,
    checkpoint: bool,
    env_extra: dict | None = None,
    args: tuple = (),
    fails: bool = False,
) -> dict[int, float] | str:
    """The per-step losses; with ``fails``, the output of a run that must exit non-zero."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "torchtitan.train",
        "--module",
        "titan_helpers",
        "--config",
        "zephon_llama3_debugmodel_cpu_recorded",
        "--training.steps",
        str(steps),
        "--dump_folder",
        str(dump),
    ]
    if checkpoint:
        cmd += ["--checkpoint.enable", "--checkpoint.interval", "2"]
    cmd += list(args)
    env = {
        **os.environ,
        "ZR_TEST_RECORD_DIR": str(record),
        "ZEPHON_RAY_RECIPE": str(TINY),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    }
    env.pop("ZEPHON_RAY_AGGREGATE_DIR", None)
    env.update(env_extra or {})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=dump.parent)
    out = ANSI_RE.sub("", proc.stdout + proc.stderr)
    if fails:
        assert proc.returncode != 0, out[-4000:]
        return out
    assert proc.returncode == 0, out[-4000:]
    losses: dict[int, float] = {}
    for step, loss in LOSS_RE.findall(out):
        losses.setdefault(int(step), float(loss))
    return losses


def recorded_digests(record: Path) -> dict[int, str]:
    """Global digest per step from the slices every rank recorded (the latest world size that served a step)."""
    by_step: dict[int, dict[int, list[Path]]] = {}
    for path in record.glob("step-*-rank-*-of-*.npz"):
        _, step, _, rank, _, world = path.stem.split("-")
        by_step.setdefault(int(step), {}).setdefault(int(world), []).append(path)
    digests = {}
    for step, worlds in by_step.items():
        for world, paths in worlds.items():
            assert len(paths) == world, f"step {step}: {len(paths)} of {world} ranks recorded"
            parts = [np.load(p) for p in sorted(paths)]
            digests[step] = compute_digest(
                np.concatenate([p["tokens"] for p in parts]), np.concatenate([p["positions"] for p in parts])
            )
    return digests


# TorchTitan's losses at W=1 (same config, seed 0; torch 2.13 CPU), to 5 decimals: steps 1..4.
REFERENCE_LOSSES = [8.20257, 7.97900, 7.64231, 7.18370]
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "tiny.json").read_text())["digests"].items()}


def check_run(losses: dict[int, float], digests: dict[int, str], reference_digests: list[str]) -> None:
    assert sorted(losses) == list(range(1, STEPS + 1)) and sorted(digests) == list(range(STEPS))
    for step in range(STEPS):
        assert digests[step] == reference_digests[step] == GOLDEN[step], f"step {step}: rows differ"
        assert losses[step + 1] == pytest.approx(REFERENCE_LOSSES[step], abs=2e-5), (step, losses)


@pytest.mark.slow  # a third torchrun (~20 s): the heavy resume below checks the same committed values
def test_reference_run_matches_its_committed_losses_and_digests(tmp_path, reference_digests):
    losses = torchtitan(1, STEPS, tmp_path / "dump", tmp_path / "record", checkpoint=False)
    digests = recorded_digests(tmp_path / "record")
    check_run(losses, digests, reference_digests)
    cli = subprocess.run(
        [sys.executable, "-m", "zephon_ray.cli", "digest", str(TINY), "--steps", f"0:{STEPS}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert cli.returncode == 0, cli.stderr
    assert digests == {int(line.split()[1]): line.split()[2] for line in cli.stdout.splitlines()}


@pytest.mark.parametrize(
    "w1,w2", [pytest.param(2, 1, marks=pytest.mark.heavy), pytest.param(1, 2, marks=pytest.mark.slow)]
)  # 1 -> 2: ~22 s duplicate
# Proves integrations/torchtitan/loader.py: the loader state DCP saved loads at another dp.
def test_resume_at_another_world(tmp_path, reference_digests, w1, w2):
    first = torchtitan(w1, 2, tmp_path / "dump", tmp_path / "record", checkpoint=True)
    assert (tmp_path / "dump" / "checkpoint" / "step-2").is_dir()
    second = torchtitan(w2, STEPS, tmp_path / "dump", tmp_path / "record", checkpoint=True)
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4], (first, second)
    check_run({**first, **second}, recorded_digests(tmp_path / "record"), reference_digests)


@pytest.mark.slow  # two torchruns (~30 s); the check itself: tests/test_torchtitan_loader.py
def test_a_checkpoint_whose_loader_state_was_not_loaded_is_refused(tmp_path):
    """The real Trainer (``ZephonTrainer``) saves at step 2; a resume that leaves the data loader's state out
    (``checkpoint.exclude_from_loading``) restores the weights at step 2 and a loader at step 0. The run stops
    before its first batch, naming both numbers, instead of training steps 0 and 1 again."""
    torchtitan(1, 2, tmp_path / "dump", tmp_path / "record", checkpoint=True)
    out = torchtitan(
        1,
        STEPS,
        tmp_path / "dump",
        tmp_path / "record",
        checkpoint=True,
        fails=True,
        args=("--checkpoint.exclude_from_loading", "dataloader"),
    )
    assert (
        "LoaderStateError: the trainer's checkpoint is at step 2 but the data loader's next_step is 0: resuming "
        "would repeat 2 step(s)"
    ) in out, out[-4000:]
    assert "step:  3" not in out and "step: 3" not in out


def test_trainer_config_rejects_a_global_batch_or_seq_len_that_is_not_the_recipes():
    from dataclasses import replace

    from zephon_ray.integrations.torchtitan.config_registry import zephon_llama3_debugmodel

    config = zephon_llama3_debugmodel()
    assert config.training.global_batch_size == 16 and config.training.seq_len == 64
    with pytest.raises(ValueError, match="training.global_batch_size 8 is smaller than the recipe's global batch"):
        replace(config, training=replace(config.training, global_batch_size=8))
    with pytest.raises(ValueError, match="training.seq_len 128 differs from the recipe's seq_len 64"):
        replace(config, training=replace(config.training, seq_len=128))


@pytest.mark.slow  # ~40 s: a materialise and a 3-process torchrun
def test_a_dp_degree_not_dividing_the_batch_trains_the_w1_losses(tmp_path, reference_digests):
    """dp = 3 on B = 16 rows (dataset mode: local mode needs dp dividing the 8 lanes): ranks hold 5, 5 and 6 rows,
    each padded to 6 with rows whose labels are all ignored, and the registry sets training.global_batch_size to
    18. TorchTitan 0.3 divides each rank's summed loss by the all-reduced count of valid labels and sums the
    gradients (FSDP's division off), so the real Trainer's losses are the W=1 run's as they are: no hook needed."""
    directory = tmp_path / "materialized"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "zephon_ray.cli",
            "materialize",
            str(TINY),
            "--steps",
            f"0:{STEPS}",
            "--out",
            str(directory),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    losses = torchtitan(
        3,
        STEPS,
        tmp_path / "dump",
        tmp_path / "record",
        checkpoint=False,
        env_extra={"ZEPHON_RAY_MODE": "dataset", "ZEPHON_RAY_DATASET_DIR": str(directory)},
    )
    check_run(losses, recorded_digests(tmp_path / "record"), reference_digests)
    rows = sorted(np.load(p)["tokens"].shape[0] for p in (tmp_path / "record").glob("step-000000-rank-*-of-003.npz"))
    assert rows == [5, 5, 6]  # the real rows only: the padding never enters the recorded slices or a digest
