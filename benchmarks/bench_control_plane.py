"""The control plane under many node readers: N simulated node readers against a real coordinator.

    python benchmarks/bench_control_plane.py [--nodes 64,250,1000,2000] [--seconds 20] [--drivers 2]
                                             [--max-sim-nodes 250] [--producers 1] [--no-calibrate] [--no-pump]
                                             [--leases 8:4,32:16]
    python benchmarks/bench_control_plane.py --nodes 2000 --kill-coordinator-at 10 [--commit-every 10]

What runs: a real DataService (coordinator, producers; the tiny recipe widened to B = 64 rows, as
``bench_service_load.load_recipe`` widens it) on a private local Ray, and ``--drivers`` driver processes that each
play many nodes in one asyncio loop. A simulated node is the real node reader's code in the driver's process:
an instance of ``zephon_ray.service.server.node_reader.NodeReader`` (the class the coordinator wraps as the node-reader actor),
holding a real handle of the coordinator, so its leases (``Coordinator.lease``: first step, ``lease_steps``,
its lanes, read-aheads with ``wait=False``, the unsent cursor moves riding on them), its cursor reports
(``Coordinator.advance``), their timing (gathering, the round-complete rule, demand) and the container refs it
opens are exactly a real node reader's. In front of it, one simulated trainer process per node (as one process
with 8 rank threads sharing a handle) mirrors ``node_read_path.ProcessReads``: a lease cache, one read call per run of
steps carrying the process's cursor moves, the read-ahead a step before its run ends, and the demand long poll.
Its 8 ranks read their step in lock-step every step time (track=True: 8 cursor moves per node-step). The
nodes of a job of ``--nodes-per-job`` nodes are ranks of one consumer with world ``8 x nodes-per-job`` (<= B);
every job reads the same global steps, so the coordinator holds 8 cursors per node. Rows are not fetched, except
a sample (``--sample-every`` node-steps): those ranks' slices are fetched from the object store and their digests
checked against ``GlobalBatchSource`` (the wrong rows are counted, and must be 0).

``--leases W:n[,W:n...]`` sets the service's ``window`` and ``lease_steps``; each pair runs every N (and its own
calibration), side by side in one run, and the table names the pair of each row.

Call-rate equivalence: N nodes at 1 s steps make N node-steps per second. Where N is more than
``--max-sim-nodes``, that many nodes run steps of ``max-sim-nodes / N`` s instead, so the coordinator sees the
same leases, reports and cursor moves per second; the line says so. The effective N printed is what was driven:
node-steps per second measured, times 1 s. Faster steps make the producers produce faster too: at 1 s steps
they make one step per second, here ``N / max-sim-nodes``, so the pump costs more than at the rate simulated. The
table shows the coordinator's CPU as measured and, beside it, that figure less the extra produced steps at the
coordinator's CPU per produced step measured in the same run (``bench_service_load._pump_once``: M producers,
nobody else reading), "at 1 s steps".

Measured per point (each on a fresh service): the coordinator process's CPU as a share of one core (every
thread's ``/proc/PID/task/*/schedstat`` run time, ``bench_service_load.thread_cpu``), its pump thread's share and
its idle rate (``_pump_once``, window full, nobody reading) as a share of the total; lease latency p50/p99 as the
simulated node readers saw it (from the send of ``Coordinator.lease`` to the caller's resumption, all leases, and
the ``wait=False`` read-aheads alone, which never wait for production), beside the same from the send to the
reply's arrival in the driver process (the core worker's callback) and the driver's event-loop lag (how late it
wakes a 10 ms timer): the first less the second is the time the reply waited for the loop that runs all the
driver's nodes, a cost of the simulation, not of the service; the mean lease latency beside the mean time the
coordinator's ``lease`` handler took (``status()``'s ``lease_seconds`` over its leases answered with steps), the
rest being the call's way into and out of the coordinator through Ray; coordinator calls per second (leases and reports, from
``status()``'s counters) and cursor moves per second; wrong rows.

Calibration (on unless ``--no-calibrate``): one real node (one process, this one, with a ``DataService``
handle on the node path and 8 rank threads reading and checking their slices in lock-step, served by a real
node-reader actor) against one simulated node at the same step time (``--cal-step-time``), each on a fresh
service for ``--cal-seconds``: coordinator calls and CPU per node-step on both sides, net of the coordinator's
idle rate, and their ratio. Both sides include the pump's cost of one produced step per node-step.

Coordinator kill -9 under load (``--kill-coordinator-at S``, instead of the CPU table): at each N, the coordinator
is SIGKILLed S seconds into the measured seconds; Ray restarts it (the service's ``coordinator_max_restarts``),
the new incarnation reopens ``state_dir`` and starts at the jobs' newest commits (each job's first node commits
every ``--commit-every`` steps, with its cursor moves, as a trainer's checkpoints do), and the node readers' calls
in flight are sent again to it. After the kill every simulated node fetches one rank's rows of each step it reads,
and a step whose shards died with the replaced producers is read again as a ``DataService`` reads it (forget what
the process holds, invalidate the step, read it again). Reported: how many simulated nodes read on after the kill,
and each one's longest wait for a step's rows after it (from the kill, or from the step's due time if later), p50
and max; the sampled rows are checked as in the CPU runs. Limit: a real node reader is an actor the coordinator
owns, so it dies with it and its processes reconnect through a new one; a simulated process replaces its node
reader at its first lost step after the kill, but the start of a node-reader actor (one per node, through Ray) is
not in these figures.

Limits: the machine this was written on has 2 shared cores, so the drivers, the producers, the coordinator and
Ray's daemons share them, and latencies are upper bounds; where the drivers cannot keep the step time the
effective N shows it. Lock-step bursts are smaller than a real job's: ``max-sim-nodes`` nodes ask at once, not N,
so the lease p99 at large N is that of the call rate, not of an N-node burst. The per-step work that grows with
the cursors (the window's refresh) sees ``8 x max-sim-nodes`` cursors refreshed N / max-sim-nodes times as often.
A simulated process's keep-alive (moves sent alone after ``consumer_ttl_s / 8`` with no read call) is left
out: with 1 s steps and runs of a few steps it never fires. Rows travel in-process between the simulated
process and its node reader (no Ray call there): that hop is the node's cost, not the coordinator's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_service_load as load  # noqa: E402 - the helpers: recipe, service start, schedstat split, _pump_once

NS = load.NS
RANKS_PER_NODE = 8
LOOP_PROBE_S = 0.01
"""A driver's loop-lag probe sleeps this long, over and over; how much later it wakes is the loop's lag."""


# ---------------------------------------------------------------------------------------------------- the node
class _Timed:
    """One method of the coordinator's handle, timed from its send: when its reply reached this process (the core
    worker's callback thread), and when the driver's event loop resumed the caller with it. The two differ by the
    time the reply waited for the loop, which runs every simulated node of the driver."""

    def __init__(self, method, kind: str, log: list) -> None:
        self._method, self._kind, self._log = method, kind, log

    def options(self, **kw):
        return _Timed(self._method.options(**kw), self._kind, self._log)

    def remote(self, *args, **kw):
        sent, t0 = time.perf_counter(), time.time()
        reply = self._method.remote(*args, **kw).future()
        arrived: list[float] = []
        reply.add_done_callback(lambda _: arrived.append(time.perf_counter()))
        return self._timed(reply, t0, sent, arrived, args)

    async def _timed(self, reply, t0: float, sent: float, arrived: list, args):
        try:
            return await asyncio.wrap_future(reply)
        finally:
            resumed = time.perf_counter()
            wait = args[7] if self._kind == "lease" and len(args) > 7 else True
            self._log.append((self._kind, t0, resumed - sent, (arrived[0] if arrived else resumed) - sent, wait))


class _TimedCoordinator:
    """The coordinator's handle as a simulated node reader holds it: every lease and report timed."""

    def __init__(self, handle, log: list) -> None:
        self.lease = _Timed(handle.lease, "lease", log)
        self.advance = _Timed(handle.advance, "report", log)
        self.invalidate = handle.invalidate


