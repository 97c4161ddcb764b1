"""A producer's puts (zephon_ray/service/server/producer.py): lanes cut into packs by ``ServiceConfig.pack_bytes``,
and the rows a service of packs serves, read whole and by every slice, against GlobalBatchSource's rows."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import wait_until
from service_helpers import start_service

from zephon_ray import GlobalBatchSource
from zephon_ray.lanes import LaneShard, LaneStepper
from zephon_ray.service.server.producer import packs, shard_nbytes

pytestmark = pytest.mark.timeout(300)


def _shard(lane: int, tokens: int) -> LaneShard:
    return LaneShard(
        lane=lane,
        tokens=np.zeros(tokens, dtype=np.int32),
        positions=np.zeros(0, dtype=np.int32),
        source_tokens=np.zeros(0, dtype=np.int64),
    )


def test_packs_are_equal_aligned_runs_of_lanes_within_the_byte_limit():
    shards = [_shard(lane, 10) for lane in range(8)]  # 40 bytes each
    lanes = lambda runs: [[s.lane for s in run] for run in runs]  # noqa: E731
    assert lanes(packs(shards, 80)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lanes(packs(shards, 120)) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # 3 lanes fit, but 3 does not divide 8
    assert lanes(packs(shards, 160)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lanes(packs(shards, 1 << 20)) == [list(range(8))]
    assert lanes(packs(shards, 79)) == lanes(packs(shards, 0)) == [[lane] for lane in range(8)]  # 0: one per lane
    assert lanes(packs(shards[:6], 120)) == [[0, 1, 2], [3, 4, 5]]
    assert lanes(packs([_shard(0, 1000)], 80)) == [[0]]  # a lane over the limit is a pack of its own
    assert packs([], 80) == []


@pytest.mark.heavy
@pytest.mark.parametrize("pack", ["default", "two lanes", "per lane"])
def test_a_service_of_packs_serves_every_slice_and_replay_as_the_reference(
    ray_cluster, tiny_recipe, reference_digests, tmp_path, pack
):
    """Two producers of 4 lanes each: by default one pack each (tiny's lanes are small), two packs of 2 lanes each,
    or one object per lane; every rank of every W (W = 16 reads half a lane) gets GlobalBatchSource's rows, and a
    step replayed after the window moved on (the Replayer's packs of all 8 lanes) its golden digest."""
    stepper = LaneStepper(tiny_recipe)
    try:
        lane_bytes = shard_nbytes(stepper.next_step()[0])  # every lane's shard has the same shape
    finally:
        stepper.close()
    kw = {"default": {}, "two lanes": {"pack_bytes": 2 * lane_bytes}, "per lane": {"pack_bytes": 0}}[pack]
    objects_per_step = {"default": 2, "two lanes": 4, "per lane": 8}[pack]
    svc = start_service(tiny_recipe, tmp_path, f"packs-{pack.replace(' ', '-')}", producers=2, **kw)
    try:
        with GlobalBatchSource(tiny_recipe) as source:
            for step in range(4):
                refs = svc.refs(step, track=True)
                assert len(set(refs.lanes)) == objects_per_step, (step, refs.lanes)
                assert refs.batch().digest == reference_digests[step]
                want = source.batch(step)
                for world in (8, 16):
                    for rank in range(world):
                        got = svc.slice(step, rank, world, track=True)
                        np.testing.assert_array_equal(got.tokens, want.slice(rank, world).tokens)
                        np.testing.assert_array_equal(got.positions, want.slice(rank, world).positions)
        svc.commit(3)  # steps before 3 may leave the table once the window moves on
        for step in range(4, 8):
            svc.batch(step, track=True)
        wait_until(lambda: 1 not in svc.status()["window"]["held_steps"], 60, "step 1 to leave the window")
        replayed = svc.refs(1)  # the Replayer makes it again, all 8 lanes in its own packs
        assert len(set(replayed.lanes)) == {"default": 1, "two lanes": 4, "per lane": 8}[pack]
        assert replayed.batch().digest == reference_digests[1]
    finally:
        svc.stop()
