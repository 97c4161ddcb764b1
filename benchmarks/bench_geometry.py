"""The service at training-sized batches: a pre-tokenised copy of the demo corpus, ``repeat = true``.

    .venv/bin/zephon-ray corpus data/corpus                       # once (data/ is git-ignored)
    python benchmarks/bench_geometry.py [--seq-lens 8192,2048] [--steps 6] [--rounds 2]
                                        [--parts producer,readers,positions,cluster] [--tokens data/geometry/tokens]

Geometry: 64 lanes x 1 microbatch x 8 rows = 512 rows per step, seq_len 8,192 (4.2 M tokens, 33.6 MB of int32
tokens + positions per step) and 2,048. The pre-tokenised copy is made once with ``zephon-ray pretokenize
recipes/demo.toml DIR`` (done here when DIR is missing). Parts (each prints a line; ``RESULT`` is one JSON line):

- ``producer``: producer tokens per CPU-second against bare Zephon over the same token ids, alternating the two
  sides for ``--rounds`` rounds (order flipped every round): *bare* is Zephon's own pipeline over all 64 lanes in
  this process (its microbatches consumed, nothing else), CPU = this process's CPU time (all threads); *service* is
  M=2 producers filling the window for a tracked whole-batch reader, CPU = the producers' processes (psutil) over
  the steps they made. Also the *lane stepper* (what a producer computes, in-process, without Ray) for reference.
  The same run gives coordinator CPU per step and object-store bytes per held step (Ray's object directory sizes
  and its memory summary). Every step read is checked against the reference digests (0 wrong rows).
- ``readers``: slice fetch latency p50/p99 for W = 8 and 64 readers (``--worlds``: any W up to 512; with a W that
  does not divide 512, e.g. ``--worlds 8,7,64,56``, the W values alternate for ``--rounds`` rounds: a slice that
  crosses lane boundaries unevenly against one that does not), in 4 reader processes (``--reader-processes``;
  W/4 ranks each as threads; ``--node-ranks 8`` runs only 8 of the W ranks, one node's share of a W-rank job) on
  this node, over steps already in the window, after one untimed warm-up read per rank (first pass: the
  processes' and the node reader's leases; later passes: warm). The reads are untracked, so the producers stay
  idle (window full) while they run: on 2 cores a producing producer would starve the readers, which says nothing
  about the read path.
  Every slice's digest is checked. A W=64 rank's slice is one lane: its arrays are shown to be views of the
  object store's shared memory (the data pointer lies in the ``/dev/shm/plasma*`` mapping of the process, the
  array owns no data and is read-only): no copy between the object store and numpy. A W=8 rank's slice spans 8
  lanes: one concatenation (a copy), measured.
- ``positions``: int32 vs int16 positions, from one real step: bytes per step, ``ray.put``/``ray.get`` time of a
  lane shard, the reader's widening cost, and that the widened int16 positions give the same digest.
- ``cluster``: a 3-raylet ``ray.cluster_utils.Cluster`` (head: the coordinator only; two workers: one producer
  and readers each) at seq_len 8,192: every lane shard read is located, from Ray's object directory, on worker
  nodes only (never the coordinator's node), owned by a producer; bytes moved between nodes per token delivered.

On 2 cores every process shares the same CPUs: latencies are upper bounds; CPU-seconds per token do not depend on
the core count. docs/scaling.md turns these figures into the 1k/4k/16k-GPU table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NS = "zr-bench-geometry"
LANES, ROWS_PER_MICROBATCH = 64, 8
READER_PROCESSES = 4


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None


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


# ---------------------------------------------------------------------------------------------------- recipes
def ensure_tokens(tokens: Path) -> Path:
    if (tokens / "manifest.json").is_file():
        return tokens
    corpus = ROOT / "data" / "corpus"
    if not (corpus / "jsonl").is_dir():
        raise SystemExit(f"no demo corpus at {corpus}: run `.venv/bin/zephon-ray corpus data/corpus` first")
    import subprocess

    subprocess.run(
        [
            str(Path(sys.executable).with_name("zephon-ray")),
            "pretokenize",
            str(ROOT / "recipes" / "demo.toml"),
            str(tokens),
            "--quiet",
        ],
        check=True,
    )
    return tokens


def geometry_recipe(tokens: Path, seq_len: int):
    """The pre-tokenised demo recipe at 64 lanes x 8 rows x ``seq_len``, repeat = true (written next to it)."""
    from zephon_ray import Recipe

    text = (tokens / "recipe.toml").read_text()
    base = tomllib.loads(text)
    lines = []
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip()
        values = {
            "lanes": LANES,
            "microbatches_per_lane": 1,
            "rows_per_microbatch": ROWS_PER_MICROBATCH,
            "seq_len": seq_len,
            "repeat": "true",
        }
        lines.append(f"{key} = {values[key]}" if key in values and "[" not in line else line)
    assert base["repeat"] is True or "repeat = true" in "\n".join(lines)
    path = tokens / f"geometry-{seq_len}.toml"
    path.write_text("\n".join(lines) + "\n")
    return Recipe.from_toml(path)


# ---------------------------------------------------------------------------------------------------- reference
def reference(recipe, steps: int, worlds=(8, 64)) -> list[dict]:
    """Per step: the global digest and every rank's slice digest for ``worlds`` (in-process LaneStepper)."""
    from zephon_ray import compute_digest
    from zephon_ray.lanes import LaneStepper
    from zephon_ray.source import assemble

    stepper = LaneStepper(recipe)
    out = []
    try:
        for step in range(steps):
            batch = assemble(recipe, step, stepper.next_step())
            ref = {"digest": batch.digest}
            for w in worlds:
                for r in range(w):
                    part = batch.slice(r, w)
                    ref[(r, w)] = compute_digest(part.tokens, part.positions)
            out.append(ref)
    finally:
        stepper.close()
    return out