class SimProcess:
    """A trainer process of 8 rank threads sharing one handle: ``node_read_path.ProcessReads``'s calls, in asyncio."""

    def __init__(self, reader, consumer: str, world: int, ranks: list[int], lo: int, hi: int, cfg: dict) -> None:
        from zephon_ray.service.client.node_read_path import READ_AHEAD_PER_WINDOW
        from zephon_ray.service.lease_cache import LeaseCache

        self.reader, self.consumer, self.world, self.ranks = reader, consumer, world, ranks
        self.lo, self.hi = lo, hi
        self.cache = LeaseCache.for_window(cfg["lanes"], cfg["window"], cfg["lease_steps"])
        self.ahead_steps = max(1, cfg["window"] // READ_AHEAD_PER_WINDOW)
        self.timeout_s = cfg["request_timeout_s"]
        self.pending: dict[tuple, tuple[int, float]] = {}
        self.inflight: dict[int, asyncio.Future] = {}
        self.calls = 0
        self.listener: asyncio.Task | None = None

    def _take(self) -> list:
        now = time.monotonic()
        moves = [(c, r, w, s, round(max(0.0, now - t), 3)) for (c, r, w), (s, t) in self.pending.items()]
        self.pending.clear()
        return moves

    def _call(self, step: int, ahead: bool) -> asyncio.Future:
        self.calls += 1
        moves = self._take()

        async def call():
            # The reply is filed and the call forgotten before the task is done, as ProcessReads does under its
            # lock: `held` awaits a done task without yielding to the loop, so a done call whose filing was still
            # queued as a callback made it spin forever, and the whole driver with it.
            try:
                reply = await self.reader.read(step, self.consumer, (self.lo, self.hi), True, self.timeout_s, moves)
            finally:
                if self.inflight.get(step) is task:
                    del self.inflight[step]
            self.cache.file(reply.steps, reply.keep_from)
            return reply

        task = asyncio.ensure_future(call())
        self.inflight[step] = task
        return task

    async def held(self, step: int, rank: int):
        """Rank ``rank`` reads ``step`` (tracked): ProcessReads.held."""
        self.pending[(self.consumer, rank, self.world)] = (step, time.monotonic())
        if self.listener is None:
            self.listener = asyncio.ensure_future(self._listen())
        while True:
            held = self.cache.get(step, self.lo, self.hi)
            if held is not None:
                first = next(
                    (
                        s
                        for s in range(step + 1, step + 1 + self.ahead_steps)
                        if self.cache.get(s, self.lo, self.hi) is None
                    ),
                    None,
                )
                if first is not None and first not in self.inflight:
                    self._call(first, ahead=True)  # the read-ahead, with this process's moves
                return held
            task = self.inflight.get(step) or self._call(step, ahead=False)
            try:
                await asyncio.shield(task)
            except Exception:
                if self.inflight.get(step) is task:
                    raise

    async def _listen(self) -> None:
        """The demand long poll (``node_read_path._Listener``): a lease at the node reader waits, send the moves."""
        epoch = 0
        while True:
            epoch = await self.reader.demand(epoch, 60.0)
            if self.pending:
                await self.reader.advance(self._take())


def _driver(
    address: str,
    name: str,
    cfg: dict,
    nodes: list[int],
    step_time: float,
    start_at,
    stop_at,
    window_s: tuple,
    sample_every: int,
    ready,
    out,
    killed_at=None,
    commit_every: int = 0,
) -> None:
    """One driver process: ``nodes`` simulated nodes in one asyncio loop, stepping from ``start_at`` every
    ``step_time`` until ``stop_at`` (``time.time()``, shared with the parent); what happened in ``window_s``
    (the measured seconds) is reported on ``out``."""
    import ray

    from zephon_ray import Recipe, compute_digest
    from zephon_ray.batch import lane_span
    from zephon_ray.service.client.node_read_path import stop_background
    from zephon_ray.service.client.step_refs import StepRefs
    from zephon_ray.service.errors import ShardsLostError
    from zephon_ray.service.server.node_reader import NodeReader
    from zephon_ray.source import pad_token_id

    ray.init(address=address, namespace=NS, log_to_driver=False, logging_level="ERROR")
    recipe = Recipe.from_toml(cfg["recipe_path"])
    pad = pad_token_id(recipe)
    handle = ray.get_actor(name, namespace=NS)
    log: list = []
    rng = random.Random(nodes[0] if nodes else 0)
    steps_done, lags, samples, errors, loop_lags = [], [], [], [], []
    stalls: list[float] = []  # per node: its longest wait for a step after the coordinator's kill

    async def main() -> None:
        coordinator = _TimedCoordinator(handle, log)
        procs = []

        def new_reader(n: int) -> NodeReader:
            return NodeReader(
                coordinator,
                lanes=recipe.lanes,
                rows_per_lane=recipe.rows_per_lane,
                lease_steps=cfg["lease_steps"],
                window=cfg["window"],
                consumer_ttl_s=cfg["consumer_ttl_s"],
                request_timeout_s=cfg["request_timeout_s"],
                node_id=f"sim-node-{n:05d}",
            )

        replaced: set[int] = set()
        for n in nodes:
            reader = new_reader(n)
            job, slot = divmod(n, cfg["nodes_per_job"])
            world = RANKS_PER_NODE * cfg["nodes_per_job"]
            ranks = list(range(slot * RANKS_PER_NODE, (slot + 1) * RANKS_PER_NODE))
            spans = [lane_span(recipe.lanes, recipe.rows_per_lane, r, world) for r in ranks]
            lo, hi = min(s.lanes.start for s in spans), max(s.lanes.stop for s in spans)
            procs.append(SimProcess(reader, f"job{job}", world, ranks, lo, hi, cfg))
        ready.wait()  # every driver is up
        ready.wait()  # the parent set the clock (start_at, stop_at, window_s)

        async def probe() -> None:
            while True:
                t = time.perf_counter()
                await asyncio.sleep(LOOP_PROBE_S)
                if window_s[0] <= time.time() < window_s[1]:
                    loop_lags.append(time.perf_counter() - t - LOOP_PROBE_S)

        prober = asyncio.ensure_future(probe())

        async def node(proc: SimProcess, index: int) -> None:
            step = 0
            count = 0
            stall = 0.0
            while True:
                due = start_at.value + step * step_time
                if due >= stop_at.value or time.time() >= stop_at.value:  # a node behind stops at the end too
                    if killed_at is not None and killed_at.value:
                        stalls.append(stall)
                    return
                rest = due - time.time()
                if rest > 0:
                    await asyncio.sleep(rest)
                t0 = time.time()
                for r in proc.ranks:  # lock-step: the node's 8 ranks read the step
                    held = await proc.held(step, r)
                if killed_at is not None and 0 < killed_at.value < time.time():
                    # After the kill a step counts as served once its rows arrive: the new incarnation replaced the
                    # producers, whose shards died with them, so a step held from before is read again, as a
                    # DataService does (forget what the process holds, invalidate the lost step, read it again).
                    r = proc.ranks[0]
                    for _attempt in range(30):
                        try:
                            refs = StepRefs(step, list(held.lanes), recipe, pad, held.generation)
                            await asyncio.to_thread(refs.slice, r, proc.world)
                            break
                        except ShardsLostError:
                            if index not in replaced:
                                # a real node reader died with the coordinator: the process reads through a new one
                                replaced.add(index)
                                if proc.listener is not None:
                                    proc.listener.cancel()
                                    proc.listener = None
                                proc.inflight.clear()
                                proc.reader = new_reader(nodes[index])
                            proc.cache.clear()
                            await asyncio.wait_for(
                                handle.invalidate.remote(step, held.generation), cfg["request_timeout_s"]
                            )
                            held = await proc.held(step, r)
                    else:
                        errors.append(f"step {step}: rows still lost after 30 reads")
                    stall = max(stall, time.time() - max(due, killed_at.value))
                if commit_every and proc.ranks[0] == 0 and step % commit_every == commit_every - 1:
                    # a trainer's checkpoint: the job's first node commits (a restarted coordinator starts there)
                    moves = [(proc.consumer, r, proc.world, step, 0.0) for r in proc.ranks]  # what it read
                    try:
                        await asyncio.wait_for(
                            handle.commit.remote(step + 1, proc.consumer, moves), cfg["request_timeout_s"]
                        )
                    except Exception as exc:  # noqa: BLE001 - counted, as the reads' errors are
                        errors.append(f"commit {step + 1}: {exc!r}"[:300])
                if window_s[0] <= t0 < window_s[1]:
                    steps_done.append(t0)
                    lags.append(t0 - due)
                count += 1
                if sample_every and (count + index) % sample_every == 0:
                    r = rng.choice(proc.ranks)
                    try:
                        part = await asyncio.to_thread(
                            StepRefs(step, list(held.lanes), recipe, pad, held.generation).slice, r, proc.world
                        )
                        samples.append((step, r, proc.world, compute_digest(part.tokens, part.positions)))
                    except ShardsLostError:
                        # a step leased before the kill, sampled after it: its ranks read it before the kill, and a
                        # DataService reads lost rows again (the recovery above); not a wrong row, not counted
                        if not (killed_at is not None and killed_at.value):
                            errors.append(f"sample step {step}: its shards were lost without a kill")
                    except Exception as exc:  # noqa: BLE001
                        errors.append(f"sample step {step}: {exc!r}")
                step += 1

        try:
            await asyncio.gather(*(node(p, i) for i, p in enumerate(procs)))
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
        prober.cancel()
        for p in procs:
            if p.listener is not None:
                p.listener.cancel()
        # let the calls in flight finish before the loop closes and Ray shuts down (their replies hold refs)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(p.inflight or p.reader._leases for p in procs):
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)

    asyncio.run(main())
    lo_t, hi_t = window_s
    leases = [(dt, arrived, wait) for kind, t0, dt, arrived, wait in log if kind == "lease" and lo_t <= t0 < hi_t]
    reports = sum(1 for kind, t0, *_ in log if kind == "report" and lo_t <= t0 < hi_t)
    out.put(
        {
            "node_steps": len(steps_done),
            "lags": lags,
            "leases": leases,
            "reports": reports,
            "samples": samples,
            "errors": errors[:5],
            "stalls": stalls,
            "loop_lags": loop_lags,
        }
    )
    ready.wait()
    stop_background()
    ray.shutdown()


