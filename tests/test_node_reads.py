"""The client's node read path (service/client/node_read_path.py) on the session's private Ray: many threads on one
handle, many handles in one process, the node reader warmed at connect, and cursor moves that ride on read calls
(or go alone as a keep-alive)."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import ray
from conftest import run_ranks, wait_until

from zephon_ray import DataService, GlobalBatchSource
from zephon_ray.service.client.node_read_path import process_reads
from zephon_ray.service.wire import READER_INFIX

NS = "zr-node-reads"
pytestmark = pytest.mark.timeout(300)


def _cached_steps(path) -> list[int]:
    """The steps a process's read path (ProcessReads) holds refs of, any lanes; read under its lock."""
    with path._lock:
        return path._cache.steps()


def _steps_in_flight(path) -> list[int]:
    """The first steps of a process's read calls in flight (a rank's, or a read-ahead's); read under its lock."""
    with path._lock:
        return sorted(request.step for request in path._requests)


def _readers(name: str) -> list[dict]:
    """info() of the node readers of service ``name`` (Ray's table of named actors)."""
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NS and entry["name"].startswith(name + READER_INFIX):
            out.append(ray.get(ray.get_actor(entry["name"], namespace=NS).info.remote(), timeout=60))
    return out


def _read_in_lock_step(name, readers, world, steps, recipe):
    """Each ``readers[key] = (handle, rank)`` reads its slice of steps 0..steps-1 in its own thread, all in lock step;
    asserts every slice's rows against GlobalBatchSource and returns the node reader's read calls after step 0.

    The count starts once the process's calls of step 0 have all arrived (a read-ahead of step 1, started by a
    cache hit of step 0, may still be on its way when the ranks finish step 0), so it holds at most one call per
    step 1..steps-1 (the ranks of a step share its call, or find it made by the read-ahead of the step before) plus
    the read-ahead that a hit of the last step starts for the step after it: ``steps`` in all."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(readers))
    got, calls_after_step_0 = {}, []
    first = next(iter(readers))

    def read(key) -> None:
        handle, r = readers[key]
        try:
            for step in range(steps):
                barrier.wait(timeout=120)
                if step == 1 and key == first:
                    path = process_reads(handle)
                    wait_until(
                        lambda path=path: not _steps_in_flight(path),
                        60,
                        lambda path=path: f"calls in flight: {_steps_in_flight(path)}",
                        interval_s=0.02,
                    )
                    calls_after_step_0.append(_readers(name)[0]["reads"])
                barrier.wait(timeout=120)
                part = handle.slice(step, r, world, track=True)
                got[(key, step)] = (part.tokens.copy(), part.positions.copy())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    keys = list(readers)
    run_ranks(len(keys), lambda i: read(keys[i]), timeout_s=240)
    assert not errors, errors[:3]
    with GlobalBatchSource(recipe) as source:
        for step in range(steps):
            ref = source.batch(step)
            for key, (_, r) in readers.items():
                want = ref.slice(r, world)
                np.testing.assert_array_equal(got[(key, step)][0], want.tokens)
                np.testing.assert_array_equal(got[(key, step)][1], want.positions)
    (info,) = _readers(name)
    return info["reads"] - calls_after_step_0[0]


def test_many_threads_on_one_handle_share_calls_and_read_the_right_rows(ray_cluster, tiny_recipe, tmp_path):
    world, steps = 16, 6  # B = 16 rows: every thread is a rank with one row
    svc = DataService.start(tiny_recipe, name="node-threads", namespace=NS, state_dir=tmp_path / "s", window=8)
    try:
        assert len(_readers("node-threads")) == 1  # warmed by start()/connect(), before any read
        client = DataService.connect("node-threads", namespace=NS, consumer="job")
        calls = _read_in_lock_step("node-threads", {r: (client, r) for r in range(world)}, world, steps, tiny_recipe)
        # Once every rank's lanes are known (after step 0), the 16 threads share the process's calls: at most one
        # per step (and one read-ahead past the last), not one per rank and step (80); fewer still, as each call
        # brings a run of steps.
        assert 0 <= calls <= steps, calls
        status = client.status()  # carries this client's own moves: exact for every rank
        cursors = {c["rank"]: c["step"] for c in status["cursors"] if c["consumer"] == "job"}
        assert cursors == {r: steps - 1 for r in range(world)}, cursors
    finally:
        svc.stop()


def test_many_handles_in_one_process_share_calls_and_keep_their_cursors(ray_cluster, tiny_recipe, tmp_path):
    """One handle per rank, two consumers, all in this process (as the benchmark's ``per_rank`` side runs 32 rank
    handles per process): the handles share the process's node path, so the node reader sees at most one read
    call per step (and one read-ahead past the last) once every rank's lanes are known, and every (consumer, rank)
    cursor still arrives exactly."""
    world, steps = 8, 6
    svc = DataService.start(tiny_recipe, name="node-handles", namespace=NS, state_dir=tmp_path / "s", window=8)
    try:
        handles = {
            (c, r): DataService.connect("node-handles", namespace=NS, consumer=c)
            for c in ("a", "b")
            for r in range(world)
        }
        readers = {key: (handle, key[1]) for key, handle in handles.items()}
        calls = _read_in_lock_step("node-handles", readers, world, steps, tiny_recipe)
        assert 0 <= calls <= steps, calls
        for handle in handles.values():
            status = handle.status()  # each carries its own moves; the last one sees every cursor
        cursors = {(c["consumer"], c["rank"]): c["step"] for c in status["cursors"]}
        assert cursors == {key: steps - 1 for key in handles}, cursors
    finally:
        svc.stop()


def test_an_advance_alone_reaches_the_coordinator_as_a_keep_alive(ray_cluster, tiny_recipe, tmp_path):
    """A move no read call carries goes alone after ``keepalive_s`` (consumer_ttl_s / 8 here: 0.25 s), through the
    node reader's next report; another handle (which carries no move of this one) sees it."""
    svc = DataService.start(
        tiny_recipe, name="node-advance", namespace=NS, state_dir=tmp_path / "s", window=4, consumer_ttl_s=4.0
    )
    try:
        trainer = DataService.connect("node-advance", namespace=NS, consumer="trainer")
        trainer.slice(0, 1, 2, track=True)
        trainer.advance(2, rank=1, world=2)  # no read follows

        def cursors():
            return {(c["consumer"], c["rank"]): c["step"] for c in svc.status()["cursors"]}

        wait_until(
            lambda: cursors().get(("trainer", 1)) == 2,
            30,
            lambda: f"trainer rank 1's cursor at step 2; cursors {cursors()}",
        )
    finally:
        svc.stop()


