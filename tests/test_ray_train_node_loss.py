"""Ray Train elastic training that loses a node resumes at the odd worker count it has left, with the same batches.

A private simulated cluster (``ray.cluster_utils.Cluster``): a head node with 3 worker slots (and the DataService's
actors, pinned there) and a second node with 2. ``ScalingConfig(num_workers=(2, 5))`` starts 5 workers reading
``ZephonDataset(service)`` through ``get_dataset_shard`` (recipes/elastic.toml: B = 24 rows, 4 or 5 rows a rank).
Once a checkpoint past step 2 exists, the second node is removed: its workers die, Ray Train restarts the group from
the latest checkpoint on the 3 slots that are left (8 rows a rank), and the steps after that checkpoint are replayed.
Every record, replays included, must carry the independent oracle's digest of its step (tests/oracle.py)
and the W=1 reference loss: the loop scales summed losses by ``batch.loss_scale``, so a W of 5 trains the same
gradient as a W of 3.

The driver runs in a spawned process of its own (a pytest process holds one Ray connection).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import run_spawned_driver

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
STEPS = 14
MIN_W, MAX_W, LEFT_W = 2, 5, 3
DRIVER_TIMEOUT_S = 540


def _drive(work: str, log: str, summary: str) -> None:
    import ray
    from train_helpers import fit_bigram

    from examples.torchtitan_ray_train import read_log
    from tests.ray_clusters import checkout_pythonpath, local_cluster, stop_quietly
    from zephon_ray import DataService
    from zephon_ray.integrations.ray_train import ZephonDataset

    info: dict = {}
    head = {"num_cpus": 4, "resources": {"slot": LEFT_W, "head": 1}}
    try:
        with local_cluster("zr-node-loss-", head) as (cluster, temp_dir):
            service = None
            try:
                doomed = cluster.add_node(num_cpus=2, resources={"slot": MAX_W - LEFT_W}, temp_dir=temp_dir)
                # Ray Train's start timeout: a group sized from a stale view of the cluster fails fast and is retried.
                env = {"PYTHONPATH": checkout_pythonpath(), "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20"}
                ray.init(
                    address=cluster.address,
                    namespace="zr-node-loss",
                    log_to_driver=False,
                    runtime_env={"env_vars": env},
                )
                pin = {"head": 0.01}
                service = DataService.start(
                    ELASTIC,
                    name="node-loss",
                    namespace="zr-node-loss",
                    producers=2,
                    window=8,
                    state_dir=str(Path(work) / "svc"),
                    checkpoint_every=4,
                    aggregate_store="torch://",
                    run_id="node-loss",
                    resources={"coordinator_resources": pin, "producer_resources": pin, "replayer_resources": pin},
                )

                def train() -> None:
                    try:
                        result = fit_bigram(
                            ZephonDataset(service),
                            workers=(MIN_W, MAX_W),
                            name="node-loss",
                            storage_path=str(Path(work) / "ray-results"),
                            log_path=log,
                            steps=STEPS,
                            run_id="node-loss",
                            cpu_per_worker=0.1,
                            worker_resources={"slot": 1},
                            max_failures=3,
                            elastic_resize_monitor_interval_s=5.0,
                        )
                        info["error"] = None if result.error is None else repr(result.error)
                    except BaseException as exc:  # noqa: BLE001 - reported to the test
                        info["error"] = repr(exc)

                trainer = threading.Thread(target=train, daemon=True)
                trainer.start()
                # Lose the node once the 5-worker group has reported a checkpoint past step 2 (every 2 steps).
                while trainer.is_alive() and not any(r["world"] == MAX_W and r["step"] >= 3 for r in read_log(log)):
                    time.sleep(0.25)
                if trainer.is_alive():
                    cluster.remove_node(doomed)
                    info["node_removed"] = time.time()
                trainer.join()
            finally:
                stop_quietly(service)
    except BaseException as exc:  # noqa: BLE001 - the driver reports everything to the test
        info.setdefault("error", repr(exc))
    finally:
        Path(summary).write_text(json.dumps(info))


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_losing_a_node_resumes_at_the_odd_worker_count_with_the_same_batches(tmp_path):
    import oracle

    from examples import bigram
    from examples.torchtitan_ray_train import read_log

    log, summary = str(tmp_path / "steps.jsonl"), tmp_path / "summary.json"
    info = run_spawned_driver(
        _drive,
        (str(tmp_path), log, str(summary)),
        summary,
        DRIVER_TIMEOUT_S,
        detail=lambda: f"; records: {read_log(log)}",
    )
    records = read_log(log)
    assert info.get("error") is None, info["error"]
    assert "node_removed" in info, f"training ended before the node could be removed: {records}"
    worlds = [r["world"] for r in records]
    first_left = worlds.index(LEFT_W)
    assert set(worlds[:first_left]) == {MAX_W} and set(worlds[first_left:]) == {LEFT_W}, worlds
    assert records[first_left]["time"] > info["node_removed"]
    steps = [r["step"] for r in records]
    assert sorted(set(steps)) == list(range(STEPS)), steps
    resumed = steps[first_left]
    assert resumed % 2 == 0 and steps[first_left:] == list(range(resumed, STEPS)), steps
    digests = oracle.digests(ELASTIC, STEPS)  # the independent oracle: Zephon's public API only
    losses = bigram.reference_losses(ELASTIC, STEPS)
    for r in records:
        assert r["digest"] == digests[r["step"]], r
        assert r["loss"] == pytest.approx(losses[r["step"]], abs=1e-5), r
