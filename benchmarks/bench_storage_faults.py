"""The service under object-storage faults: producer throughput with 20 % of requests answered 503
SlowDown against none, in alternating rounds, and the figures of a 15 s endpoint outage.

    python benchmarks/bench_storage_faults.py [--steps 40] [--rounds 3] [--outage-s 15] [--step-s 0.25]

Set-up: moto on 127.0.0.1 behind the fault proxy of tests/fault_proxy.py (the same as tests/test_storage_faults.py);
a private local Ray; a service whose recipe, sources and state_dir are in buckets, 2 producers, a checkpoint every
step (``checkpoint_every=1``: the most storage writes per produced step) and a trainer-like reader that commits every
step. Each round starts a service on its own state_dir, reads ``--steps`` steps tracked (committing each) and
reports tokens/s delivered over that stretch; the faulted and clean rounds alternate, so drifts of the machine hit
both alike.

Outage figures: with the reader at step 6, the endpoint refuses connections for ``--outage-s`` while the reader goes
on reading, one step per ``--step-s`` of simulated compute; reported are the steps it read while the endpoint was
down, its summed and longest waits for a step (what the outage cost it: the sources are in the shard cache, so
production goes on), and whether any restart happened. ``--rounds 0`` runs the outage part alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_round(s3, recipe, steps: int, slowdown: float, name: str) -> dict:
    from zephon_ray import DataService

    state = f"s3://{s3.new_bucket('zr-bench-state')}/run"
    svc = DataService.start(
        recipe,
        name=name,
        namespace="zr-bench-faults",
        state_dir=state,
        producers=2,
        checkpoint_every=1,
        run_id=name,
        aggregate_store="torch://",
        window=4,
        consumer="trainer",
    )
    try:
        svc.batch(0, track=True)  # started and warm
        s3.faults.set_faults(slowdown=slowdown)
        before = dict(s3.faults.stats)
        t0 = time.monotonic()
        for step in range(1, steps + 1):
            svc.batch(step, track=True)
            svc.commit(step + 1)
        wall = time.monotonic() - t0
        s3.faults.clear()
        status = svc.status()
        tokens = steps * recipe.tokens_per_step
        return {
            "slowdown": slowdown,
            "steps": steps,
            "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall),
            "slowdowns": s3.faults.stats["slowdowns"] - before["slowdowns"],
            "requests": s3.faults.stats["requests"] - before["requests"],
            "restarts": status["restarts"],
        }
    finally:
        s3.faults.clear()
        svc.stop()


def outage(s3, recipe, seconds: float, step_s: float) -> dict:
    """A trainer-like reader (one step every ``step_s`` of "compute", tracked) reads through an endpoint outage of
    ``seconds``: what the outage cost it is its waits for steps while the endpoint was down."""
    from zephon_ray import DataService

    state = f"s3://{s3.new_bucket('zr-bench-state')}/run"
    svc = DataService.start(
        recipe,
        name="outage",
        namespace="zr-bench-faults",
        state_dir=state,
        producers=2,
        checkpoint_every=2,
        run_id="outage",
        aggregate_store="torch://",
        window=4,
    )
    try:
        for step in range(6):
            svc.batch(step, track=True)
        s3.faults.refuse_for(seconds)
        down_at = time.monotonic()
        up_at = down_at + seconds
        waits, step = [], 6
        while time.monotonic() < up_at + 5:
            t0 = time.monotonic()
            svc.batch(step, track=True)
            waits.append((t0, time.monotonic() - t0))
            step += 1
            time.sleep(step_s)  # the trainer's compute
        during = [w for t, w in waits if t < up_at]
        svc.commit(step)  # durable only once the checkpoints and commits of the outage are written
        return {
            "outage_s": seconds,
            "step_s": step_s,
            "steps_during_outage": len(during),
            "wait_during_outage_s": round(sum(during), 3),
            "longest_wait_s": round(max(w for _, w in waits), 3),
            "restarts": svc.status()["restarts"],
            "unwritten_checkpoints_at_end": svc.status()["checkpoints"]["unwritten"],
        }
    finally:
        svc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--outage-s", type=float, default=15.0)
    parser.add_argument("--step-s", type=float, default=0.25, help="the reader's compute per step in the outage part")
    args = parser.parse_args()

    from tests import s3_server

    s3 = s3_server.configure_environment()  # before Ray starts: its workers inherit the endpoint
    s3.start()
    import ray

    from zephon_ray import Recipe

    bucket = s3.new_bucket("zr-bench-data")
    s3.upload_tree(ROOT / "recipes" / "data" / "tiny", bucket, "recipes/data/tiny")
    s3.client().upload_file(str(ROOT / "recipes" / "tiny.toml"), bucket, "recipes/tiny.toml")
    temp = tempfile.mkdtemp(prefix="zr-bench-faults-", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=temp,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    try:
        recipe = Recipe.from_toml(f"s3://{bucket}/recipes/tiny.toml")
        rows = []
        for r in range(args.rounds):
            for slowdown in (0.0, 0.2) if r % 2 == 0 else (0.2, 0.0):
                rows.append(run_round(s3, recipe, args.steps, slowdown, f"b{r}{int(slowdown * 100)}"))
                print(json.dumps(rows[-1]), flush=True)
        if rows:
            clean = statistics.median(x["tokens_per_s"] for x in rows if x["slowdown"] == 0)
            slow = statistics.median(x["tokens_per_s"] for x in rows if x["slowdown"] > 0)
            print(
                json.dumps(
                    {
                        "tokens_per_s_no_faults": clean,
                        "tokens_per_s_20pct_slowdown": slow,
                        "ratio": round(slow / clean, 3),
                    }
                ),
                flush=True,
            )
        print(json.dumps(outage(s3, recipe, args.outage_s, args.step_s)), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
