"""The data service at scale, measured on a private local Ray (issues 8 and 16). Every row read is checked.

    python benchmarks/bench_service_load.py [--parts load,calls,pending,pump,idle,replies,cpu,resume,kill,long]
                                            [--ranks 256] [--steps 10] [--rounds 2]

Two read paths, side by side in one run, in rounds whose order flips every round (the same work on both sides):
``direct`` is the path before leases (every rank's read of every step is one coordinator call) and ``node`` is the
lease path (a node reader per node leases ``lease_steps`` steps at once for every rank there; the coordinator sees
its leases and cursor reports only). Parts (each prints a line; one JSON line ``RESULT`` at the end):
- ``load``: one service per side and round, 2 jobs x R simulated ranks (threads) x S steps, each job reading its
  slices in lock-step at a fixed step time; p50/p99/max data wait and the longest after step 0 (a round's
  first read is cold: a process's first fetch), p50/p99 of ``status()`` latency (a prober
  calls it every 50 ms), coordinator CPU per rank-step (psutil on the coordinator's process), node readers' CPU per
  rank-step, all slices checked against the reference digests (GlobalBatchSource). Run at R=32 and R=``--ranks``.
  The recipe is the tiny fixture with B=256 rows (``rows_per_microbatch=32``), so 256 ranks each get a real slice.
  Targets (what a 1k-16k GPU deployment needs, docs/scaling.md): node coordinator CPU per rank-step <= 0.1 ms at R=256; direct p99 wait / node p99 wait >= 10;
  node status() p99 <= 100 ms.
- ``calls``: coordinator CPU per call of each kind (a lease of ``--lease-steps`` steps, 4 by default, with 8 cursor
  moves, a report of 8 moves, a report of none, ``status()``), net of its idle rate, for docs/scaling.md.
- ``pending``: 512 reads waiting at once (a holder consumer pins the window), per side, while ``status()`` and
  ``commit()`` are timed; then the holder releases and every waiting read must complete with the right rows.
- ``pump``: coordinator CPU per produced step (the whole process and its pump thread) and its idle rate, at
  M = 1, 2, 4, 8 producers (``--pump-producers``; above 8 the recipe's B = 256 rows are cut into max(M) lanes, one
  per producer at the largest M), with nobody reading but one cursor hopping a window at a time.
- ``idle``: idle CPU (per second, by kind of thread) of the coordinator (full window, nobody reading), the node
  reader, a producer and two bare Ray actors (async, threaded: Ray's own floor), over the same ``--idle-seconds``.
- ``replies``: Ray's own cost to a caller of one produce-like call (no service: a driver and one actor), its
  reply carrying the ref of a ``ray.put`` container as the producers' replies do (the caller borrows it) vs the
  same container's id as bytes (no ref travels): what a ref in a reply costs the pump per producer and step; and
  the same replies as the items of one streaming-generator call (``num_returns="streaming"``), paced one item
  ahead (``_generator_backpressure_num_objects=1``) as a pump that wants steps one at a time would consume them.
- ``cpu``: service CPU-seconds per million tokens (coordinator + producers + replayer) at M=1, 2, 4 (order flipped
  every round), and tokens/s; coordinator CPU per step.
- ``resume``: warm time to first batch for a restarted W=4 job (same consumer, resumes at its commit): retained
  window (hits) vs the replay path (``retain_behind=0``), order flipped every round.
- ``kill``: ``kill -9`` the coordinator while a consumer reads: time to the next batch (recovery).
- ``long``: 5,000 steps with commits every 50: ``state_dir`` file count and bytes, and the object store (Ray's
  own memory summary), sampled every 500 steps, must stay flat.

On 2 cores every process (producers, coordinator, node reader, reader threads, Ray) shares the same CPUs:
latencies are upper bounds; CPU-seconds per token do not depend on the core count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NS = "zr-bench-load"


def pct(values, q):
    values = sorted(values)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def load_recipe(rows_per_microbatch: int, tmp: Path, lanes: int = 8):
    from zephon_ray import Recipe

    text = (ROOT / "recipes" / "tiny.toml").read_text()
    text = text.replace("rows_per_microbatch = 2", f"rows_per_microbatch = {rows_per_microbatch}")
    text = text.replace("lanes = 8", f"lanes = {lanes}")
    text = text.replace('path = "data/', f'path = "{ROOT / "recipes" / "data"}/')
    path = tmp / f"tiny-l{lanes}-b{lanes * rows_per_microbatch}.toml"
    path.write_text(text)
    return Recipe.from_toml(path)


def start(recipe, name, tmp, **kw):
    from zephon_ray import DataService

    kw.setdefault("window", 8)
    kw.setdefault("checkpoint_every", 8)
    if kw.get("producers", 1) > 1:
        kw.setdefault("aggregate_store", "torch://")
        kw.setdefault("run_id", name)
    return DataService.start(recipe, name=name, namespace=NS, state_dir=tmp / f"state-{name}", **kw)


def service_pids(svc) -> list[int]:
    status = svc.status()
    pids = [status["coordinator"]["pid"]] + [p["pid"] for p in status["producers"]]
    pids += [r["pid"] for r in status["replayers"] if r]
    return [p for p in pids if p]


def cpu_seconds(pids) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# ---------------------------------------------------------------------------------------------------- load
def reader_infos() -> list[dict]:
    """``info()`` of this cluster's node readers (named ``<service>.reader.*``; Ray's actor table, no dashboard):
    pid and call counters."""
    import ray

    infos = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if ".reader." in entry.get("name", ""):
            try:
                handle = ray.get_actor(entry["name"], namespace=entry["namespace"])
                infos.append(ray.get(handle.info.remote(), timeout=30))
            except Exception:  # noqa: BLE001
                pass
    return infos


def reader_pids() -> list[int]:
    return [i["pid"] for i in reader_infos() if i.get("pid")]


def _reader_calls(infos: list[dict]) -> dict[str, int]:
    keys = ("reads", "hits", "advances", "leases", "reports")
    return {k: sum(i.get(k, 0) for i in infos) for k in keys}


def thread_seconds(pid: int, tid: str, source: str = "schedstat") -> float:
    """One thread's CPU-seconds: its ``schedstat`` run time (ns; its ``stat`` where the kernel has no schedstat), or
    its ``stat`` (``source="stat"``: 10 ms ticks charged by sampling). OSError: the thread is gone."""
    if source == "schedstat":
        try:
            return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            pass
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU-seconds of one process's living threads by kind, from ``/proc/PID/task/*`` (Linux): ``pump`` (the
    coordinator's pump thread), ``python`` (other threads Python started: the actor's event loops, executors; they
    carry the process's name), ``core_worker`` (Ray's C++ io threads: ``worker.io`` and the like) and ``grpc``
    (gRPC's pollers and event engine). Read from ``schedstat`` (the scheduler's run time, in ns): a thread's
    ``stat`` is charged 10 ms ticks by sampling and under-counts threads that run for microseconds at a time, where
    the process's own ``stat`` total, scaled from run time, does not (``bench_cpu_accounting.py``; before this read
    schedstat, the split missed 0.015 of 0.023 ms per rank-step in one W = 256 round, docs/scaling.md). Falls back
    to ``stat`` where the kernel has no schedstat."""
    out = {"python": 0.0, "pump": 0.0, "core_worker": 0.0, "grpc": 0.0}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            cpu = thread_seconds(pid, tid)
        except OSError:
            continue
        if comm.startswith("zr-pump"):  # the coordinator's pump thread names itself
            out["pump"] += cpu
        elif comm.startswith(("ray::", "python", "default_worker")):
            out["python"] += cpu
        elif comm.startswith(
            (
                "client.poll",
                "server.poll",
                "event_engine",
                "grpc",
                "grpcpp",
                "resolver",
                "timer_manager",
                "default-executo",
            )
        ):
            out["grpc"] += cpu
        else:
            out["core_worker"] += cpu
    return out