# ---------------------------------------------------------------------------------------------------- a point
def _coord_counters(svc) -> dict:
    s = svc.status()
    reads = s["reads"]
    return {
        "leases": reads["leases"],
        "lease_seconds": reads["lease_seconds"],
        "reports": reads["reports"],
        "moves": reads["cursor_moves"],
        "produced": s["throughput"]["produced_steps"],
        "t": time.perf_counter(),
    }


def _failed_drivers(procs) -> str:
    failed = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
    return "; ".join(f"driver {i} exited with code {code} (its traceback is above)" for i, code in failed)


def _abort_on_failed_driver(procs, ready, stop: threading.Event) -> None:
    """A driver that dies would leave the others and this process waiting at the barrier until its timeout."""
    while not stop.wait(1.0):
        if _failed_drivers(procs):
            ready.abort()
            return


def _driver_result(out, procs, timeout_s: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=2.0)
        except queue.Empty:
            if failed := _failed_drivers(procs):
                raise RuntimeError(failed) from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"a driver sent no result within {timeout_s:.0f} s") from None


def run_sim(
    recipe_path: Path,
    recipe,
    tmp: Path,
    tag: str,
    nodes: int,
    step_time: float,
    seconds: float,
    warmup: float,
    drivers: int,
    producers: int,
    nodes_per_job: int,
    sample_every: int,
    kill_at: float | None = None,
    commit_every: int = 0,
    window: int = 8,
    lease_steps: int = 4,
) -> dict:
    """``nodes`` simulated nodes at ``step_time`` for ``warmup + seconds`` on a fresh service; the coordinator
    measured over the last ``seconds``. ``kill_at``: SIGKILL the coordinator that many seconds into the measured
    ones (its CPU is then not measured; each node's longest wait for a step after the kill is)."""
    import ray

    svc = load.start(recipe, f"cp-{tag}", tmp, producers=producers, window=window, lease_steps=lease_steps)
    watch = threading.Event()  # set: the thread that watches the drivers stops
    try:
        cfg = {
            "recipe_path": str(recipe_path),
            "lanes": recipe.lanes,
            "window": svc.config.window,
            "lease_steps": svc.config.lease_steps,
            "consumer_ttl_s": svc.config.consumer_ttl_s,
            "request_timeout_s": svc.config.request_timeout_s,
            "nodes_per_job": nodes_per_job,
        }
        pid = svc.status()["coordinator"]["pid"]
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Barrier(drivers + 1)
        out = ctx.Queue()
        start_at, stop_at = ctx.Value("d", 1e18), ctx.Value("d", 1e18)
        address = ray.get_runtime_context().gcs_address
        procs = []
        shares = [list(range(nodes))[d::drivers] for d in range(drivers)]
        window = ctx.Array("d", [0.0, 0.0])
        killed_at = ctx.Value("d", 0.0)
        for d in range(drivers):
            procs.append(
                ctx.Process(
                    target=_driver_entry,
                    args=(
                        address,
                        svc.name,
                        cfg,
                        shares[d],
                        step_time,
                        start_at,
                        stop_at,
                        window,
                        sample_every,
                        ready,
                        out,
                        killed_at if kill_at is not None else None,
                        commit_every,
                    ),
                )
            )
        for p in procs:
            p.start()
        threading.Thread(target=_abort_on_failed_driver, args=(procs, ready, watch), daemon=True).start()
        try:
            ready.wait(timeout=600)  # every driver up (connected, its nodes built): then the clock starts
        except threading.BrokenBarrierError:
            raise RuntimeError(_failed_drivers(procs) or "the drivers did not start within 600 s") from None
        t_begin = time.time() + 0.5
        start_at.value = t_begin
        stop_at.value = t_begin + warmup + seconds
        window[0], window[1] = t_begin + warmup, t_begin + warmup + seconds
        ready.wait(timeout=60)
        time.sleep(max(0.0, window[0] - time.time()))
        c0, s0 = _coord_counters(svc), ({} if kill_at is not None else load.thread_cpu(pid))
        if kill_at is not None:
            time.sleep(max(0.0, window[0] + kill_at - time.time()))
            killed_at.value = time.time()
            os.kill(pid, 9)
        time.sleep(max(0.0, window[1] - time.time()))
        s1, c1 = ({} if kill_at is not None else load.thread_cpu(pid)), _coord_counters(svc)
        wall = c1["t"] - c0["t"]
        got = [_driver_result(out, procs) for _ in procs]
        ready.wait(timeout=120)
        for p in procs:
            p.join(120)
    finally:
        watch.set()
        svc.stop()
    leases = [x for g in got for x in g["leases"]]
    all_lat = [dt for dt, _, _ in leases]
    arrived = [a for _, a, _ in leases]
    ahead = [dt for dt, _, wait in leases if not wait]
    loop_lags = [x for g in got for x in g["loop_lags"]]
    lags = [x for g in got for x in g["lags"]]
    node_steps = sum(g["node_steps"] for g in got)
    cpu = {k: (s1[k] - s0[k]) / wall * 1e3 for k in s1}  # ms/s by kind of thread
    return {
        "nodes_simulated": nodes,
        "step_time_s": step_time,
        "seconds": round(wall, 2),
        "node_steps": node_steps,
        "node_steps_per_s": node_steps / wall,
        "coordinator_ms_per_s": sum(cpu.values()),
        "coordinator_threads_ms_per_s": cpu,
        # calls as the node readers made them (the coordinator's own counters leave out read-aheads that
        # found nothing produced yet); moves as the coordinator applied them
        "leases_per_s": len(leases) / wall,
        "reports_per_s": sum(g["reports"] for g in got) / wall,
        "leases_filled_per_s": (c1["leases"] - c0["leases"]) / wall,
        "moves_per_s": (c1["moves"] - c0["moves"]) / wall,
        "produced_per_s": (c1["produced"] - c0["produced"]) / wall,
        "lease_ms": {
            "n": len(all_lat),
            "p50": (load.pct(all_lat, 0.5) or 0) * 1e3,
            "p99": (load.pct(all_lat, 0.99) or 0) * 1e3,
            "max": max(all_lat, default=0) * 1e3,
            "mean": sum(all_lat) / max(1, len(all_lat)) * 1e3,
        },
        # the coordinator's handler, from its start on the event loop to its reply (leases answered with steps):
        # the rest of a lease's latency is the call's way into and out of the coordinator through Ray
        "lease_in_handler_ms_mean": (c1["lease_seconds"] - c0["lease_seconds"])
        / max(1, c1["leases"] - c0["leases"])
        * 1e3,
        "lease_arrived_ms": {
            "p50": (load.pct(arrived, 0.5) or 0) * 1e3,
            "p99": (load.pct(arrived, 0.99) or 0) * 1e3,
        },
        "driver_loop_lag_ms": {
            "p50": (load.pct(loop_lags, 0.5) or 0) * 1e3,
            "p99": (load.pct(loop_lags, 0.99) or 0) * 1e3,
        },
        "read_ahead_lease_ms": {
            "n": len(ahead),
            "p50": (load.pct(ahead, 0.5) or 0) * 1e3,
            "p99": (load.pct(ahead, 0.99) or 0) * 1e3,
        },
        "step_lag_ms": {"p50": (load.pct(lags, 0.5) or 0) * 1e3, "p99": (load.pct(lags, 0.99) or 0) * 1e3},
        "samples": [s for g in got for s in g["samples"]],
        "errors": [e for g in got for e in g["errors"]][:5],
        "kill_stalls_s": sorted(x for g in got for x in g["stalls"]),
    }


