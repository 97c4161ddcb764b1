"""A start that cannot work says so in one line, at once: its checks of the cluster address and of its storage.

- Attaching to an address where no cluster answers is one line within ``CONNECT_TIMEOUT_S`` (Ray alone waits
  minutes), from the Python API and from ``zephon-ray status --address``.
- A ``state_dir`` whose endpoint does not resolve is one line within the start's storage budget
  (``storage.START_BUDGET_S``), not an outage retried for ten minutes; refused credentials and a missing bucket are one
  line at once; none of them writes anything (against the real S3 API server of tests/s3_server.py).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import s3_server
from tests.conftest import ROOT, one_line
from tests.ports import held_ports

s3_server.configure_environment()  # at collection: before any test starts Ray, so Ray workers inherit it


def test_no_cluster_at_the_address_is_one_line_at_once():
    from zephon_ray.service.client.session import CONNECT_TIMEOUT_S, check_reachable

    with held_ports() as (port,):  # held, not listening: nothing answers there, and nothing can start to
        t0 = time.monotonic()
        with pytest.raises(ConnectionError) as info:
            check_reachable(f"127.0.0.1:{port}")
        one_line(info.value, f":{port}", "no Ray cluster answers", "ray start --head")
        assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 5
        done = subprocess.run(
            [sys.executable, "-m", "zephon_ray.cli", "status", "--name", "run7", "--address", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines and lines[-1].startswith("zephon-ray: error: no Ray cluster answers"), (
        done.stderr[-2000:]
    )


@pytest.mark.heavy
def test_an_unresolvable_storage_endpoint_is_one_line_within_the_start_budget(monkeypatch):
    from zephon_ray import DataService, storage

    for name in ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):  # the tests' own endpoint, set by other modules
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://no-such-host.invalid:9000")
    monkeypatch.setenv("ZEPHON_RAY_S3_CONNECT_TIMEOUT_S", "1")
    storage.clear_filesystem_cache()
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError) as info:
            DataService.start("tiny", name="unreachable", state_dir="s3://zr-bucket/run7")
        waited = time.monotonic() - t0
    finally:
        storage.clear_filesystem_cache()
    one_line(info.value, "s3://zr-bucket/run7", "resolve host", f"{storage.START_BUDGET_S:g}s")
    assert waited < storage.START_BUDGET_S + 60, waited  # the start's budget, not the 600 s outage budget


def test_refused_credentials_and_a_missing_bucket_at_start_write_nothing():
    from zephon_ray import DataService, storage

    s3 = s3_server.server().start()
    bucket = s3.new_bucket("zr-launch")
    s3.require_auth(True)
    storage.clear_filesystem_cache()
    try:
        with pytest.raises(ValueError) as info:
            DataService.start("tiny", name="refused", state_dir=f"s3://{bucket}/state")
    finally:
        s3.require_auth(False)
        storage.clear_filesystem_cache()
    one_line(info.value, f"s3://{bucket}/state", "access denied", "check the credentials")
    assert s3.keys(bucket) == {}
    t0 = time.monotonic()
    with pytest.raises(ValueError) as info:
        DataService.start("tiny", name="absent", state_dir=f"s3://zr-absent-{bucket}/state")
    one_line(info.value, "does not exist")
    assert time.monotonic() - t0 < 30  # permanent: no retries
