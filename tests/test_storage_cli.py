"""Storage settings reach the cluster, secrets do not; worker-side storage failures are one line (issue 25).

- :func:`zephon_ray.cli.exit_codes.storage_failure` / :func:`zephon_ray.cli.exit_codes.worker_error` turn an error that came
  back from Ray workers (a traceback-laden RayTaskError around a storage error) into one line naming the object and
  the likely cause; exit code 2 (the CLI's user-error code).
- docs/deployment.md's cloud section runs as written, in that order, on a cluster started before the storage
  exports (slow: a `ray start --head` cluster of its own).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from tests import s3_server
from tests.conftest import ROOT, TINY
from tests.ports import Reserved

s3_server.configure_environment()


class _FakeRayTaskError(RuntimeError):
    """Stands in for ray.exceptions.RayTaskError's shape: a long traceback text and the cause."""

    __module__ = "ray.exceptions"

    def __init__(self, cause: BaseException) -> None:
        super().__init__(
            "ray::LaneGroupWorker.__call__() (pid=1, ip=10.0.0.9)\nTraceback (most recent call last):\n"
            '  File "x.py", line 1, in f\n    g()\n' + f"{type(cause).__name__}: {cause}"
        )
        self.cause = cause


@pytest.mark.parametrize(
    "cause, needles",
    [
        (
            "s3://zr-b/runs/run7/materialized/manifest.json: access denied (read it); check the credentials "
            "(AWS_ACCESS_KEY_ID/AWS_PROFILE, or the node's instance role): AWS Error ACCESS_DENIED",
            ["s3://zr-b/runs/run7/materialized/manifest.json", "no credentials", "never shipped"],
        ),
        (
            "s3://zr-b/recipes/data/tiny/code: cannot list (cannot connect to the endpoint (default AWS))",
            ["s3://zr-b/recipes/data/tiny/code", "no endpoint", "AWS_ENDPOINT_URL"],
        ),
    ],
)
def test_a_worker_storage_failure_is_one_line_naming_the_object_and_the_cause(monkeypatch, cause, needles):
    from zephon_ray.cli.exit_codes import worker_error

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    line = worker_error(_FakeRayTaskError(OSError(cause)))
    assert line is not None and "\n" not in line and "Traceback" not in line and "s3cr3t" not in line, line
    for needle in needles:
        assert needle in line, line
    assert worker_error(ValueError("a local error")) is None  # this process's own errors keep their handling


def _cloud_section() -> str:
    text = (ROOT / "docs" / "deployment.md").read_text()
    marker = "tests/test_storage_cli.py::test_deployment_cloud_section_runs_as_written"
    start = text.index("```bash", text.index(marker)) + len("```bash")
    return text[start : text.index("```", start)]


@pytest.mark.slow
@pytest.mark.spawns
def test_deployment_cloud_section_runs_as_written(tmp_path):
    """The section's commands, unchanged but for its placeholders (the credentials, the endpoint, the bucket and
    the cluster's address), on a `ray start --head` cluster started *before* the exports: its nodes have the
    credentials (their own environment, as an instance role gives them) and no endpoint or region."""
    from tests import oracle

    s3 = s3_server.server()
    bucket = s3.new_bucket("zr-deploy")
    held = Reserved()  # until the head is stopped: its GCS binds beside the holder (tests/ports.py)
    port = held.port
    node_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_ENDPOINT", "S3_ENDPOINT", "AWS_REGION", "ZR_TEST_"))
    }
    node_env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{node_env.get('PATH', '')}"
    ray_dir = tempfile.mkdtemp(prefix="zr-")  # short: Ray's socket paths under it must stay within 107 bytes
    head = subprocess.Popen(
        [
            "ray",
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=8",
            "--include-dashboard=false",
            f"--temp-dir={ray_dir}",
            "--block",
        ],
        env=node_env,
        cwd=tmp_path,
        start_new_session=True,
        stdout=open(tmp_path / "head.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180  # `ray start --head` on a loaded machine: its GCS port opens late
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-2000:]
                time.sleep(1)
        script = _cloud_section()
        script = script.replace("AWS_ACCESS_KEY_ID=...", f"AWS_ACCESS_KEY_ID={s3_server.ACCESS_KEY}")
        script = script.replace("AWS_SECRET_ACCESS_KEY=...", f"AWS_SECRET_ACCESS_KEY={s3_server.SECRET_KEY}")
        script = script.replace("http://minio.internal:9000", s3.endpoint).replace(
            "BUCKET=my-bucket", f"BUCKET={bucket}"
        )
        script = script.replace("127.0.0.1:6379", f"127.0.0.1:{port}")
        assert "..." not in script and "minio" not in script
        env = dict(node_env, RAY_ADDRESS=f"127.0.0.1:{port}")
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
        )
        assert run.returncode == 0, run.stderr[-3000:]
        digests = oracle.digests(TINY, 4)
        lines = re.findall(r"^step (\d+) ([0-9a-f]{64})$", run.stdout, re.M)
        assert [d for _, d in lines] == digests + digests, run.stdout  # via service, then via the dataset
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(60)
        held.release()
        shutil.rmtree(ray_dir, ignore_errors=True)
