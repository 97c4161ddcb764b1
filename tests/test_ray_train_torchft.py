"""Ray Train's torchft mode (Ray 2.60's ``TorchftConfig``) reading zephon-ray batches through ``ZephonDatasetShard.ft``.

Runs ``examples/ray_train_torchft.py``: a ``TorchTrainer`` with ``TorchftConfig`` (a real torchft Lighthouse actor,
each of 2 workers its own replica group, gloo), a ``ZephonDataset`` of a DataService of recipes/tiny.toml in the
example's own private Ray and ``ZephonDataConfig(ledger_dir=...)``, passed in ``train_loop_config`` (a replaced
worker's ``ray.train.get_dataset_shard`` never returns under TorchftConfig in Ray 2.60: docs/torchft.md). Group 1's worker is
SIGKILLed in step 2 before its all-reduce; Ray Train starts a new worker for that group, torchft heals it from the
survivor, and it trains again. Checked: every committed step was trained once per reader of the W it was committed at
(W 1 at the step the kill hit, 2 at the end), each reader's rows have the digest of its slice of the global batch,
whose digest is the independent oracle's (tests/golden/tiny.json), and ``zephon-ray audit`` of the ledger is clean.

Slow: a Ray start, Ray Train's worker start-up twice, torchft's quorums (about 2-3 minutes on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spawns, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"
EXAMPLE = ROOT / "examples" / "ray_train_torchft.py"
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "tiny.json").read_text())["digests"].items()}


def test_a_killed_replica_group_keeps_the_global_batch_under_ray_train_torchft(tmp_path):
    from zephon_ray import GlobalBatchSource, Recipe

    out, ledger = tmp_path / "summary.json", tmp_path / "ledger"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the example starts a private Ray
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--workers",
            "2",
            "--steps",
            "7",
            "--kill",
            "1@2",
            "--ledger",
            str(ledger),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert out.is_file(), (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads(out.read_text())
    assert proc.returncode == 0 and summary["error"] is None, (summary, (proc.stdout + proc.stderr)[-3000:])
    assert "life-1-1" in summary["lives"], summary["lives"]  # Ray Train replaced group 1's worker
    (verdict,) = summary["audit"]
    assert verdict.startswith("audit: clean: steps [0, 7) each trained exactly once"), verdict
    assert "slice digests matched the recipe's global batches" in verdict, verdict

    steps: dict[int, list[dict]] = {}
    for record in summary["steps"]:
        steps.setdefault(record["step"], []).append(record)
    assert sorted(steps) == list(range(7)), sorted(steps)
    source = GlobalBatchSource(Recipe.from_toml(TINY))
    worlds = []
    for step, records in sorted(steps.items()):
        (world,) = {r["world"] for r in records}
        assert sorted(r["rank"] for r in records) == list(range(world)), (step, records)
        batch = source.batch(step)
        assert batch.digest == GOLDEN[step]
        for r in records:
            assert r["digest"] == batch.slice(r["rank"], world).ledger_digest, (step, r)
        worlds.append(world)
    assert worlds[0] == 2 and worlds[2] == 1 and worlds[-1] == 2, worlds  # the kill at step 2, the rejoin
