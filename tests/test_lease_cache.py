"""LeaseCache (service/lease_cache.py): the one cache of leased lane refs that the node reader and the client's node
path both keep. Pure logic, no Ray: refs are stand-in strings."""

from __future__ import annotations

import pytest

from zephon_ray.service.lease_cache import REPLAYS_KEPT, LeaseCache
from zephon_ray.service.wire import REPLAYED, StepLanes

LANES = 4


def lanes(step: int, gen: int, lo: int = 0, hi: int = LANES) -> list:
    return [f"s{step}g{gen}l{i}" if lo <= i < hi else None for i in range(LANES)]


def steps(first: int, count: int, gen: int = 0, lo: int = 0, hi: int = LANES) -> list[StepLanes]:
    return [StepLanes(s, gen, lanes(s, gen, lo, hi)) for s in range(first, first + count)]


def test_run_hands_out_what_was_filed_and_only_the_lanes_asked_for():
    cache = LeaseCache(LANES, cap=32)
    assert cache.file(steps(3, 4), keep_from=3) == 4
    run = cache.run(3, 1, 2, limit=8)
    assert [r.step for r in run] == [3, 4, 5, 6]  # up to the first gap
    assert run[0].lanes == [None, "s3g0l1", None, None]
    assert [r.step for r in cache.run(4, 0, LANES, limit=2)] == [4, 5]
    assert cache.run(7, 0, LANES, limit=8) == [] and cache.get(7, 0, 1) is None


def test_a_second_lease_of_other_lanes_merges_and_another_generation_replaces():
    cache = LeaseCache(LANES, cap=32)
    cache.file(steps(0, 2, lo=0, hi=2), keep_from=0)
    assert cache.get(0, 2, 4) is None  # lanes 2, 3 not held yet
    cache.file(steps(0, 2, lo=2, hi=4), keep_from=0)
    assert cache.get(0, 0, 4).lanes == lanes(0, 0)
    cache.file([StepLanes(1, 5, lanes(1, 5, 0, 1))], keep_from=0)  # made again by generation 5: the old refs go
    held = cache.get(1, 0, 1)
    assert held.generation == 5 and held.lanes == lanes(1, 5, 0, 1) and cache.get(1, 1, 2) is None


def test_keep_from_evicts_live_steps_but_not_the_newest_replays():
    cache = LeaseCache(LANES, cap=64)
    cache.file(steps(10, 5), keep_from=10)
    cache.file([StepLanes(2, REPLAYED, lanes(2, REPLAYED))], keep_from=10)  # a past step, replayed
    assert cache.steps() == [2, 10, 11, 12, 13, 14]
    cache.file(steps(15, 1), keep_from=13)
    assert cache.steps() == [2, 13, 14, 15]  # 10-12 dropped, the replay kept
    cache.file(steps(16, 1), keep_from=5)  # keep_from never goes back
    assert cache.keep_from == 13


def test_replays_and_the_cap_bound_it():
    cache = LeaseCache(LANES, cap=12)
    for s in range(REPLAYS_KEPT + 3):
        cache.file([StepLanes(s, REPLAYED, lanes(s, REPLAYED))], keep_from=100)
    assert cache.steps() == list(range(3, REPLAYS_KEPT + 3))  # the oldest replays went first
    cache.file(steps(100, 10), keep_from=100)
    assert len(cache) == 12 and cache.steps()[-10:] == list(range(100, 110))  # a reply is never evicted by itself
    cache.file(steps(110, 12), keep_from=100)
    assert cache.steps() == list(range(110, 122))


def test_drop_only_the_generation_found_lost_and_clear():
    cache = LeaseCache(LANES, cap=32)
    cache.file(steps(0, 3, gen=1), keep_from=0)
    assert not cache.drop(1, generation=0)  # a late report about an older copy
    assert cache.drop(1, generation=1) and cache.steps() == [0, 2]
    cache.file(steps(5, 1), keep_from=4)
    cache.clear()
    assert len(cache) == 0 and cache.keep_from == 0


def test_bad_cap():
    with pytest.raises(ValueError, match=r"LeaseCache: cap must be an int in \[1, .*\], got 0"):
        LeaseCache(LANES, cap=0)
