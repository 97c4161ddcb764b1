"""The real TorchTitan Trainer (llama3 debug model, CPU) on zephon-ray batches, launched by torchrun.

A reference run at W=1 for 4 steps; then 2 -> 1 and 1 -> 2: 2 steps at W1 with a DCP checkpoint at step 2, resumed
at W2 to step 4. Per-step global digests (every rank's recorded slice, concatenated in rank order) must equal the
reference and ``zephon-ray digest``; losses must equal the reference. The config is the test-side registry
``tests/titan_helpers.py`` (the CPU config of examples/torchtitan_cpu.py, recording each rank's slices).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zephon_ray import compute_digest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"
STEPS = 4
LOSS_RE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def torchtitan(nproc: int, steps: int, dump: Path, record: Path, *, checkpoint: bool) -> dict[int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "torchtitan.train", "--module", "titan_helpers", "--config", "zephon_llama3_debugmodel_cpu_recorded",
           "--training.steps", str(steps), "--dump_folder", str(dump)]
    if checkpoint:
        cmd += ["--checkpoint.enable", "--checkpoint.interval", "2"]
    env = {**os.environ, "ZR_TEST_RECORD_DIR": str(record), "ZEPHON_RAY_RECIPE": str(TINY),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("ZEPHON_RAY_AGGREGATE_DIR", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=dump.parent)
    out = ANSI_RE.sub("", proc.stdout + proc.stderr)
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
            digests[step] = compute_digest(np.concatenate([p["tokens"] for p in parts]),
                                           np.concatenate([p["positions"] for p in parts]))
    return digests


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("tt-ref")
    losses = torchtitan(1, STEPS, base / "dump", base / "record", checkpoint=False)
    return losses, recorded_digests(base / "record")


def test_reference_matches_zephon_ray_digest(reference, reference_digests):
    losses, digests = reference
    assert sorted(losses) == list(range(1, STEPS + 1))
    cli = subprocess.run([sys.executable, "-m", "zephon_ray.cli", "digest", str(TINY), "--steps", f"0:{STEPS}"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    expected = {int(line.split()[1]): line.split()[2] for line in cli.stdout.splitlines()}
    assert digests == expected
    assert [digests[s] for s in range(STEPS)] == reference_digests[:STEPS]


@pytest.mark.parametrize("w1,w2", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])  # 1 -> 2: ~22 s duplicate
def test_resume_at_another_world(reference, tmp_path, w1, w2):
    ref_losses, ref_digests = reference
    first = torchtitan(w1, 2, tmp_path / "dump", tmp_path / "record", checkpoint=True)
    assert (tmp_path / "dump" / "checkpoint" / "step-2").is_dir()
    second = torchtitan(w2, STEPS, tmp_path / "dump", tmp_path / "record", checkpoint=True)
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4], (first, second)
    assert recorded_digests(tmp_path / "record") == ref_digests
    losses = {**first, **second}
    for step in range(1, STEPS + 1):
        assert losses[step] == pytest.approx(ref_losses[step], abs=2e-5), (step, losses, ref_losses)


def test_trainer_config_rejects_a_global_batch_or_seq_len_that_is_not_the_recipes():
    from dataclasses import replace

    from zephon_ray.integrations.torchtitan.config_registry import zephon_llama3_debugmodel

    config = zephon_llama3_debugmodel()
    assert config.training.global_batch_size == 16 and config.training.seq_len == 64
    with pytest.raises(ValueError, match="training.global_batch_size 32 differs from the recipe's global batch of 16"):
        replace(config, training=replace(config.training, global_batch_size=32))
    with pytest.raises(ValueError, match="training.seq_len 128 differs from the recipe's seq_len 64"):
        replace(config, training=replace(config.training, seq_len=128))
