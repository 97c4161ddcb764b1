"""examples/online_mixing.py at a small size: a policy that re-weights the mixture from per-source losses while the
run trains (local mode, per-token source ids, ``Loader.add_phase``), then a replay of the recorded schedule from
step 0 with no policy, and a resume halfway at W = 3 in service mode: both give the run's global batches."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

# slow: about 60 s of the default suite's time; tests/test_phases.py checks its parts (a run-time phase in the
# loader state in CI's heavy tier; local-mode phases on every reader and source ids in the default suite).
pytestmark = [pytest.mark.spawns, pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_example_decides_phases_and_both_replays_are_identical():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "online_mixing.py"), "--steps", "12", "--every", "4", "--lag", "3"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": str(ROOT)},
    )
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]
    phases = [line for line in out.splitlines() if line.startswith("  from step ")]
    assert [line.split(":")[0] for line in phases] == ["  from step 7", "  from step 11"], out
    assert "replay from step 0 with the recorded schedule, no policy: identical global batches: YES" in out, out
    assert "resume at step 6, W=3, service mode: identical global batches: YES" in out, out
