"""``zephon_ray.integrations.ray_train`` without a Ray Train run: validation when built, ``configure`` at any world size, and a
shard read in-process (W=1) whose steps and resume match the committed goldens. The 4 -> 2 -> 3 Ray Train runs
through ``get_dataset_shard`` are in tests/test_ray_train_elastic.py."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from conftest import golden_digests

from zephon_ray.integrations.ray_train import STATE_FILE, ZephonDataConfig, ZephonDataset, ZephonDatasetShard

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"run_id": ""}, "run_id"),
        ({"local_batch_size": -1}, "local_batch_size"),
        ({"prefetch": 0}, "prefetch"),
        ({"checkpoint_every": 2.5}, "checkpoint_every"),
        ({"local_batch_size": True}, "local_batch_size"),
    ],
)
def test_data_config_rejects_bad_values_when_built(kwargs, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        ZephonDataConfig(**kwargs)


def test_dataset_rejects_bad_sources_in_the_driver(tmp_path):
    with pytest.raises(ValueError, match="recipe file not found"):
        ZephonDataset(tmp_path / "missing.toml")
    with pytest.raises(TypeError, match="recipe path or a DataService"):
        ZephonDataset(42)
    with pytest.raises(ValueError, match="at most one of aggregate_store"):
        ZephonDataset(ELASTIC, aggregate_store="torch://", aggregate_dir=str(tmp_path))


def test_configure_hands_each_rank_its_shard_at_every_world_size():
    dataset, config = ZephonDataset(ELASTIC), ZephonDataConfig(run_id="r")
    for world in (1, 2, 3, 4, 12):  # what an elastic restart does: configure again with the new world size
        shards = config.configure({"train": dataset}, world, None, None)
        assert len(shards) == world
        assert [(s["train"].rank, s["train"].world) for s in shards] == [(r, world) for r in range(world)]
        assert shards[0]["train"].microbatches_per_step == 1  # local_batch_size 0: one microbatch per step


@pytest.mark.parametrize(
    "world, local_batch_size, message",
    [
        (5, 0, "local mode needs the worker count to divide the recipe's 12 lanes, got 5 workers"),
        (8, 0, "divide the recipe's 12 lanes, got 8 workers"),
        (2, 5, "local_batch_size 5 does not divide every reader's share of the recipe's global batch of 24 rows"),
    ],
)
def test_configure_refuses_a_world_that_cannot_be_served(world, local_batch_size, message):
    config = ZephonDataConfig(run_id="r", local_batch_size=local_batch_size)
    with pytest.raises(ValueError, match=message) as err:
        config.configure({"train": ZephonDataset(ELASTIC)}, world, None, None)
    assert "dataset 'train'" in str(err.value)


def test_shard_reads_global_batches_and_resumes_from_its_saved_state(tmp_path):
    """A W=1 shard (pickled as Ray Train ships it) yields every step's rows; save() + restore() on a fresh shard
    continues at the saved step with the same rows (checked by digest against the committed goldens)."""
    from ray.train import Checkpoint

    (shard,) = (
        s["train"]
        for s in ZephonDataConfig(run_id="r", local_batch_size=4, checkpoint_every=2).configure(
            {"train": ZephonDataset(ELASTIC)}, 1, None, None
        )
    )
    shard = pickle.loads(pickle.dumps(shard))
    expected = golden_digests(ELASTIC)[:5]  # the independent oracle's committed digests
    try:
        seen = []
        for batch in shard.iter_steps(until=2):
            assert len(batch.microbatches) == 6 and batch.microbatches[0][0]["input"].shape == (4, 64)
            seen.append(_digest(batch.slice))
        assert seen == expected[:2]
        state = shard.save(tmp_path)
        assert state["next_step"] == 2 and (tmp_path / STATE_FILE).is_file()
    finally:
        shard.close()
    fresh = pickle.loads(pickle.dumps(shard))
    try:
        assert fresh.restore(Checkpoint.from_directory(str(tmp_path))) == 2
        (batch,) = fresh.iter_steps(until=3)
        assert _digest(batch.slice) == expected[2]
        steps = [(mb.step, mb.last) for mb in fresh.iter_torch_batches(until=4)]
        assert steps == [(3, False)] * 5 + [(3, True)]
    finally:
        fresh.close()


def test_restore_refuses_a_checkpoint_without_loader_state(tmp_path):
    from ray.train import Checkpoint

    shard = ZephonDataConfig(run_id="r").configure({"train": ZephonDataset(ELASTIC)}, 1, None, None)[0]["train"]
    assert isinstance(shard, ZephonDatasetShard)
    with pytest.raises(FileNotFoundError, match=STATE_FILE):
        shard.restore(Checkpoint.from_directory(str(tmp_path)))
    shard.close()


def _digest(piece):
    from zephon_ray.batch import compute_digest

    return compute_digest(piece.tokens, piece.positions)


def test_a_shard_built_without_ray_trains_dataset_manager_equals_configures():
    """``ZephonDataConfig.shard`` (for Ray Train's torchft mode, where a replaced worker cannot call
    ``get_dataset_shard``) builds what ``configure`` hands the same rank; its ``ft`` refuses a recipe (local mode) in one
    line before touching the manager."""
    config = ZephonDataConfig(run_id="ft", ledger_dir="/tmp/unused-ledger")
    dataset = ZephonDataset(ELASTIC)
    built = config.shard(dataset, rank=1, world=3)
    configured = config.configure({"train": dataset}, world_size=3)[1]["train"]
    assert (built.rank, built.world, built.settings) == (configured.rank, configured.world, configured.settings)
    with pytest.raises(ValueError, match=r"torchft needs a DataService \(service mode\)") as info:
        built.ft(manager=None)
    assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="expected a ZephonDataset"):
        config.shard(ELASTIC)


def test_the_short_path_is_the_integration_module():
    """``from zephon_ray import ray_train`` (like ``zephon_ray.torchtitan``) is zephon_ray.integrations.ray_train,
    imported on first use, so ``import zephon_ray`` alone does not pull in Ray Train."""
    import subprocess
    import sys

    import zephon_ray
    import zephon_ray.integrations.ray_train as module
    from zephon_ray import ray_train

    assert ray_train is module and zephon_ray.ray_train is module
    assert ray_train.ZephonDataset is ZephonDataset and zephon_ray.ZephonDataConfig is ZephonDataConfig
    probe = (
        "import sys, zephon_ray; assert 'zephon_ray.integrations.ray_train' not in sys.modules; "
        "from zephon_ray import ray_train; print(ray_train.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "zephon_ray.integrations.ray_train"
