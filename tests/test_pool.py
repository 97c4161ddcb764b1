"""The producer pool's room check (zephon_ray/service/server/pool.py ``fits``): whether a fresh producer group fits
in the nodes' free resources beside the running one, first-fit, node by node. The replacements it chooses between
(retire the old group, or kill it) run in tests/test_service_faults.py."""

from __future__ import annotations

from zephon_ray.service.server.pool import fits


def test_actors_fit_node_by_node_not_in_the_sum():
    two_halves = [{"CPU": 0.2}, {"CPU": 0.2}]  # 0.4 CPU free in all, but no node has 0.25
    assert not fits(two_halves, 1, {"CPU": 0.25})
    assert fits([{"CPU": 0.5}, {"CPU": 0.2}], 2, {"CPU": 0.25})
    assert not fits([{"CPU": 0.5}, {"CPU": 0.2}], 3, {"CPU": 0.25})
    assert fits([{"CPU": 0.3}, {"CPU": 0.3}], 2, {"CPU": 0.25})


def test_custom_resources_count_and_a_missing_one_never_fits():
    free = [{"CPU": 4.0, "data": 1.0}, {"CPU": 4.0}]
    assert fits(free, 1, {"CPU": 0.25, "data": 1.0})
    assert not fits(free, 2, {"CPU": 0.25, "data": 1.0})
    assert not fits([{"CPU": 4.0}], 1, {"CPU": 0.25, "data": 1.0})
    assert fits([], 0, {"CPU": 0.25}) and not fits([], 1, {"CPU": 0.25})


def test_fractions_that_add_up_exactly_fit():
    assert fits([{"CPU": 0.75}], 3, {"CPU": 0.25})  # 0.25 + 0.25 + 0.25 in floats: within the tolerance
