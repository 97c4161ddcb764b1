"""The data service on a private local Ray cluster: digests, slices, reads, consumers, the window, errors and
bounds (its faults, restarts and rescales: tests/test_service_faults.py).

Every test compares the rows served with the committed golden digests (tests/oracle.py) or with GlobalBatchSource's
rows, so a test passes only if the service serves exactly the reference rows.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import RankThreads, run_ranks, wait_until
from service_helpers import NS, replayer_actors, start_service, status_detail

from zephon_ray import DataService, GlobalBatchSource, compute_digest
from zephon_ray.service.errors import FingerprintMismatchError, ServiceError

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "producers, aggregate",
    [
        (1, None),
        # the default aggregation: tests/test_oracle.py::test_service_two_producers_slices_joined runs it in the default suite
        pytest.param(2, "hosted-store", marks=pytest.mark.slow),
        pytest.param(2, "external-store", marks=pytest.mark.heavy),
        pytest.param(2, "dir", marks=pytest.mark.heavy),
    ],
)
def test_digests_and_slices_match_reference(
    ray_cluster, tiny_recipe, reference_digests, tmp_path, producers, aggregate
):
    kw, store = {}, None
    if aggregate == "external-store":  # a TCPStore someone else hosts, named as torch://host:port
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        kw["aggregate_store"] = f"torch://127.0.0.1:{store.port}"
    elif aggregate == "dir":
        kw["aggregate_dir"] = tmp_path / "aggregate"
    svc = start_service(tiny_recipe, tmp_path, f"digests-m{producers}-{aggregate}", producers=producers, **kw)
    try:
        with GlobalBatchSource(tiny_recipe) as source:
            for step in range(12):
                assert svc.batch(step, track=True).digest == reference_digests[step]
                if step not in (5, 11):
                    continue
                ref = source.batch(step)
                for world in (1, 2, 4, 8, 16):  # B = 16 rows; W = 16 splits a lane (2 rows) in two
                    for rank in range(world):
                        got, want = svc.slice(step, rank, world, track=True), ref.slice(rank, world)
                        assert (got.step, got.rank, got.world) == (step, rank, world)
                        np.testing.assert_array_equal(got.tokens, want.tokens)
                        np.testing.assert_array_equal(got.positions, want.positions)
        status = svc.status()
        assert len(status["producers"]) == producers
        assert sorted(lane for p in status["producers"] for lane in p["lanes"]) == list(range(8))
        assert status["checkpoints"]["latest"] is not None and status["checkpoints"]["every"] == 4
        assert status["throughput"]["produced_steps"] >= 12
        if aggregate == "external-store":
            assert status["aggregate"]["store"] == kw["aggregate_store"]
    finally:
        svc.stop()


@pytest.mark.heavy
def test_refs_prefetch_and_any_consumer_handle(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    import ray

    svc = start_service(tiny_recipe, tmp_path, "refs", window=6)
    try:
        svc.prefetch(range(0, 4))
        refs = svc.refs(0, track=True)
        assert refs.is_refs and len(refs.lanes) == 8 and all(isinstance(r, ray.ObjectRef) for r in refs.lanes)
        assert refs.batch().digest == reference_digests[0]
        for step in range(1, 4):
            assert svc.batch(step, track=True).digest == reference_digests[step]

        @ray.remote(num_cpus=0.1)
        def read_in_task(name, step):  # a task/worker finds the service by name, as a Ray Train worker does
            other = DataService.connect(name, namespace=NS, consumer="task")
            return other.slice(step, 1, 2, track=True).tokens.copy(), other.batch(step).digest

        # Read ahead without moving the cursor, then report consumption with advance().
        ahead = svc.refs(5, track=False)
        cursor = lambda: {c["consumer"]: c["step"] for c in svc.status()["cursors"]}[svc.consumer]  # noqa: E731
        assert ahead.batch().digest == reference_digests[5] and cursor() == 3
        svc.advance(5)
        deadline = time.monotonic() + 30
        while cursor() != 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        tokens, digest = ray.get(read_in_task.remote("refs", 4), timeout=120)
        assert digest == reference_digests[4]
        with GlobalBatchSource(tiny_recipe) as source:
            np.testing.assert_array_equal(tokens, source.batch(4).slice(1, 2).tokens)
    finally:
        svc.stop()


@pytest.mark.heavy
def test_two_consumers_and_window_bound(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    window = 4
    with GlobalBatchSource(tiny_recipe) as source:
        reference_batches = [source.batch(step) for step in range(20)]
    # B must stay live through a stall of the machine: with the default 120 s TTL, a 127 s stall (heavy disk I/O
    # beside the test) expired B's cursor, by design, and B's next read was replayed.
    a = start_service(tiny_recipe, tmp_path, "two", window=window, consumer_ttl_s=600.0)
    b = DataService.connect("two", namespace=NS, consumer="notebook")
    debugger = DataService.connect("two", namespace=NS, consumer="debugger")
    try:
        lag = 2  # B trails A by `lag` steps; A may run up to `window` steps ahead of B before it must wait
        assert b.batch(0, track=True).digest == reference_digests[0]
        # B's first move reaches the coordinator with its node reader's next report (within REPORT_GATHER_S), A's
        # with every a.status() below: B's status() makes its first cursor exact before A moves on, so no gather
        # races A's first steps (tests/test_node.py checks the report itself).
        b.status()
        for step in range(20):
            try:  # the heavy run at 7c6ef33 hung here for 300 s once (not reproduced in 24 runs): say where, if again
                got = a.batch(step, track=True, timeout_s=120).digest
            except TimeoutError as exc:
                pytest.fail(f"A's read of step {step}: {exc}{status_detail(a)()}")
            assert got == reference_digests[step]
            if step >= lag:
                part = b.slice(step - lag, 1, 2, track=False)  # B's cursor is its batch's (one world per consumer)
                np.testing.assert_array_equal(part.tokens, reference_batches[step - lag].slice(1, 2).tokens)
                np.testing.assert_array_equal(part.positions, reference_batches[step - lag].slice(1, 2).positions)
                assert b.batch(step - lag, track=True).digest == reference_digests[step - lag]
            status = a.status()
            w = status["window"]
            assert len(w["held_steps"]) <= window and w["held_bytes"] <= w["bound_bytes"], w
            # B's reads stay inside the window it holds: none is replayed (the step and the coordinator's view if so)
            assert status["replay"]["requests"] == 0, (
                f"step {step}: window {w}, replay {status['replay']}, cursors {status['cursors']}, "
                f"coordinator {status['coordinator']}, reads {status['reads']}"
            )
        b.status()  # status() carries the caller's own cursor moves: b's are exact now, a's with a.status()
        # The window is read once it is full (steps low .. low + window - 1): the pump's refresh that sees B's last
        # move (low 17) and the produce call it starts (seen in flight under load, 0.2 s after the last read) may
        # still be on their way; the debugger's replay below is compared with this window.
        deadline = time.monotonic() + 60
        while (held_before := a.status()["window"]["held_steps"]) != list(range(17, 17 + window)):
            assert time.monotonic() < deadline, f"the window never filled: {held_before}"
            time.sleep(0.05)
        status = a.status()
        w = status["window"]
        assert 0 < w["peak_held_bytes"] <= w["bound_bytes"] == w["bound_steps"] * w["global_batch_bytes"]
        assert w["bound_steps"] == window + w["retain_behind"]
        cursors = {(c["consumer"], c["rank"]): c["step"] for c in status["cursors"]}
        assert cursors[(a.consumer, 0)] == 19 and cursors[("notebook", 0)] == 17
        assert w["low"] == 17 and status["replay"]["requests"] == 0  # B holds the window; nobody replayed
        assert replayer_actors("two") == [] and status["replayers"] == [None]  # so no replayer was started
        # A third consumer debugging a past step: restore + at most K replay, live window untouched.
        assert debugger.batch(2).digest == reference_digests[2]
        after = a.status()
        assert after["replay"]["last"] == {"step": 2, "replay_steps": 2 % 4}
        assert after["replay"]["max_replay_steps"] <= 4
        assert after["window"]["held_steps"] == held_before
        assert len(replayer_actors("two")) == 1 and after["replayers"][0]["pid"] != after["coordinator"]["pid"]
        b.release()
        assert a.batch(20, track=True).digest == reference_digests[20]
    finally:
        a.stop()


@pytest.mark.heavy
def test_to_dataset_rows_and_parquet(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    import pyarrow.parquet as pq

    svc = start_service(tiny_recipe, tmp_path, "dataset")
    try:
        ds = svc.to_dataset(range(1, 4))
        assert ds.count() == 3 * 16
        out = tmp_path / "audit"
        ds.write_parquet(str(out))
        table = pq.read_table(str(out)).sort_by([("step", "ascending"), ("row", "ascending")])
        assert set(table.column_names) >= {"step", "lane", "row", "tokens", "positions", "digest"}
        for step in range(1, 4):
            rows = table.filter(table["step"].to_numpy() == step)
            tokens = np.array(rows["tokens"].to_pylist(), dtype=np.int32)
            positions = np.array(rows["positions"].to_pylist(), dtype=np.int32)
            assert compute_digest(tokens, positions) == reference_digests[step]
            assert rows["lane"].to_pylist() == [r // 2 for r in range(16)]
    finally:
        svc.stop()


def test_clean_errors(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    with pytest.raises(ValueError, match="producers=3"):
        DataService.start(tiny_recipe, name="bad", namespace=NS, producers=3, run_id="r", aggregate_store="torch://")
    with pytest.raises(ValueError, match="not both"):
        DataService.start(
            tiny_recipe,
            name="bad",
            namespace=NS,
            producers=2,
            aggregate_store="torch://",
            aggregate_dir=str(tmp_path / "agg"),
        )
    svc = start_service(tiny_recipe, tmp_path, "errors")
    try:
        with pytest.raises(ServiceError, match="already runs"):
            start_service(tiny_recipe, tmp_path, "errors")
        with pytest.raises(ValueError, match="a world of 17 ranks exceeds the global batch of 16 rows") as info:
            svc.slice(0, 0, 17, track=True)
        with pytest.raises(ValueError, match=r"step must be an int in \[0, .*\], got -1") as info:
            svc.batch(-1)
        assert "Traceback" not in str(info.value) and "Ray" not in type(info.value).__name__
        with pytest.raises(ValueError, match="commit step"):
            svc.commit(-2)
        # Backpressure: another live consumer at step 0 holds the window (4); step 50 times out, and the
        # coordinator's TimeoutError arrives unwrapped from Ray's error types, naming the window.
        holder = DataService.connect("errors", namespace=NS, consumer="holder")
        holder.batch(0, track=True)
        with pytest.raises(TimeoutError, match=r"live window is \[0, 4\)") as timeout_info:
            svc.refs(50, timeout_s=1.0, track=True)
        assert "Traceback" not in str(timeout_info.value) and "Ray" not in type(timeout_info.value).__name__
        holder.release()
        assert svc.refs(50, timeout_s=60, track=True).batch().digest == reference_digests[50]  # rows, not the step
        svc.commit(3)
    finally:
        svc.stop()
    other = replace(tiny_recipe, seed=tiny_recipe.seed + 1)
    other.__dict__.pop("fingerprint", None)
    state_dir = tmp_path / "errors"
    before = sorted((p.relative_to(state_dir), p.stat().st_mtime_ns) for p in state_dir.rglob("*"))
    with pytest.raises(FingerprintMismatchError, match="belongs to recipe fingerprint"):
        start_service(other, tmp_path, "errors")
    assert sorted((p.relative_to(state_dir), p.stat().st_mtime_ns) for p in state_dir.rglob("*")) == before
    import ray

    with pytest.raises(ValueError):
        ray.get_actor("errors", namespace=NS)  # nothing was started for the refused recipe


def test_a_silent_rank_holds_nothing_back_beyond_its_ttl(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """A rank that read step 0 through the node reader (which holds its cursor and leases) and then falls silent,
    as a dead rank does: the node reader's keep-alives report how long ago it was heard, so after consumer_ttl_s
    the coordinator drops its cursor and the other consumer reads past the window it held."""
    svc = start_service(tiny_recipe, tmp_path, "ttl", window=4, consumer_ttl_s=3.0)
    dead = DataService.connect("ttl", namespace=NS, consumer="dead-rank")
    try:
        part = dead.slice(0, 1, 2, track=True)  # its cursor: step 0; it holds produce_until at 4
        assert part.num_rows == 8
        del dead  # no release(): it just stops
        got = [svc.batch(step, track=True).digest for step in range(10)]  # step 4 waits until the TTL has passed
        assert got == reference_digests[:10]
        status = svc.status()
        assert "dead-rank" not in {c["consumer"] for c in status["cursors"]}, status["cursors"]
        # Step 9 was made, so the window reaches 10 at least (one refresh may not yet have seen the last moves): far
        # past the 4 the silent rank held it at.
        assert status["window"]["produce_until"] >= 10, status["window"]
    finally:
        svc.stop()


def test_request_bounds_reject_cleanly(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    svc = start_service(tiny_recipe, tmp_path, "bounds", max_ahead=64)
    try:
        assert svc.batch(3, track=True).digest == reference_digests[3]
        with pytest.raises(ValueError, match=r"step 1000000 is more than max_ahead=64 steps past") as info:
            svc.batch(10**6, track=True)
        assert "Traceback" not in str(info.value)
        with pytest.raises(ValueError, match="max_ahead"):
            svc.batch(10**6)  # untracked reads are bounded the same way
        with pytest.raises(ValueError, match=r"commit step 1000000000000 of consumer .* at most 4"):
            svc.commit(10**12)
        with pytest.raises(ValueError, match=r"rank must be an int in \[0, world=4\), got 5"):
            svc.refs(3, rank=5, world=4, track=True)
        assert svc.commit(4)["step"] == 4
        status = svc.status()
        assert status["commits"]["per_consumer"] == {svc.consumer: 4}
        assert status["window"]["head"] < 64 and status["replay"]["requests"] == 0  # nothing ground toward 10**6
        # Ad-hoc reads move no cursor; the default consumer name is per Ray job.
        assert svc.consumer.startswith("job-")
        before = {(c["consumer"], c["rank"]): c["step"] for c in status["cursors"]}
        assert svc.batch(5).digest == reference_digests[5]
        assert {(c["consumer"], c["rank"]): c["step"] for c in svc.status()["cursors"]} == before
    finally:
        svc.stop()


@pytest.mark.heavy
def test_many_waiting_reads_hold_no_thread(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """96 reads wait at once (a holder pins the window); the coordinator runs fewer threads than that, and
    status()/commit() still answer. (The 512-read latency is measured in benchmarks/bench_service_load.py.)"""
    import psutil

    pending, world, target = 96, 16, 6
    svc = start_service(tiny_recipe, tmp_path, "pending", window=4)
    holder = DataService.connect("pending", namespace=NS, consumer="holder")
    try:
        holder.slice(0, 0, 1, track=True)
        with GlobalBatchSource(tiny_recipe) as source:
            want = {r: source.batch(target).slice(r, world).tokens for r in range(world)}
        ok = []

        def read(i):
            client = DataService.connect("pending", namespace=NS, consumer=f"reader{i}")
            part = client.slice(target, i % world, world, track=True)
            ok.append(np.array_equal(part.tokens, want[i % world]))

        readers = RankThreads(pending, read)
        wait_until(
            lambda: len(svc.status()["cursors"]) >= pending + 1,
            120,  # every read registered and waits
            lambda: f"{pending} waiting reads; cursors {svc.status()['cursors']}",
            interval_s=0.2,
        )
        registered = time.monotonic()  # the lease for `target` waits in the coordinator's handler from here on
        status = svc.status()
        assert not ok and status["window"]["produce_until"] == 4 and target not in status["window"]["held_steps"]
        threads_in_coordinator = psutil.Process(status["coordinator"]["pid"]).num_threads()
        assert threads_in_coordinator < pending, threads_in_coordinator
        assert holder.commit(1)["step"] == 1  # a write answers while the reads wait
        holder.release()
        released = time.monotonic()
        readers.join(120)
        assert len(ok) == pending and all(ok)
        # status() counts the seconds leases spent in the handler, waits for production included
        assert svc.status()["reads"]["lease_seconds"] >= released - registered
        print("waiting reads:", json.dumps({"pending": pending, "coordinator_threads": threads_in_coordinator}))
    finally:
        svc.stop()


def test_replays_run_in_the_replayer_and_are_shared(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """8 readers of one evicted step: 4 through this node's reader (one lease between them), 4 straight to the
    coordinator (read_path="direct", as ranks of other nodes would arrive): one replay in the Replayer for all."""
    import threading

    svc = start_service(tiny_recipe, tmp_path, "replayer", window=4)
    try:
        for step in range(14):
            svc.slice(step, 0, 1, track=True)
        readers, got = 8, []
        barrier = threading.Barrier(readers)

        def read(i):
            client = DataService.connect(
                "replayer", namespace=NS, consumer=f"debug{i}", read_path="node" if i % 2 else "direct"
            )
            barrier.wait(timeout=60)
            got.append(client.batch(2).digest)  # a past step: evicted from the window long ago

        run_ranks(readers, read, timeout_s=180)
        assert got == [reference_digests[2]] * readers
        status = svc.status()
        replay, replayer = status["replay"], status["replayers"][0]
        # the 4 direct readers and the node reader's lease(s): one replay submitted, the other requests shared
        assert replay["submitted"] == 1 and replay["shared"] == replay["requests"] - 1 >= readers // 2, replay
        assert replayer["pid"] != status["coordinator"]["pid"]  # replayed in the Replayer, not the coordinator
        assert svc.batch(3).digest == reference_digests[3]  # the next past step reuses the replayer's pipeline
    finally:
        svc.stop()


def test_a_read_ahead_of_the_window_is_served_once_produced_not_held_by_its_replay(
    ray_cluster, tiny_recipe, reference_digests, tmp_path
):
    """An untracked read ahead of the live window is replayed (no cursor moves producers there). If the slowest rank
    then moves the window past it, the read is served from the table as soon as producers file the step, and does
    not wait for the replayer. Here the replayer can never start (it asks for a resource no node has). Before the
    fix the read waited for the replay to its deadline, and so did every read of that step: three ranks' prefetch
    threads joined it in 2 of 6 scratch runs of tests/test_skips.py's service test (W = 3, a skip ahead), the hang of
    two full suite runs."""
    import threading

    svc = start_service(
        tiny_recipe, tmp_path, "ahead", window=4, resources={"replayer_resources": {"zr_no_such_node": 1}}
    )
    try:
        assert svc.batch(0, track=True).digest == reference_digests[0]  # the window: [0, 4)
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(digest=svc.batch(6, timeout_s=120).digest), daemon=True)
        reader.start()
        wait_until(lambda: svc.status()["replay"]["requests"] >= 1, 60, "the read of step 6 to go to the replayer")
        for step in range(1, 4):  # the slowest (only) cursor moves to 3: producers make steps up to 6
            assert svc.batch(step, track=True).digest == reference_digests[step]
        reader.join(60)
        assert got.get("digest") == reference_digests[6], "the read of step 6 waited for a replay that never starts"
        status = svc.status()
        assert status["replayers"] == [None] and status["replay"]["submitted"] == 1, status["replay"]
    finally:
        svc.stop()


@pytest.mark.heavy
def test_coordinator_owns_no_shard_bytes(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """A shipped recipe (recipes/tiny.toml, ~1 KiB lane shards: far under Ray's 100 KiB inline limit) with 2
    producers: every lane shard of every held step is owned by a producer and lies in the object store, never
    inlined into the coordinator. Read from Ray's own tables: the owner address in each ref and the object
    directory (zephon_ray/service/ray_internals.py), not from our counters. Replayed steps: owned by the replayer."""
    import ray

    from zephon_ray.service.ray_internals import object_locations, owner_worker_id

    svc = start_service(tiny_recipe, tmp_path, "owners", producers=2, window=4)
    try:
        for step in range(6):
            assert svc.batch(step, track=True).digest == reference_digests[step]
        deadline = time.monotonic() + 60
        while len(svc.status()["window"]["held_steps"]) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        status = svc.status()
        producers = {p["worker_id"] for p in status["producers"]}
        coordinator = status["coordinator"]["worker_id"]
        assert len(producers) == 2 and coordinator not in producers and None not in producers
        held = status["window"]["held_steps"]
        owners, sizes = {}, []
        for step in held:
            refs = svc.refs(step).lanes
            assert len(refs) == tiny_recipe.lanes and all(isinstance(r, ray.ObjectRef) for r in refs)
            locations = object_locations(refs)
            for ref in refs:
                owners[owner_worker_id(ref)] = owners.get(owner_worker_id(ref), 0) + 1
                assert locations[ref]["node_ids"], "an inlined object has no node: it would live in its owner"
                sizes.append(locations[ref]["object_size"])
        assert set(owners) == producers, (owners, producers, coordinator)
        assert sum(owners.values()) == len(held) * tiny_recipe.lanes
        assert min(sizes) >= 2 * tiny_recipe.rows_per_lane * tiny_recipe.row_length * 4  # tokens + positions
        # what the coordinator holds of a step: one container per producer (of the lane refs), owned by it
        assert status["window"]["shard_owners"] == {"producers": 2, "coordinator": 0, "other": 0}
        replayed = svc.refs(0).lanes  # evicted: served by the Replayer, which owns what it replays
        replayers = {r["worker_id"] for r in svc.status()["replayers"]}
        assert {owner_worker_id(ref) for ref in replayed} <= replayers and coordinator not in replayers
        print(
            "shard owners:",
            json.dumps(
                {
                    "held_steps": held,
                    "owners": owners,
                    "coordinator": coordinator,
                    "object_size": [min(sizes), max(sizes)],
                }
            ),
        )
    finally:
        svc.stop()


def test_node_readers_load_neither_torch_nor_zephon(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """A node reader runs on every node: it routes refs and never touches rows, so its process must not pay for
    torch or Zephon, which imports torch (about 1 s of import and 180 MB of RSS each). Read from the real actor's
    memory map: no libtorch in it."""
    import ray

    from zephon_ray.service.wire import READER_INFIX

    svc = start_service(tiny_recipe, tmp_path, "lean-reader")
    try:
        for step in range(3):
            part = svc.slice(step, rank=1, world=2, track=True)
            assert part.tokens.shape == (tiny_recipe.global_batch_rows // 2, tiny_recipe.row_length)
        assert (
            compute_digest(
                np.concatenate([svc.slice(3, rank=r, world=2, track=True).tokens for r in range(2)]),
                np.concatenate([svc.slice(3, rank=r, world=2, track=True).positions for r in range(2)]),
            )
            == reference_digests[3]
        )
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NS and a["name"].startswith("lean-reader" + READER_INFIX)
        ]
        assert len(names) == 1, names
        pid = ray.get(ray.get_actor(names[0], namespace=NS).info.remote(), timeout=60)["pid"]
        with open(f"/proc/{pid}/maps") as fh:
            mapped = {line.split()[-1] for line in fh if "/" in line}
        heavy = sorted(m for m in mapped if "libtorch" in m)
        assert not heavy, heavy
    finally:
        svc.stop()


def test_ray_internals_fence(ray_cluster):
    """The Ray internals the service and its tests use (zephon_ray/service/ray_internals.py) still exist and mean
    what we read from them; a Ray upgrade that moves them fails here, loudly."""
    import numpy as np
    import ray

    from zephon_ray.service.ray_internals import object_locations, owner_worker_id

    ref = ray.put(np.zeros(300_000, dtype=np.int32))
    assert owner_worker_id(ref) == ray.get_runtime_context().get_worker_id()
    location = object_locations([ref])[ref]
    assert location["node_ids"] == [ray.get_runtime_context().get_node_id()]
    assert location["object_size"] >= 1_200_000

    from tests.conftest import wait_until
    from zephon_ray.service.ray_internals import free_resources_per_node

    (free,) = free_resources_per_node()  # the session's one node, 8 CPUs
    assert 0 <= free["CPU"] <= 8, free

    @ray.remote(num_cpus=0.5)
    class Holder:
        def ping(self) -> int:
            return 1

    holder = Holder.remote()
    ray.get(holder.ping.remote(), timeout=60)
    try:  # while it lives, at most 7.5 of the 8 CPUs can be free, whatever other tests hold
        wait_until(lambda: free_resources_per_node()[0]["CPU"] <= 7.5, 30, "the GCS to count an actor's 0.5 CPU")
    finally:
        ray.kill(holder)
