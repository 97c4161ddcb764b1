"""Ray alone (no Zephon): which release orders leave an entry behind in a core worker's in-process memory store.

    python benchmarks/ray_memstore_leak.py [--steps 300] [--rss-calls 12000]

Prints, per pattern, the growth per object of ``CoreWorker.get_memory_store_size()`` in the owner (the actor that
``ray.put`` the objects) and in the borrower (an async actor that opens a container of refs):

- ``owner_drops_first``: the owner puts an object, returns its ref and keeps nothing; the caller (a borrower) drops
  it later. The object leaves the object store, but the owner's memory store keeps one entry for it, forever.
- ``owner_drops_last``: the same, but the owner holds the ref until after the borrower dropped it: no entry stays.
- ``borrower_container_first``: a borrower awaits a container (an object holding refs), drops the container's ref
  and keeps the refs it held; when those go, the container's entry stays in the borrower's memory store.
- ``borrower_container_last``: the borrower holds the container's ref until after the refs it held: no entry stays.

With ``--rss-calls N``, it also measures the owner's RSS per call (5 puts) over N calls in the order that leaves
no entry (the owner holds its last 32 calls' refs), after 2,000 calls of warm-up.

Measured with Ray 2.60 on a 2-core VM (docs/benchmarks.md "Memory over a long run"): 1.0 entry per object in the
first and third patterns, 0 in the others. The data service avoids the first and third orders
(server/producer.py's and server/node_reader.py's held refs).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile

import numpy as np
import ray


def entries() -> int:
    return ray._private.worker.global_worker.core_worker.get_memory_store_size()


@ray.remote(num_cpus=0.1)
class Owner:
    def __init__(self, hold: int) -> None:
        self.held: collections.deque = collections.deque(maxlen=hold or None)
        self.hold = hold

    def entries(self) -> int:
        return entries()

    def rss(self) -> int:
        import psutil

        return psutil.Process().memory_info().rss

    def put(self, inner: int) -> dict:
        lanes = [ray.put(np.zeros(130, np.int32)) for _ in range(inner)]
        container = ray.put(lanes)
        if self.hold:
            self.held.append((container, lanes))
        return {"container": container}


@ray.remote(num_cpus=0.1)
class Table:
    """Like the service's coordinator: keeps the container refs of the last 10 steps and hands them out."""

    def __init__(self, owner) -> None:
        self.owner, self.table = owner, {}

    async def pump(self, step: int, inner: int) -> None:
        meta = await self.owner.put.remote(inner)
        self.table[step] = meta["container"]
        self.table.pop(step - 10, None)

    async def lease(self, step: int) -> list:
        return [self.table[step]]


@ray.remote(num_cpus=0.1)
class Borrower:
    """Like the service's node reader: leases a step's container, opens it and keeps the lane refs 10 steps."""

    def __init__(self, table, keep_container: bool, keep: int) -> None:
        self.table = table
        self.keep_container = keep_container
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.keep = keep

    async def entries(self) -> int:
        return entries()

    async def open(self, step: int) -> list:
        containers = await self.table.lease.remote(step)
        lanes = await containers[0]
        self.cache[step] = (lanes, containers if self.keep_container else None)
        while len(self.cache) > self.keep:
            self.cache.popitem(last=False)
        return [lanes]


def run(steps: int, owner_hold: int, keep_container: bool, inner: int = 4) -> dict:
    owner = Owner.remote(owner_hold)
    table = Table.remote(owner)
    borrower = Borrower.remote(table, keep_container, keep=10)

    def step(s: int) -> None:
        ray.get(table.pump.remote(s, inner))
        ray.get(ray.get(borrower.open.remote(s))[0])

    for s in range(50):
        step(s)
    before = ray.get([owner.entries.remote(), borrower.entries.remote()])
    for s in range(50, 50 + steps):
        step(s)
    after = ray.get([owner.entries.remote(), borrower.entries.remote()])
    for actor in (owner, table, borrower):
        ray.kill(actor)
    return {
        "owner_entries_per_object": round((after[0] - before[0]) / (steps * (inner + 1)), 3),
        "borrower_entries_per_container": round((after[1] - before[1]) / steps, 3),
    }


def rss_per_call(calls: int, hold: int = 32) -> list[str]:
    owner = Owner.remote(hold)

    def call() -> None:
        meta = ray.get(owner.put.options(enable_task_events=False).remote(4))
        ray.get(ray.get(meta["container"]))

    for _ in range(2000):
        call()
    r0, out = ray.get(owner.rss.remote()), []
    for q in range(1, 5):
        for _ in range(calls // 4):
            call()
        done = q * (calls // 4)
        out.append(f"{done}: {(ray.get(owner.rss.remote()) - r0) / done:.0f} B/call")
    ray.kill(owner)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rss-calls", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="memstore-") as tmp:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp)
        try:
            print("ray", ray.__version__)
            # the borrower keeps 10 steps: an owner holding 0 drops first, one holding 32 drops last
            for name, hold, keep_c in [
                ("owner_drops_first + borrower_container_first", 0, False),
                ("owner_drops_last + borrower_container_last", 32, True),
            ]:
                print(name, json.dumps(run(a.steps, hold, keep_c)), flush=True)
            if a.rss_calls:
                print("owner RSS per call, owner drops last:", ", ".join(rss_per_call(a.rss_calls)), flush=True)
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
