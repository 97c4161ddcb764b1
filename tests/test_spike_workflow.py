"""examples/spike_workflow.py, the loss-spike workflow of docs/operations.md, run as a user would: the run, ``show
--docs`` of the spike step and the steps before it, a rollback with a ``[[skips]]`` entry resumed at W = 2, the audit
(a note, exit 0; undeclared, findings) and ``locate`` with the run's schedule (the example checks each and exits 1
if one fails)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.spawns, pytest.mark.timeout(600)]


def test_the_spike_workflow_runs_end_to_end():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "spike_workflow.py")],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "spike workflow: OK" in out
    assert "note: step 6: data steps 6..9 skipped by schedule entry 'spike-1'" in out
    assert "read data steps [10, 11, 12, 13]" in out
