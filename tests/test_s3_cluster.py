"""Object storage, the long runs (slow; the default suite has a cheaper test of each promise in tests/test_s3.py):

- the coordinator killed with ``kill -9`` while its state lives only in a bucket, healed from it, then a cold
  restart, with a materialised prefix that is in a bucket too;
- the Ray Train path: ``TorchTrainer`` with ``RunConfig(storage_path="s3://...")`` (through
  ``storage.ray_train_storage``) and the loader's ``aggregate_dir`` in the bucket, at W=2 then resumed at W=1, the
  same digests;
- a 3-raylet ``ray.cluster_utils.Cluster`` with no shared directory: sources, materialised run, service state,
  aggregation and Ray Train checkpoints all in buckets; nothing is written outside the bucket and the temp dirs.

Against the real S3 API server on loopback of tests/s3_server.py; digests against the local-disk reference.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests import s3_server
from tests.conftest import RECIPES, ROOT, TINY, run_spawned_driver, tiny_bucket

s3_server.configure_environment()  # at collection, before any Ray starts

pytestmark = pytest.mark.slow
ELASTIC = RECIPES / "elastic.toml"


@pytest.fixture(scope="module")
def bucket(s3):
    return tiny_bucket(s3, "zr-cluster-data", (TINY, ELASTIC))


def test_coordinator_kill9_heals_from_s3_state_with_a_prefix_on_s3(ray_cluster, s3, bucket, reference_digests):
    from zephon_ray import DataService, Recipe
    from zephon_ray.jobs.materialize import materialize

    recipe = Recipe.from_toml(f"s3://{bucket}/recipes/tiny.toml")
    prefix = f"s3://{s3.new_bucket('zr-prefix')}/tiny"
    materialize(recipe, prefix, range(0, 8), segment_steps=4, progress=False)
    state_dir = f"s3://{s3.new_bucket('zr-heal-state')}/run"
    kwargs = dict(
        name="s3-heal",
        namespace="zr-s3-cluster",
        state_dir=state_dir,
        materialized_dir=prefix,
        checkpoint_every=4,
        window=4,
        reconnect_timeout_s=240,
    )
    service = DataService.start(recipe, **kwargs)
    try:
        assert [service.batch(s, track=True).digest for s in range(6)] == reference_digests[:6]
        service.commit(4)
        before = service.status()
        os.kill(before["coordinator"]["pid"], signal.SIGKILL)
        killed = time.monotonic()
        assert [service.batch(s, track=True).digest for s in range(6, 14)] == reference_digests[6:14]
        healed_s = time.monotonic() - killed
        after = service.status()
        assert after["coordinator"]["pid"] != before["coordinator"]["pid"] and after["coordinator"]["restarted"]
        service.commit(12)
    finally:
        service.stop()
    print(f"coordinator healed from its S3 state_dir; 8 steps read {healed_s:.1f} s after the kill")
    service = DataService.start(recipe, **kwargs)  # cold: only the bucket remembers
    try:
        start = service.status()["start"]
        assert start["start_step"] == 12, start
        assert [service.batch(s).digest for s in (3, 12, 13)] == [reference_digests[s] for s in (3, 12, 13)]
    finally:
        service.stop()


def test_ray_train_storage_on_s3_resumes_at_another_world_size(ray_cluster, s3, bucket, tmp_path):
    """TorchTrainer with RunConfig(storage_path in a bucket) and the loader's aggregate_dir in a bucket (Zephon's
    collective checkpoint meets there): W=2 until step 4, then W=1 from the latest checkpoint until step 6."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from examples import bigram
    from examples.torchtitan_ray_train import read_log
    from zephon_ray import GlobalBatchSource, Recipe, storage
    from zephon_ray.integrations.ray_train import ZephonDataConfig, ZephonDataset

    recipe_uri = f"s3://{bucket}/recipes/elastic.toml"
    with GlobalBatchSource(Recipe.from_toml(ELASTIC)) as source:
        reference = [source.batch(s).digest for s in range(6)]
    train_bucket = s3.new_bucket("zr-train")
    dataset = ZephonDataset(recipe_uri, aggregate_dir=f"s3://{train_bucket}/aggregate")
    log = str(tmp_path / "steps.jsonl")
    run_storage = storage.ray_train_storage(f"s3://{train_bucket}/ray-results")
    for world, until in ((2, 4), (1, 6)):
        result = TorchTrainer(
            bigram.train_loop,
            train_loop_config={"log_path": log, "steps": until, "checkpoint_every": 2},
            datasets={"train": dataset},
            dataset_config=ZephonDataConfig(run_id="s3-train", checkpoint_every=2),
            scaling_config=ScalingConfig(num_workers=world, resources_per_worker={"CPU": 0.25}),
            run_config=RunConfig(name="s3-train", **run_storage),
        ).fit()
        assert result.error is None, result.error
        assert result.checkpoint is not None and result.checkpoint.path.startswith(f"{train_bucket}/ray-results/")
    records = read_log(log)
    assert [r["step"] for r in records] == list(range(6))
    assert [r["world"] for r in records] == [2] * 4 + [1] * 2
    assert [r["digest"] for r in records] == reference
    keys = s3.keys(train_bucket)
    assert any(k.startswith("ray-results/s3-train/") and k.endswith("zephon_loader.json") for k in keys), keys