def test_the_last_step_held_fetches_the_next_steps_before_the_rank_asks(ray_cluster, tiny_recipe, tmp_path):
    """Read-ahead (node_read_path.py): a tracked read of the last step this process holds starts its next read call in
    the background, with the cursor move, so the next steps are made and held here before the rank asks for them,
    across the window's edge (step 8 needs the move of step 1 at the coordinator), with the right rows. Without it
    no call goes before the rank's own read of the step, and the first step past a run never shows up here."""
    steps = 14
    svc = DataService.start(tiny_recipe, name="node-ahead", namespace=NS, state_dir=tmp_path / "s", window=8)
    try:
        client = DataService.connect("node-ahead", namespace=NS, consumer="trainer")
        path = process_reads(client)
        got = {0: client.slice(0, 0, 1, track=True)}
        for step in range(1, steps):
            wait_until(
                lambda step=step: step in _cached_steps(path),
                30,
                lambda step=step: f"step {step} held before it is read; held {_cached_steps(path)}",
                interval_s=0.02,
            )
            got[step] = client.slice(step, 0, 1, track=True)
        with GlobalBatchSource(tiny_recipe) as source:
            for step, part in got.items():
                want = source.batch(step).slice(0, 1)
                np.testing.assert_array_equal(part.tokens, want.tokens)
                np.testing.assert_array_equal(part.positions, want.positions)
    finally:
        svc.stop()


@pytest.mark.heavy
def test_a_read_does_not_wait_out_another_consumers_replay_that_covers_its_step(
    ray_cluster, tiny_recipe, reference_digests, tmp_path
):
    """A debug reader's read of a step behind the window is replayed, and its lease at the node reader covers the
    next ``lease_steps`` steps too. A read of one of those steps, produced and in the table, looks it up itself
    after ``JOIN_PROBE_S`` (node_reader.py) instead of waiting out the replay. The replayer here can never start (it
    asks for a resource no node has), so without the probe the read waits as long as the replay's lease does."""
    STUCK_S = 60
    svc = DataService.start(
        tiny_recipe,
        name="node-join",
        namespace=NS,
        state_dir=tmp_path / "s",
        window=4,
        resources={"replayer_resources": {"zr_no_such_node": 1}},
    )
    try:
        trainer = DataService.connect("node-join", namespace=NS, consumer="trainer", read_path="direct")
        for step in range(10):  # the window is [9, 13): steps below 9 are the replayer's
            assert trainer.batch(step, track=True).digest == reference_digests[step]
        debug = DataService.connect("node-join", namespace=NS, consumer="debug")

        def stuck() -> None:
            with contextlib.suppress(TimeoutError):  # the replay never comes
                debug.batch(7, timeout_s=STUCK_S)

        stuck_read = threading.Thread(target=stuck, daemon=True)
        stuck_read.start()
        wait_until(lambda: svc.status()["replay"]["requests"] >= 1, 60, "the read of step 7 to go to the replayer")
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(digest=debug.batch(10, timeout_s=200).digest), daemon=True)
        reader.start()
        reader.join(STUCK_S / 3)  # well before the lease of step 7 gives up
        assert got.get("digest") == reference_digests[10], "the read of step 10 waited out the replay of step 7"
        status = svc.status()
        assert status["replayers"] == [None]  # the replay of step 7 is still waiting for its replayer
        assert sum(r["join_probes"] for r in _readers("node-join")) >= 1
        stuck_read.join(STUCK_S + 30)
        assert not stuck_read.is_alive(), f"the read of step 7 outlived its {STUCK_S} s deadline"
    finally:
        svc.stop()
