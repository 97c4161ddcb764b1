"""The data service under faults, on a private local Ray cluster: producers killed with -9 (while read and while
idle), restarts from ``state_dir``, rescales, recycled groups, a hung producer, a producer that cannot start.

Every test compares the rows served with the committed golden digests (tests/oracle.py), so it passes only if no
step's rows are wrong, missing or served twice. tests/test_service.py holds the service's reads and consumers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from service_helpers import NS, live_pids, start_service

from tests.conftest import TINY, run_spawned_driver
from zephon_ray import DataService, GlobalBatchSource, Recipe
from zephon_ray.service.errors import ServiceError
from zephon_ray.service.server.replay_scheduler import RETIRE_GRACE_S

pytestmark = pytest.mark.timeout(300)


@pytest.mark.heavy
@pytest.mark.timeout(600)  # two group restarts (actor start + identity check + restore) on a loaded 2-core box
def test_kill9_producer_while_read_and_while_idle(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """Producer 1 killed while read (step 3), then producer 0 of the new group while idle: two restarts. The
    slow test_chaos_random_kills_and_rescales kills at random moments, in collective checkpoints too."""
    svc = start_service(tiny_recipe, tmp_path, "kill9", producers=2)
    kills = []
    try:
        served = []
        for step in range(16):
            if step == 3:
                status, pids = live_pids(svc)
                victim = pids[1]
                os.kill(victim, signal.SIGKILL)
                kills.append({"step": step, "pid": victim, "generation": status["generation"]})
            served.append(svc.batch(step, track=True).digest)  # the digest of the rows received, not an echo
        assert served == reference_digests[:16], "a step's rows were wrong, missing or served twice"
        status, pids = live_pids(svc)
        assert status["restarts"] >= 1 and status["generation"] >= 1, status
        assert status["last_restart"]["generation"] == kills[0]["generation"], status["last_restart"]
        assert "Actor" in status["last_restart"]["reason"], status["last_restart"]  # RayActorError: the kill
        assert not set(pids) & {k["pid"] for k in kills}
        # An idle producer (window full, nobody reading) killed: replaced without waiting for a consumer.
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while svc.status()["restarts"] == status["restarts"]:
            assert time.monotonic() < deadline, "an idle producer killed with -9 was never replaced"
            time.sleep(0.5)
        assert [svc.batch(s, track=True).digest for s in range(16, 18)] == reference_digests[16:18]
        print("kill -9 results:", json.dumps({"kills": kills, "restarts": svc.status()["restarts"]}))
    finally:
        svc.stop()


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_a_service_mode_loader_reads_through_a_producer_kill(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """A trainer rank's Loader in service mode holds the refs of steps ahead of it when a producer is killed with -9:
    the shards behind them are lost, and the loader has them made again instead of raising ShardsLostError (a
    seq_len 8,192 soak's rank died so, 9 steps after the kill). Both producers die, so every step the rank had not
    fetched yet is lost; its rows must still be the golden ones, each step once."""
    from zephon_ray import compute_digest
    from zephon_ray.stream.loader import Loader, LoaderConfig

    svc = start_service(tiny_recipe, tmp_path, "loader-kill", producers=2, window=8)
    config = LoaderConfig(
        recipe=str(tiny_recipe.path),
        mode="service",
        run_id="loader-kill",
        service_name="loader-kill",
        service_namespace=NS,
    )
    loader = Loader(config, rank=0, world=1)
    try:
        it = iter(loader)
        served = [next(it).slice for _ in range(2)]
        _, pids = live_pids(svc)
        held = [svc.refs(s) for s in range(2, 10)]  # untracked: this process's read path holds their refs now
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120  # until Ray knows the owners died, their objects still read fine
        while svc.status()["restarts"] < 1:
            assert time.monotonic() < deadline, "the killed producers were never replaced"
            time.sleep(0.2)
        served += [next(it).slice for _ in range(14)]
        digests = [compute_digest(s.tokens, s.positions) for s in served]
        assert digests == reference_digests[:16], "a step's rows were wrong, missing or served twice"
        del held  # alive until the loader read past those steps
    finally:
        loader.close()
        svc.stop()


def _restart_cycles(tiny_recipe, reference_digests, tmp_path, cycles):
    """Per cycle (s, read_until, producers): read up to read_until with M=2, commit s, stop; restart from
    state_dir with ``producers``: the first batch is step s's rows, the replay at start is at most K steps."""
    state_dir = tmp_path / "state"
    k = 8
    records = []
    for s, read_until, producers in cycles:
        svc = start_service(tiny_recipe, tmp_path, "restart", producers=2, state_dir=state_dir, checkpoint_every=k)
        try:
            first = records[-1]["s"] if records else 0
            for step in range(first, read_until):
                assert svc.batch(step, track=True).digest == reference_digests[step]
            svc.commit(s)
        finally:
            svc.stop()
        t0 = time.monotonic()
        svc = start_service(
            tiny_recipe, tmp_path, "restart", producers=producers, state_dir=state_dir, checkpoint_every=k
        )
        try:
            first_batch = svc.batch(s, track=True)
            ttfb = time.monotonic() - t0
            assert first_batch.digest == reference_digests[s]
            start = svc.status()["start"]
            assert start["start_step"] == s and start["latest_commit"] == s
            assert start["checkpoint_step"] == s - s % k and start["replay_steps"] <= k, start
            for step in range(s + 1, s + 6):
                assert svc.batch(step, track=True).digest == reference_digests[step]
            records.append({"s": s, "producers": producers, "time_to_first_batch_s": round(ttfb, 3), **start})
        finally:
            svc.stop()
    print("restart time-to-first-batch:", json.dumps(records))


@pytest.mark.heavy
def test_restart_from_state_dir_bounded_replay(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """Stop after a commit, restart from state_dir at another M (2 -> 1): steps s.. match, replay <= K."""
    _restart_cycles(tiny_recipe, reference_digests, tmp_path, [(21, 30, 1)])


@pytest.mark.slow
def test_restart_from_state_dir_twice_far_apart(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """The same promise twice on one state_dir, the second time 136 steps later (pruned checkpoints, anchors)."""
    _restart_cycles(tiny_recipe, reference_digests, tmp_path, [(21, 30, 2), (157, 165, 1)])


@pytest.mark.heavy
def test_rescale_2_1_2_keeps_batches(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    svc = start_service(tiny_recipe, tmp_path, "rescale", producers=2)
    try:
        got = [svc.batch(s, track=True).digest for s in range(7)]
        assert svc.rescale(1)["producers"] == 1
        got += [svc.batch(s, track=True).digest for s in range(7, 15)]
        assert len(svc.status()["producers"]) == 1
        assert svc.rescale(2)["producers"] == 2
        got += [svc.batch(s, track=True).digest for s in range(15, 24)]
        status = svc.status()
        assert len(status["producers"]) == 2 and status["generation"] == 2
        assert got == reference_digests[:24]
        with pytest.raises(ValueError, match="producers=3 does not divide"):
            svc.rescale(3)
    finally:
        svc.stop()


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.heavy
def test_a_group_is_recycled_every_producer_recycle_steps_and_no_batch_changes(
    ray_cluster, tiny_recipe, reference_digests, tmp_path
):
    """``producer_recycle_steps=6`` with 2 producers: by step 24 the group has been replaced by fresh processes at
    least three times, each from a collective checkpoint at a step boundary, and so has the replayer (a past step is
    read at every step from 8 on); every step's rows, live or replayed, are the golden ones. Each retired replayer
    dies once its replays are done; the past steps read again after that (those the client holds from a killed
    replayer have lost their shards: invalidated, replayed again) are the golden ones too."""
    svc = start_service(tiny_recipe, tmp_path, "recycle", producers=2, producer_recycle_steps=6)
    try:
        got, replayed, pids, replayer_pids = [], [], set(), set()
        for step in range(24):
            got.append(svc.batch(step, track=True).digest)
            if step >= 8:  # behind the live window (4 steps): the replayer's
                replayed.append(svc.batch(step - 8).digest)
            status = svc.status()
            pids |= {p["pid"] for p in status["producers"] if p["pid"]}
            replayer_pids |= {r["pid"] for r in status["replayers"] if r and r.get("pid")}
        assert got == reference_digests[:24], "a step's rows were wrong, missing or served twice"
        assert replayed == reference_digests[:16], "a replayed step's rows were wrong"
        status = svc.status()
        assert status["recycles"] >= 3 and status["restarts"] == 0, status
        assert status["generation"] == status["recycles"], status
        assert len(pids) >= 2 * 3, pids  # new processes: a recycle drops the old ones' memory
        assert len(replayer_pids) >= 2, replayer_pids  # the replayer's too
        assert status["replay"]["retired"] >= 2, status["replay"]
        # each retired replayer finished its replays (none failed a read above), then was killed
        current = {r["pid"] for r in status["replayers"] if r}
        deadline = time.monotonic() + RETIRE_GRACE_S + 20
        while (left := {p for p in replayer_pids - current if pid_alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"retired replayers still alive {RETIRE_GRACE_S:.0f}s after their last replay: {left}"
        # the replays the client still holds from killed replayers have lost their shards: invalidated, made again
        assert [svc.batch(step).digest for step in range(16)] == reference_digests[:16]
    finally:
        svc.stop()


def _replace_without_room(summary: str, change: str) -> None:
    """Spawned driver: a private Ray whose 2 ``slot`` resources fit exactly one group of 2 producers (each asks for a
    slot), and a consumer that reads and commits steps 0-19. The group is replaced after step 5 by ``change``: a
    phase added at step 10 (``"phase"``), a rescale to 1 producer (``"rescale"``), or a recycle every 8 steps
    (``"recycle"``). The new group cannot start while the old one keeps its slots. The rows read are compared with
    the in-process source of the recipe the service runs under."""
    import ray

    from tests.ray_clusters import local_cluster

    info: dict = {}
    recipe = Recipe.from_toml(TINY)
    after = recipe.with_phase("late", 10, {"code": 1.0}) if change == "phase" else recipe
    with GlobalBatchSource(after) as source:
        golden = [source.batch(step).digest for step in range(20)]
    try:
        with local_cluster("zr-no-room-", {"num_cpus": 4, "resources": {"slot": 2}, "include_dashboard": False}) as (
            cluster,
            _,
        ):
            ray.init(address=cluster.address, namespace="zr-no-room", log_to_driver=False)
            svc = start_service(
                TINY,
                Path(summary).parent,
                f"{change}-no-room",
                producers=2,
                producer_recycle_steps=8 if change == "recycle" else 0,
                read_timeout_s=120,
                resources={"producer_resources": {"slot": 1}},
            )
            try:
                got = []
                for step in range(20):
                    if step == 6 and change == "phase":
                        svc.add_phase("late", 10, {"code": 1.0})
                    elif step == 6 and change == "rescale":
                        svc.rescale(1)
                    got.append(svc.batch(step, track=True).digest)
                    svc.commit(step)
                status = svc.status()
                info = {
                    "rows_golden": got == golden,
                    "producers": len(status["producers"]),
                    **{k: status[k] for k in ("recycles", "replaced_without_room")},
                }
            finally:
                svc.stop()
    except Exception as exc:  # noqa: BLE001 - the test reads it from the summary
        info["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    Path(summary).write_text(json.dumps(info))


@pytest.mark.heavy
@pytest.mark.parametrize("change", ["phase", "rescale", "recycle"])
def test_a_group_replaced_without_room_for_both_groups_is_not_a_hang(tmp_path, change):
    summary = tmp_path / "summary.json"
    info = run_spawned_driver(_replace_without_room, (str(summary), change), summary, 280)
    assert "error" not in info, info["error"]
    assert info["rows_golden"], "a step's rows were wrong, missing or served twice"
    assert info["producers"] == (1 if change == "rescale" else 2), info
    replaced = info["recycles"] if change == "recycle" else 1
    assert replaced >= (2 if change == "recycle" else 1) and info["replaced_without_room"] == replaced, info


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_random_kills_and_rescales(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """Producers killed with -9 at random moments (inside collective checkpoints too) while two consumers read
    and the service rescales 2 -> 4 -> 1 -> 2: every step served has the reference digest. At least 5 kills
    whatever the machine's speed: at steps 20, 40, .., 100 the reader waits (bounded) until the killer has made one
    kill per 20 steps, and the killer, asked, kills without waiting for a newly produced step."""
    import random
    import threading

    rng = random.Random(7)
    svc = start_service(tiny_recipe, tmp_path, "chaos", producers=2, window=3, checkpoint_every=3)
    other = DataService.connect("chaos", namespace=NS, consumer="other")
    stop, wanted = threading.Event(), threading.Event()
    kills = []

    def killer():
        # Kill only once the group has produced a step since the previous kill: a kill rate faster than recovery
        # (actor start + Zephon restore, seconds on a loaded 2-core machine) is a livelock that the service rightly
        # ends after MAX_CONSECUTIVE_DEATHS, not a test of recovery.
        produced_at_kill = -1
        while not stop.wait(rng.uniform(0.3, 1.5)):
            try:
                status = svc.status()
                produced = status["throughput"]["produced_steps"]
                pids = [p["pid"] for p in status["producers"] if p["pid"]]
                if pids and (produced > produced_at_kill or wanted.is_set()):
                    victim = rng.choice(pids)
                    os.kill(victim, signal.SIGKILL)
                    kills.append(victim)
                    produced_at_kill = produced
                    wanted.clear()
            except (ProcessLookupError, ServiceError):
                pass

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    t0 = time.monotonic()
    chaos_source = GlobalBatchSource(tiny_recipe)  # sequential reads of steps 0..115: cheap
    try:
        for step in range(120):
            if step % 10 == 0:  # shown on a failure: where a slow or stuck run was
                print(f"chaos: step {step} at {time.monotonic() - t0:.0f} s, {len(kills)} kills", flush=True)
            if step % 20 == 0 and len(kills) < step // 20:  # a kill count by condition, not by the clock
                wanted.set()
                deadline = time.monotonic() + 120
                while len(kills) < step // 20:
                    assert time.monotonic() < deadline, f"the killer made no kill in 120 s at step {step}"
                    time.sleep(0.1)
            assert svc.batch(step, track=True).digest == reference_digests[step], step
            if step % 2 == 0 and step >= 4:
                # untracked: a tracked cursor 4 steps behind would hold the main consumer (window 3) until it
                # expires (consumer_ttl_s), which measures the TTL, not recovery
                part = other.slice(step - 4, step % 4, 4, track=False)
                want = chaos_source.batch(step - 4).slice(step % 4, 4)
                assert np.array_equal(part.tokens, want.tokens) and np.array_equal(part.positions, want.positions)
            if step in (30, 60, 90):
                svc.rescale({30: 4, 60: 1, 90: 2}[step])
    finally:
        stop.set()
        thread.join(timeout=10)
        chaos_source.close()
        status = svc.status()
        svc.stop()
    print(
        "chaos:", json.dumps({"kills": len(kills), "restarts": status["restarts"], "generation": status["generation"]})
    )
    assert len(kills) >= 5 and status["restarts"] >= 1


@pytest.mark.parametrize(
    "producers", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.heavy)]
)  # one producer: slow (time)
def test_watchdog_replaces_a_hung_producer(ray_cluster, tiny_recipe, reference_digests, tmp_path, producers):
    """SIGSTOP a producer: alive but stuck. The progress watchdog replaces the group; reads go on, rows right. With
    two producers the other one's calls keep finishing: a finished call of a step still waiting on the stuck one is
    not progress (it once was, and a pump that spun on it never replaced the group)."""
    # No collective checkpoint in the way (it would hold the healthy producer's calls too). 10 s: a replacement
    # group's first call (its pipeline's start, then skipping from step 0) must not look hung on a loaded machine,
    # where 3 s could make five replacements in a row (fatal: a review found it, no run has shown it); the stopped
    # one is still found well within the reads' 60 s.
    svc = start_service(
        tiny_recipe,
        tmp_path,
        f"hung{producers}",
        window=3,
        progress_timeout_s=10.0,
        producers=producers,
        checkpoint_every=64,
    )
    stopped = None
    try:
        for step in range(4):
            assert svc.batch(step, track=True).digest == reference_digests[step]
        _, pids = live_pids(svc)
        stopped = pids[0]
        os.kill(stopped, signal.SIGSTOP)
        since = time.monotonic()
        for step in range(4, 14):
            try:
                # 150 s: this scenario's reads went on 13-14 s after the SIGSTOP alone (the print below), 33 s with
                # ten CPU-bound processes beside it on 2 cores; 60 s was once too short in CI (three heavy workers)
                batch = svc.refs(step, track=True, timeout_s=150).batch()
            except TimeoutError as exc:  # the coordinator's wait, or this process's wait on the call in flight
                status = svc.status()
                seen = {k: status[k] for k in ("hung_replacements", "restarts", "generation", "last_restart")}
                raise AssertionError(f"step {step}, {time.monotonic() - since:.0f}s after SIGSTOP: {seen}") from exc
            assert batch.digest == reference_digests[step]
        print("hung producer replaced; reads went on after", round(time.monotonic() - since, 1), "s")
        status = svc.status()
        assert status["hung_replacements"] >= 1 and stopped not in [p["pid"] for p in status["producers"]]
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        svc.stop()


def test_producer_init_failure_is_one_config_error(ray_cluster, tiny_recipe, tmp_path):
    """Data missing on the producers' node: start() fails once, naming the node and the reason."""
    import shutil

    from zephon_ray import Recipe

    data = tmp_path / "data"
    shutil.copytree(tiny_recipe.path.parent / "data" / "tiny", data)
    text = tiny_recipe.path.read_text().replace('path = "data/tiny/', f'path = "{data}/')
    (tmp_path / "moved.toml").write_text(text)
    recipe = Recipe.from_toml(tmp_path / "moved.toml")
    _ = recipe.fingerprint  # identity taken while the data is there ...
    shutil.rmtree(data / "code")  # ... then one source disappears from the node
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match=r"configuration error: .*(producer|replayer).* on ") as info:
        start_service(recipe, tmp_path, "noinit", producers=2)
    message = str(info.value)
    assert "code" in message and "Traceback" not in message, message
    import ray

    leftovers = [
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e.get("namespace") == NS and e.get("name", "").startswith("noinit")
    ]
    assert not leftovers, leftovers
    print("init failure reported in", round(time.monotonic() - t0, 2), "s:", message[:300])
