"""Ray Train elastic training on zephon-ray batches: every resize and every failure keeps the global batches.

Each scenario trains the plain torch loop (a tiny bigram LM) under ``TorchTrainer``: 4 workers to step 4, resumed
from the Ray Train checkpoint by 2 workers to step 6, then by 3 workers to step 8 (recipes/elastic.toml: 12 lanes,
B = 24, so 2, 3 and 4 divide both). Every step's global digest, gathered from the ranks' slices, must equal the
in-process reference, and every loss the W=1 in-process reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zephon_ray import GlobalBatchSource, Recipe

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
STEPS = 8
SCHEDULE = ((4, 4), (2, 6), (3, 8))  # (W, train until step)


@pytest.fixture(scope="module")
def elastic_reference():
    from zephon_ray.torchtitan.ray_train import ElasticRun, reference_losses

    with GlobalBatchSource(Recipe.from_toml(ELASTIC)) as source:
        digests = [source.batch(s).digest for s in range(STEPS)]
    losses = reference_losses(ElasticRun(recipe=ELASTIC, run_id="ref", log_path="", steps=STEPS))
    return digests, losses


def run_schedule(tmp_path, schedule, **loader):
    from zephon_ray.torchtitan.ray_train import ElasticRun, fit, read_log

    log = str(tmp_path / "steps.jsonl")
    for world, until in schedule:
        run = ElasticRun(recipe=ELASTIC, run_id="elastic-test", log_path=log, steps=until, checkpoint_every=2,
                         **loader)
        result = fit(run, workers=world, name="elastic", storage_path=str(tmp_path / "ray-results"))
        assert result.error is None, result.error
    return read_log(log)


def check(records, elastic_reference, worlds):
    digests, losses = elastic_reference
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["world"] for r in records] == worlds
    assert [r["digest"] for r in records] == digests
    for r in records:
        assert r["loss"] == pytest.approx(losses[r["step"]], abs=1e-5), r


WORLDS = [4] * 4 + [2] * 2 + [3] * 2


def test_elastic_4_2_3_service(ray_cluster, tmp_path, elastic_reference):
    from zephon_ray import DataService

    service = DataService.start(ELASTIC, name="elastic-svc", namespace="zr-elastic-tests", producers=2, window=8,
                                state_dir=str(tmp_path / "svc"), checkpoint_every=4, aggregate_store="torch://",
                                run_id="elastic-svc")
    try:
        records = run_schedule(tmp_path, SCHEDULE, mode="service", service_name="elastic-svc",
                               service_namespace="zr-elastic-tests")
    finally:
        service.stop()
    check(records, elastic_reference, WORLDS)


def test_elastic_4_2_3_local_torch_store(ray_cluster, tmp_path, elastic_reference):
    """Local mode aggregating through Ray Train's own TCPStore (rank 0's, a new port after every restart)."""
    records = run_schedule(tmp_path, SCHEDULE, mode="local", aggregate_store="torch://")
    check(records, elastic_reference, WORLDS)


def test_elastic_4_2_3_local_dir(ray_cluster, tmp_path, elastic_reference):
    records = run_schedule(tmp_path, SCHEDULE, mode="local", aggregate_dir=str(tmp_path / "aggregate"))
    check(records, elastic_reference, WORLDS)


@pytest.mark.parametrize("mode", ["local", pytest.param("service", marks=pytest.mark.slow)])
def test_worker_killed_mid_run_replays_identical_steps(ray_cluster, tmp_path, elastic_reference, mode):
    """Rank 1 of 2 SIGKILLs itself before step 3; Ray Train restarts the group from the step-2 checkpoint
    (FailureConfig(max_failures=1)); steps 2.. are replayed and every record, replays included, matches."""
    from zephon_ray import DataService
    from zephon_ray.torchtitan.ray_train import ElasticRun, fit, read_log

    digests, losses = elastic_reference
    log, marker = str(tmp_path / "steps.jsonl"), tmp_path / "killed"
    if mode == "service":
        service = DataService.start(ELASTIC, name="chaos-svc", namespace="zr-elastic-tests", producers=2,
                                    state_dir=str(tmp_path / "svc"), aggregate_store="torch://", run_id="chaos-svc")
        loader = {"mode": "service", "service_name": "chaos-svc", "service_namespace": "zr-elastic-tests"}
    else:
        service, loader = None, {"mode": "local", "aggregate_store": "torch://"}
    run = ElasticRun(recipe=ELASTIC, run_id="chaos", log_path=log, steps=6, checkpoint_every=2,
                     kill={"step": 3, "rank": 1, "marker": str(marker)}, **loader)
    try:
        result = fit(run, workers=2, name="chaos", storage_path=str(tmp_path / "ray-results"), max_failures=1)
    finally:
        if service is not None:
            service.stop()
    assert result.error is None, result.error
    assert marker.exists(), "the failure was not injected"
    records = read_log(log)
    steps = [r["step"] for r in records]
    assert steps == [0, 1, 2, 2, 3, 4, 5], steps  # step 2 ran, the kill hit before step 3, step 2 was replayed
    assert len({r["pid"] for r in records}) == 2  # two incarnations of rank 0
    for r in records:
        assert r["digest"] == digests[r["step"]], r
        assert r["loss"] == pytest.approx(losses[r["step"]], abs=1e-5), r
