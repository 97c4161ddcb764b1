"""A coordinator that heals itself: kill -9 it while a W=4 job reads; the job sees only a delay.

Real private Ray, real producers; every global batch the four ranks assemble is checked against the in-process
reference digests, and each rank must receive every step exactly once, in order.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from zephon_ray import DataService, compute_digest

NS = "zr-heal"
pytestmark = pytest.mark.timeout(400)


def test_kill9_coordinator_while_w4_job_reads(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    world, steps, kill_at = 4, 24, 9
    svc = DataService.start(tiny_recipe, name="heal", namespace=NS, window=4, checkpoint_every=4,
                            state_dir=tmp_path / "heal", consumer="job", reconnect_timeout_s=240)
    got: dict[int, list] = {r: [] for r in range(world)}
    waits: dict[int, list[tuple[int, float]]] = {r: [] for r in range(world)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(world + 1)

    def rank_loop(rank: int) -> None:
        client = DataService.connect("heal", namespace=NS, consumer="job")
        try:
            for step in range(steps):
                if step == kill_at:
                    barrier.wait(timeout=120)  # all ranks are past step kill_at - 1 ...
                    barrier.wait(timeout=120)  # ... and the coordinator was just killed
                t0 = time.monotonic()
                part = client.slice(step, rank, world)
                waits[rank].append((step, time.monotonic() - t0))
                got[rank].append((part.step, np.array(part.tokens), np.array(part.positions)))
                if rank == 0 and step % 4 == 3:
                    client.commit(step + 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        barrier.wait(timeout=120)
        status = svc.status()
        old_pid, old_producers = status["coordinator"]["pid"], [p["pid"] for p in status["producers"]]
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        barrier.wait(timeout=120)
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        recovery_s = max(w for r in range(world) for s, w in waits[r] if s == kill_at)
        for rank in range(world):
            assert [s for s, _, _ in got[rank]] == list(range(steps)), f"rank {rank} skipped or repeated a step"
        for step in range(steps):
            tokens = np.concatenate([got[r][step][1] for r in range(world)])
            positions = np.concatenate([got[r][step][2] for r in range(world)])
            assert compute_digest(tokens, positions) == reference_digests[step], step
        after = svc.status()
        assert after["coordinator"]["pid"] != old_pid and after["coordinator"]["restarted"]
        assert after["start"]["latest_commit"] is not None and after["start"]["start_step"] <= kill_at
        live = {e["name"] for e in __import__("ray").util.list_named_actors(all_namespaces=True)
                if e.get("namespace") == NS and ".producer." in e.get("name", "")}
        assert len(live) == len(after["producers"])  # the dead incarnation's producers were killed, not orphaned
        print("coordinator kill -9:", json.dumps({"recovery_s": round(recovery_s, 3),
                                                  "since_kill_s": round(time.monotonic() - killed_at, 3),
                                                  "old_producers": old_producers,
                                                  "start": after["start"]}))
    finally:
        svc.stop()