# ---------------------------------------------------------------------- a cluster without a shared directory
CLUSTER_TIMEOUT_S = 900


def _tree(root: Path) -> dict[str, int]:
    out = {}
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = path.stat().st_size
    return out


def _no_shared_directory_driver(scratch: str, data_bucket: str, out_bucket: str, summary: str) -> None:
    """Spawned driver: HOME, the working directory and the temp dir (TMPDIR: Ray's sessions, Zephon's shard cache
    and catalog) are fresh directories under ``scratch``; the head (0 CPUs) and two worker nodes share nothing
    else. Every durable thing goes to ``out_bucket``."""
    import traceback

    scratch_path = Path(scratch)
    home, cwd, tmp = (scratch_path / n for n in ("home", "cwd", "tmp"))
    for d in (home, cwd, tmp):
        d.mkdir(parents=True, exist_ok=True)
    os.environ.update(HOME=str(home), TMPDIR=str(tmp), RAY_TMPDIR=str(tmp), XDG_CACHE_HOME=str(tmp / "cache"))
    # The parent's ray.init sets RAY_AUTH_MODE=token (its ~/.ray holds a token); under the fresh HOME there is
    # none, and a GCS told to use token auth without one aborts. Let Ray decide, as on a fresh machine.
    os.environ.pop("RAY_AUTH_MODE", None)
    os.chdir(cwd)
    import tempfile

    tempfile.tempdir = None  # re-read TMPDIR
    info: dict = {}
    t0 = time.monotonic()
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from examples import bigram
        from tests.ray_clusters import local_cluster
        from zephon_ray import DataService, MaterializedSource, Recipe, storage
        from zephon_ray.integrations.ray_train import ZephonDataConfig, ZephonDataset
        from zephon_ray.jobs.materialize import materialize

        head = {"num_cpus": 0, "include_dashboard": False}
        with local_cluster("", head, temp_dir=str(tmp / "ray")) as (cluster, ray_dir):
            for name in ("node_a", "node_b"):
                cluster.add_node(num_cpus=2, resources={name: 1}, temp_dir=ray_dir)
            ray.init(
                address=cluster.address,
                namespace="zr-no-shared",
                log_to_driver=False,
                # The job's workers see the same stores (and import examples/ from the checkout).
                runtime_env={"env_vars": {**storage.worker_environment(), "PYTHONPATH": str(ROOT)}},
            )
            info["cluster_s"] = round(time.monotonic() - t0, 1)
            recipe = Recipe.from_toml(f"s3://{data_bucket}/recipes/tiny.toml")
            out = f"s3://{out_bucket}"
            materialize(
                recipe,
                f"{out}/materialized",
                range(0, 8),
                producers=2,
                segment_steps=4,
                cpus_per_actor=0.75,
                progress=False,
            )
            with MaterializedSource(f"{out}/materialized", recipe=recipe) as source:
                info["materialized"] = [source.batch(s).digest for s in range(8)]
            service = DataService.start(
                recipe,
                name="no-shared",
                namespace="zr-no-shared",
                producers=2,
                state_dir=f"{out}/state",
                aggregate_dir=f"{out}/service-aggregate",
                run_id="no-shared",
                checkpoint_every=2,
                window=4,
            )
            try:
                info["service"] = [service.batch(s, track=True).digest for s in range(8)]
                service.commit(6)
                info["producer_nodes"] = sorted({p.get("node_id") for p in service.status()["producers"]})
            finally:
                service.stop()
            log = str(tmp / "train-steps.jsonl")  # test scaffolding (the digests rank 0 saw), in the temp dir
            result = TorchTrainer(
                bigram.train_loop,
                train_loop_config={"log_path": log, "steps": 4, "checkpoint_every": 2},
                datasets={
                    "train": ZephonDataset(
                        f"s3://{data_bucket}/recipes/elastic.toml", aggregate_dir=f"{out}/train-aggregate"
                    )
                },
                dataset_config=ZephonDataConfig(run_id="no-shared-train", checkpoint_every=2),
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                run_config=RunConfig(name="no-shared-train", **storage.ray_train_storage(f"{out}/ray-results")),
            ).fit()
            info["train_error"] = None if result.error is None else str(result.error)
            info["train"] = [json.loads(line)["digest"] for line in Path(log).read_text().splitlines()]
    except BaseException:  # noqa: BLE001 - reported to the test
        info["error"] = traceback.format_exc()
    finally:
        info["total_s"] = round(time.monotonic() - t0, 1)
        info["outside_temp"] = {d: _tree(scratch_path / d) for d in ("home", "cwd")}
        Path(summary).write_text(json.dumps(info))


