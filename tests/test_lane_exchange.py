"""zephon_ray/lane_exchange.py over both channels (a shared directory, a real c10d TCPStore): a gather returns the
values of the groups of its own count, never values a run at another lane-group count left under the same key."""

from __future__ import annotations

from datetime import timedelta

import pytest
from conftest import run_ranks

from zephon_ray.lane_exchange import ExchangeError, gather
from zephon_ray.pipeline import LaneGroup


def _channels(tmp_path):
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return master, [
        {"aggregate_dir": str(tmp_path / "agg")},
        {"aggregate_store": f"torch://127.0.0.1:{master.port}"},
    ]


def _gather_all(count: int, key: str, channel: dict, timeout_s: float = 30.0) -> list[list]:
    """Every group of ``count`` gathers ``key`` at once (threads), each one's value its lanes of 8; what they all got."""

    def one(index: int) -> list:
        group = LaneGroup(count=count, index=index, run_id="x", aggregate_timeout_s=timeout_s, **channel)
        return gather(group, key, list(group.owned_lanes(8)))

    got = run_ranks(count, one, timeout_s=60)
    assert all(g == got[0] for g in got), got
    return got[0]


def test_a_key_left_by_another_group_count_is_not_read(tmp_path):
    """A run at 4 lane groups gathered a boundary's key and stopped; the run resumes at 2 groups and reaches the same
    boundary. Group 0 of 2 alone (its peer not there yet) must wait for group 1 of 2, not take the value group 1 of
    4 left, which holds other lanes: that mixed the two counts' lanes and gave a wrong phase start (found by a soak)."""
    _master, channels = _channels(tmp_path)  # the store lives as long as this test
    for channel in channels:
        assert _gather_all(4, "boundary-7", channel) == [[0, 1], [2, 3], [4, 5], [6, 7]]
        alone = LaneGroup(count=2, index=0, run_id="x", aggregate_timeout_s=1.0, **channel)
        with pytest.raises(ExchangeError, match=r"group.*1\]? of 2"):
            gather(alone, "boundary-7", [0, 1, 2, 3])
        assert _gather_all(2, "boundary-7", channel) == [[0, 1, 2, 3], [4, 5, 6, 7]]