def _driver_entry(*args) -> None:
    _driver(*args)


# ---------------------------------------------------------------------------------------------------- calibration
def run_real(
    recipe, reference: dict, tmp: Path, step_time: float, seconds: float, warmup: float, window: int, lease_steps: int
) -> dict:
    """One real node: this process, one handle on the node path, 8 rank threads in lock-step (rank r of world 8),
    every slice fetched and checked."""
    from zephon_ray import DataService, compute_digest

    svc = load.start(recipe, f"cp-real-{window}-{lease_steps}", tmp, window=window, lease_steps=lease_steps)
    try:
        pid = svc.status()["coordinator"]["pid"]
        client = DataService.connect(svc.name, namespace=NS, consumer="real", read_path="node")
        barrier = threading.Barrier(RANKS_PER_NODE)
        t_begin = time.time() + 0.5
        w0, w1 = t_begin + warmup, t_begin + warmup + seconds
        steps_in, bad, errors = [], [], []

        def rank(r: int) -> None:
            try:
                step = 0
                while True:
                    due = t_begin + step * step_time
                    if due >= w1:
                        return
                    time.sleep(max(0.0, due - time.time()))
                    t0 = time.time()
                    part = client.slice(step, r, RANKS_PER_NODE, track=True)
                    want = reference.get((step, r, RANKS_PER_NODE))
                    if want is not None and compute_digest(part.tokens, part.positions) != want:
                        bad.append((step, r))
                    if r == 0 and w0 <= t0 < w1:
                        steps_in.append(step)
                    barrier.wait(timeout=600)
                    step += 1
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))
                barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(RANKS_PER_NODE)]
        for t in threads:
            t.start()
        time.sleep(max(0.0, w0 - time.time()))
        c0, s0, r0 = _coord_counters(svc), load.thread_cpu(pid), load._reader_calls(load.reader_infos())
        time.sleep(max(0.0, w1 - time.time()))
        s1, c1, r1 = load.thread_cpu(pid), _coord_counters(svc), load._reader_calls(load.reader_infos())
        for t in threads:
            t.join(600)
        wall = c1["t"] - c0["t"]
        cpu = {k: (s1[k] - s0[k]) / wall * 1e3 for k in s1}
        return {
            "node_steps": len(steps_in),
            "seconds": wall,
            "coordinator_ms_per_s": sum(cpu.values()),
            "pump_ms_per_s": cpu["pump"],
            "leases": r1["leases"] - r0["leases"],
            "reports": r1["reports"] - r0["reports"],
            "moves": c1["moves"] - c0["moves"],
            "produced": c1["produced"] - c0["produced"],
            "wrong_rows": len(bad),
            "checked_steps": max(steps_in, default=-1) + 1,
            "errors": errors[:3],
        }
    finally:
        svc.stop()