def bare_zephon(recipe, steps: int) -> dict:
    """Zephon's pipeline over all lanes, microbatches consumed and dropped: tokens per CPU-second of this process."""
    import psutil

    from zephon_ray.pipeline import build_pipeline

    per_step = recipe.lanes * recipe.microbatches_per_lane
    it = iter(build_pipeline(recipe))
    for _ in range(per_step):  # warm-up: the first step pays the pipeline's start
        next(it)
    me = psutil.Process()
    c0, t0 = sum(me.cpu_times()[:2]), time.perf_counter()
    for _ in range(steps * per_step):
        next(it)
    cpu, wall = sum(me.cpu_times()[:2]) - c0, time.perf_counter() - t0
    close = getattr(it, "close", None)
    if close:
        close()
    tokens = steps * recipe.tokens_per_step
    return {"tokens_per_cpu_s": tokens / cpu, "tokens_per_s": tokens / wall, "cpu_s": cpu}


def lane_stepper(recipe, steps: int) -> dict:
    import psutil

    from zephon_ray.lanes import LaneStepper

    stepper = LaneStepper(recipe)
    try:
        stepper.next_step()
        me = psutil.Process()
        c0 = sum(me.cpu_times()[:2])
        for _ in range(steps):
            stepper.next_step()
        cpu = sum(me.cpu_times()[:2]) - c0
    finally:
        stepper.close()
    return {"tokens_per_cpu_s": steps * recipe.tokens_per_step / cpu, "cpu_s": cpu}


# ---------------------------------------------------------------------------------------------------- service
def start_service(recipe, name: str, producers: int = 2, window: int = 4, **kw):
    from zephon_ray import DataService

    return DataService.start(
        recipe,
        name=name,
        namespace=NS,
        producers=producers,
        window=window,
        checkpoint_every=8,
        run_id=name,
        aggregate_store="torch://" if producers > 1 else None,
        state_dir=tempfile.mkdtemp(prefix=f"zr-geo-{name}-"),
        **kw,
    )


