"""A long run as a user runs it: memory, files and step wait over many steps of the data service.

    python benchmarks/bench_soak.py --steps 20000 [--every 1000] [--save-every 100] [--worlds 4,2,3]
    python benchmarks/bench_soak.py --mode local --steps 20000 --worlds 4,2,8
    python benchmarks/bench_soak.py --mode dataset --steps 20000 --worlds 4,2,3

- A service with 2 producers (``--producers``) and a ``state_dir`` (checkpoint every 8 steps), on a private local Ray.
- The recipe is ``recipes/tiny.toml`` (rows of ``--seq-len`` tokens, 64 by default) with one mixture phase added at
  half the run (``--phase-at``), so the run crosses a phase boundary; ``--phase-end`` adds a second boundary there,
  back to the sources' own weights (so that the first and last rows compare like for like, with ``--worlds`` that
  ends at its first W). The in-process source reads the same recipe.
- W loaders, one process per rank (as torchrun places them), in service mode, each with the ledger, ``commit`` of
  every step and a state saved every ``--save-every`` steps. W follows ``--worlds``: the run is cut into equal
  segments, and each new group resumes from the state the previous group saved at its last step.
- One producer is killed with SIGKILL at 40% of the run and the node reader at 60% (``--kill-at``).
- Every ``--every`` steps (of the slowest rank) it prints one row: the RSS of each actor (producers, coordinator,
  replayers once started, node reader; ``_priv``: the RSS less its shared pages, the object store's among them) and
  of each trainer process, the object store's use, the step wait p50/p99 over the last rows' steps, and the files
  and bytes in ``state_dir`` and the ledger. Every digest a rank saw is checked against
  ``GlobalBatchSource(recipe).batch(s).slice(rank, W)`` in this process, by a thread at nice 19 that may fall behind
  the ranks (the row's ``unchecked``) and catches up after the run; the run ends with the count of wrong rows.
- Growth per step (``RESULT`` line): each actor's RSS (and its private part) from the first row after the warm-up
  to the last, divided by the steps between; an actor that started later (a new pid: restarted, or a replayer)
  starts a new baseline, its own warm-up counted from its start. Each rank reports its own RSS every 100 steps, and
  its growth over its segment after the warm-up (at most half the segment) is printed when the segment ends
  (``rank_growth``). ``peak_above_first_mb``: each actor's role (a producer replaced by a kill or by
  ``producer_recycle_steps`` included), its highest RSS after the warm-up above its first row after it.
- Step wait (``RESULT``, ``wait_ms``): p50/p99 over every rank's first 10,000 steps after the warm-up and its last
  10,000, read back from the ranks' files, each also split between the steps the producers checkpoint before (a
  collective of the 2 producers) and the rest; ``wait_p99_last_over_first`` is the ratio of the two p99s.

``--mode local`` / ``--mode dataset``: the same ranks, ledger, saves, W changes and phase boundary for the trainer
process alone: local-mode loaders (each rank runs Zephon in-process for its lanes and aggregates its checkpoint
through a shared directory; W must divide the lanes), or dataset-mode loaders over a materialised run of all the
steps (written first by ``zephon_ray.jobs.materialize`` on a private Ray, 2 producers). No service, no kills.

Prints a table and one JSON line (prefixed ``RESULT``). Results on this machine: docs/benchmarks.md
("Memory over a long run").
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NS = "zr-soak"
NAME = "soak"
CHECKPOINT_EVERY = 8
"""The service's checkpoint interval (its default): with 2 producers each checkpoint is a collective of theirs."""
WINDOW = 10_000
"""Steps of the first (after the warm-up) and the last wait windows that the issue's latency criterion compares."""
WAIT_S = 900.0
"""The longest the parent waits for a segment's ranks to reach its end (a kill -9 heals within seconds)."""
CHECK_FINISH_S = 3600.0
"""The longest the checker may take after the run to check the rows it fell behind by (the source makes a step in
5-8 ms: ``bench_source_memory.py --time-every``)."""
CHECK_BATCH_ITEMS = 16_384
"""Rows the checker takes from its queue at once and checks in step order."""


