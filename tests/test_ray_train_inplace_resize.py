"""In-place elastic resize inside ONE Ray Train ``fit()`` keeps every global batch identical.

The loop is ``examples/bigram.py`` reading ``ray.train.get_dataset_shard`` (``ZephonDataConfig.configure`` runs
again for the W=4 group). A private simulated multi-node cluster (``ray.cluster_utils.Cluster``) starts with a
2-CPU head node, so that only the minimum of ``ScalingConfig(num_workers=(2, 4))`` fits (1 CPU per worker). Once
the first step record is in the log, a second 2-CPU node joins; Ray Train's elastic policy notices it
(``elastic_resize_monitor_interval_s``) and restarts the worker group at W=4 from the latest registered checkpoint, all within the same ``fit()``. The steps
after that checkpoint are replayed. Every record, replays included, must carry the in-process reference digest
of its step (recipes/elastic.toml: 12 lanes, B = 24 rows, so W = 2 and W = 4 both divide).

The driver runs in a spawned process of its own: a pytest process can hold only one Ray connection, and the
session ``ray_cluster`` fixture may already own it when the slow tests run together.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import run_spawned_driver
from zephon_ray import GlobalBatchSource, Recipe

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
STEPS = 60
# Long enough that the W=2 group is still training when Ray notices the new node: the autoscaling coordinator
# refreshes its view of the cluster only every ~20 s, then the policy checks every MONITOR_S and the group restarts.
# Measured: a node added at the 1st record showed up as W=4 records ~25 s later; each step takes ~1 s at W=2.
MIN_W, MAX_W = 2, 4
MONITOR_S = 5.0  # Ray's default resize check is every 60 s: far too slow for a test
DRIVER_TIMEOUT_S = 480


def _drive(work: str, log: str, summary: str) -> None:
    """The driver (in a spawned process): start the cluster, fit() elastically, add a node while it trains."""
    import ray
    from ray.cluster_utils import Cluster

    from train_helpers import fit_bigram

    from zephon_ray.integrations.ray_train import ZephonDataset
    from examples.torchtitan_ray_train import read_log

    temp_dir = tempfile.mkdtemp(prefix="zr-inplace-", dir="/tmp")
    # Cluster() records its address in <RAY_TMPDIR>/ray/ray_current_cluster: keep that in our own dir, not /tmp/ray.
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    info: dict = {"temp_dir": temp_dir}
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": MIN_W, "temp_dir": temp_dir})
        ray.init(address=cluster.address, namespace="zr-inplace-resize", log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}})

        def train() -> None:
            try:
                result = fit_bigram(ZephonDataset(ELASTIC), workers=(MIN_W, MAX_W), name="inplace",
                                    storage_path=str(Path(work) / "ray-results"), log_path=log, steps=STEPS,
                                    run_id="inplace", cpu_per_worker=1.0,
                                    elastic_resize_monitor_interval_s=MONITOR_S)
                info["error"] = None if result.error is None else repr(result.error)
            except BaseException as exc:  # reported to the test, which fails on it
                info["error"] = repr(exc)
            info["fit_end"] = time.time()

        # fit() runs in a thread: Cluster.add_node() installs signal handlers, so it must run in the main thread.
        trainer = threading.Thread(target=train, daemon=True)
        info["fit_start"] = time.time()
        trainer.start()
        while trainer.is_alive() and not read_log(log):
            time.sleep(0.5)
        if trainer.is_alive():
            info["first_record_seen"] = time.time()
            cluster.add_node(num_cpus=MAX_W - MIN_W, temp_dir=temp_dir)
            info["node_added"] = time.time()
        trainer.join()
    except BaseException as exc:
        info.setdefault("error", repr(exc))
    finally:
        Path(summary).write_text(json.dumps(info))
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inplace_upsize_in_one_fit_keeps_global_batches(tmp_path):
    from examples.torchtitan_ray_train import read_log

    with GlobalBatchSource(Recipe.from_toml(ELASTIC)) as source:
        digests = [source.batch(s).digest for s in range(STEPS)]

    log, summary = str(tmp_path / "steps.jsonl"), tmp_path / "summary.json"
    info = run_spawned_driver(_drive, (str(tmp_path), log, str(summary)), summary, DRIVER_TIMEOUT_S,
                              detail=lambda: f"; records: {read_log(log)}")
    records = read_log(log)
    assert info.get("error") is None, info["error"]
    assert "node_added" in info, f"training ended before the second node could join: {records}"

    # The resize really happened inside this one fit(): first W=2 only, then (after the node joined) W=4.
    worlds = [r["world"] for r in records]
    assert worlds[0] == MIN_W, worlds
    assert MAX_W in worlds, f"Ray Train never upsized: {worlds}"
    first_max = worlds.index(MAX_W)
    assert set(worlds[:first_max]) == {MIN_W} and set(worlds[first_max:]) == {MAX_W}, worlds
    assert records[first_max]["time"] > info["node_added"]
    assert len({r["pid"] for r in records}) >= 2  # rank 0 was restarted

    # Every step ran, in order within each worker group; a repeated step is only a replay after the restart.
    steps = [r["step"] for r in records]
    assert sorted(set(steps)) == list(range(STEPS)), steps
    assert steps[:first_max] == list(range(first_max)), steps
    resumed = steps[first_max]
    assert resumed <= steps[first_max - 1] + 1 and resumed % 2 == 0, steps  # from a checkpoint (every 2 steps)
    assert steps[first_max:] == list(range(resumed, STEPS)), steps

    # The global batch of every step, replays included, is the in-process reference.
    for r in records:
        assert r["digest"] == digests[r["step"]], r