@pytest.mark.timeout(CLUSTER_TIMEOUT_S + 120)
def test_three_raylets_without_a_shared_directory(s3, bucket, tmp_path, reference_digests):
    import shutil
    import tempfile

    from zephon_ray import GlobalBatchSource, Recipe

    out_bucket = s3.new_bucket("zr-no-shared")
    scratch = Path(tempfile.mkdtemp(prefix="zr-ns-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    summary = tmp_path / "summary.json"
    data_before = _tree(RECIPES / "data")
    try:
        info = run_spawned_driver(
            _no_shared_directory_driver, (str(scratch), bucket, out_bucket, str(summary)), summary, CLUSTER_TIMEOUT_S
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert "error" not in info, info["error"]
    print(
        "3 raylets, no shared directory:",
        json.dumps({k: info.get(k) for k in ("cluster_s", "total_s", "producer_nodes", "outside_temp")}),
    )
    assert info["materialized"] == reference_digests[:8] and info["service"] == reference_digests[:8]
    assert info["train_error"] is None
    with GlobalBatchSource(Recipe.from_toml(RECIPES / "elastic.toml")) as source:
        assert info["train"] == [source.batch(s).digest for s in range(4)]
    # Nothing outside the bucket and the temp dirs: HOME and the working directory stay empty (Ray's auth token,
    # which `ray start` keeps in ~/.ray, is the one thing allowed there), and the recipe data is untouched.
    outside = {
        d: {k: v for k, v in files.items() if not k.startswith(".ray/")} for d, files in info["outside_temp"].items()
    }
    assert outside == {"home": {}, "cwd": {}}, info["outside_temp"]
    assert _tree(RECIPES / "data") == data_before
    keys = {k.split("/")[0] for k in s3.keys(out_bucket) if not k.endswith("/")}
    assert {"materialized", "state", "ray-results"} <= keys, keys
    assert (ROOT / "tests").is_dir()
