"""Ray Train elastic training through Ray Train's own data API: every resize and every failure keeps the batches.

Each scenario trains ``examples/bigram.py``, whose loop reads ``ray.train.get_dataset_shard("train")`` (a
``ZephonDataset`` configured by ``ZephonDataConfig``) and resumes from ``ray.train.get_checkpoint()``: 4 workers to
step 4, then 2 workers to step 6, then 3 workers to step 8, each a new ``fit()`` on the same run (recipes/elastic.toml:
12 lanes, B = 24, so 2, 3 and 4 divide both). ``ZephonDataConfig.configure`` re-runs at every start with the new
world size. Every step's global digest, gathered from the ranks' slices, must equal the committed golden's (tests/oracle.py), and
every loss the W=1 in-process reference.

CI runs one service-mode job that meets both events (``heavy``): at 2 workers a rank is SIGKILLed before step 3
(Ray Train restarts the group from the step-2 checkpoint and step 2 is replayed), then the job resumes at 5 workers
(5 does not divide B: ranks hold 4 or 5 rows, and the losses are still the W=1 reference's, since the loop scales
summed losses by ``batch.loss_scale``). The full 4 -> 2 -> 3 schedule of each mode (service, local with the torch://
store, local with a directory) and the worker kill in local mode are ``slow``, as is the quickstart's local 1 -> 2
(tests/test_ray_train_quickstart.py); the loader core's local mode changes W at every resume in the default suite
(tests/test_stream_loader.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import golden_digests
from train_helpers import KillOnce, bigram, fit_bigram

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
STEPS = 8
SCHEDULE = ((4, 4), (2, 6), (3, 8))  # (W, train until step)


def worlds_of(schedule) -> list[int]:
    """The worker count that trains each step under ``schedule``."""
    worlds, start = [], 0
    for world, until in schedule:
        worlds += [world] * (until - start)
        start = until
    return worlds


WORLDS = worlds_of(SCHEDULE)  # [4, 4, 4, 4, 2, 2, 3, 3]


@pytest.fixture(scope="module")
def elastic_reference():
    digests = golden_digests(ELASTIC)[:STEPS]  # the independent oracle's committed digests
    return digests, bigram.reference_losses(ELASTIC, STEPS)


def run_schedule(tmp_path, dataset, run_id, schedule=SCHEDULE):
    from examples.torchtitan_ray_train import read_log

    log = str(tmp_path / "steps.jsonl")
    for world, until in schedule:
        result = fit_bigram(
            dataset,
            workers=world,
            name="elastic",
            storage_path=str(tmp_path / "ray-results"),
            log_path=log,
            steps=until,
            run_id=run_id,
        )
        assert result.error is None, result.error
    return read_log(log)


def check(records, elastic_reference, worlds=WORLDS):
    digests, losses = elastic_reference
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["world"] for r in records] == worlds
    assert [r["digest"] for r in records] == digests
    for r in records:
        assert r["loss"] == pytest.approx(losses[r["step"]], abs=1e-5), r


def _kill_before_step_3(tmp_path, name: str) -> KillOnce:
    """Rank 1 SIGKILLs itself before step 3, once Ray Train registered the checkpoint at step 2."""
    return KillOnce(
        step=3,
        rank=1,
        marker=str(tmp_path / "killed"),
        registered_step=1,
        snapshot=str(tmp_path / "ray-results" / name / "checkpoint_manager_snapshot.json"),
    )


@pytest.mark.heavy
def test_service_worker_killed_then_resized_2_to_5(ray_cluster, tmp_path, elastic_reference):
    """One job, two events: a worker dies at W=2 (steps 2.. replayed after the restart), then the job resumes at
    W=5, a count that does not divide B = 24 (12 rows a rank, then 4 or 5: every slice boundary moves). Every
    record, replays included, has the golden digest and the W=1 reference's loss."""
    from examples.torchtitan_ray_train import read_log
    from zephon_ray import DataService
    from zephon_ray.integrations.ray_train import ZephonDataset

    log = str(tmp_path / "steps.jsonl")
    service = DataService.start(
        ELASTIC,
        name="elastic-svc",
        namespace="zr-elastic-tests",
        producers=2,
        window=8,
        state_dir=str(tmp_path / "svc"),
        checkpoint_every=4,
    )
    try:
        for workers, until, hook in ((2, 4, _kill_before_step_3(tmp_path, "elastic")), (5, STEPS, None)):
            result = fit_bigram(
                ZephonDataset(service),
                workers=workers,
                name="elastic",
                run_id="elastic-svc",
                storage_path=str(tmp_path / "ray-results"),
                log_path=log,
                steps=until,
                max_failures=1,
                before_step=hook,
            )
            assert result.error is None, result.error
    finally:
        service.stop()
    assert (tmp_path / "killed").exists(), "the failure was not injected"
    records = read_log(log)
    assert [r["step"] for r in records] == [0, 1, 2, 2, 3, 4, 5, 6, 7]  # the kill hit before step 3; 2 replayed
    assert [r["world"] for r in records] == [2] * 5 + [5] * 4
    digests, losses = elastic_reference
    for r in records:
        assert r["digest"] == digests[r["step"]], r
        assert r["loss"] == pytest.approx(losses[r["step"]], abs=1e-5), r


