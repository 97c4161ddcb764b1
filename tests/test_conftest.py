"""tests/conftest.py's start of a worker's session Ray: only Ray's fixed start-up timeout is retried, and the processes
the failed start left are killed first. ``ray.init`` is replaced here (the retry is the tests' own machinery, not
zephon-ray's); a real timeout needs a machine too loaded to start a raylet in 30 s."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import ray
from conftest import RAY_START_TIMEOUT, init_ray_retrying_start_timeout


def test_a_start_timeout_kills_what_the_failed_start_left_and_starts_again(monkeypatch):
    calls, left = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:  # as Ray's Node does: its processes are started, then the raylet never registers
            left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
            raise Exception(f"{RAY_START_TIMEOUT}. This could happen because some of the raylet failed to startup")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # this worker's own session Ray, if it has one, stays up
    init_ray_retrying_start_timeout(address="local", num_cpus=8)
    assert calls == [{"address": "local", "num_cpus": 8}] * 2
    assert not psutil.pid_exists(left[0].pid)  # killed and reaped, not left running


def test_any_other_error_is_raised_at_once(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        raise ValueError("num_cpus must be a non-negative integer")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(ValueError, match="num_cpus"):
        init_ray_retrying_start_timeout(num_cpus=-1)
    assert len(calls) == 1
