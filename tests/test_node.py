"""The node reader's cursor reports (service/server/node_reader.py): a NodeReader in this process, against a real
service's coordinator on the session's private Ray."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from zephon_ray import DataService
from zephon_ray.service.server import node_reader

NS = "zr-node"
pytestmark = pytest.mark.timeout(300)


def test_a_complete_round_is_reported_without_waiting_for_the_gather(ray_cluster, tiny_recipe, tmp_path, monkeypatch):
    """A report woken by a move waits REPORT_GATHER_S for the node's other ranks, unless the node's slowest rank of
    the consumer already moved past the last report: then nothing is left to gather and it goes at once (at the
    window's edge the producers wait for it). The gather is 60 s here; the round's report still reaches the
    coordinator within seconds, and the cursors it carries are exact."""
    monkeypatch.setattr(node_reader, "REPORT_GATHER_S", 60.0)
    svc = DataService.start(
        tiny_recipe, name="node-round", namespace=NS, state_dir=tmp_path / "s", window=4, consumer_ttl_s=600.0
    )  # keep-alive reports every 30 s: none in this test's seconds
    try:
        reader = _reader(svc, tiny_recipe)

        def cursors() -> dict[int, int]:
            return {c["rank"]: c["step"] for c in svc.status()["cursors"] if c["consumer"] == "job"}

        async def scenario() -> dict[int, int]:
            # rank 0 reads step 0 (a lease: it carries both ranks' moves, the first report of this consumer)
            await reader.read(0, "job", track=True, moves=[("job", 0, 2, 0, 0.0), ("job", 1, 2, 0, 0.0)])
            await reader.advance([("job", 0, 2, 2, 0.0)])  # the node's slowest rank (1) has not moved: gather
            await reader.advance([("job", 1, 2, 2, 0.0)])  # now it has: the round is complete
            deadline = time.monotonic() + 20  # far under the 60 s gather
            while (got := await asyncio.to_thread(cursors)) != {0: 2, 1: 2} and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return got

        assert asyncio.run(scenario()) == {0: 2, 1: 2}
        # ... and the coordinator's process made no ray.get, on its event loops or elsewhere (Ray logs "Using
        # blocking ray.get inside async actor" into the worker's log at the first one; pool.get_off_loop)
        assert_no_blocking_get(svc.status()["coordinator"]["pid"])
    finally:
        svc.stop()


@pytest.mark.heavy
def test_a_rank_heard_for_the_first_time_is_reported_at_once(ray_cluster, tiny_recipe, tmp_path, monkeypatch):
    """A new consumer's first move, with no lease to carry it, reaches the coordinator within the gather, not with
    the next lease or keep-alive: until the coordinator knows the consumer, another consumer's moves could take the
    window past steps it has yet to read (a fresh-clone run of test_service.py's window test replayed step 2 so).
    The keep-alive is 30 s here, the gather 1 s; the cursor must arrive within 20 s, and carry the step sent."""
    monkeypatch.setattr(node_reader, "REPORT_GATHER_S", 1.0)
    svc = DataService.start(
        tiny_recipe, name="node-first", namespace=NS, state_dir=tmp_path / "s", window=4, consumer_ttl_s=600.0
    )
    try:
        reader = _reader(svc, tiny_recipe)

        def cursors() -> dict[tuple[str, int], int]:
            return {(c["consumer"], c["rank"]): c["step"] for c in svc.status()["cursors"]}

        async def scenario() -> dict[tuple[str, int], int]:
            await reader.advance([("notebook", 0, 1, 1, 0.0)])  # no lease: nothing else would carry it for 30 s
            deadline = time.monotonic() + 20
            while ("notebook", 0) not in (got := await asyncio.to_thread(cursors)) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return got

        got = asyncio.run(scenario())
        assert got.get(("notebook", 0)) == 1, got
        assert reader.stats["reports"] == 1, reader.stats
    finally:
        svc.stop()


def _reader(svc: DataService, recipe) -> node_reader.NodeReader:
    """A NodeReader in this process for ``svc``'s coordinator (keep-alive reports every 30 s: consumer_ttl_s / 4,
    capped)."""
    return node_reader.NodeReader(
        svc._coordinator,
        lanes=recipe.lanes,
        rows_per_lane=recipe.rows_per_lane,
        lease_steps=4,
        window=4,
        consumer_ttl_s=600.0,
        request_timeout_s=60.0,
        node_id="this-process",
    )


def assert_no_blocking_get(pid: int) -> None:
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    files = [f for f in logs.glob(f"worker-*-{pid}.*") if f.suffix in (".out", ".err")]
    assert files, f"no Ray worker log for pid {pid} in {logs}"
    for f in files:
        assert "blocking ray.get" not in f.read_text(errors="replace"), f"{f.name}: a blocking ray.get"
