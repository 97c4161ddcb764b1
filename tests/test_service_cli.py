"""`zephon-ray digest --via service` (M = 1 and 2) prints exactly what `--via local` prints; CLI errors are clean.

Each service run starts its own private local Ray (no --address), so these tests need no fixture cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"
pytestmark = pytest.mark.timeout(400)


def _env():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(*args):
    return [sys.executable, "-m", "zephon_ray.cli", *args]


def test_digest_via_service_equals_local():
    steps = "0:12"
    runs = {
        "local": _cli("digest", str(TINY), "--steps", steps, "--via", "local"),
        "m1": _cli("digest", str(TINY), "--steps", steps, "--via", "service", "--producers", "1"),
        "m2": _cli("digest", str(TINY), "--steps", steps, "--via", "service", "--producers", "2"),
    }
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
             for k, cmd in runs.items()}
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=360)
        assert proc.returncode == 0, f"{key}: rc {proc.returncode}\n{stderr[-3000:]}"
        out[key] = stdout.splitlines()
    assert len(out["local"]) == 12
    assert all(line.startswith(f"step {i} ") and len(line.split()[2]) == 64 for i, line in enumerate(out["local"]))
    assert out["m1"] == out["local"]
    assert out["m2"] == out["local"]


def test_service_cli_errors_are_one_line():
    proc = subprocess.run(_cli("digest", str(TINY), "--steps", "0:2", "--via", "service", "--producers", "3"),
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("zephon-ray: error: ")
    assert "producers=3 does not divide" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""
