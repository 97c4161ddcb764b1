"""The client's direct read path (service/client/direct_read_path.py) on the session's private Ray: many threads on
one handle prefetching, reading ahead untracked and advancing the cursor, as the stream loader does, each as its own
rank."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_ranks

from zephon_ray import DataService, GlobalBatchSource

NS = "zr-direct-reads"
pytestmark = pytest.mark.timeout(300)


def test_many_threads_prefetch_read_and_advance_on_one_handle(ray_cluster, tiny_recipe, tmp_path):
    world, steps = 8, 5
    svc = DataService.start(
        tiny_recipe, name="direct-threads", namespace=NS, state_dir=tmp_path / "s", window=8, read_path="direct"
    )
    try:
        client = DataService.connect("direct-threads", namespace=NS, consumer="job")
        assert client.read_path == "direct"
        got: dict[tuple[int, int], np.ndarray] = {}

        def rank(r: int) -> None:
            client.refs(0, rank=r, world=world, track=True)  # registers the cursor
            for step in range(steps):
                client.prefetch(range(step + 1, step + 3), rank=r, world=world)
                part = client.refs(step, rank=r, world=world).slice(r, world)
                got[(step, r)] = part.tokens.copy()
                client.advance(step, rank=r, world=world)

        run_ranks(world, rank, timeout_s=240)
        with GlobalBatchSource(tiny_recipe) as source:
            for step in range(steps):
                ref = source.batch(step)
                for r in range(world):
                    np.testing.assert_array_equal(got[(step, r)], ref.slice(r, world).tokens)
        # the prefetch table stays bounded, and what the threads left in it are real lease calls of later steps
        left = dict(client._reads._prefetched)
        assert len(left) <= 4 * client.config.window
        assert {step for step, _, _ in left} <= set(range(1, steps + 2)), sorted(left)
        cursors = {c["rank"]: c["step"] for c in client.status()["cursors"] if c["consumer"] == "job"}
        assert cursors == {r: steps - 1 for r in range(world)}, cursors
    finally:
        svc.stop()
