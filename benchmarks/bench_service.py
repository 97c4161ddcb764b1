"""Data-service throughput and latency against in-process reading, the same work on both sides, in rounds.

    python benchmarks/bench_service.py [--recipe recipes/mixture.toml] [--steps 40] [--rounds 4]

Each side reads whole global batches of steps 1..N (after step 0, the warm-up) and computes their digests:
- ``local``: ``GlobalBatchSource(recipe).batch(s).digest`` in this process;
- ``service M=1`` and ``service M=2``: a fresh service per round, ``DataService.batch(s, track=True).digest``
  (producers run ahead of the reader by at most ``window``), every digest checked against the local side's;
- ``service M=1 per lane``: M=1 with ``pack_bytes=0``, one object per lane shard instead of the default packs
  (``ServiceConfig.pack_bytes``).
The sides rotate: round r starts r places further along the list, so machine noise hits every side. Ratios are
medians of per-round ratios of end-to-end tokens/s (what the reader sees); the producers' own rate (first to last
produced step) is reported beside it, never divided by a local rate. Then the latency of ``slice(s, r, W)`` for a
warm step (inside the live window): p50/p99.

Prints a table and one JSON line (prefixed ``RESULT``). On a 2-core machine M=2 cannot beat M=1 by much: the
producers, the coordinator, the reader and Ray itself share the same two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_local(recipe, steps: int) -> tuple[float, list[str]]:
    from zephon_ray import GlobalBatchSource

    with GlobalBatchSource(recipe) as source:
        source.batch(0)
        t0 = time.perf_counter()
        digests = [source.batch(s).digest for s in range(1, steps + 1)]
        elapsed = time.perf_counter() - t0
    return steps * recipe.tokens_per_step / elapsed, digests


SERVICE_SIDES = {"m1": (1, None), "m1_per_lane": (1, 0), "m2": (2, None)}
"""Each service side's producers and ``pack_bytes`` (None: the default)."""


def run_service(recipe, steps: int, producers: int, pack_bytes: int | None, window: int, tag: str) -> dict:
    from zephon_ray import DataService

    state_dir = tempfile.mkdtemp(prefix="zr-bench-state-")
    svc = DataService.start(
        recipe,
        name=f"bench-{tag}",
        namespace="zr-bench",
        producers=producers,
        window=window,
        state_dir=state_dir,
        checkpoint_every=8,
        run_id=f"bench-{tag}",
        aggregate_store="torch://" if producers > 1 else None,
        **({} if pack_bytes is None else {"pack_bytes": pack_bytes}),
    )
    try:
        svc.batch(0, track=True)  # tracked: this consumer moves the window (untracked reads would be replays)
        t0 = time.perf_counter()
        digests = [svc.batch(s, track=True).digest for s in range(1, steps + 1)]
        elapsed = time.perf_counter() - t0
        thr = svc.status()["throughput"]
        out = {
            "end_to_end": steps * recipe.tokens_per_step / elapsed,
            "produced": thr["tokens_per_s"],
            "digests": digests,
        }
        if producers == 1 and pack_bytes is None:
            out["slice_ms"] = slice_latency(svc, steps, recipe)
        return out
    finally:
        svc.stop()
        shutil.rmtree(state_dir, ignore_errors=True)