def _tids(pids) -> set[str]:
    out = set()
    for pid in pids:
        try:
            out |= {f"{pid}/{t}" for t in os.listdir(f"/proc/{pid}/task")}
        except OSError:
            pass
    return out


def _split_delta(before: dict[str, float], after: dict[str, float], per: int) -> dict[str, float]:
    return {k: (after.get(k, 0.0) - before.get(k, 0.0)) / max(per, 1) * 1e3 for k in after}


def _rank_process(
    address: str,
    name: str,
    consumer: str,
    world: int,
    ranks: list[int],
    steps: int,
    step_time: float,
    ref: dict,
    barrier,
    ready,
    out,
) -> None:
    """One trainer process of the ``per_rank`` side: each of ``ranks`` is a thread with a handle of its own
    (``DataService.connect``), as each rank of a real job is a process with its own handle. ``barrier`` spans every
    rank of the job (all processes): lock-step."""
    import ray

    from zephon_ray import DataService, compute_digest
    from zephon_ray.service.client.node_read_path import stop_background

    ray.init(address=address, namespace=NS, log_to_driver=False, logging_level="ERROR")
    handles = {r: DataService.connect(name, namespace=NS, consumer=consumer) for r in ranks}
    waits, later, bad, errors = [], [], [], []
    ready.wait()  # every process connected: the parent starts the clock

    def rank_loop(r: int) -> None:
        client = handles[r]
        try:
            for step in range(steps):
                t_step = time.perf_counter()
                part = client.slice(step, r, world, track=True)
                waits.append(time.perf_counter() - t_step)
                if step:
                    later.append(waits[-1])
                if compute_digest(part.tokens, part.positions) != ref[(step, r)]:
                    bad.append((r, step))
                barrier.wait(timeout=600)
                rest = step_time - (time.perf_counter() - t_step)
                if rest > 0:
                    time.sleep(rest)
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
            barrier.abort()

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put({"waits": waits, "later": later, "bad": bad, "errors": errors})
    ready.wait()  # the parent took its CPU reading: now leave (handles released with the process)
    stop_background()  # as zephon_ray's own sessions do: no thread of ours may call into Ray after shutdown
    ray.shutdown()


SIDES = ("direct", "node", "per_rank")
"""``direct``: one handle per job shared by its rank threads, one coordinator call per read; ``node``: the same
handle on the node path; ``per_rank``: one handle per rank (``--processes`` processes per job), node path."""


