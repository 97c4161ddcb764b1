"""Flat memory over a run: the service's producers and node reader hold nothing per step served.

Measured quantity: the entries of each actor's core-worker memory store (``memory()``, ray_internals.memory_store),
which is exact where RSS is noisy. Before the held refs of server/producer.py and server/node_reader.py, Ray 2.60
left one entry per lane shard and container behind in each producer (the owner) and one per container in the node
reader (a borrower) for every step: about 2.6 and 3.2 KB of RSS per step of ``tiny`` (benchmarks/ray_memstore_leak.py shows
the release orders with Ray alone; docs/benchmarks.md "Memory over a long run").
"""

from __future__ import annotations

import pytest
from service_helpers import NS, start_service

from zephon_ray.service.wire import PRODUCER_INFIX, READER_INFIX

pytestmark = pytest.mark.usefixtures("ray_cluster")

WARM_STEPS = 60
"""Past the steps a producer holds refs of (lease_cache.producer_hold_steps: 44 at this test's settings)."""
MEASURED_STEPS = 80


def actors(name: str, infix: str) -> list:
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NS and a["name"].startswith(name + infix)
    ]
    return [ray.get_actor(n, namespace=NS) for n in sorted(names)]


def entries(handles: list) -> list[int]:
    import ray

    return [m["entries"] for m in ray.get([h.memory.remote() for h in handles], timeout=60)]


@pytest.mark.heavy
def test_producers_and_node_reader_memory_store_stays_flat(tiny_recipe, tmp_path):
    """2 producers, 2 service-mode loaders with a ledger, every step committed, a state saved every 20 steps: after
    the warm-up, no actor's memory store grows with the steps (measured on the code before the fix: +5.0 entries per
    step in each producer, +1.2 in the node reader)."""
    from zephon_ray.stream.loader import Loader, LoaderConfig

    name = "mem-flat"
    svc = start_service(tiny_recipe, tmp_path, name, producers=2, window=4, retain_behind=8, checkpoint_every=8)
    loaders = []
    try:
        cfg = LoaderConfig(
            recipe=str(tiny_recipe.path),
            mode="service",
            service_name=name,
            service_namespace=NS,
            run_id=name,
            ledger_dir=str(tmp_path / "ledger"),
        )
        loaders = [Loader(cfg, rank=r, world=2) for r in range(2)]
        its = [iter(loader) for loader in loaders]

        def run(first: int, count: int) -> None:
            for step in range(first, first + count):
                for it in its:
                    next(it)
                for loader in loaders:
                    loader.commit(step)
                if (step + 1) % 20 == 0:
                    for loader in loaders:
                        loader.state_dict()

        run(0, WARM_STEPS)
        producers, readers = actors(name, PRODUCER_INFIX), actors(name, READER_INFIX)
        assert len(producers) == 2 and len(readers) == 1, (producers, readers)
        before = entries(producers + readers)
        run(WARM_STEPS, MEASURED_STEPS)
        after = entries(producers + readers)
        per_step = [round((b - a) / MEASURED_STEPS, 3) for a, b in zip(before, after)]
        # The old code left 5.0 entries per step in each producer and 1.2 in the node reader. The fixed code leaves
        # none in the producers, and 0.05-0.2 in the node reader over 500-step stretches of a longer run
        # (docs/benchmarks.md "Memory over a long run": not yet explained), hence its looser bound.
        assert per_step[0] < 0.1 and per_step[1] < 0.1 and per_step[2] < 0.5, (
            f"memory-store entries per step (producers, node reader): {per_step}; before {before}, after {after}"
        )
    finally:
        for loader in loaders:
            loader.close()
        svc.stop()