def write_recipe(dest: Path, phase_at: int, seq_len: int = 64, phase_end: int | None = None) -> Path:
    """tiny.toml with absolute source paths, ``seq_len`` tokens a row and one phase from ``phase_at`` (to
    ``phase_end``, where the sources' own weights return)."""
    text = (ROOT / "recipes" / "tiny.toml").read_text()
    text = text.replace('path = "data/', f'path = "{ROOT}/recipes/data/').replace(
        "seq_len = 64", f"seq_len = {seq_len}"
    )
    text += f'\n[[phases]]\nname = "main"\nstart_step = {phase_at}\nweights = {{ prose = 0.2, code = 0.8 }}\n'
    if phase_end is not None:
        text += f'\n[[phases]]\nname = "back"\nstart_step = {phase_end}\nweights = {{ prose = 0.6, code = 0.4 }}\n'
    dest.write_text(text)
    return dest


# ---------------------------------------------------------------------------------------------------------- rank
def rank_main(a: argparse.Namespace) -> None:
    """One trainer process: read steps [first, stop) at (rank, world), commit each, save every ``save_every``."""
    import ray

    from zephon_ray.stream.loader import Loader, LoaderConfig

    if a.mode == "service":
        ray.init(address=a.address, namespace=NS, log_to_driver=False)
    cfg = LoaderConfig(
        recipe=a.recipe,
        mode=a.mode,
        service_name=NAME,
        service_namespace=NS,
        run_id=NAME,
        ledger_dir=a.ledger,
        dataset_dir=a.dataset if a.mode == "dataset" else None,
        aggregate_dir=a.aggregate if a.mode == "local" else None,
        # local mode: a Zephon checkpoint in every saved state, so the next group resumes, not replays
        checkpoint_every=a.save_every if a.mode == "local" else 0,
    )
    loader = Loader(cfg, rank=a.rank, world=a.world)
    if a.state:
        loader.load_state_dict(json.loads(Path(a.state).read_text()))
    assert loader.next_step == a.first, (loader.next_step, a.first)
    it = iter(loader)
    with open(a.out, "a", buffering=1) as out:
        for step in range(a.first, a.stop):
            t0 = time.perf_counter()
            b = next(it)
            wait_ms = (time.perf_counter() - t0) * 1e3
            loader.commit(step)
            # Every 100 steps the rank's own RSS (MB) at that step: the parent's checker may lag the ranks.
            rss = f" {_own_rss_mb():.1f}" if (step + 1) % 100 == 0 else ""
            out.write(f"{step} {b.slice.ledger_digest} {wait_ms:.3f}{rss}\n")
            if (step + 1) % a.save_every == 0 or step + 1 == a.stop:
                state = loader.state_dict()
                if a.rank == 0 and step + 1 == a.stop:  # the next group resumes from it (identical on every rank)
                    tmp = Path(a.save_to + ".tmp")
                    tmp.write_text(json.dumps(state))
                    os.replace(tmp, a.save_to)
    loader.close()
    # No ray.shutdown(): a rank's background threads may still touch the core worker while it shuts down, and Ray
    # then exits the process with status 1 ("The core worker has already been shutdown"); its output is complete.
    sys.stdout.flush()
    os._exit(0)


def _own_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# -------------------------------------------------------------------------------------------------------- parent
def tree(path: Path) -> tuple[int, int]:
    files = size = 0
    for p in path.rglob("*"):
        if p.is_file():
            files += 1
            size += p.stat().st_size
    return files, size


def rss_mb(pid: int) -> tuple[float, float] | tuple[None, None]:
    """The process's RSS and its private part (MB): the RSS less its file-backed and shared-memory pages, among them
    the object store's pages the process has mapped."""
    import psutil

    try:
        m = psutil.Process(pid).memory_info()
    except psutil.Error:
        return None, None
    return m.rss / 2**20, (m.rss - m.shared) / 2**20


def actor_pids(svc) -> dict[str, int]:
    """{label: pid} of the coordinator, the producers, the replayers and the node readers (their memory() or info()
    calls)."""
    import ray

    from zephon_ray.service.wire import PRODUCER_INFIX, READER_INFIX, REPLAYER_INFIX

    out = {"coordinator": svc.status()["coordinator"]["pid"]}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NS:
            continue
        for infix, label in ((PRODUCER_INFIX, "producer"), (REPLAYER_INFIX, "replayer"), (READER_INFIX, "reader")):
            if entry["name"].startswith(NAME + infix):
                actor = ray.get_actor(entry["name"], namespace=NS)
                try:
                    m = ray.get((actor.info if label == "replayer" else actor.memory).remote(), timeout=30)
                except Exception:  # noqa: BLE001 - a retired or dying actor: not in this row
                    continue
                idx = entry["name"].rsplit(".", 1)[-1] if label != "reader" else "0"
                out[f"{label}{idx}"] = m["pid"]
    return out