def _per_node_step(x: dict, idle_ms_per_s: float) -> dict:
    """Coordinator CPU per node-step net of its idle rate (the pump's step per node-step included), and the calls
    per node-step."""
    n = max(x["node_steps"], 1)
    net = (x["coordinator_ms_per_s"] - idle_ms_per_s) * x["seconds"] / n
    return {
        "node_steps": x["node_steps"],
        "coordinator_ms_per_node_step_net_of_idle": net,
        "produced_per_node_step": x["produced"] / n,
        "leases_per_10_steps": 10 * x["leases"] / n,
        "reports_per_10_steps": 10 * x["reports"] / n,
        "moves_per_step": x["moves"] / n,
    }


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="64,250,1000,2000", help="N: nodes at 1 s steps (call-rate equivalents)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds run before the measured ones, per point")
    ap.add_argument("--drivers", type=int, default=2, help="driver processes playing the nodes")
    ap.add_argument(
        "--max-sim-nodes",
        type=int,
        default=250,
        help="nodes simulated at most; beyond, fewer nodes step faster (same call rate)",
    )
    ap.add_argument("--step-time", type=float, default=1.0, help="the simulated job's step time (s)")
    ap.add_argument("--producers", type=int, default=1)
    ap.add_argument("--nodes-per-job", type=int, default=8, help="nodes per consumer (world 8 x this <= B = 64)")
    ap.add_argument(
        "--sample-every",
        type=int,
        default=20,
        help="fetch and check one rank's rows per this many node-steps of a node (0: none)",
    )
    ap.add_argument(
        "--leases",
        default="8:4",
        help="WINDOW:LEASE_STEPS[,...]: the service's window and lease_steps; each pair is measured at every N, "
        "side by side in one run",
    )
    ap.add_argument("--no-calibrate", action="store_true")
    ap.add_argument("--no-pump", action="store_true", help="skip the pump's own figure (then no 1 s adjustment)")
    ap.add_argument("--cal-step-time", type=float, default=0.25)
    ap.add_argument("--cal-seconds", type=float, default=20.0)
    ap.add_argument("--pump-steps", type=int, default=48)
    ap.add_argument(
        "--kill-coordinator-at",
        type=float,
        default=None,
        metavar="S",
        help="instead of the CPU table: at each N, SIGKILL the coordinator S seconds into the measured seconds and "
        "report each node's longest wait for a step after it",
    )
    ap.add_argument(
        "--commit-every",
        type=int,
        default=10,
        help="with --kill-coordinator-at: each job commits every this many steps, as a trainer's checkpoints do",
    )
    args = ap.parse_args()
    try:
        configs = [tuple(int(v) for v in pair.split(":")) for pair in args.leases.split(",")]
        assert all(len(c) == 2 and c[0] >= 1 and c[1] >= 1 for c in configs)
    except (ValueError, AssertionError):
        ap.error(f"--leases: expected WINDOW:LEASE_STEPS[,...] of positive integers, got {args.leases!r}")
    if args.kill_coordinator_at is not None:
        args.no_pump = args.no_calibrate = True

    import ray

    from zephon_ray import GlobalBatchSource, compute_digest

    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-cp-"))
    recipe = load.load_recipe(8, tmp)  # B = 64 rows: 8 nodes of 8 ranks per consumer
    recipe_path = Path(recipe.path)
    if 8 * args.nodes_per_job > recipe.global_batch_rows:
        ap.error(f"--nodes-per-job: world {8 * args.nodes_per_job} > B = {recipe.global_batch_rows}")
    n_ref = args.pump_steps + 16
    with GlobalBatchSource(recipe) as source:
        digests = [source.batch(s).digest for s in range(n_ref)]
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
    result: dict = {
        "cpus": os.cpu_count(),
        "recipe_rows": recipe.global_batch_rows,
        "producers": args.producers,
        "seconds": args.seconds,
        "drivers": args.drivers,
        "max_sim_nodes": args.max_sim_nodes,
        "step_time_s": args.step_time,
        "points": {},
    }
    samples: list = []
    try:
        pump = {"idle_ms_per_s": 0.0, "coordinator_ms_per_step": 0.0, "pump_ms_per_step": 0.0}
        if not args.no_pump:
            pump = load._pump_once(recipe, digests, tmp, args.pump_steps, args.producers, "cp")
        idle = pump["idle_ms_per_s"]
        pump_ms = pump["coordinator_ms_per_step"]
        result["pump"] = pump
        if not args.no_pump:
            print(
                f"pump M={args.producers}: coordinator {pump_ms:.2f} CPU-ms per produced step (pump thread "
                f"{pump['pump_ms_per_step']:.2f}); idle {idle:.2f} CPU-ms/s",
                flush=True,
            )

        cal_ref: dict = {}
        if not args.no_calibrate:
            n_cal = int((args.warmup + args.cal_seconds) / args.cal_step_time) + 4
            with GlobalBatchSource(recipe) as source:
                for s in range(n_cal):
                    b = source.batch(s)
                    for r in range(RANKS_PER_NODE):
                        part = b.slice(r, RANKS_PER_NODE)
                        cal_ref[(s, r, RANKS_PER_NODE)] = compute_digest(part.tokens, part.positions)
        for window, lease_steps in configs:
            setting = f"window {window}, lease_steps {lease_steps}"
            print(f"== {setting}", flush=True)
            if not args.no_calibrate:
                real = run_real(
                    recipe, cal_ref, tmp, args.cal_step_time, args.cal_seconds, args.warmup, window, lease_steps
                )
                sim = run_sim(
                    recipe_path,
                    recipe,
                    tmp,
                    f"cal-{window}-{lease_steps}",
                    1,
                    args.cal_step_time,
                    args.cal_seconds,
                    args.warmup,
                    1,
                    args.producers,
                    1,
                    args.sample_every,
                    window=window,
                    lease_steps=lease_steps,
                )
                samples += sim["samples"]
                sim_c = {
                    "node_steps": sim["node_steps"],
                    "seconds": sim["seconds"],
                    "coordinator_ms_per_s": sim["coordinator_ms_per_s"],
                    "leases": sim["leases_per_s"] * sim["seconds"],
                    "reports": sim["reports_per_s"] * sim["seconds"],
                    "moves": sim["moves_per_s"] * sim["seconds"],
                    "produced": sim["produced_per_s"] * sim["seconds"],
                }
                cr, cs = _per_node_step(real, idle), _per_node_step(sim_c, idle)
                key = "coordinator_ms_per_node_step_net_of_idle"
                ratio = cs[key] / cr[key] if cr[key] > 0 else float("nan")
                result.setdefault("calibration", {})[setting] = {
                    "step_time_s": args.cal_step_time,
                    "real": {**real, **cr},
                    "simulated": {k: v for k, v in sim.items() if k != "samples"} | cs,
                    "ratio_sim_vs_real": ratio,
                }
                print(
                    f"calibration at {args.cal_step_time} s steps, one node of 8 ranks, net of idle {idle:.1f} ms/s:",
                    flush=True,
                )
                print(
                    f"  {'':<10}{'node-steps':>11}{'CPU-ms/node-step':>17}{'produced/step':>14}"
                    f"{'leases/10 st':>13}{'reports/10 st':>14}{'moves/step':>11}",
                    flush=True,
                )
                for label, c in (("real", cr), ("simulated", cs)):
                    print(
                        f"  {label:<10}{c['node_steps']:>11}{c[key]:>17.3f}"
                        f"{c['produced_per_node_step']:>14.2f}{c['leases_per_10_steps']:>13.2f}"
                        f"{c['reports_per_10_steps']:>14.2f}{c['moves_per_step']:>11.2f}",
                        flush=True,
                    )
                print(
                    f"  simulated / real coordinator CPU per node-step: {ratio:.2f}; simulated node errors {sim['errors'] or 'none'} (real node: "
                    f"{real['wrong_rows']} wrong rows of {real['checked_steps']} steps x 8 ranks; errors "
                    f"{real['errors'] or 'none'})",
                    flush=True,
                )

            for n in [int(x) for x in args.nodes.split(",")]:
                sim_nodes = min(n, args.max_sim_nodes)
                step_time = args.step_time * sim_nodes / n
                if sim_nodes < n:
                    print(
                        f"N={n}: {sim_nodes} simulated nodes at {step_time * 1e3:.1f} ms steps stand for {n} nodes at "
                        f"{args.step_time:g} s steps (the same call rate)",
                        flush=True,
                    )
                killing = args.kill_coordinator_at is not None
                point = n if len(configs) == 1 else f"{n} @ {window}:{lease_steps}"
                x = run_sim(
                    recipe_path,
                    recipe,
                    tmp,
                    f"{'kill' if killing else 'n'}{n}-{window}-{lease_steps}",
                    sim_nodes,
                    step_time,
                    args.seconds,
                    args.warmup,
                    args.drivers,
                    args.producers,
                    args.nodes_per_job,
                    args.sample_every,
                    kill_at=args.kill_coordinator_at,
                    commit_every=args.commit_every if killing else 0,
                    window=window,
                    lease_steps=lease_steps,
                )
                if killing:
                    samples += x.pop("samples")
                    stalls = x["kill_stalls_s"]
                    x["nodes_target"] = n
                    result.setdefault("kills", {})[point] = x
                    print(
                        f"N={point}: coordinator SIGKILLed {args.kill_coordinator_at:g} s into the measured seconds: "
                        f"{len(stalls)} of {sim_nodes} simulated nodes read on after it; their longest wait for a step's rows "
                        f"after the kill: p50 {load.pct(stalls, 0.5) or 0:.2f} s, max {max(stalls, default=0):.2f} s; "
                        f"lease p99 over the run {x['lease_ms']['p99']:.0f} ms; errors {x['errors'] or 'none'}",
                        flush=True,
                    )
                    continue
                samples += x.pop("samples")
                x["nodes_target"] = n
                x["window"], x["lease_steps"] = window, lease_steps
                x["effective_nodes"] = x["node_steps_per_s"] * args.step_time
                x["driven_fraction"] = x["effective_nodes"] / n
                extra = max(0.0, (x["produced_per_s"] or 0) - 1.0 / args.step_time)
                x["coordinator_ms_per_s_at_1s_steps"] = x["coordinator_ms_per_s"] - extra * pump_ms
                rate = max(x["node_steps_per_s"], 1e-9)
                x["coordinator_ms_per_node_step"] = (x["coordinator_ms_per_s_at_1s_steps"] - idle) / rate
                x["leases_per_node_step"] = x["leases_per_s"] / rate
                x["reports_per_node_step"] = x["reports_per_s"] / rate
                # what the point's N would cost at this CPU per node-step (= the measured figure where it was driven)
                x["projected_core_share_at_n"] = (idle + x["coordinator_ms_per_node_step"] * n * args.step_time) / 1e3
                x["pump_share"] = x["coordinator_threads_ms_per_s"]["pump"] / x["coordinator_ms_per_s"]
                x["idle_share"] = idle / x["coordinator_ms_per_s"]
                result["points"][point] = x
                print(
                    f"N={point}: effective N {x['effective_nodes']:.0f} ({x['node_steps_per_s']:.0f} node-steps/s"
                    f"{'' if x['driven_fraction'] > 0.95 else ', the drivers could not keep the rate'}); coordinator "
                    f"{x['coordinator_ms_per_s'] / 10:.1f} % of a core ({x['coordinator_ms_per_s_at_1s_steps'] / 10:.1f} % "
                    f"at 1 s steps), pump {100 * x['pump_share']:.0f} %, idle {100 * x['idle_share']:.0f} %; lease p50/p99 "
                    f"{x['lease_ms']['p50']:.1f}/{x['lease_ms']['p99']:.1f} ms, mean {x['lease_ms']['mean']:.1f} ms of which "
                    f"{x['lease_in_handler_ms_mean']:.2f} ms in the coordinator's handler (at the reply's arrival "
                    f"{x['lease_arrived_ms']['p50']:.1f}/{x['lease_arrived_ms']['p99']:.1f} ms; the drivers' loop lag "
                    f"p50/p99 {x['driver_loop_lag_ms']['p50']:.1f}/{x['driver_loop_lag_ms']['p99']:.1f} ms); "
                    f"{x['leases_per_s']:.0f} leases/s, "
                    f"{x['reports_per_s']:.0f} reports/s, {x['moves_per_s']:.0f} moves/s; step lag p99 "
                    f"{x['step_lag_ms']['p99']:.0f} ms; errors {x['errors'] or 'none'}",
                    flush=True,
                )
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)

    # the sampled rows, against GlobalBatchSource (in step order: the source steps forward)
    wrong = 0
    with GlobalBatchSource(recipe) as source:
        for step, r, world, digest in sorted(samples):
            part = source.batch(step).slice(r, world)
            wrong += compute_digest(part.tokens, part.positions) != digest
    shutil.rmtree(tmp, ignore_errors=True)
    result["sampled_rows_checked"] = len(samples)
    result["wrong_rows"] = wrong + sum(c["real"]["wrong_rows"] for c in result.get("calibration", {}).values())

    if result["points"]:
        print()
        print(
            f"{'N':>5} | {'W:n':>5} | {'sim':>4} | {'step ms':>7} | {'eff. N':>6} | {'coord %':>7} | {'at 1 s':>6} | {'pump %':>6} | "
            f"{'idle %':>6} | {'lease p50/p99 ms':>16} | {'arrived p50/p99':>16} | {'loop lag p99':>12} | {'calls/s':>7} | {'L+R /node-step':>14} | {'ms/node-step':>12} | "
            f"{'proj. % at N':>12} | {'lag p99 ms':>10}"
        )
        for x in result["points"].values():
            print(
                f"{x['nodes_target']:>5} | {x['window']:>2}:{x['lease_steps']:<2} | {x['nodes_simulated']:>4} | {x['step_time_s'] * 1e3:>7.1f} | {x['effective_nodes']:>6.0f} | "
                f"{x['coordinator_ms_per_s'] / 10:>7.1f} | {x['coordinator_ms_per_s_at_1s_steps'] / 10:>6.1f} | "
                f"{100 * x['pump_share']:>6.0f} | {100 * x['idle_share']:>6.0f} | "
                f"{x['lease_ms']['p50']:>7.1f}/{x['lease_ms']['p99']:<8.1f} | "
                f"{x['lease_arrived_ms']['p50']:>7.1f}/{x['lease_arrived_ms']['p99']:<8.1f} | "
                f"{x['driver_loop_lag_ms']['p99']:>12.1f} | "
                f"{x['leases_per_s'] + x['reports_per_s']:>7.0f} | "
                f"{x['leases_per_node_step']:>6.2f}+{x['reports_per_node_step']:<7.2f} | "
                f"{x['coordinator_ms_per_node_step']:>12.3f} | {100 * x['projected_core_share_at_n']:>12.1f} | "
                f"{x['step_lag_ms']['p99']:>10.0f}"
            )
        print(
            "W:n: the service's window and lease_steps; coord %: the coordinator's CPU as a share of one core, measured; at 1 s: less the steps produced beyond one "
            "per second; lease: a node reader's lease from its send to its caller's resumption, arrived: to the reply's arrival in "
            "the driver process, loop lag: how late the driver's event loop wakes a timer; L+R: leases and reports per node-step; ms/node-step: (at 1 s - idle) / node-steps per s; "
            "proj. % at N: idle + ms/node-step x N; lag: how late the simulated ranks read (the drivers' backlog)"
        )
    print(f"wrong rows: {result['wrong_rows']} ({len(samples)} sampled slices checked, and every real-node slice)")
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
