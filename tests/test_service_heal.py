"""A coordinator that heals itself: kill -9 it while every rank of a W=4 job has a read in flight.

A second consumer ("holder") pins the window at [0, 4), so when the job's four ranks ask for step 4 their reads
wait inside the service (a lease waiting in the coordinator, the ranks' calls waiting in the node reader). The test
checks that all four reads are in flight (each rank entered ``slice(4)`` and none returned; the coordinator lists
the four cursors at step 4, which node readers report at once while a lease waits), then kills the coordinator with
SIGKILL. Ray restarts it; the new incarnation kills the old producers (their shards die with them), starts at the
job's commit and the in-flight reads complete through a new node reader.

Real private Ray, real producers. Every rank's rows are compared with the reference slice of the step it asked
for, and the four slices of each step must assemble to the reference digest: a skipped, repeated or stale step
shows up as wrong rows, never as an echoed step number.

The ranks also keep the ledger as the loader does (``LedgerRecorder``: each slice handed, confirmed, and sealed into
a segment at steps 4, 8 and 12, the first before the kill), and ``zephon-ray audit``'s check of that ledger against
GlobalBatchSource's global batches is clean: every step once, in three segments, 48 slice digests matched.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from conftest import RankThreads

from zephon_ray import DataService, GlobalBatchSource, compute_digest
from zephon_ray.jobs.audit import audit
from zephon_ray.stream.ledger_recorder import LedgerRecorder

NS = "zr-heal"
pytestmark = pytest.mark.timeout(400)


@pytest.mark.heavy
def test_kill9_coordinator_with_reads_in_flight(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    world, steps, blocked_at = 4, 12, 4
    svc = DataService.start(
        tiny_recipe,
        name="heal",
        namespace=NS,
        window=4,
        checkpoint_every=4,
        state_dir=tmp_path / "heal",
        consumer="job",
        reconnect_timeout_s=240,
    )
    holder = DataService.connect("heal", namespace=NS, consumer="holder")
    with GlobalBatchSource(tiny_recipe) as source:
        full = {s: source.batch(s) for s in range(steps)}
        want = {(s, r): full[s].slice(r, world) for s in range(steps) for r in range(world)}
    got: dict[int, list] = {r: [] for r in range(world)}
    entered: dict[int, set] = {r: set() for r in range(world)}
    waits: dict[int, dict[int, float]] = {r: {} for r in range(world)}
    heads: dict[int, str] = {}

    def rank_loop(rank: int) -> None:
        client = DataService.connect("heal", namespace=NS, consumer="job")
        recorder = LedgerRecorder(
            run_id="job",
            fingerprint=tiny_recipe.fingerprint,
            rank=rank,
            world=world,
            ledger_dir=str(tmp_path / "ledger"),
        )
        for step in range(steps):
            entered[rank].add(step)
            t0 = time.monotonic()
            part = client.slice(step, rank, world, track=True)
            waits[rank][step] = time.monotonic() - t0
            recorder.handed(part)
            recorder.commit(step)
            if (step + 1) % blocked_at == 0:  # a save: at step 4 (before the kill), 8 and 12
                heads[rank] = recorder.seal(step + 1, tiny_recipe)
            got[rank].append((np.array(part.tokens), np.array(part.positions)))
            if rank == 0 and step == blocked_at - 1:
                client.commit(blocked_at)

    try:
        assert holder.slice(0, 0, 1, track=True).num_rows == tiny_recipe.global_batch_rows  # pins produce_until at 4
        ranks = RankThreads(world, rank_loop)
        deadline = time.monotonic() + 120
        while True:  # every rank is inside slice(4), none got it, and the coordinator sees them waiting there
            assert not ranks.errors, ranks.errors
            status = svc.status()
            at = sorted(c["rank"] for c in status["cursors"] if c["consumer"] == "job" and c["step"] == blocked_at)
            inside = all(blocked_at in entered[r] and blocked_at not in waits[r] for r in range(world))
            if inside and at == list(range(world)):
                break
            assert time.monotonic() < deadline, (status["cursors"], entered, waits)
            time.sleep(0.1)
        assert status["window"]["produce_until"] == blocked_at and blocked_at not in status["window"]["held_steps"]
        old_pid, old_producers = status["coordinator"]["pid"], [p["pid"] for p in status["producers"]]
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        ranks.join(300)
        for rank in range(world):
            assert len(got[rank]) == steps, f"rank {rank} got {len(got[rank])} of {steps} slices"
            for step, (tokens, positions) in enumerate(got[rank]):
                np.testing.assert_array_equal(tokens, want[(step, rank)].tokens, err_msg=f"step {step} rank {rank}")
                np.testing.assert_array_equal(positions, want[(step, rank)].positions)
        for step in range(steps):
            tokens = np.concatenate([got[r][step][0] for r in range(world)])
            positions = np.concatenate([got[r][step][1] for r in range(world)])
            assert compute_digest(tokens, positions) == reference_digests[step], step
        assert len(set(heads.values())) == 1, heads  # every rank computed the same head segment
        report = audit(
            str(tmp_path / "ledger"),
            heads[0],
            reference=lambda s: (full[s].tokens, full[s].positions),
            rows=tiny_recipe.global_batch_rows,
        )
        assert report.clean and report.verdict() == (
            "audit: clean: steps [0, 12) each trained exactly once in a lineage of 3 segment(s) (W 4); 48 slice "
            "digests matched the recipe's global batches"
        ), [f.line for f in report.findings]
        after = svc.status()
        assert after["coordinator"]["pid"] != old_pid and after["coordinator"]["restarted"]
        assert after["start"]["latest_commit"] == blocked_at and after["start"]["start_step"] == blocked_at
        live = {
            e["name"]
            for e in __import__("ray").util.list_named_actors(all_namespaces=True)
            if e.get("namespace") == NS and ".producer." in e.get("name", "")
        }
        assert len(live) == len(after["producers"])  # the dead incarnation's producers were killed, not orphaned
        print(
            "coordinator kill -9 with reads in flight:",
            json.dumps(
                {
                    "recovery_s": round(max(waits[r][blocked_at] for r in range(world)), 3),
                    "since_kill_s": round(time.monotonic() - killed_at, 3),
                    "old_producers": old_producers,
                    "start": after["start"],
                }
            ),
        )
    finally:
        svc.stop()
