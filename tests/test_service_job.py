"""`ray job submit` starts the service; a second submitted job reads slices from it and prints their digests.

The test starts its own Ray head (`ray start --head`, dashboard on, held non-default ports, its own --temp-dir) and
stops exactly that cluster afterwards by killing the processes whose command line names its temp dir
(tests/ray_clusters.py). It never runs `ray stop`, which would stop every cluster on the machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_clusters import checkout_pythonpath, pids_with, ray_head
from zephon_ray import GlobalBatchSource, compute_digest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"
RAY = str(Path(sys.executable).with_name("ray"))
pytestmark = [pytest.mark.spawns, pytest.mark.timeout(420)]


@pytest.fixture
def head_cluster():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"  # Ray 2.60 enables token auth; CLI clients must send the token
    env["PYTHONPATH"] = checkout_pythonpath()
    with ray_head("zrjob-") as head:
        cmd = [
            RAY,
            "start",
            "--head",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            *head.flags,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert pids_with(head.temp_dir), "ray start returned but no process of our cluster runs"
        yield {"address": f"http://{head.dashboard}", "gcs": head.gcs, "env": env, "temp_dir": head.temp_dir}


def _submit(cluster, *args, timeout=240):
    cmd = [
        RAY,
        "job",
        "submit",
        "--address",
        cluster["address"],
        "--entrypoint-num-cpus",
        "0",
        "--",
        sys.executable,
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cluster["env"], timeout=timeout)
    assert proc.returncode == 0 and "succeeded" in proc.stdout, (
        f"job {args[0]} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


@pytest.mark.heavy
def test_job_submit_starts_service_and_second_job_reads_slices(head_cluster, tiny_recipe, reference_digests, tmp_path):
    name, ns, world, steps = "job-svc", "zr-job", 4, range(0, 6)
    out = _submit(
        head_cluster,
        str(ROOT / "service" / "start.py"),
        str(TINY),
        "--name",
        name,
        "--namespace",
        ns,
        "--producers",
        "2",
        "--window",
        "4",
        "--state-dir",
        str(tmp_path / "state"),
    )  # defaults: run_id, store
    assert "serving" in out and "2 producers" in out, out[-2000:]
    try:
        out = _submit(
            head_cluster,
            str(ROOT / "service" / "read_slices.py"),
            "--name",
            name,
            "--namespace",
            ns,
            "--steps",
            f"{steps.start}:{steps.stop}",
            "--world",
            str(world),
        )
        got_steps = dict(re.findall(r"^step (\d+) ([0-9a-f]{64})$", out, re.M))
        got_slices = {
            (int(s), int(r)): d for s, r, d in re.findall(rf"^slice (\d+) (\d+)/{world} ([0-9a-f]{{64}})$", out, re.M)
        }
        assert {int(s): d for s, d in got_steps.items()} == {s: reference_digests[s] for s in steps}, out[-3000:]
        with GlobalBatchSource(tiny_recipe) as source:
            want = {
                (s, r): compute_digest(part.tokens, part.positions)
                for s in steps
                for r in range(world)
                for part in [source.batch(s).slice(r, world)]
            }
        assert got_slices == want
        # The CLI reaches the same cluster through the GCS address (token auth on).
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "zephon_ray.cli",
                "status",
                "--name",
                name,
                "--namespace",
                ns,
                "--address",
                head_cluster["gcs"],
            ],
            capture_output=True,
            text=True,
            env=head_cluster["env"],
            timeout=120,
        )
        assert status.returncode == 0 and "producers   2" in status.stdout, status.stdout + status.stderr[-2000:]
        missing = subprocess.run(
            [
                sys.executable,
                "-m",
                "zephon_ray.cli",
                "status",
                "--name",
                "nope",
                "--namespace",
                ns,
                "--address",
                head_cluster["gcs"],
            ],
            capture_output=True,
            text=True,
            env=head_cluster["env"],
            timeout=120,
        )
        assert missing.returncode == 2 and "zephon-ray: error: no service named 'nope'" in missing.stderr
        assert "Traceback" not in missing.stderr
    finally:
        out = _submit(head_cluster, str(ROOT / "service" / "stop.py"), "--name", name, "--namespace", ns)
    assert f"stopped '{name}'" in out
