"""The data service at scale, measured on a private local Ray (issue 8 "Measure"). Every row read is checked.

    python benchmarks/bench_service_load.py [--parts load,pending,cpu,resume,kill,long] [--ranks 256] [--steps 50]

Parts (each prints a line; one JSON line ``RESULT`` at the end):
- ``load``: one service, 2 jobs x R simulated ranks x S steps, each job reading its slices in lock-step at a
  fixed step time; p50/p99/max data wait, p99 of ``status()`` latency, all slices checked against the reference
  (GlobalBatchSource) digests. Run at R=32 and R=``--ranks`` side by side. The recipe is the tiny fixture with
  B=256 rows (``rows_per_microbatch=32``), so that 256 ranks each get a real, distinct slice.
- ``pending``: 512 reads waiting at once (a holder consumer pins the window), while ``status()``/``commit()``
  are timed; then the holder releases and every waiting read must complete with the right rows.
- ``cpu``: service CPU-seconds per million tokens (coordinator + producers + replayer, summed with psutil over
  the actor PIDs) at M=1, 2, 4, and tokens/s; coordinator CPU per step, from which one coordinator's capacity is
  projected.
- ``resume``: warm time to first batch for a restarted W=4 job (same consumer, resumes at its commit): retained
  window (hits) vs the replay path (``retain_behind=0``: every step since the commit is replayed).
- ``kill``: ``kill -9`` the coordinator while a consumer reads: time to the next batch (recovery).
- ``long``: 5,000 steps with commits every 50: ``state_dir`` file count and bytes, and the object store (Ray's
  own ``memory_summary``/``list_objects``), sampled every 500 steps, must stay flat.

On 2 cores every process (producers, coordinator, reader threads, Ray) shares the same CPUs: latencies are
upper bounds; CPU-seconds per token do not depend on the core count.
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


def load_recipe(rows_per_microbatch: int, tmp: Path):
    from zephon_ray import Recipe

    text = (ROOT / "recipes" / "tiny.toml").read_text()
    text = text.replace("rows_per_microbatch = 2", f"rows_per_microbatch = {rows_per_microbatch}")
    text = text.replace('path = "data/', f'path = "{ROOT / "recipes" / "data"}/')
    path = tmp / f"tiny-b{8 * rows_per_microbatch}.toml"
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
def run_load(recipe, reference, tmp, ranks: int, steps: int, step_time: float, jobs: int = 2) -> dict:
    from zephon_ray import DataService, compute_digest

    rows = recipe.global_batch_rows
    world = ranks if rows % ranks == 0 else next(w for w in range(min(ranks, rows), 0, -1) if rows % w == 0)
    svc = start(recipe, f"load-{ranks}", tmp, window=8)
    waits, bad, errors, status_lat = [], [], [], []
    stop = threading.Event()

    def prober():
        while not stop.wait(0.05):
            t0 = time.perf_counter()
            svc.status()
            status_lat.append(time.perf_counter() - t0)

    def job(j: int):
        client = DataService.connect(svc.name, namespace=NS, consumer=f"job{j}")
        barrier = threading.Barrier(ranks)

        def rank_loop(r: int):
            try:
                for step in range(steps):
                    t_step = time.perf_counter()
                    part = client.slice(step, r % world, world)
                    waits.append(time.perf_counter() - t_step)
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
    cpu0 = cpu_seconds([coordinator])
    probe = threading.Thread(target=prober, daemon=True)
    probe.start()
    t0 = time.perf_counter()
    job_threads = [threading.Thread(target=job, args=(j,), daemon=True) for j in range(jobs)]
    for t in job_threads:
        t.start()
    for t in job_threads:
        t.join()
    elapsed = time.perf_counter() - t0
    coordinator_cpu = cpu_seconds([coordinator]) - cpu0
    stop.set()
    probe.join()
    svc.stop()
    return {"jobs": jobs, "ranks": ranks, "world": world, "steps": steps, "step_time_s": step_time,
            "reads": len(waits), "wrong_rows": len(bad), "coordinator_cpu_s": round(coordinator_cpu, 3),
            "coordinator_cpu_ms_per_read": coordinator_cpu / max(len(waits), 1) * 1e3, "errors": errors[:3], "elapsed_s": round(elapsed, 2),
            "wait_ms": {"p50": pct(waits, .5) * 1e3, "p99": pct(waits, .99) * 1e3, "max": max(waits) * 1e3},
            "status_ms": {"p50": pct(status_lat, .5) * 1e3, "p99": pct(status_lat, .99) * 1e3,
                          "n": len(status_lat)}}


# ---------------------------------------------------------------------------------------------------- pending
def run_pending(recipe, reference, tmp, n: int = 512) -> dict:
    from zephon_ray import DataService, compute_digest

    svc = start(recipe, "pending", tmp, window=4)
    holder = DataService.connect(svc.name, namespace=NS, consumer="holder")
    holder.slice(0, 0, 1)  # pins the window at [0, 4)
    world = 16
    target = 6  # beyond the window: every read of it waits for the holder
    results, errors = [], []

    def reader(i):
        try:
            client = DataService.connect(svc.name, namespace=NS, consumer=f"r{i % 64}")
            part = client.slice(target, i % world, world)
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
    return {"pending_reads": n, "cursors_while_pending": pending_cursors, "completed_ok": sum(results),
            "errors": errors[:3], "status_ms": {"p50": pct(lat_status, .5) * 1e3, "p99": pct(lat_status, .99) * 1e3,
                                                "max": max(lat_status) * 1e3},
            "commit_ms": {"p50": pct(lat_commit, .5) * 1e3, "max": max(lat_commit) * 1e3},
            "drain_s": round(drain, 2)}


# ---------------------------------------------------------------------------------------------------- cpu
def run_cpu(recipe, reference, tmp, steps: int) -> dict:
    out = {}
    for m in (1, 2, 4):
        svc = start(recipe, f"cpu-m{m}", tmp, producers=m, window=8)
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
            out[m] = {"cpu_s_per_mtok": (all1 - all0) / mtok, "tokens_per_s": mtok * 1e6 / elapsed,
                      "coordinator_cpu_ms_per_step": (c1 - c0) / steps * 1e3, "processes": len(pids)}
        finally:
            svc.stop()
    out["ratio_m2_vs_m1_cpu_per_token"] = out[2]["cpu_s_per_mtok"] / out[1]["cpu_s_per_mtok"]
    out["ratio_m2_vs_m1_tokens_per_s"] = out[2]["tokens_per_s"] / out[1]["tokens_per_s"]
    return out


# ---------------------------------------------------------------------------------------------------- resume
def run_resume(recipe, reference, tmp, behind: int = 6, world: int = 4) -> dict:
    from zephon_ray import DataService

    out = {}
    for label, retain in (("retained", 32), ("replay_path", 0)):
        svc = start(recipe, f"resume-{label}", tmp, window=4, retain_behind=retain, checkpoint_every=8)
        try:
            job = DataService.connect(svc.name, namespace=NS, consumer="job")
            commit_at, read_until = 20, 20 + behind
            for s in range(read_until):
                for r in range(world):
                    job.slice(s, r, world)
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
            out[label] = {"first_batch_s": first, "replay": svc.status()["replay"]}
        finally:
            svc.stop()
    out["ratio_replay_vs_retained"] = out["replay_path"]["first_batch_s"] / out["retained"]["first_batch_s"]
    return out


# ---------------------------------------------------------------------------------------------------- kill
def run_kill(recipe, reference, tmp) -> dict:
    svc = start(recipe, "kill", tmp, window=4, checkpoint_every=4)
    try:
        for s in range(10):
            assert svc.slice(s, 0, 1).step == s
            if s % 4 == 3:
                svc.commit(s + 1)
        pid = svc.status()["coordinator"]["pid"]
        os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        batch = svc.batch(10, track=True)
        recovery = time.perf_counter() - t0
        assert batch.digest == reference[10]
        later = [svc.batch(s, track=True).digest == reference[s] for s in range(11, 16)]
        return {"recovery_s": recovery, "later_ok": all(later), "start": svc.status()["start"]}
    finally:
        svc.stop()


# ---------------------------------------------------------------------------------------------------- long
def object_store_view() -> dict:
    import ray
    from ray._private.internal_api import memory_summary

    out = {}
    try:
        from ray.util.state import list_objects

        objs = list_objects(limit=100_000, raise_on_missing_output=False)
        out["objects"] = len(objs)
        out["object_bytes"] = sum(int(o.object_size or 0) for o in objs if o.object_size and o.object_size > 0)
    except Exception as exc:  # noqa: BLE001 - the state API needs the dashboard
        out["list_objects_error"] = type(exc).__name__
    summary = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    for line in summary.splitlines():
        if "Plasma memory usage" in line:
            out["plasma"] = line.strip()
    return out


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
                samples.append({"step": s + 1, "files": len(files), "bytes": sum(p.stat().st_size for p in files),
                                "held_steps": len(st["window"]["held_steps"]),
                                "held_bytes": st["window"]["held_bytes"], **object_store_view()})
                print("  long:", json.dumps(samples[-1]), flush=True)
    finally:
        svc.stop()
    return {"steps": steps, "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="load,pending,cpu,resume,kill")
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--step-time", type=float, default=0.5)
    ap.add_argument("--cpu-steps", type=int, default=60)
    ap.add_argument("--long-steps", type=int, default=5000)
    ap.add_argument("--pending", type=int, default=512)
    args = ap.parse_args()
    parts = set(args.parts.split(","))

    import ray

    from zephon_ray import GlobalBatchSource, compute_digest

    tmp = Path(tempfile.mkdtemp(prefix="zr-bench-load-"))
    recipe = load_recipe(32, tmp)  # B = 256 rows
    small = load_recipe(2, tmp)  # the tiny fixture itself, B = 16
    n_ref = max(args.steps, args.cpu_steps + 1, 30)
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
    ray.init(address="local", num_cpus=8, include_dashboard=False, _temp_dir=ray_tmp, log_to_driver=False,
             logging_level="ERROR", namespace=NS)
    result = {"cpus": os.cpu_count(), "recipe_rows": recipe.global_batch_rows,
              "tokens_per_step": recipe.tokens_per_step}
    try:
        if "load" in parts:
            for ranks in sorted({32, args.ranks}):
                r = run_load(recipe, reference, tmp, ranks, args.steps, args.step_time)
                result[f"load_{ranks}"] = r
                print(f"load {r['jobs']}x{ranks} ranks x {r['steps']} steps: wrong rows {r['wrong_rows']}, errors "
                      f"{len(r['errors'])}, wait p50/p99/max {r['wait_ms']['p50']:.1f}/{r['wait_ms']['p99']:.1f}/"
                      f"{r['wait_ms']['max']:.1f} ms, status p99 {r['status_ms']['p99']:.1f} ms, coordinator "
                      f"{r['coordinator_cpu_ms_per_read']:.2f} CPU-ms/read", flush=True)
        if "pending" in parts:
            r = result["pending"] = run_pending(recipe, reference, tmp, args.pending)
            print(f"pending {r['pending_reads']} reads: status p99 {r['status_ms']['p99']:.1f} ms (max "
                  f"{r['status_ms']['max']:.1f}), commit max {r['commit_ms']['max']:.1f} ms, completed ok "
                  f"{r['completed_ok']}, drained in {r['drain_s']} s", flush=True)
        if "cpu" in parts:
            r = result["cpu"] = run_cpu(recipe, digests, tmp, args.cpu_steps)
            for m in (1, 2, 4):
                print(f"cpu M={m}: {r[m]['cpu_s_per_mtok']:.2f} service CPU-s per M tokens, "
                      f"{r[m]['tokens_per_s'] / 1e6:.3f} M tok/s, coordinator {r[m]['coordinator_cpu_ms_per_step']:.2f} "
                      f"CPU-ms/step", flush=True)
            print(f"cpu ratio M=2/M=1 per token {r['ratio_m2_vs_m1_cpu_per_token']:.2f} (target <= 1.2), tokens/s "
                  f"{r['ratio_m2_vs_m1_tokens_per_s']:.2f}", flush=True)
        if "resume" in parts:
            r = result["resume"] = run_resume(recipe, digests, tmp)
            print(f"resume first batch: retained {r['retained']['first_batch_s']:.3f} s, replay path "
                  f"{r['replay_path']['first_batch_s']:.3f} s, ratio {r['ratio_replay_vs_retained']:.1f}x", flush=True)
        if "kill" in parts:
            r = result["kill"] = run_kill(recipe, digests, tmp)
            print(f"coordinator kill -9: next batch after {r['recovery_s']:.2f} s", flush=True)
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