class Checker:
    """Reads the ranks' output files as they grow, and checks each digest against the in-process source in a thread
    of its own at nice 19: below the ranks (nice 0) and the service's actors (Ray starts its workers at nice 15), so
    that the check, which runs on the same cores, is not in the measured path. It falls behind the ranks when the
    cores are busy and catches up after the run (``finish``); each row shows how many rows wait (``unchecked``)."""

    def __init__(self, recipe) -> None:
        from zephon_ray import GlobalBatchSource

        self.source = GlobalBatchSource(recipe)
        self.expected: dict[int, object] = {}
        self.pos: dict[str, int] = {}
        self.wrong = 0
        self.rows = 0
        self.checked = 0
        self._todo: queue.SimpleQueue = queue.SimpleQueue()  # (step, rank, world, digest); None: no more
        self._thread = threading.Thread(target=self._check, name="soak-checker", daemon=True)
        self._thread.start()
        self.waits: list[float] = []
        self.rss: dict[int, float] = {}
        """rank -> its latest reported RSS (MB), as of the newest step read."""
        self.rss_log: dict[int, list[tuple[int, float]]] = {}
        """rank -> every (step, RSS MB) it reported in the current segment."""

    def _check(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        # get() waits for work with no deadline on purpose: finish() always sends the None that ends this loop, and
        # the thread is a daemon, so a run that stops early does not wait for it
        done = False
        while not done:
            item = self._todo.get()
            if item is None:
                break
            # The ranks' lines arrive one rank's file at a time, hundreds of steps each when the checker is behind:
            # checked in step order, each step's batch is made once, not once per rank (and with no seek back).
            items = [item]
            while len(items) < CHECK_BATCH_ITEMS:
                try:
                    item = self._todo.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    done = True
                    break
                items.append(item)
            for step, rank, world, digest in sorted(items):
                if self.batch(step).slice(rank, world).ledger_digest != digest:
                    self.wrong += 1
                self.checked += 1

    @property
    def unchecked(self) -> int:
        return self.rows - self.checked

    def finish(self, timeout_s: float) -> None:
        """Wait until every row read has been checked; SystemExit naming what is left past ``timeout_s``."""
        self._todo.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive() or self.unchecked:  # still checking, or it died (its error is on stderr)
            raise SystemExit(
                f"the checker left {self.unchecked} rows unchecked {timeout_s:.0f}s after the run's end "
                "(an error of its own is on stderr)"
            )

    def batch(self, step: int):
        if step not in self.expected:
            self.expected = {s: b for s, b in self.expected.items() if s >= step - 64}
            self.expected[step] = self.source.batch(step)
        return self.expected[step]

    def poll(self, path: Path, rank: int, world: int) -> int | None:
        """Newest step the file shows; every new line checked."""
        last = None
        if not path.exists():
            return None
        with open(path) as f:
            f.seek(self.pos.get(str(path), 0))
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                self.pos[str(path)] = f.tell()
                step_s, digest, wait, *rss = line.split()
                step = int(step_s)
                if rss:
                    self.rss[rank] = float(rss[0])
                    self.rss_log.setdefault(rank, []).append((step, float(rss[0])))
                self.rows += 1
                self._todo.put((step, rank, world, digest))
                self.waits.append(float(wait))
                last = step
        return last


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def wait_summary(work: Path, lo: int, hi: int) -> dict:
    """Step wait p50/p99 (ms) over every rank's steps in [lo, hi), read back from the ranks' output files, and split
    between the steps the producers checkpoint before (multiples of ``CHECKPOINT_EVERY``) and the rest."""
    every, at_ckpt, rest = [], [], []
    for path in work.glob("rank*-seg*.txt"):
        with open(path) as f:
            for line in f:
                step_s, _, wait_s, *_ = line.split()
                if lo <= int(step_s) < hi:
                    every.append(float(wait_s))
                    (at_ckpt if int(step_s) % CHECKPOINT_EVERY == 0 else rest).append(float(wait_s))
    return {
        "steps": [lo, hi],
        "n": len(every),
        "p50": pct(every, 0.5),
        "p99": pct(every, 0.99),
        "checkpoint_steps_p50_p99": [pct(at_ckpt, 0.5), pct(at_ckpt, 0.99)],
        "other_steps_p50_p99": [pct(rest, 0.5), pct(rest, 0.99)],
    }


def start_ray(work: Path) -> None:
    """A private local Ray; once more after Ray's fixed 30 s start-up timeout, which a loaded shared machine hits
    (the processes the failed attempt left, children of this one, are killed first)."""
    import psutil
    import ray

    from zephon_ray.service.ray_internals import init_private_local

    me = psutil.Process()
    for attempt in range(3):
        before = {c.pid for c in me.children(recursive=True)}
        try:
            init_private_local(str(work / f"ray{attempt}"), num_cpus=4, include_dashboard=False, log_to_driver=False)
            return
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
        left = [c for c in me.children(recursive=True) if c.pid not in before]
        for c in left:
            c.kill()
        psutil.wait_procs(left, timeout=30)
        ray.shutdown()
        print("Ray did not start within its fixed 30 s; starting it again", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps in all (docs/benchmarks.md runs 20,000)")
    ap.add_argument("--every", type=int, default=1000, help="print a row every this many steps")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--worlds", default="4,2,3", help="W of each segment (W changes between segments)")
    ap.add_argument("--phase-at", type=int, default=None, help="step of the phase boundary (default: steps/2)")
    ap.add_argument("--phase-end", type=int, default=None, help="step where the sources' own weights return")
    ap.add_argument(
        "--kill-at",
        default="0.4,0.6",
        help="fractions of the run at which a producer and then the node reader are killed with SIGKILL",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps of each process's life before its growth baseline (default: every)",
    )
    ap.add_argument("--seq-len", type=int, default=64, help="tokens a row (tiny.toml has 64)")
    ap.add_argument("--producers", type=int, default=2, help="the service's producers (M; 1: no collective checkpoint)")
    ap.add_argument(
        "--recycle-steps",
        type=int,
        default=None,
        help="the service's producer_recycle_steps (default: ServiceConfig's); each recycle replaces the replayers too",
    )
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--mode",
        choices=("service", "local", "dataset"),
        default="service",
        help="the loaders' mode; local and dataset soak the trainer processes alone",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for key in ("address", "recipe", "ledger", "state", "out", "save_to", "dataset", "aggregate"):
        ap.add_argument(f"--{key.replace('_', '-')}", default=None, help=argparse.SUPPRESS)
    for key in ("rank", "world", "first", "stop"):
        ap.add_argument(f"--{key}", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        rank_main(a)
        return

    import ray
    from ray_plasma import plasma_usage

    from zephon_ray import DataService, Recipe

    work = Path(a.workdir or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    phase_at = a.phase_at if a.phase_at is not None else a.steps // 2
    recipe_path = write_recipe(work / "soak.toml", phase_at, a.seq_len, a.phase_end)
    recipe = Recipe.from_toml(recipe_path)
    state_dir, ledger = work / "state", work / "ledger"
    worlds = [int(w) for w in a.worlds.split(",")]
    bounds = [a.steps * i // len(worlds) for i in range(len(worlds) + 1)]
    kill_producer_at, kill_reader_at = (int(a.steps * float(f)) for f in a.kill_at.split(","))
    warmup = a.every if a.warmup is None else a.warmup

    service = a.mode == "service"
    svc = None
    address = ""
    dataset, aggregate = work / "dataset", work / "aggregate"
    if service or a.mode == "dataset":
        start_ray(work)
        address = ray.get_runtime_context().gcs_address
    if service:
        svc = DataService.start(
            str(recipe_path),
            name=NAME,
            namespace=NS,
            producers=a.producers,
            state_dir=str(state_dir),
            checkpoint_every=CHECKPOINT_EVERY,
            aggregate_store="torch://",
            run_id=NAME,
            **({} if a.recycle_steps is None else {"producer_recycle_steps": a.recycle_steps}),
        )
    elif a.mode == "dataset":
        from zephon_ray.jobs.materialize import materialize

        t0 = time.time()
        materialize(recipe, dataset, range(a.steps), producers=2, progress=False)
        ray.shutdown()
        print(f"materialised {a.steps} steps in {time.time() - t0:.0f} s", flush=True)
    checker = Checker(recipe)
    print(
        f"soak ({a.mode} mode): {a.steps} steps of {recipe_path.name} at seq_len {a.seq_len} "
        f"(phase at {phase_at}" + (f", back at {a.phase_end}" if a.phase_end is not None else "") + "), "
        f"worlds {worlds} at steps {bounds[:-1]}, save every {a.save_every}"
        + (f", kill -9 producer at {kill_producer_at} and node reader at {kill_reader_at}" if service else "")
        + f"; work dir {work}",
        flush=True,
    )
    header = None
    rows: list[dict] = []
    killed: dict[str, int] = {}  # "producer" / "reader" -> the step it was killed at
    next_row = a.every
    last_row = -1
    t_start = time.time()
    state_file = None
    rank_growth: list[dict] = []
    try:
        for seg, world in enumerate(worlds):
            first, stop = bounds[seg], bounds[seg + 1]
            save_to = str(work / f"state-{stop}.json")
            outs = [work / f"rank{r}-seg{seg}.txt" for r in range(world)]
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        "--address",
                        address,
                        "--recipe",
                        str(recipe_path),
                        "--ledger",
                        str(ledger),
                        "--out",
                        str(outs[r]),
                        "--save-to",
                        save_to,
                        "--rank",
                        str(r),
                        "--world",
                        str(world),
                        "--first",
                        str(first),
                        "--stop",
                        str(stop),
                        "--save-every",
                        str(a.save_every),
                        "--mode",
                        a.mode,
                        "--dataset",
                        str(dataset),
                        "--aggregate",
                        str(aggregate),
                    ]
                    + (["--state", state_file] if state_file else []),
                    env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
                    stderr=open(work / f"rank{r}-seg{seg}.err", "ab"),
                )
                for r in range(world)
            ]
            deadline = time.monotonic() + WAIT_S
            checker.rss, checker.rss_log = {}, {}
            last_seen = {r: first - 1 for r in range(world)}
            while True:
                exited = all(p.poll() is not None for p in procs)  # before reading: an exited rank wrote every line
                for r in range(world):
                    got = checker.poll(outs[r], r, world)
                    if got is not None:
                        last_seen[r] = got
                        deadline = time.monotonic() + WAIT_S
                slowest = min(last_seen.values()) + 1
                if service and "producer" not in killed and slowest >= kill_producer_at:
                    pid = actor_pids(svc)["producer0"]
                    os.kill(pid, signal.SIGKILL)
                    killed["producer"] = slowest
                    print(f"step {slowest}: kill -9 producer pid {pid}", flush=True)
                if service and "reader" not in killed and slowest >= kill_reader_at:
                    pid = actor_pids(svc)["reader0"]
                    os.kill(pid, signal.SIGKILL)
                    killed["reader"] = slowest
                    print(f"step {slowest}: kill -9 node reader pid {pid}", flush=True)
                if (slowest >= next_row or (exited and slowest >= stop)) and slowest != last_row:
                    last_row = slowest
                    pids = actor_pids(svc) if service else {}
                    row = {"step": slowest, "elapsed_s": round(time.time() - t_start), "W": world}
                    for label, pid in sorted(pids.items()):
                        row[f"{label}_mb"], row[f"{label}_priv_mb"] = rss_mb(pid)
                        row[f"{label}_pid"] = pid
                    for r, p in enumerate(procs):
                        row[f"rank{r}_mb"] = checker.rss.get(r)  # as the rank reported it at about this step
                        row[f"rank{r}_pid"] = p.pid
                    if service:
                        row["plasma_mib"] = plasma_usage()["mib"]
                    row["wait_p50_ms"], row["wait_p99_ms"] = pct(checker.waits, 0.5), pct(checker.waits, 0.99)
                    checker.waits = []
                    if service:
                        row["state_files"], row["state_bytes"] = tree(state_dir)
                    row["ledger_files"], row["ledger_bytes"] = tree(ledger)
                    row["wrong"] = checker.wrong
                    row["unchecked"] = checker.unchecked
                    rows.append(row)
                    cols = [k for k in row if not k.endswith("_pid")]
                    if header != cols:
                        header = cols
                        print(" ".join(f"{c:>12}" for c in cols), flush=True)
                    print(
                        " ".join(
                            f"{row[c]:>12.1f}" if isinstance(row[c], float) else f"{str(row[c]):>12}" for c in cols
                        ),
                        flush=True,
                    )
                    while next_row <= slowest:
                        next_row += a.every
                if exited:
                    bad = [p.returncode for p in procs if p.returncode]
                    if bad or slowest < stop:
                        raise SystemExit(
                            f"segment {seg} (W={world}): ranks exited with {bad} at step {slowest} "
                            f"(their stderr: {work}/rank*-seg{seg}.err)"
                        )
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"segment {seg} (W={world}): no rank progressed within {WAIT_S:.0f}s")
                time.sleep(0.5)
            # Each rank's growth over its segment's steps after the warm-up (at most half the segment).
            since = first + min(warmup, (stop - first) // 2)
            for r, log in sorted(checker.rss_log.items()):
                log = [(st, mb) for st, mb in log if st >= since]
                if len(log) >= 2 and log[-1][0] > log[0][0]:
                    kb = (log[-1][1] - log[0][1]) * 1024 / (log[-1][0] - log[0][0])
                    rank_growth.append(
                        {
                            "segment": seg,
                            "W": world,
                            "rank": r,
                            "from": log[0][0],
                            "to": log[-1][0],
                            "mb": [log[0][1], log[-1][1]],
                            "kb_per_step": round(kb, 3),
                        }
                    )
                    print(
                        f"segment {seg} (W={world}) rank {r}: RSS {log[0][1]:.1f} -> {log[-1][1]:.1f} MB over steps "
                        f"{log[0][0]}..{log[-1][0]}: {kb:.3f} KB per step",
                        flush=True,
                    )
            state_file = save_to
    finally:
        for p in [p for p in locals().get("procs", []) if p.poll() is None]:
            p.kill()  # only our own rank processes, on an error
        if svc is not None:
            svc.stop()
        ray.shutdown()

    def growth(label: str, key: str) -> float | None:
        """KB per step of ``key`` on the actor's latest pid, from its first row at least ``warmup`` steps after it
        started to the last. A pid that is not the first row's started after this benchmark's kill of its kind, and
        at most ``--every`` steps before the first row that shows it."""
        pid_key = f"{label}_pid"
        last = rows[-1]
        same = [r for r in rows if r.get(pid_key) == last.get(pid_key)]
        born = 0
        if rows[0].get(pid_key) != last.get(pid_key):
            born = max(killed.get(label.rstrip("0123456789"), 0), same[0]["step"] - a.every)
        same = [r for r in same if r["step"] >= born + warmup and r.get(key)]
        if len(same) < 2 or same[-1]["step"] == same[0]["step"]:
            return None
        return round((same[-1][key] - same[0][key]) * 1024 / (same[-1]["step"] - same[0]["step"]), 3)

    def peak_above_first(key: str) -> float | None:
        """MB: the most an actor's role (whichever process holds it: restarts and recycled producer groups included)
        held after the first row past the warm-up, above that row: what a node must budget for it."""
        after = [r[key] for r in rows if r["step"] >= warmup and r.get(key)]
        return round(max(after) - after[0], 1) if len(after) >= 2 else None

    checker.finish(CHECK_FINISH_S)
    # the latency criterion: the wait p99 of the last WINDOW steps against the first WINDOW after the warm-up
    waits = {
        "first": wait_summary(work, warmup, warmup + WINDOW),
        "last": wait_summary(work, max(0, a.steps - WINDOW), a.steps),
    }
    first_p99, last_p99 = waits["first"]["p99"], waits["last"]["p99"]
    ratio = round(last_p99 / first_p99, 3) if first_p99 and last_p99 is not None else None
    labels = sorted({k[:-4] for r in rows for k in r if k.endswith("_pid") and not k.startswith("rank")})  # actors
    result = {
        "steps": a.steps,
        "rows_checked": checker.rows,
        "wrong_rows": checker.wrong,
        "elapsed_s": round(time.time() - t_start),
        "growth_kb_per_step": {lb: growth(lb, f"{lb}_mb") for lb in labels},
        "private_growth_kb_per_step": {lb: growth(lb, f"{lb}_priv_mb") for lb in labels},
        "peak_above_first_mb": {lb: peak_above_first(f"{lb}_mb") for lb in labels},
        "rank_growth": rank_growth,
        "wait_ms": waits,
        "wait_p99_last_over_first": ratio,
        "last": rows[-1] if rows else None,
    }
    print("RESULT " + json.dumps(result), flush=True)
    if checker.wrong:
        raise SystemExit(f"{checker.wrong} rows differ from the in-process source")


if __name__ == "__main__":
    main()