def slice_latency(svc, step: int, recipe, n: int = 300) -> dict:
    world = next(w for w in (8, 4, 2, 1) if recipe.global_batch_rows % w == 0)
    svc.slice(step, 0, world, track=True)  # warm: the step is in the live window
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        svc.slice(step, i % world, world, track=True)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"world": world, "p50": times[len(times) // 2] * 1e3, "p99": times[int(len(times) * 0.99) - 1] * 1e3, "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "mixture.toml"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window", type=int, default=8)
    args = ap.parse_args()

    import ray

    from zephon_ray import Recipe

    recipe = Recipe.from_toml(args.recipe)
    print(
        f"recipe {recipe.describe()}: {recipe.global_batch_rows} rows x {recipe.seq_len} = "
        f"{recipe.tokens_per_step} tokens/step, {args.steps} steps x {args.rounds} rounds, window {args.window}"
    )
    temp_dir = tempfile.mkdtemp(prefix="zr-bench-ray-", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        run_local(recipe, 2)  # warm caches (catalog, tokenizer, page cache)
        rounds = []
        sides = ["local", *SERVICE_SIDES]
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            got = {}
            for side in order:
                if side == "local":
                    got["local"], got["local_digests"] = run_local(recipe, args.steps)
                else:
                    got[side] = run_service(recipe, args.steps, *SERVICE_SIDES[side], args.window, f"{side}-{r}")
            wrong = sum(
                a != b for side in SERVICE_SIDES for a, b in zip(got[side].pop("digests"), got["local_digests"])
            )
            got["wrong_steps"] = wrong
            del got["local_digests"]
            rounds.append(got)
            print(
                f"round {r} ({', '.join(order)}): local {got['local'] / 1e6:.3f}  "
                + "  ".join(
                    f"{side} e2e {got[side]['end_to_end'] / 1e6:.3f} (produced {got[side]['produced'] / 1e6:.3f})"
                    for side in SERVICE_SIDES
                )
                + f"  (M tok/s), wrong steps {wrong}",
                flush=True,
            )
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

    med = statistics.median
    result = {
        "recipe": str(args.recipe),
        "steps": args.steps,
        "rounds": args.rounds,
        "window": args.window,
        "tokens_per_step": recipe.tokens_per_step,
        "cpus": os.cpu_count(),
        "wrong_steps": sum(x["wrong_steps"] for x in rounds),
        "local_tokens_per_s": [x["local"] for x in rounds],
    }
    for side in SERVICE_SIDES:
        result[f"{side}_end_to_end_tokens_per_s"] = [x[side]["end_to_end"] for x in rounds]
        result[f"{side}_produced_tokens_per_s"] = [x[side]["produced"] for x in rounds]
        result[f"ratio_{side}_end_to_end_vs_local"] = med(x[side]["end_to_end"] / x["local"] for x in rounds)
    for a, b in (("m1", "m1_per_lane"), ("m2", "m1")):
        result[f"ratio_{a}_vs_{b}_end_to_end"] = med(x[a]["end_to_end"] / x[b]["end_to_end"] for x in rounds)
    result["slice_warm_ms"] = rounds[-1]["m1"]["slice_ms"]
    names = {"m1": "service M=1", "m1_per_lane": "service M=1 per lane", "m2": "service M=2"}
    rows = [("local GlobalBatchSource (M tok/s, median)", f"{med(result['local_tokens_per_s']) / 1e6:.3f}")]
    rows += [
        (f"{names[side]} end-to-end (M tok/s, median)", f"{med(result[f'{side}_end_to_end_tokens_per_s']) / 1e6:.3f}")
        for side in SERVICE_SIDES
    ]
    rows.append(
        ("service M=1 producers alone (M tok/s, median)", f"{med(result['m1_produced_tokens_per_s']) / 1e6:.3f}")
    )
    rows += [
        (f"ratio {names[side]} end-to-end / local", f"{result[f'ratio_{side}_end_to_end_vs_local']:.3f}")
        for side in SERVICE_SIDES
    ]
    rows.append(("ratio M=1 / M=1 per lane end-to-end", f"{result['ratio_m1_vs_m1_per_lane_end_to_end']:.3f}"))
    rows.append(("ratio M=2 / M=1 end-to-end", f"{result['ratio_m2_vs_m1_end_to_end']:.3f}"))
    rows.append(("wrong steps (service digest != local digest)", str(result["wrong_steps"])))
    lat = result["slice_warm_ms"]
    rows.append((f"slice warm p50 / p99 (ms, W={lat['world']})", f"{lat['p50']:.2f} / {lat['p99']:.2f}"))
    print()
    print(f"{'measure':<50}{'value':>14}")
    for name, value in rows:
        print(f"{name:<50}{value:>14}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