def run_load(
    recipe,
    reference,
    tmp,
    ranks: int,
    steps: int,
    step_time: float,
    side: str,
    tag: str,
    jobs: int = 2,
    processes: int = 8,
    profile: str | None = None,
    status_every: float = 0.05,
    window: int = 8,
) -> dict:
    import multiprocessing

    import ray

    from zephon_ray import DataService, compute_digest

    rows = recipe.global_batch_rows
    world = ranks if rows % ranks == 0 else next(w for w in range(min(ranks, rows), 0, -1) if rows % w == 0)
    read_path = "direct" if side == "direct" else "node"
    svc = start(recipe, f"load-{ranks}-{side}-{tag}", tmp, window=window)
    waits, later, bad, errors, status_lat = [], [], [], [], []
    stop = threading.Event()

    def prober():
        while status_every > 0 and not stop.wait(status_every):
            t0 = time.perf_counter()
            svc.status()
            status_lat.append(time.perf_counter() - t0)

    def job(j: int):
        client = DataService.connect(svc.name, namespace=NS, consumer=f"job{j}", read_path=read_path)
        barrier = threading.Barrier(ranks)

        def rank_loop(r: int):
            try:
                for step in range(steps):
                    t_step = time.perf_counter()
                    part = client.slice(step, r % world, world, track=True)
                    waits.append(time.perf_counter() - t_step)
                    if step:
                        later.append(waits[-1])
                    if compute_digest(part.tokens, part.positions) != reference[step][(r % world, world)]:
                        bad.append((j, r, step))
                    barrier.wait(timeout=600)  # lock-step: the job's next step starts when all ranks have theirs
                    rest = step_time - (time.perf_counter() - t_step)
                    if rest > 0:
                        time.sleep(rest)
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))
                barrier.abort()

        threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    coordinator = svc.status()["coordinator"]["pid"]
    if read_path == "node":  # start the node reader before the clock: its start-up is not a read cost
        svc.refs(0)
    readers = reader_pids()
    calls0 = _reader_calls(reader_infos())
    procs, ready, out = [], None, None
    if side == "per_rank":  # connect every handle before the clock: a connect is not a read cost
        ctx = multiprocessing.get_context("spawn")
        per = -(-ranks // processes)
        ready = ctx.Barrier(jobs * processes + 1)
        out = ctx.Queue()
        address = ray.get_runtime_context().gcs_address
        for j in range(jobs):
            barrier = ctx.Barrier(ranks)
            for p in range(processes):
                mine = list(range(p * per, min(ranks, (p + 1) * per)))
                ref = {(s, r): reference[s][(r, world)] for s in range(steps) for r in mine}
                procs.append(
                    ctx.Process(
                        target=_rank_process,
                        args=(address, svc.name, f"job{j}", world, mine, steps, step_time, ref, barrier, ready, out),
                    )
                )
        for proc in procs:
            proc.start()
        ready.wait(timeout=900)
    split0 = thread_cpu(coordinator)
    rsplit0 = [thread_cpu(p) for p in readers]
    tids0 = _tids([coordinator, *readers])
    cpu0, rcpu0 = cpu_seconds([coordinator]), cpu_seconds(readers)
    profilers = start_profilers(profile, f"{side}-{ranks}-{tag}", coordinator, readers) if profile else []
    probe = threading.Thread(target=prober, daemon=True)
    probe.start()
    t0 = time.perf_counter()
    if side == "per_rank":
        for _ in procs:
            got = out.get(timeout=1800)
            waits += got["waits"]
            later += got["later"]
            bad += got["bad"]
            errors += got["errors"]
    else:
        job_threads = [threading.Thread(target=job, args=(j,), daemon=True) for j in range(jobs)]
        for t in job_threads:
            t.start()
        for t in job_threads:
            t.join()
    elapsed = time.perf_counter() - t0
    coordinator_cpu = cpu_seconds([coordinator]) - cpu0
    reader_cpu = cpu_seconds(readers) - rcpu0
    split = _split_delta(split0, thread_cpu(coordinator), len(waits))
    rsplit = {}
    for before, pid in zip(rsplit0, readers):
        for k, v in _split_delta(before, thread_cpu(pid), len(waits)).items():
            rsplit[k] = rsplit.get(k, 0.0) + v
    threads_gone = len(tids0 - _tids([coordinator, *readers]))  # their CPU is in the tick totals, not the splits
    profiles = stop_profilers(profilers)
    calls1 = _reader_calls(reader_infos())
    stop.set()
    probe.join()
    if procs:
        ready.wait(timeout=120)
        for proc in procs:
            proc.join(120)
    reads = svc.status()["reads"]
    svc.stop()
    n = max(len(waits), 1)
    return {
        "side": side,
        "read_path": read_path,
        "jobs": jobs,
        "ranks": ranks,
        "world": world,
        "steps": steps,
        "processes": len(procs) if procs else 1,
        "step_time_s": step_time,
        "reads": len(waits),
        "wrong_rows": len(bad),
        "coordinator_cpu_s": round(coordinator_cpu, 3),
        # the figures: the threads' run time (ns); the processes' 10 ms-tick totals beside them as a check
        "coordinator_cpu_ms_per_rank_step": sum(split.values()),
        "node_reader_cpu_ms_per_rank_step": sum(rsplit.values()),
        "coordinator_ticks_ms_per_rank_step": coordinator_cpu / n * 1e3,
        "node_reader_ticks_ms_per_rank_step": reader_cpu / n * 1e3,
        "threads_gone": threads_gone,
        "coordinator_threads_ms_per_rank_step": split,
        "node_reader_threads_ms_per_rank_step": rsplit,
        "coordinator_calls": {
            "leases": reads["leases"],
            "reports": reads["reports"],
            "cursor_moves": reads["cursor_moves"],
        },
        "node_reader_calls": {k: calls1[k] - calls0.get(k, 0) for k in calls1},
        "errors": errors[:3],
        "elapsed_s": round(elapsed, 2),
        "profiles": profiles,
        "wait_ms": {
            "p50": pct(waits, 0.5) * 1e3,
            "p99": pct(waits, 0.99) * 1e3,
            "max": max(waits) * 1e3,
            "max_after_step_0": max(later, default=0.0) * 1e3,
        },
        "status_ms": {
            "p50": (pct(status_lat, 0.5) or 0) * 1e3,
            "p99": (pct(status_lat, 0.99) or 0) * 1e3,
            "n": len(status_lat),
        },
    }


# ---------------------------------------------------------------------------------------------------- profiles
def start_profilers(folder: str, tag: str, coordinator: int, readers: list[int]) -> list:
    """Profilers on the coordinator and the node readers while the load runs, each writing to ``folder``:
    ``py-spy record`` (the Python frames of every Python thread, sampled without pausing the process) and
    ``perf record -g`` (every thread, Ray's C++ core worker and gRPC included; Ray's ``_raylet.so`` carries its
    symbols). Neither is a dependency of the project (``pip install py-spy``; perf from the OS); a missing one is
    skipped. Both need ptrace/perf_event rights on the processes."""
    import subprocess

    Path(folder).mkdir(parents=True, exist_ok=True)
    running = []
    for who, pid in [("coordinator", coordinator)] + [(f"reader{i}", p) for i, p in enumerate(readers)]:
        if shutil.which("py-spy"):
            path = Path(folder) / f"{tag}-{who}.pyspy.txt"
            cmd = [
                "py-spy",
                "record",
                "--pid",
                str(pid),
                "--format",
                "raw",
                "--output",
                str(path),
                "--rate",
                "250",
                "--nonblocking",
            ]
            running.append(
                (who + ".pyspy", path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            )
        if shutil.which("perf"):
            path = Path(folder) / f"{tag}-{who}.perf.data"
            cmd = ["perf", "record", "-F", "499", "-g", "-p", str(pid), "-o", str(path)]
            running.append(
                (who + ".perf", path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            )
    if not running:
        print("  (neither py-spy nor perf on PATH: no profile)", flush=True)
    return running


def stop_profilers(running: list) -> dict:
    out = {}
    for _who, _path, proc in running:
        proc.send_signal(signal.SIGINT)
    for who, path, proc in running:
        try:
            proc.wait(120)
        except Exception:  # noqa: BLE001
            proc.kill()
        out[who] = str(path)
    return out


# ---------------------------------------------------------------------------------------------------- calls
def run_calls(recipe, tmp, n: int = 1500, lease_steps: tuple[int, ...] = (4,), threads: int = 8) -> dict:
    """Coordinator CPU per call of each kind a node reader makes, for docs/scaling.md: a lease of each count in
    ``lease_steps`` of produced steps and 1 lane with 8 cursor moves (a node of 8 ranks; ``lease`` for a count of
    4, ``lease_<count>`` for others), a report of 8 moves, a report of none (``empty``: the call alone), and
    ``status()``. Calls come from ``threads`` threads at once; CPU is the coordinator process's (psutil), minus its
    idle rate measured for as long just before."""
    import ray

    svc = start(recipe, "calls", tmp, window=max(8, *lease_steps))
    try:
        svc.batch(0, track=True)
        while len(svc.status()["window"]["held_steps"]) < max(lease_steps):
            time.sleep(0.1)
        coordinator = ray.get_actor(svc.name, namespace=NS)
        pid = svc.status()["coordinator"]["pid"]
        moves = [("calls", r, 256, 0, 0.0) for r in range(8)]

        def lease(count: int):
            return lambda: coordinator.lease.remote(0, count, (0, 1), 60, moves, False, "node-x")

        kinds = {("lease" if count == 4 else f"lease_{count}"): lease(count) for count in lease_steps}
        kinds["report"] = lambda: coordinator.advance.remote(moves)
        kinds["empty"] = lambda: coordinator.advance.remote([])  # a call that does nothing: Ray's floor
        kinds["status"] = lambda: coordinator.status.remote()
        out = {}
        for kind, call in kinds.items():
            c0, t0 = cpu_seconds([pid]), time.perf_counter()
            time.sleep(2.0)
            idle_rate = (cpu_seconds([pid]) - c0) / (time.perf_counter() - t0)
            per_thread = n // threads if kind != "status" else 100 // threads

            def loop(per_thread=per_thread, call=call):
                for _ in range(per_thread):
                    ray.get(call())

            workers = [threading.Thread(target=loop) for _ in range(threads)]
            c0, t0 = cpu_seconds([pid]), time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            wall = time.perf_counter() - t0
            cpu = cpu_seconds([pid]) - c0 - idle_rate * wall
            calls = per_thread * threads
            out[kind] = {
                "calls": calls,
                "cpu_ms_per_call": cpu / calls * 1e3,
                "calls_per_s": calls / wall,
                "idle_cpu_ms_per_s": idle_rate * 1e3,
            }
        return out
    finally:
        svc.stop()


# ---------------------------------------------------------------------------------------------------- pending
def run_pending(recipe, reference, tmp, n: int = 512, read_path: str = "node") -> dict:
    from zephon_ray import DataService, compute_digest

    svc = start(recipe, f"pending-{read_path}", tmp, window=4)
    holder = DataService.connect(svc.name, namespace=NS, consumer="holder")
    holder.slice(0, 0, 1, track=True)  # pins the window at [0, 4)
    world = 16
    target = 6  # beyond the window: every read of it waits for the holder
    results, errors = [], []

    def reader(i):
        try:
            client = DataService.connect(svc.name, namespace=NS, consumer=f"r{i % 64}", read_path=read_path)
            part = client.slice(target, i % world, world, track=True)
            results.append(compute_digest(part.tokens, part.positions) == reference[target][(i % world, world)])
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait until the reads are really pending in the coordinator
        if len(svc.status()["cursors"]) >= 64 * 1 + 1:
            break
        time.sleep(0.5)
    lat_status, lat_commit = [], []
    for _ in range(40):
        t0 = time.perf_counter()
        st = svc.status()
        lat_status.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        holder.commit(1)
        lat_commit.append(time.perf_counter() - t0)
    pending_cursors = len(st["cursors"])
    t0 = time.perf_counter()
    holder.release()
    for t in threads:
        t.join(timeout=600)
    drain = time.perf_counter() - t0
    svc.stop()
    return {
        "read_path": read_path,
        "pending_reads": n,
        "cursors_while_pending": pending_cursors,
        "completed_ok": sum(results),
        "errors": errors[:3],
        "status_ms": {
            "p50": pct(lat_status, 0.5) * 1e3,
            "p99": pct(lat_status, 0.99) * 1e3,
            "max": max(lat_status) * 1e3,
        },
        "commit_ms": {"p50": pct(lat_commit, 0.5) * 1e3, "max": max(lat_commit) * 1e3},
        "drain_s": round(drain, 2),
    }


# ---------------------------------------------------------------------------------------------------- cpu
def run_cpu(recipe, reference, tmp, steps: int, rounds: int = 1) -> dict:
    runs: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for r in range(rounds):
        for m in (1, 2, 4) if r % 2 == 0 else (4, 2, 1):
            runs[m].append(_run_cpu_once(recipe, reference, tmp, steps, m, f"{m}-{r}"))
    med = statistics.median
    out = {m: {k: med(x[k] for x in xs) for k in xs[0]} for m, xs in runs.items()}
    out["ratio_m2_vs_m1_cpu_per_token"] = med(
        a["cpu_s_per_mtok"] / b["cpu_s_per_mtok"] for a, b in zip(runs[2], runs[1])
    )
    out["ratio_m2_vs_m1_tokens_per_s"] = med(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[2], runs[1]))
    return out


def _run_cpu_once(recipe, reference, tmp, steps: int, m: int, tag: str) -> dict:
    if True:
        svc = start(recipe, f"cpu-m{tag}", tmp, producers=m, window=8)
        try:
            assert svc.batch(0, track=True).digest == reference[0]
            pids = service_pids(svc)
            coord = pids[0]
            c0, all0, t0 = cpu_seconds([coord]), cpu_seconds(pids), time.perf_counter()
            for s in range(1, steps + 1):
                if svc.batch(s, track=True).digest != reference[s]:
                    raise AssertionError(f"M={m} step {s}: wrong rows")
            elapsed = time.perf_counter() - t0
            c1, all1 = cpu_seconds([coord]), cpu_seconds(pids)
            mtok = steps * recipe.tokens_per_step / 1e6
            return {
                "cpu_s_per_mtok": (all1 - all0) / mtok,
                "tokens_per_s": mtok * 1e6 / elapsed,
                "coordinator_cpu_ms_per_step": (c1 - c0) / steps * 1e3,
                "processes": len(pids),
            }
        finally:
            svc.stop()


# ---------------------------------------------------------------------------------------------------- pump
def run_pump(
    recipe, digests, tmp, steps: int = 48, rounds: int = 1, producers=(1, 2, 4, 8), profile: str | None = None
) -> dict:
    """The coordinator's CPU per produced step against the number of producers M, with no reader but one: a
    direct-path client moves its cursor ``window`` steps at a time (``advance``) and waits for the last of them
    (one lease), so the producers refill the whole window each hop. Reported per produced step: the whole
    coordinator process, its pump thread alone, and its idle rate (window full, nobody reading) measured just
    before. Checkpoints (every 8 steps) are included. M order flips every round."""
    runs: dict[int, list[dict]] = {m: [] for m in producers}
    for r in range(rounds):
        for m in producers if r % 2 == 0 else producers[::-1]:
            runs[m].append(_pump_once(recipe, digests, tmp, steps, m, f"{m}-{r}", profile))
            x = runs[m][-1]
            print(
                f"pump M={m}, round {r}: coordinator {x['coordinator_ms_per_step']:.2f} CPU-ms per produced "
                f"step (pump thread {x['pump_ms_per_step']:.2f}); idle {x['idle_ms_per_s']:.2f} CPU-ms/s "
                f"(pump thread {x['idle_pump_ms_per_s']:.2f}, other python {x['idle_python_ms_per_s']:.2f}, "
                f"core worker {x['idle_core_worker_ms_per_s']:.2f}, grpc {x['idle_grpc_ms_per_s']:.2f})",
                flush=True,
            )
    med = statistics.median
    return {m: {k: med(x[k] for x in xs) for k in xs[0]} for m, xs in runs.items()}


def _pump_once(recipe, digests, tmp, steps: int, m: int, tag: str, profile: str | None = None) -> dict:
    # at most 4 logical CPUs for the producers (Ray has 8 here), so that M = 32 schedules too
    resources = {"producer_num_cpus": min(0.25, 4 / m)}
    svc = start(recipe, f"pump-m{tag}", tmp, producers=m, window=8, read_path="direct", resources=resources)
    try:
        window = svc.config.window
        assert svc.refs(0, track=True).batch().digest == digests[0]
        assert svc.refs(window - 1).batch().digest == digests[window - 1]  # the window is full
        pid = svc.status()["coordinator"]["pid"]
        time.sleep(1.0)
        s0, t0 = thread_cpu(pid), time.perf_counter()
        time.sleep(10.0)  # an average over Ray's periodic work (its metrics export: every 10 s by default)
        s1, idle_wall = thread_cpu(pid), time.perf_counter() - t0
        idle = {k: (s1[k] - s0[k]) / idle_wall * 1e3 for k in s1}
        produced = 0
        profilers = start_profilers(profile, f"pump-m{tag}", pid, []) if profile else []
        s0 = thread_cpu(pid)
        for first in range(window, window + steps, window):
            svc.advance(first)  # the cursor moves past the window: producers make the next ``window`` steps
            last = first + window - 1
            if svc.refs(last, timeout_s=600).batch().digest != digests[last]:
                raise AssertionError(f"M={m} step {last}: wrong rows")
            produced += window
        s1 = thread_cpu(pid)
        stop_profilers(profilers)
        total = sum(s1.values()) - sum(s0.values())
        return {
            "producers": m,
            "produced_steps": produced,
            "coordinator_ms_per_step": total / produced * 1e3,
            "pump_ms_per_step": (s1["pump"] - s0["pump"]) / produced * 1e3,
            "idle_ms_per_s": sum(idle.values()),
            "idle_pump_ms_per_s": idle["pump"],
            **{f"idle_{k}_ms_per_s": v for k, v in idle.items() if k != "pump"},
        }
    finally:
        svc.stop()


def run_replies(calls: int = 1500, rounds: int = 2) -> dict:
    """See the module docstring (``replies``). The caller's process CPU per call, read as the pump reads replies
    (``ObjectRef.future()``), the last 16 replies held; the two kinds alternate, order flipped every round."""
    import concurrent.futures

    import psutil
    import ray

    @ray.remote(num_cpus=0.01)
    class Replier:
        def __init__(self) -> None:
            self.keep: list = []

        def with_ref(self, step: int) -> dict:
            return {"step": step, "nbytes": 100, "container": ray.put([ray.put(b"x" * 100)])}

        def with_id(self, step: int) -> dict:
            ref = ray.put([ray.put(b"x" * 100)])
            self.keep = (self.keep + [ref])[-32:]  # alive as long as the caller holds replies
            return {"step": step, "nbytes": 100, "container": ref.binary()}

        def streamed(self, calls: int):
            for step in range(calls):
                yield self.with_ref(step)

    def stream_items(calls: int):
        gen = actor.streamed.options(
            num_returns="streaming", enable_task_events=False, _generator_backpressure_num_objects=1
        ).remote(calls)
        return (next(gen) for _ in range(calls))

    actor = Replier.remote()
    ray.get(actor.with_ref.remote(0))
    me = psutil.Process()
    runs: dict[str, list[float]] = {"with_ref": [], "with_id": [], "streamed": []}
    for r in range(rounds):
        for kind in ("with_ref", "with_id", "streamed") if r % 2 == 0 else ("streamed", "with_id", "with_ref"):
            held = []
            time.sleep(0.3)
            t = me.cpu_times()
            c0 = t.user + t.system
            if kind == "streamed":
                refs = stream_items(calls)
            else:
                method = getattr(actor, kind).options(enable_task_events=False)
                refs = (method.remote(step) for step in range(calls))
            for ref in refs:
                future = ref.future()
                concurrent.futures.wait([future])
                held = (held + [future.result()])[-16:]
            t = me.cpu_times()
            runs[kind].append((t.user + t.system - c0) / calls * 1e3)
            print(f"replies round {r}: {kind} {runs[kind][-1]:.3f} caller CPU-ms per call", flush=True)
    ray.kill(actor)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "caller_ms_per_call": med,
        "ref_in_reply_ms": med["with_ref"] - med["with_id"],
        "streamed_saves_ms": med["with_ref"] - med["streamed"],
    }


def _bare_actors():
    """Two actors with no code of ours (one async, one threaded), for Ray's own idle floor beside the service's."""
    import ray

    @ray.remote(num_cpus=0.01)
    class BareAsync:
        async def pid(self):
            return os.getpid()

    @ray.remote(num_cpus=0.01)
    class BareThreaded:
        def pid(self):
            return os.getpid()

    return [BareAsync.remote(), BareThreaded.remote()]


def run_idle(recipe, reference, tmp, seconds: float = 20.0, rounds: int = 1) -> dict:
    """Idle CPU (CPU-ms per second, by kind of thread, from ``/proc``) of every service process beside two bare Ray
    actors, all measured over the same seconds: the coordinator with a full window (one tracked consumer, nobody
    reading), the node reader that served that consumer's read, a producer, and Ray's floor."""
    import ray

    from zephon_ray import compute_digest

    runs: dict[str, list[dict]] = {}
    for rnd in range(rounds):
        bare = _bare_actors()
        svc = start(recipe, f"idle-{rnd}", tmp, read_path="node")
        try:
            idle = svc.connect(svc.name, namespace=NS, consumer="idle")
            part = idle.slice(0, 0, 4, track=True)  # through a node reader
            assert compute_digest(part.tokens, part.positions) == reference[0][(0, 4)], "step 0: wrong rows"
            last = svc.config.window - 1
            assert svc.refs(last).batch().digest == reference[last]["digest"], "the window is not full"
            status = svc.status()
            pids = {
                "coordinator": status["coordinator"]["pid"],
                "producer": status["producers"][0]["pid"],
                "node_reader": reader_pids()[0],
                "bare_async": ray.get(bare[0].pid.remote()),
                "bare_threaded": ray.get(bare[1].pid.remote()),
            }
            time.sleep(2.0)  # the last reply's work done
            before, t0 = {k: thread_cpu(p) for k, p in pids.items()}, time.perf_counter()
            time.sleep(seconds)
            after, wall = {k: thread_cpu(p) for k, p in pids.items()}, time.perf_counter() - t0
            for k in pids:
                by_kind = {t: (after[k][t] - before[k][t]) / wall * 1e3 for t in after[k]}
                runs.setdefault(k, []).append({"ms_per_s": sum(by_kind.values()), **by_kind})
        finally:
            svc.stop()
            for a in bare:
                ray.kill(a)
        print(
            f"idle round {rnd} ({seconds:.0f} s): "
            + ", ".join(f"{k} {v[-1]['ms_per_s']:.1f}" for k, v in runs.items())
            + " CPU-ms/s",
            flush=True,
        )
    med = statistics.median
    return {k: {f: med(x[f] for x in xs) for f in xs[0]} for k, xs in runs.items()}


# ---------------------------------------------------------------------------------------------------- resume
def run_resume(recipe, reference, tmp, behind: int = 6, world: int = 4, rounds: int = 1) -> dict:
    runs: dict[str, list[float]] = {"retained": [], "replay_path": []}
    for r in range(rounds):
        order = (("retained", 32), ("replay_path", 0)) if r % 2 == 0 else (("replay_path", 0), ("retained", 32))
        for label, retain in order:
            runs[label].append(_resume_once(recipe, reference, tmp, behind, world, label, retain, str(r)))
    med = statistics.median
    return {
        "retained": {"first_batch_s": med(runs["retained"])},
        "replay_path": {"first_batch_s": med(runs["replay_path"])},
        "ratio_replay_vs_retained": med(a / b for a, b in zip(runs["replay_path"], runs["retained"])),
    }


def _resume_once(recipe, reference, tmp, behind, world, label, retain, tag) -> float:
    from zephon_ray import DataService

    if True:
        svc = start(recipe, f"resume-{label}-{tag}", tmp, window=4, retain_behind=retain, checkpoint_every=8)
        try:
            job = DataService.connect(svc.name, namespace=NS, consumer="job")
            commit_at, read_until = 20, 20 + behind
            for s in range(read_until):
                for r in range(world):
                    job.slice(s, r, world, track=True)
                if s + 1 == commit_at:
                    job.commit(commit_at)
            time.sleep(0.5)
            # The "restarted" worker group: the same consumer, new ranks, resuming at the commit.
            restarted = DataService.connect(svc.name, namespace=NS, consumer="job")
            t0 = time.perf_counter()
            threads = [threading.Thread(target=restarted.slice, args=(commit_at, r, world)) for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            first = time.perf_counter() - t0
            assert restarted.batch(commit_at).digest == reference[commit_at]
            return first
        finally:
            svc.stop()


# ---------------------------------------------------------------------------------------------------- kill
def run_kill(recipe, reference, tmp) -> dict:
    from zephon_ray import compute_digest

    svc = start(recipe, "kill", tmp, window=4, checkpoint_every=4)
    try:
        for s in range(10):
            part = svc.slice(s, 0, 1, track=True)
            assert compute_digest(part.tokens, part.positions) == reference[s]
            if s % 4 == 3:
                svc.commit(s + 1)
        pid = svc.status()["coordinator"]["pid"]
        os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        waits = []
        # past what this process and its node reader had leased before the kill: those steps need the new
        # incarnation (and, its predecessor's producers killed, steps made again)
        for s in range(10, 10 + 2 * svc.config.lease_steps + 2):
            t = time.perf_counter()
            batch = svc.batch(s, track=True)
            waits.append(time.perf_counter() - t)
            assert batch.digest == reference[s]
        return {
            "recovery_s": max(waits),
            "steps_after_kill_s": time.perf_counter() - t0,
            "later_ok": True,
            "start": svc.status()["start"],
        }
    finally:
        svc.stop()


# ---------------------------------------------------------------------------------------------------- long
def object_store_view() -> dict:
    from ray_plasma import plasma_usage

    usage = plasma_usage()
    return {"plasma_mib": usage["mib"], "plasma_objects": usage["objects"]}


def run_long(recipe, reference_source, tmp, steps: int = 5000) -> dict:
    svc = start(recipe, "long", tmp, window=8, checkpoint_every=8, keep_checkpoints=4, anchor_every=512)
    state_dir = Path(svc.status()["state_dir"])
    samples = []
    try:
        for s in range(steps):
            batch = svc.batch(s, track=True)
            if s % 97 == 0 and batch.digest != reference_source.batch(s).digest:
                raise AssertionError(f"step {s}: wrong rows")
            if s % 50 == 49:
                svc.commit(s + 1)
            if s % 500 == 499:
                files = [p for p in state_dir.rglob("*") if p.is_file()]
                st = svc.status()
                samples.append(
                    {
                        "step": s + 1,
                        "files": len(files),
                        "bytes": sum(p.stat().st_size for p in files),
                        "held_steps": len(st["window"]["held_steps"]),
                        "held_bytes": st["window"]["held_bytes"],
                        **object_store_view(),
                    }
                )
                print("  long:", json.dumps(samples[-1]), flush=True)
    finally:
        svc.stop()
    return {"steps": steps, "samples": samples}


def _load_line(r: dict) -> str:
    c, n = r["coordinator_threads_ms_per_rank_step"], r["node_reader_threads_ms_per_rank_step"]
    return (
        f"{r['side']:>8} ({r['processes']} processes): wrong rows {r['wrong_rows']}, errors {len(r['errors'])}, "
        f"wait p50/p99/max {r['wait_ms']['p50']:.1f}/{r['wait_ms']['p99']:.1f}/{r['wait_ms']['max']:.1f} ms "
        f"(max after step 0 {r['wait_ms']['max_after_step_0']:.1f}), "
        f"status p50/p99 {r['status_ms']['p50']:.1f}/{r['status_ms']['p99']:.1f} ms, coordinator "
        f"{r['coordinator_cpu_ms_per_rank_step']:.3f} CPU-ms/rank-step (pump {c.get('pump', 0):.3f}, python "
        f"{c.get('python', 0):.3f}, core "
        f"worker {c.get('core_worker', 0):.3f}, grpc {c.get('grpc', 0):.3f}; in 10 ms ticks "
        f"{r['coordinator_ticks_ms_per_rank_step']:.3f}), node readers {r['node_reader_cpu_ms_per_rank_step']:.3f} "
        f"(python {n.get('python', 0):.3f}, core worker {n.get('core_worker', 0):.3f}, grpc "
        f"{n.get('grpc', 0):.3f}; in ticks {r['node_reader_ticks_ms_per_rank_step']:.3f}), threads gone "
        f"{r['threads_gone']}, coordinator calls {r['coordinator_calls']}, node reader calls "
        f"{r['node_reader_calls']}"
    )


def compare_load(runs: dict[str, list[dict]]) -> dict:
    med = statistics.median
    summary = {}
    for side, xs in runs.items():
        summary[side] = {
            "wait_p50_ms": med(x["wait_ms"]["p50"] for x in xs),
            "wait_p99_ms": med(x["wait_ms"]["p99"] for x in xs),
            "wait_max_after_step_0_ms": med(x["wait_ms"]["max_after_step_0"] for x in xs),
            "status_p99_ms": med(x["status_ms"]["p99"] for x in xs),
            "coordinator_cpu_ms_per_rank_step": med(x["coordinator_cpu_ms_per_rank_step"] for x in xs),
            "node_reader_cpu_ms_per_rank_step": med(x["node_reader_cpu_ms_per_rank_step"] for x in xs),
            "wrong_rows": sum(x["wrong_rows"] for x in xs),
            "errors": sum(len(x["errors"]) for x in xs),
        }
        for key in ("coordinator_threads_ms_per_rank_step", "node_reader_threads_ms_per_rank_step"):
            summary[side][key] = {k: med(x[key].get(k, 0.0) for x in xs) for k in xs[0][key]}
    pairs = [("direct", "node", "ratio_{}_direct_vs_node"), ("per_rank", "node", "ratio_{}_per_rank_vs_shared")]
    for a, b, name in pairs:
        if a in runs and b in runs:
            summary[name.format("wait_p99")] = med(
                x["wait_ms"]["p99"] / y["wait_ms"]["p99"] for x, y in zip(runs[a], runs[b])
            )
            summary[name.format("coordinator_cpu")] = med(
                x["coordinator_cpu_ms_per_rank_step"] / y["coordinator_cpu_ms_per_rank_step"]
                for x, y in zip(runs[a], runs[b])
            )
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="load,pending,cpu,resume,kill")
    ap.add_argument("--paths", default="direct,node", help="read paths compared by pending")
    ap.add_argument("--sides", default="direct,node,per_rank", help=f"sides compared by load, of {','.join(SIDES)}")
    ap.add_argument("--jobs", type=int, default=2, help="jobs (consumers) reading at once in load")
    ap.add_argument("--processes", type=int, default=8, help="trainer processes per job on the per_rank side")
    ap.add_argument(
        "--status-every",
        type=float,
        default=0.05,
        help="load: a prober calls status() this often, timing it (0: no prober)",
    )
    ap.add_argument("--profile", default=None, help="folder: py-spy the coordinator and node readers during load")
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--small-ranks", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lease-steps", default="4", help="calls: the steps a lease asks for, comma-separated")
    ap.add_argument("--window", type=int, default=8, help="load: the service's window (steps held ahead)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-time", type=float, default=0.5)
    ap.add_argument("--cpu-steps", type=int, default=60)
    ap.add_argument("--pump-steps", type=int, default=48)
    ap.add_argument(
        "--pump-producers",
        default="1,2,4,8",
        help="pump: the producer counts M; with an M above 8 the pump's recipe has max(M) lanes (each M divides it)",
    )
    ap.add_argument("--long-steps", type=int, default=5000)
    ap.add_argument("--pending", type=int, default=512)
    ap.add_argument("--idle-seconds", type=float, default=20.0)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    try:
        pump_producers = tuple(int(m) for m in args.pump_producers.split(","))
    except ValueError:
        ap.error(f"--pump-producers: expected M[,M...] of integers, got {args.pump_producers!r}")
    if min(pump_producers) < 1 or any(max(pump_producers) % m for m in pump_producers):
        ap.error(f"--pump-producers: every M must be >= 1 and divide the largest, got {args.pump_producers!r}")
    paths = args.paths.split(",")
    sides = args.sides.split(",")
    if unknown := set(sides) - set(SIDES):
        ap.error(f"--sides: unknown {sorted(unknown)}; choose from {list(SIDES)}")

    import ray

    from zephon_ray import GlobalBatchSource, compute_digest

    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-load-"))
    recipe = load_recipe(32, tmp)  # B = 256 rows
    small = load_recipe(2, tmp)  # the tiny fixture itself, B = 16
    n_ref = max(args.steps, args.cpu_steps + 1, args.pump_steps + 16, 30)
    with GlobalBatchSource(recipe) as source:
        reference = []
        for s in range(n_ref):
            b = source.batch(s)
            ref = {"digest": b.digest}
            for w in {1, 4, 16, 32, 256}:
                for r in range(w):
                    part = b.slice(r, w)
                    ref[(r, w)] = compute_digest(part.tokens, part.positions)
            reference.append(ref)
    digests = [r["digest"] for r in reference]
    ray_tmp = tempfile.mkdtemp(prefix="zr-bench-ray-", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=ray_tmp,
        log_to_driver=False,
        logging_level="ERROR",
        namespace=NS,
    )
    result = {
        "cpus": os.cpu_count(),
        "recipe_rows": recipe.global_batch_rows,
        "tokens_per_step": recipe.tokens_per_step,
        "rounds": args.rounds,
        "paths": paths,
    }
    try:
        if "load" in parts:
            for ranks in sorted({args.small_ranks, args.ranks}):
                runs: dict[str, list[dict]] = {p: [] for p in sides}
                for rnd in range(args.rounds):
                    order = sides if rnd % 2 == 0 else sides[::-1]
                    for side in order:
                        r = run_load(
                            recipe,
                            reference,
                            tmp,
                            ranks,
                            args.steps,
                            args.step_time,
                            side,
                            str(rnd),
                            jobs=args.jobs,
                            processes=args.processes,
                            profile=args.profile,
                            status_every=args.status_every,
                            window=args.window,
                        )
                        runs[side].append(r)
                        print(
                            f"load {args.jobs}x{ranks} ranks x {args.steps} steps, round {rnd}, {_load_line(r)}",
                            flush=True,
                        )
                summary = compare_load(runs)
                result[f"load_{ranks}"] = {"runs": runs, "summary": summary}
                print(f"load {args.jobs}x{ranks}: {json.dumps(summary)}", flush=True)
        if "calls" in parts:
            r = result["calls"] = run_calls(recipe, tmp, lease_steps=tuple(int(x) for x in args.lease_steps.split(",")))
            print(
                "calls: "
                + ", ".join(
                    f"{k} {v['cpu_ms_per_call']:.3f} coordinator CPU-ms/call ({v['calls_per_s']:.0f}/s)"
                    for k, v in r.items()
                )
                + f"; idle {r['report']['idle_cpu_ms_per_s']:.1f} "
                "CPU-ms/s",
                flush=True,
            )
        if "pending" in parts:
            for path in paths:
                r = result[f"pending_{path}"] = run_pending(recipe, reference, tmp, args.pending, path)
                print(
                    f"pending {r['pending_reads']} reads ({path}): status p99 {r['status_ms']['p99']:.1f} ms (max "
                    f"{r['status_ms']['max']:.1f}), commit max {r['commit_ms']['max']:.1f} ms, completed ok "
                    f"{r['completed_ok']}, drained in {r['drain_s']} s",
                    flush=True,
                )
        if "cpu" in parts:
            r = result["cpu"] = run_cpu(recipe, digests, tmp, args.cpu_steps, args.rounds)
            for m in (1, 2, 4):
                print(
                    f"cpu M={m}: {r[m]['cpu_s_per_mtok']:.2f} service CPU-s per M tokens, "
                    f"{r[m]['tokens_per_s'] / 1e6:.3f} M tok/s, coordinator {r[m]['coordinator_cpu_ms_per_step']:.2f} "
                    f"CPU-ms/step",
                    flush=True,
                )
            print(
                f"cpu ratio M=2/M=1 per token {r['ratio_m2_vs_m1_cpu_per_token']:.2f} (target <= 1.2), tokens/s "
                f"{r['ratio_m2_vs_m1_tokens_per_s']:.2f}",
                flush=True,
            )
        if "pump" in parts:
            pump_recipe, pump_digests = recipe, digests
            if max(pump_producers) > recipe.lanes:
                lanes = max(pump_producers)  # the same B = 256 rows a step, in more lanes
                pump_recipe = load_recipe(max(1, recipe.global_batch_rows // lanes), tmp, lanes=lanes)
                with GlobalBatchSource(pump_recipe) as source:
                    pump_digests = [source.batch(s).digest for s in range(args.pump_steps + 16)]
            result["pump"] = run_pump(
                pump_recipe,
                pump_digests,
                tmp,
                steps=args.pump_steps,
                rounds=args.rounds,
                producers=pump_producers,
                profile=args.profile,
            )
        if "idle" in parts:
            r = result["idle"] = run_idle(recipe, reference, tmp, args.idle_seconds, args.rounds)
            print(
                "idle (median of rounds): "
                + "; ".join(
                    f"{k} {v['ms_per_s']:.1f} CPU-ms/s ("
                    + ", ".join(f"{t} {v[t]:.1f}" for t in v if t != "ms_per_s")
                    + ")"
                    for k, v in r.items()
                ),
                flush=True,
            )
        if "replies" in parts:
            r = result["replies"] = run_replies(rounds=args.rounds)
            print(
                f"replies: a borrowed ref in the reply costs the caller {r['ref_in_reply_ms']:.3f} CPU-ms per call "
                f"({r['caller_ms_per_call']['with_ref']:.3f} vs {r['caller_ms_per_call']['with_id']:.3f}); as streamed "
                f"items {r['caller_ms_per_call']['streamed']:.3f} ({r['streamed_saves_ms']:.3f} less than a call)",
                flush=True,
            )
        if "resume" in parts:
            r = result["resume"] = run_resume(recipe, digests, tmp, rounds=args.rounds)
            print(
                f"resume first batch: retained {r['retained']['first_batch_s']:.3f} s, replay path "
                f"{r['replay_path']['first_batch_s']:.3f} s, ratio {r['ratio_replay_vs_retained']:.1f}x",
                flush=True,
            )
        if "kill" in parts:
            r = result["kill"] = run_kill(recipe, digests, tmp)
            print(
                f"coordinator kill -9: the slowest of the next {2 * 4 + 2} steps took {r['recovery_s']:.2f} s "
                f"({r['steps_after_kill_s']:.2f} s for all)",
                flush=True,
            )
        if "long" in parts:
            with GlobalBatchSource(small) as source:
                r = result["long"] = run_long(small, source, tmp, args.long_steps)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