def service_producer(recipe, ref: list[dict], steps: int, tag: str) -> dict:
    """M=2 producers; a tracked whole-batch reader reads steps 0..steps; producer and coordinator CPU over the
    steps made after the first one; object-store bytes per held step."""
    from ray_plasma import plasma_usage

    from zephon_ray.service.ray_internals import object_locations

    svc = start_service(recipe, f"prod-{tag}", window=4)
    try:
        wrong = 0
        wrong += svc.batch(0, track=True).digest != ref[0]["digest"]
        status = svc.status()
        producers = [p["pid"] for p in status["producers"]]
        coordinator = status["coordinator"]["pid"]
        while svc.status()["window"]["inflight_steps"]:  # let the window fill: then measure the idle rate
            time.sleep(0.5)
        i0, t0 = cpu_seconds([coordinator]), time.perf_counter()
        time.sleep(3.0)
        idle_rate = (cpu_seconds([coordinator]) - i0) / (time.perf_counter() - t0)
        status = svc.status()
        made0 = status["throughput"]["produced_steps"]
        p0, c0, t_read = cpu_seconds(producers), cpu_seconds([coordinator]), time.perf_counter()
        for step in range(1, steps + 1):
            wrong += svc.batch(step, track=True).digest != ref[step]["digest"]
        c_cpu = cpu_seconds([coordinator]) - c0  # the reads' cost; the polling below is not
        read_s = time.perf_counter() - t_read
        made_reading = svc.status()["throughput"]["produced_steps"] - made0
        deadline = time.monotonic() + 600
        while True:  # the producers fill the window ahead of the reader: count the steps they made
            status = svc.status()
            if not status["window"]["inflight_steps"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        made = status["throughput"]["produced_steps"] - made0
        p_cpu = cpu_seconds(producers) - p0
        if made < 2 or p_cpu <= 0:
            raise SystemExit(f"only {made} steps made while measuring: use --steps > window (4)")
        held = status["window"]["held_steps"]
        sizes = []
        for step in held:
            lanes = svc.refs(step).lanes
            sizes.append(sum(v["object_size"] for v in object_locations(lanes).values()))
            del lanes
        plasma = plasma_usage()
        return {
            "steps_made": made,
            "producer_cpu_s": p_cpu,
            "tokens_per_cpu_s": made * recipe.tokens_per_step / p_cpu,
            "coordinator_cpu_ms_per_step": c_cpu / max(made_reading, 1) * 1e3,
            "coordinator_idle_cpu_ms_per_s": idle_rate * 1e3,
            "coordinator_net_cpu_ms_per_step": (c_cpu - idle_rate * read_s) / max(made_reading, 1) * 1e3,
            "wrong_steps": wrong,
            "held_steps": len(held),
            "object_bytes_per_held_step": statistics.mean(sizes) if sizes else None,
            "plasma_mib": plasma["mib"],
            "plasma_objects": plasma["objects"],
            "shard_owners": status["window"]["shard_owners"],
            "token_bytes_per_step": recipe.tokens_per_step * 4,
        }
    finally:
        svc.stop()


def run_producer(recipe, ref, steps: int, rounds: int) -> dict:
    rows = []
    for r in range(rounds):
        sides = ("bare", "service") if r % 2 == 0 else ("service", "bare")
        got = {}
        for side in sides:
            got[side] = bare_zephon(recipe, steps) if side == "bare" else service_producer(recipe, ref, steps, str(r))
        rows.append(got)
        print(
            f"  round {r} ({'/'.join(sides)}): bare {got['bare']['tokens_per_cpu_s'] / 1e6:.2f} M tok/CPU-s, "
            f"service producers {got['service']['tokens_per_cpu_s'] / 1e6:.2f} M tok/CPU-s "
            f"(x{got['service']['tokens_per_cpu_s'] / got['bare']['tokens_per_cpu_s']:.2f})",
            flush=True,
        )
    stepper = lane_stepper(recipe, max(2, steps // 2))
    ratios = [x["service"]["tokens_per_cpu_s"] / x["bare"]["tokens_per_cpu_s"] for x in rows]
    last = rows[-1]["service"]
    return {
        "rounds": rows,
        "ratio_producer_vs_bare": statistics.median(ratios),
        "round_ratios": ratios,
        "lane_stepper_tokens_per_cpu_s": stepper["tokens_per_cpu_s"],
        "bare_tokens_per_cpu_s": statistics.median(x["bare"]["tokens_per_cpu_s"] for x in rows),
        "service_tokens_per_cpu_s": statistics.median(x["service"]["tokens_per_cpu_s"] for x in rows),
        "coordinator_cpu_ms_per_step": statistics.median(x["service"]["coordinator_cpu_ms_per_step"] for x in rows),
        "coordinator_net_cpu_ms_per_step": statistics.median(
            x["service"]["coordinator_net_cpu_ms_per_step"] for x in rows
        ),
        "coordinator_idle_cpu_ms_per_s": statistics.median(x["service"]["coordinator_idle_cpu_ms_per_s"] for x in rows),
        "object_bytes_per_held_step": last["object_bytes_per_held_step"],
        "token_bytes_per_step": last["token_bytes_per_step"],
        "plasma_mib": last["plasma_mib"],
        "held_steps": last["held_steps"],
        "shard_owners": last["shard_owners"],
        "wrong_steps": sum(x["service"]["wrong_steps"] for x in rows),
    }


# ---------------------------------------------------------------------------------------------------- readers
def _reader_process(
    address: str, name: str, world: int, ranks: list[int], steps: list[int], passes: int, ref: dict, out: str
) -> None:
    """One reader process: ``ranks`` as threads, each reading its slice of ``steps`` ``passes`` times."""
    import threading

    import ray

    from zephon_ray import DataService, compute_digest

    ray.init(address=address, namespace=NS, log_to_driver=False, logging_level="ERROR")
    svc = DataService.connect(name, namespace=NS, consumer="readers")
    samples, wrong, proof = [], [0], {}
    lock = threading.Lock()

    barrier = threading.Barrier(len(ranks))

    def rank_loop(rank: int) -> None:
        svc.slice(0, rank, world, track=False)  # warm-up, not timed: the process's first call to its node reader
        for p in range(passes):
            got = []
            barrier.wait()
            for step in steps:  # timed reads only; the digests are checked after every rank of the process read
                t0 = time.perf_counter()
                got.append((step, svc.slice(step, rank, world, track=False)))
                with lock:
                    samples.append((p, time.perf_counter() - t0))
            barrier.wait()
            for step, part in got:
                ok = compute_digest(part.tokens, part.positions) == ref[f"{step}:{rank}"]
                with lock:
                    wrong[0] += not ok
                    if not proof:
                        proof.update(zero_copy_proof(part.tokens))
                        proof["positions"] = zero_copy_proof(part.positions)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out).write_text(json.dumps({"samples": samples, "wrong": wrong[0], "proof": proof}))
    ray.shutdown()


def zero_copy_proof(array) -> dict:
    """Is ``array``'s data inside this process's mapping of the object store's shared memory?"""
    ptr = array.ctypes.data
    mapping = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                mapping = line.split()[-2] if line.strip().endswith("(deleted)") else line.split()[-1]
                break
    return {
        "in_plasma_mapping": bool(mapping and "plasma" in mapping),
        "mapping": mapping,
        "owndata": bool(array.flags.owndata),
        "writeable": bool(array.flags.writeable),
    }


def run_readers(
    recipe,
    ref: list[dict],
    worlds=(8, 64),
    passes: int = 3,
    processes: int = READER_PROCESSES,
    node_ranks: int | None = None,
) -> dict:
    """``node_ranks``: only ranks [0, node_ranks) of each W read, as on one node of a W-rank job (default: all W)."""
    import ray

    out = {}
    window = 8
    for world in worlds:
        svc = start_service(recipe, f"readers-{world}", window=window)
        try:
            svc.batch(0, track=True)  # this consumer holds the window at 0: the producers fill steps 0..7
            deadline = time.monotonic() + 900
            while len(svc.status()["window"]["held_steps"]) < window and time.monotonic() < deadline:
                time.sleep(0.5)
            steps = list(range(1, window))  # step 0 is each reader process's warm-up
            here = min(node_ranks or world, world)
            procs_n = min(processes, here)
            flat = {f"{s}:{r}": ref[s][(r, world)] for s in steps for r in range(here)}
            tmp = Path(tempfile.mkdtemp(prefix="zr-geo-readers-"))
            ctx = multiprocessing.get_context("spawn")
            procs = []
            for p in range(procs_n):  # contiguous rank ranges, as even as the counts allow
                ranks = list(range(p * here // procs_n, (p + 1) * here // procs_n))
                procs.append(
                    ctx.Process(
                        target=_reader_process,
                        args=(
                            ray.get_runtime_context().gcs_address,
                            svc.name,
                            world,
                            ranks,
                            steps,
                            passes,
                            flat,
                            str(tmp / f"{p}.json"),
                        ),
                    )
                )
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(900)
            results = [json.loads((tmp / f"{p}.json").read_text()) for p in range(procs_n)]
            shutil.rmtree(tmp, ignore_errors=True)
            first = [dt for r in results for p, dt in r["samples"] if p == 0]
            warm = [dt for r in results for p, dt in r["samples"] if p > 0]
            reads = svc.status()["reads"]
            out[world] = {
                "processes": procs_n,
                "ranks_on_this_node": here,
                "slices": len(first) + len(warm),
                "wrong_slices": sum(r["wrong"] for r in results),
                "first_pass_ms": {"p50": pct(first, 0.5) * 1e3, "p99": pct(first, 0.99) * 1e3},
                "warm_ms": {"p50": pct(warm, 0.5) * 1e3, "p99": pct(warm, 0.99) * 1e3},
                "all_ms": {"p50": pct(first + warm, 0.5) * 1e3, "p99": pct(first + warm, 0.99) * 1e3},
                "zero_copy": results[0]["proof"],
                "leases": reads["leases"],
                "node_readers": reads["node_readers"],
                "slice_bytes": recipe.tokens_per_step * 8 // world,
            }
            o = out[world]
            print(
                f"  W={world} ({here} ranks here) in {procs_n} processes: slice p50/p99 "
                f"{o['all_ms']['p50']:.1f}/{o['all_ms']['p99']:.1f} ms (first pass {o['first_pass_ms']['p50']:.1f}/"
                f"{o['first_pass_ms']['p99']:.1f}), wrong {o['wrong_slices']}, zero-copy "
                f"{o['zero_copy']['in_plasma_mapping'] and not o['zero_copy']['owndata']}, leases {o['leases']}",
                flush=True,
            )
        finally:
            svc.stop()
    return out


# ---------------------------------------------------------------------------------------------------- positions
def run_positions(recipe, repeats: int = 20) -> dict:
    """int32 vs int16 positions for one real step's lane shards."""
    import numpy as np
    import ray

    from zephon_ray import compute_digest
    from zephon_ray.lanes import LaneShard, LaneStepper

    stepper = LaneStepper(recipe)
    try:
        shards = stepper.next_step()
    finally:
        stepper.close()
    tokens = np.concatenate([shards[lane].tokens for lane in range(recipe.lanes)])
    positions = np.concatenate([shards[lane].positions for lane in range(recipe.lanes)])
    narrow = positions.astype(np.int16)
    exact = bool(positions.max() < 2**15 and np.array_equal(narrow.astype(np.int32), positions))
    same_digest = compute_digest(tokens, narrow.astype(np.int32)) == compute_digest(tokens, positions)
    out = {
        "max_position": int(positions.max()),
        "row_length": recipe.row_length,
        "int16_exact": exact,
        "same_digest": same_digest,
    }
    for name, pos in (("int32", shards[0].positions), ("int16", shards[0].positions.astype(np.int16))):
        shard = LaneShard(0, shards[0].tokens, pos, shards[0].source_tokens)
        put, get, widen = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ref = ray.put(shard)
            t1 = time.perf_counter()
            got = ray.get(ref)
            t2 = time.perf_counter()
            wide = got.positions.astype(np.int32)
            t3 = time.perf_counter()
            put.append(t1 - t0)
            get.append(t2 - t1)
            widen.append(t3 - t2 if name == "int16" else 0.0)
            del ref, got, wide
        per_step = recipe.tokens_per_step * (4 + pos.itemsize)
        out[name] = {
            "bytes_per_step": per_step,
            "bytes_per_token": 4 + pos.itemsize,
            "put_ms_per_lane": statistics.median(put) * 1e3,
            "get_ms_per_lane": statistics.median(get) * 1e3,
            "widen_ms_per_lane": statistics.median(widen) * 1e3,
        }
    out["bytes_saved"] = 1 - out["int16"]["bytes_per_step"] / out["int32"]["bytes_per_step"]
    return out


# ---------------------------------------------------------------------------------------------------- cluster
def _cluster_driver(recipe_path: str, steps: int, summary: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from zephon_ray import DataService, GlobalBatchSource, Recipe, compute_digest
    from zephon_ray.service.config import ActorResources
    from zephon_ray.service.ray_internals import object_locations, owner_worker_id

    temp_dir = tempfile.mkdtemp(prefix="zr-geo-cluster-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    info: dict = {}
    cluster = svc = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "resources": {"zr-coord": 1},
                "temp_dir": temp_dir,
                "object_store_memory": 400 * 2**20,
            },
        )
        for i in range(2):
            cluster.add_node(
                num_cpus=2,
                resources={"zr-work": 1, f"zr-node{i}": 1},
                temp_dir=temp_dir,
                object_store_memory=800 * 2**20,
            )
        ray.init(
            address=cluster.address,
            namespace=NS,
            log_to_driver=False,
            logging_level="ERROR",
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        head = ray.get_runtime_context().get_node_id()
        recipe = Recipe.from_toml(recipe_path)
        with GlobalBatchSource(recipe) as source:
            want = {}
            for s in range(steps):
                batch = source.batch(s)
                for r in range(8):
                    part = batch.slice(r, 8)
                    want[(s, r)] = compute_digest(part.tokens, part.positions)
        svc = DataService.start(
            recipe,
            name="geo-cluster",
            namespace=NS,
            producers=2,
            run_id="geo-cluster",
            aggregate_store="torch://",
            window=4,
            checkpoint_every=8,
            state_dir=os.path.join(temp_dir, "state"),
            resources=ActorResources(
                coordinator_resources={"zr-coord": 0.01},
                producer_resources={"zr-work": 0.01},
                replayer_resources={"zr-work": 0.01},
            ),
        )

        @ray.remote(num_cpus=0.1)
        class Reader:
            def __init__(self, ranks):
                self.ranks = ranks
                self.svc = DataService.connect("geo-cluster", namespace=NS, consumer="trainer")

            def node(self):
                return ray.get_runtime_context().get_node_id()

            def read(self, step):
                out = {}
                for r in self.ranks:
                    part = self.svc.slice(step, r, 8, track=True)
                    out[r] = compute_digest(part.tokens, part.positions)
                return out

            def refs(self, step):  # the refs this node's ranks were handed (borrowed, not fetched again)
                return [
                    ref for r in self.ranks for ref in self.svc.refs(step, rank=r, world=8).lanes if ref is not None
                ]

        readers = [
            Reader.options(resources={f"zr-node{i}": 0.01}).remote(list(range(4 * i, 4 * i + 4))) for i in range(2)
        ]
        info["reader_nodes"] = ray.get([r.node.remote() for r in readers])
        status = svc.status()
        info.update(
            head=head,
            coordinator_node=status["coordinator"]["node_id"],
            producer_nodes=[p["node_id"] for p in status["producers"]],
        )
        producers = {p["worker_id"] for p in status["producers"]}
        wrong, locations, moved, owners = 0, {}, 0, set()
        t0 = time.perf_counter()
        for step in range(steps):
            got = ray.get([r.read.remote(step) for r in readers], timeout=900)
            for part in got:
                wrong += sum(want[(step, int(r))] != d for r, d in part.items())
            for reader in readers:
                refs = ray.get(reader.refs.remote(step), timeout=300)
                found = object_locations(refs)
                for ref in refs:
                    where = found.get(ref) or {"node_ids": [], "object_size": 0}
                    nodes = where["node_ids"]
                    locations.setdefault(step, set()).update(nodes)
                    owners.add(owner_worker_id(ref))
                    moved += (where["object_size"] or 0) * max(0, len(nodes) - 1)  # copies beyond the producer's
        info["elapsed_s"] = time.perf_counter() - t0
        info["wrong_slices"] = wrong
        info["locations"] = {s: sorted(n) for s, n in locations.items()}
        info["head_in_locations"] = any(head in n for n in locations.values())
        info["owners_are_producers"] = owners <= producers
        info["bytes_moved_between_nodes"] = moved
        info["tokens_delivered"] = steps * recipe.tokens_per_step
        info["bytes_moved_per_token"] = moved / info["tokens_delivered"]
        final = svc.status()
        info["window"] = final["window"]["shard_owners"]
        info["producer_nodes_after"] = [p["node_id"] for p in final["producers"]]
    except BaseException:  # noqa: BLE001 - reported
        import traceback

        info["error"] = traceback.format_exc()
    finally:
        Path(summary).write_text(json.dumps(info, default=str))
        try:
            if svc is not None:
                svc.stop()
        except Exception:  # noqa: BLE001
            pass
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def run_cluster(recipe, steps: int) -> dict:
    summary = Path(tempfile.mkdtemp(prefix="zr-geo-sum-")) / "cluster.json"
    proc = multiprocessing.get_context("spawn").Process(
        target=_cluster_driver, args=(str(recipe.path), steps, str(summary))
    )
    proc.start()
    proc.join(1800)
    if proc.is_alive():
        proc.terminate()
        return {"error": "cluster driver timed out"}
    return json.loads(summary.read_text())


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default=str(ROOT / "data" / "geometry" / "tokens"))
    ap.add_argument("--seq-lens", default="8192,2048")
    ap.add_argument("--steps", type=int, default=10, help="steps read per service run (> window = 4)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="producer,readers,positions,cluster")
    ap.add_argument("--cluster-steps", type=int, default=3)
    ap.add_argument("--reader-processes", type=int, default=READER_PROCESSES)
    ap.add_argument(
        "--worlds",
        default="8,64",
        help="readers: the W values, in this order, repeated --rounds times when they include a W that "
        "does not divide the 512 rows (e.g. 8,7,64,56: a divisor beside a neighbouring non-divisor)",
    )
    ap.add_argument(
        "--node-ranks",
        type=int,
        default=None,
        help="readers: only this many ranks of each W read here, as on one node of a W-rank job "
        "(8 GPUs a node: 8); default all W",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))

    import ray

    tokens = ensure_tokens(Path(args.tokens))
    result: dict = {"cpus": os.cpu_count(), "lanes": LANES, "rows_per_step": LANES * ROWS_PER_MICROBATCH}
    for seq_len in [int(s) for s in args.seq_lens.split(",")]:
        recipe = geometry_recipe(tokens, seq_len)
        print(
            f"geometry seq_len {seq_len}: {recipe.global_batch_rows} rows x {recipe.row_length} = "
            f"{recipe.tokens_per_step / 1e6:.2f} M tokens/step, {recipe.tokens_per_step * 8 / 2**20:.1f} MiB "
            f"tokens+positions",
            flush=True,
        )
        out = result[f"seq_{seq_len}"] = {"tokens_per_step": recipe.tokens_per_step}
        local_parts = parts & {"producer", "readers", "positions"}
        worlds = [int(w) for w in args.worlds.split(",")]
        ref = (
            reference(recipe, max(args.steps + 8, 8), worlds=sorted(set(worlds + [8, 64])))
            if parts & {"producer", "readers"}
            else []
        )
        ray_tmp = tempfile.mkdtemp(prefix="zr-geo-ray-", dir="/tmp")
        if local_parts:
            ray.init(
                address="local",
                num_cpus=8,
                include_dashboard=False,
                _temp_dir=ray_tmp,
                log_to_driver=False,
                logging_level="ERROR",
                object_store_memory=3 * 2**30,
                namespace=NS,
            )
        try:
            if "producer" in parts:
                r = out["producer"] = run_producer(recipe, ref, args.steps, args.rounds)
                print(
                    f"producer: x{r['ratio_producer_vs_bare']:.2f} of bare Zephon per CPU-second (rounds "
                    f"{', '.join(f'{x:.2f}' for x in r['round_ratios'])}; target >= 0.8), coordinator "
                    f"{r['coordinator_cpu_ms_per_step']:.1f} CPU-ms/step ({r['coordinator_net_cpu_ms_per_step']:.1f} net "
                    f"of its idle {r['coordinator_idle_cpu_ms_per_s']:.1f} ms/s), object store "
                    f"{r['object_bytes_per_held_step'] / 2**20:.1f} MiB per held step, wrong steps "
                    f"{r['wrong_steps']}",
                    flush=True,
                )
            if "readers" in parts:
                uneven = any(recipe.global_batch_rows % w for w in worlds)
                rounds = [
                    run_readers(recipe, ref, worlds=worlds, processes=args.reader_processes, node_ranks=args.node_ranks)
                    for _ in range(args.rounds if uneven else 1)
                ]
                out["readers"] = rounds[0] if len(rounds) == 1 else {"rounds": rounds}
            if "positions" in parts:
                r = out["positions"] = run_positions(recipe)
                print(
                    f"positions: int16 exact {r['int16_exact']}, same digest {r['same_digest']}, bytes/token "
                    f"{r['int32']['bytes_per_token']} -> {r['int16']['bytes_per_token']} ({r['bytes_saved']:.0%} "
                    f"less), put {r['int32']['put_ms_per_lane']:.2f} -> {r['int16']['put_ms_per_lane']:.2f} "
                    f"ms/lane, widen {r['int16']['widen_ms_per_lane']:.2f} ms/lane",
                    flush=True,
                )
        finally:
            ray.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
        if "cluster" in parts and seq_len == 8192:
            r = out["cluster"] = run_cluster(recipe, args.cluster_steps)
            if "error" in r:
                print("cluster: ERROR", r["error"][-2000:], flush=True)
            else:
                print(
                    f"cluster (3 raylets): wrong slices {r['wrong_slices']}, a shard on the coordinator's node: "
                    f"{r['head_in_locations']}, owners are producers: {r['owners_are_producers']}, "
                    f"{r['bytes_moved_per_token']:.2f} bytes moved between nodes per token",
                    flush=True,
                )
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