@pytest.mark.slow
def test_get_dataset_shard_4_2_3_service(ray_cluster, tmp_path, elastic_reference):
    from zephon_ray import DataService
    from zephon_ray.integrations.ray_train import ZephonDataset

    service = DataService.start(
        ELASTIC,
        name="elastic-svc",
        namespace="zr-elastic-tests",
        producers=2,
        window=8,
        state_dir=str(tmp_path / "svc"),
        checkpoint_every=4,
    )
    try:
        records = run_schedule(tmp_path, ZephonDataset(service), "elastic-svc")
    finally:
        service.stop()
    check(records, elastic_reference)


@pytest.mark.slow  # ~80 s; CI's heavy tier has the service job (above)
def test_get_dataset_shard_4_2_3_local_torch_store(ray_cluster, tmp_path, elastic_reference):
    """Local mode: Zephon's collective checkpoint aggregates through Ray Train's own TCPStore (rank 0's, a new
    port after every restart)."""
    from zephon_ray.integrations.ray_train import ZephonDataset

    check(run_schedule(tmp_path, ZephonDataset(ELASTIC), "elastic-local"), elastic_reference)


@pytest.mark.slow
def test_get_dataset_shard_4_2_3_local_dir(ray_cluster, tmp_path, elastic_reference):
    from zephon_ray.integrations.ray_train import ZephonDataset

    dataset = ZephonDataset(ELASTIC, aggregate_dir=str(tmp_path / "aggregate"))
    check(run_schedule(tmp_path, dataset, "elastic-dir"), elastic_reference)


@pytest.mark.slow  # CI's heavy tier kills a worker in service mode (above)
@pytest.mark.parametrize("mode", ["local", "service"])
def test_worker_killed_mid_run_replays_identical_steps(ray_cluster, tmp_path, elastic_reference, mode):
    """Rank 1 of 2 SIGKILLs itself before step 3; Ray Train restarts the group from the step-2 checkpoint
    (FailureConfig(max_failures=1)), configure() hands the new group fresh shards, steps 2.. are replayed, and
    every record, replays included, matches."""
    from examples.torchtitan_ray_train import read_log
    from zephon_ray import DataService
    from zephon_ray.integrations.ray_train import ZephonDataset

    digests, losses = elastic_reference
    log, marker = str(tmp_path / "steps.jsonl"), tmp_path / "killed"
    service = None
    if mode == "service":
        service = DataService.start(
            ELASTIC, name="chaos-svc", namespace="zr-elastic-tests", producers=2, state_dir=str(tmp_path / "svc")
        )
    try:
        result = fit_bigram(
            ZephonDataset(service or ELASTIC),
            workers=2,
            name="chaos",
            storage_path=str(tmp_path / "ray-results"),
            log_path=log,
            steps=6,
            run_id="chaos",
            max_failures=1,
            before_step=KillOnce(
                step=3,
                rank=1,
                marker=str(marker),
                registered_step=1,  # the checkpoint at 2
                snapshot=str(tmp_path / "ray-results" / "chaos" / "checkpoint_manager_snapshot.json"),
            ),
        )
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
