"""Object storage under long faults (issue 25; slow): a 2-minute endpoint outage, and a 10-minute soak with random
faults from the proxy (outages of 2-20 s, 20 % SlowDown, latency, cut responses) while two jobs of 64 ranks each
read every step. Every step each job assembles from its 64 slices must be the oracle's (tests/oracle.py): 0 wrong
rows, no service restart. Against moto through tests/fault_proxy.py, as tests/test_storage_faults.py."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from tests import s3_server
from tests.conftest import RECIPES, ROOT, run_ranks

s3_server.configure_environment()

pytestmark = pytest.mark.slow
SOAK = ROOT / "tests" / "recipes" / "soak.toml"
RANKS = 64
SOAK_S = 600.0


@pytest.fixture(scope="module")
def soak_service(ray_cluster, s3):
    from zephon_ray import DataService, Recipe

    bucket = s3.new_bucket("zr-soak")
    s3.upload_tree(RECIPES / "data" / "tiny", bucket, "recipes/data/tiny")
    s3.client().upload_file(str(SOAK), bucket, "recipes/soak.toml")
    recipe = Recipe.from_toml(f"s3://{bucket}/recipes/soak.toml")
    svc = DataService.start(
        recipe,
        name="soak",
        namespace="zr-storage-soak",
        state_dir=f"s3://{bucket}/state",
        producers=2,
        checkpoint_every=2,
        run_id="soak",
        aggregate_store="torch://",
        window=8,
    )
    try:
        yield svc
    finally:
        s3.faults.clear()
        svc.stop()


class _Oracle:
    """The oracle's batches of soak.toml (tests/oracle.py; its data is tiny's, under recipes/), in blocks."""

    def __init__(self) -> None:
        self.batches: list = []

    def __getitem__(self, step: int):
        from tests import oracle

        if step >= len(self.batches):
            self.batches = oracle.global_batches(oracle.read_recipe(SOAK, root=RECIPES), step + 64)
        return self.batches[step]


def _read_jobs(svc, oracle: _Oracle, until: float, first: int) -> dict:
    """Two jobs of RANKS threads; each job's ranks read step s together; the job's step is the concatenation of its
    slices in rank order. Returns steps read per job and the wrong rows."""
    from zephon_ray import DataService
    from zephon_ray.batch import compute_digest

    result = {"steps": {}, "wrong_rows": 0, "errors": []}

    def job(name: str) -> None:
        client = DataService.connect("soak", namespace="zr-storage-soak", consumer=name)
        step = first
        try:
            while time.monotonic() < until:
                parts = run_ranks(RANKS, lambda r, step=step: client.slice(step, r, RANKS, track=True))
                tokens = np.concatenate([p.tokens for p in parts])
                positions = np.concatenate([p.positions for p in parts])
                want = oracle[step]
                if compute_digest(tokens, positions) != want.digest:
                    result["wrong_rows"] += (
                        int(((tokens != want.tokens).any(axis=1) | (positions != want.positions).any(axis=1)).sum())
                        or RANKS
                    )
                step += 1
                if step % 4 == 0:
                    client.commit(step)
            result["steps"][name] = step - first
        except Exception as exc:  # noqa: BLE001 - reported by the test
            result["errors"].append(f"{name} at step {step}: {exc}")
        finally:
            client.release()

    names = ("job-a", "job-b")
    run_ranks(len(names), lambda i: job(names[i]), timeout_s=until - time.monotonic() + 600)
    return result


def test_two_minute_outage_then_a_ten_minute_soak_with_random_faults(s3, soak_service):
    svc = soak_service
    oracle = _Oracle()
    before = svc.status()
    # 1. A 2-minute outage while both jobs read: the held steps are served, the rest wait, then all resume.
    s3.faults.refuse_for(120.0)
    outage = _read_jobs(svc, oracle, time.monotonic() + 150.0, first=0)
    assert not outage["errors"] and outage["wrong_rows"] == 0, outage
    assert min(outage["steps"].values()) > 8, outage  # production went on after the endpoint returned
    # 2. Ten minutes of random faults.
    stop = threading.Event()
    rng = random.Random(25)
    done = dict(outage["steps"])

    def chaos() -> None:
        while not stop.is_set():
            kind = rng.choice(["outage", "slowdown", "latency", "cut", "calm"])
            if kind == "outage":
                s3.faults.refuse_for(rng.uniform(2, 20))
            elif kind == "slowdown":
                s3.faults.set_faults(slowdown=0.2)
            elif kind == "latency":
                s3.faults.set_faults(latency_s=rng.uniform(0.05, 0.5))
            elif kind == "cut":
                s3.faults.cut(rng.randint(1, 3))
            stop.wait(rng.uniform(10, 30))
            s3.faults.clear()

    chaos_thread = threading.Thread(target=chaos, daemon=True)
    chaos_thread.start()
    try:
        soak = _read_jobs(svc, oracle, time.monotonic() + SOAK_S, first=max(done.values()))
    finally:
        stop.set()
        chaos_thread.join(60)
        s3.faults.clear()
    assert not soak["errors"] and soak["wrong_rows"] == 0, soak
    after = svc.status()
    assert after["fatal"] is None and after["restarts"] == before["restarts"], after["last_restart"]
    print(
        f"soak: {soak['steps']} steps per job in {SOAK_S:.0f} s of random faults, 0 wrong rows; proxy "
        f"{s3.faults.stats}; coordinator storage retries {after['storage']}"
    )
