"""TorchTitan 0.3.0's torchft trainer through zephon-ray (``ZephonFTTrainer``) writes the exactly-once ledger.

Both tests run ``examples/torchtitan_torchft.py``: replica groups as ``torchrun`` processes of TorchTitan's real
``FaultTolerantTrainer`` (CPU shims, llama3 debug model), a real torchft Lighthouse in the parent, rows of
recipes/tiny.toml from a materialised directory.

* A churn: 2 groups, group 1 SIGKILLed in step 2 (before its all-reduce, so the survivor's attempt is rejected and
  step 2 is served again to it alone) and a new process of group 1 rejoining at step 4 (torchft heals it under
  TorchTitan's async quorum, the ledger head coming with the peer's ``train_state``). ``zephon-ray audit`` of the ledger
  is clean, and the test checks the ledger itself: every step once per reader of the W it was committed at, W 1 at
  the step the kill hit (recorded as attempt 1) and 2 at the end, and every record's digest equal to that reader's
  slice of the global batch, whose digest is the golden (tests/golden/tiny.json, made by the independent oracle).
* An applied rejected attempt: one group whose optimizer applies step 1 though torchft rejected it (the example's
  ``--apply-rejected``, a verdict-ignoring optimizer container): the audit names step 1 in one line.

Slow: TorchTitan's start-up in every group process (about 90-200 s per run on 2 busy cores).
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
EXAMPLE = ROOT / "examples" / "torchtitan_torchft.py"
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "tiny.json").read_text())["digests"].items()}


@pytest.fixture(scope="module")
def tiny_rows(ray_cluster, tmp_path_factory):
    from zephon_ray import Recipe
    from zephon_ray.jobs.materialize import materialize

    directory = tmp_path_factory.mktemp("titan-ft") / "tiny"
    materialize(Recipe.from_toml(TINY), directory, range(0, 10), producers=1, progress=False)
    return str(directory)


def _example(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert out.is_file(), (proc.stdout + proc.stderr)[-4000:]
    return proc, json.loads(out.read_text())


def test_a_churn_through_torchtitans_torchft_trainer_audits_clean(tiny_rows, tmp_path):
    from zephon_ray import GlobalBatchSource, Recipe
    from zephon_ray.formats.ledger import read_ledger

    ledger = tmp_path / "ledger"
    proc, summary = _example(
        tmp_path,
        "--groups",
        "2",
        "--steps",
        "8",
        "--kill",
        "1@2",
        "--rejoin",
        "1@4",
        "--ledger",
        str(ledger),
        "--dataset-dir",
        tiny_rows,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    groups = summary["groups"]
    assert sorted(groups) == ["0/0", "1/0", "1/1"]
    assert groups["1/0"]["killed"] and groups["0/0"]["exit"] == groups["1/1"]["exit"] == 0, groups
    (verdict,) = summary["audit"]
    assert verdict.startswith("audit: clean: steps [0, ") and "each trained exactly once" in verdict, verdict
    assert "slice digests matched the recipe's global batches" in verdict, verdict

    records = [r for seg in read_ledger(str(ledger)).values() for part in seg.parts.values() for r in part]
    steps = sorted({r.step for r in records})
    assert steps == list(range(len(steps))) and len(steps) >= 6, steps
    worlds = {}
    for r in records:
        worlds.setdefault(r.step, set()).add(r.world)
    assert all(len(w) == 1 for w in worlds.values()), worlds  # one W per committed step
    w = [worlds[s].pop() for s in steps]
    # The kill leaves group 0 alone (W 1) at step 2; the rejoined process takes part once healed (W 2 at the end).
    # Before the kill W may be 1 as well: under TorchTitan's async quorum a group that heals (group 1 at step 0,
    # torchft's init_sync) trains placeholder rows in that step, and one run here had group 1 out of step 1 too.
    assert w[2] == 1 and w[-1] == 2 and set(w) == {1, 2}, w
    assert sorted((r.step, r.rank) for r in records) == sorted((s, k) for s in steps for k in range(w[s]))
    assert all(r.trained == 1 for r in records)
    assert any(r.attempt == 1 and r.world == 1 and r.step == 2 for r in records), records  # the kill hit step 2

    source = GlobalBatchSource(Recipe.from_toml(TINY))  # the rows, independently of the audit's own check
    for r in records:
        batch = source.batch(r.step)
        assert batch.digest == GOLDEN[r.step]
        assert r.digest == batch.slice(r.rank, r.world).ledger_digest, (r.step, r.rank, r.world)


def test_an_applied_rejected_attempt_on_torchtitans_torchft_trainer_is_named(tiny_rows, tmp_path):
    from zephon_ray.formats.ledger import read_ledger

    ledger = tmp_path / "ledger"
    proc, summary = _example(
        tmp_path,
        "--groups",
        "1",
        "--steps",
        "4",
        "--apply-rejected",
        "1",
        "--ledger",
        str(ledger),
        "--dataset-dir",
        tiny_rows,
    )
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]  # the audit's finding
    assert summary["groups"]["0/0"]["exit"] == 0
    records = sorted(
        (r.step, r.rank, r.attempt, r.trained)
        for seg in read_ledger(str(ledger)).values()
        for part in seg.parts.values()
        for r in part
    )
    assert records == [(0, 0, 0, 1), (1, 0, 1, 2), (2, 0, 0, 1)]  # step 1 served again, applied both times
    assert summary["audit"] == [
        "step 1: trained twice: rank 0 of 1 trained it 2 times (its record is attempt 1: an earlier attempt that "
        "torchft rejected was applied too)",
        "audit: 1 finding(s) in steps [0, 3) (W 1)",
    ], summary["audit"]
