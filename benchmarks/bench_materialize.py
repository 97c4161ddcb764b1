"""Materialisation: tokens/s with M = 1 and 2 lane-group actors, and random access to a past step.

    python benchmarks/bench_materialize.py [--recipe recipes/tiny.toml] [--steps 200] [--probes 40] [--service]

1. ``materialize`` of steps 0:``--steps`` with M = 1 and M = 2 Ray Data lane-group actors on a private local Ray
   (wall time, actor start-up included; ``steady`` excludes everything before the first committed segment), side
   by side with the in-process ``GlobalBatchSource`` producing the same steps, the three sides rotating their
   order in each of ``--rounds`` rounds (medians) (and, with ``--service``, the live
   DataService with one producer, read step by step through ``DataService.batch``, against the same service
   over the M=1 directory as a materialised prefix, ``materialized_dir``). The materialised digests are checked
   against the in-process ones.
2. Random access to past steps: ``--probes`` random steps in [0, steps), read from the materialised directory
   (``MaterializedSource.batch``: one Parquet row group plus a digest check) against the replay path
   (``GlobalBatchSource.batch`` of a step behind its position: a Zephon restore plus up to ``checkpoint_every``
   steps of replay; this is what the service's replayers do too), the two read the same step back to back, which
   one first alternating. p50/p99 of each, and the ratio of p50s
   (target >= 20x). With ``--service``, also through each service: untracked reads of steps far behind its
   window (the live service replays them in its Replayer; the prefix service reads them from the directory).
3. Bytes on disk per million tokens of the materialisation (zstd Parquet, int32 tokens and positions).

Prints a table and one JSON line (prefixed ``RESULT``). Timings on a shared machine are noisy: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "tiny.toml"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--probes", type=int, default=40)
    parser.add_argument("--segment-steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the sides' order changes every round")
    parser.add_argument("--service", action="store_true", help="also time the live DataService (M=1)")
    args = parser.parse_args()

    import ray

    from zephon_ray.formats.materialized import MaterializedSource
    from zephon_ray.jobs.materialize import materialize
    from zephon_ray.recipe import Recipe
    from zephon_ray.source import GlobalBatchSource

    recipe = Recipe.from_toml(args.recipe)
    work = Path(tempfile.mkdtemp(prefix="bench-mat-"))
    ray_tmp = tempfile.mkdtemp(prefix="bench-mat-ray-", dir="/tmp")
    tokens = args.steps * recipe.tokens_per_step
    out: dict[str, float | int | bool | str] = {
        "recipe": str(args.recipe),
        "steps": args.steps,
        "tokens": tokens,
        "cpus": os.cpu_count() or 1,
    }
    try:

        def in_process() -> list[str]:
            with GlobalBatchSource(recipe) as local:
                return [local.batch(s).digest for s in range(args.steps)]

        ray.init(
            address="local",
            num_cpus=max(4, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            _temp_dir=ray_tmp,
        )
        # The same work on every side (steps 0:--steps of the recipe): in-process, M=1, M=2; the order rotates every
        # round, each materialisation into a fresh directory. Medians per side.
        sides = ["in_process", "M1", "M2"]
        walls: dict[str, list[float]] = {k: [] for k in sides}
        steady: dict[str, list[float]] = {"M1": [], "M2": []}
        reference: list[str] = []
        for r in range(args.rounds):
            for side in sides[r % 3 :] + sides[: r % 3]:
                t0 = time.perf_counter()
                if side == "in_process":
                    reference = in_process()
                    walls[side].append(time.perf_counter() - t0)
                    continue
                m = int(side[1])
                directory = work / (f"m{m}" if r == 0 else f"m{m}-r{r}")
                materialize(
                    recipe,
                    directory,
                    range(0, args.steps),
                    producers=m,
                    segment_steps=args.segment_steps,
                    progress=False,
                )
                walls[side].append(time.perf_counter() - t0)
                segments = sorted((directory / "segments").glob("*.parquet"), key=lambda p: p.stat().st_mtime)
                span = segments[-1].stat().st_mtime - segments[0].stat().st_mtime
                steady_steps = args.steps - args.segment_steps
                if span > 0 and steady_steps > 0:
                    steady[side].append(steady_steps * recipe.tokens_per_step / span)
                if r > 0:
                    shutil.rmtree(directory, ignore_errors=True)
        out["in_process_tokens_per_s"] = tokens / statistics.median(walls["in_process"])
        for m in (1, 2):
            out[f"materialize_M{m}_tokens_per_s"] = tokens / statistics.median(walls[f"M{m}"])
            out[f"materialize_M{m}_steady_tokens_per_s"] = (
                statistics.median(steady[f"M{m}"]) if steady[f"M{m}"] else None
            )
            with MaterializedSource(work / f"m{m}", recipe=recipe) as source:
                out[f"materialize_M{m}_digests_equal"] = [source.digest(s) for s in range(args.steps)] == reference
        out["bytes_per_million_tokens"] = (
            sum(p.stat().st_size for p in (work / "m1" / "segments").glob("*")) / tokens * 1e6
        )

        if args.service:
            from zephon_ray.service.client import DataService

            # Past steps well behind the window (retain_behind=32), each read once: the service's past-step path.
            service_probes = random.Random(1).sample(range(args.steps - 64), min(args.probes, 20, args.steps - 64))
            rates: dict[str, list[float]] = {"service_M1": [], "service_prefix": []}
            pasts: dict[str, list[float]] = {"service_M1": [], "service_prefix": []}
            kinds = [("service_M1", None), ("service_prefix", str(work / "m1"))]
            for r in range(args.rounds):  # a fresh service per side and round; the order flips every round
                for key, prefix in kinds if r % 2 == 0 else kinds[::-1]:
                    service = DataService.start(
                        recipe,
                        name="bench-materialize",
                        namespace="bench-materialize",
                        state_dir=work / f"{key}-state-{r}",
                        window=8,
                        materialized_dir=prefix,
                    )
                    try:
                        service.batch(0)
                        t0 = time.perf_counter()
                        for s in range(1, args.steps):
                            service.batch(s, track=True)
                            service.commit(s)
                        rates[key].append((args.steps - 1) * recipe.tokens_per_step / (time.perf_counter() - t0))
                        for s in service_probes:
                            t0 = time.perf_counter()
                            assert service.batch(s).digest == reference[s]
                            pasts[key].append(time.perf_counter() - t0)
                    finally:
                        service.stop()
            for key in rates:
                out[f"{key}_tokens_per_s"] = statistics.median(rates[key])
                out[f"{key}_past_p50_ms"] = statistics.median(pasts[key]) * 1e3
                out[f"{key}_past_p99_ms"] = percentile(pasts[key], 0.99) * 1e3
            out["service_prefix_read_speedup"] = out["service_prefix_tokens_per_s"] / out["service_M1_tokens_per_s"]
            out["service_past_speedup_p50"] = out["service_M1_past_p50_ms"] / out["service_prefix_past_p50_ms"]
        ray.shutdown()

        # Distinct steps, visited from the newest down: each one is behind the replay source's position, so each
        # pays the past-step path (restore + replay), never a cache hit or a forward production.
        probes = sorted(random.Random(0).sample(range(args.steps - 1), min(args.probes, args.steps - 1)), reverse=True)
        source = MaterializedSource(work / "m1", recipe=recipe)
        source.batch(0)  # open the footer cache fairly: the first read of each file pays its footer once
        materialized_s, replay_s = [], []
        with GlobalBatchSource(recipe, cache_steps=1) as replay:
            replay.batch(args.steps - 1)  # the head: every probe is a step behind it
            for i, s in enumerate(probes):  # the same step on both sides, which side goes first alternating
                pair = [(materialized_s, source.batch), (replay_s, replay.batch)]
                for times, read in pair if i % 2 == 0 else pair[::-1]:
                    t0 = time.perf_counter()
                    read(s)
                    times.append(time.perf_counter() - t0)
        out["random_access_materialized_p50_ms"] = statistics.median(materialized_s) * 1e3
        out["random_access_materialized_p99_ms"] = percentile(materialized_s, 0.99) * 1e3
        out["random_access_replay_p50_ms"] = statistics.median(replay_s) * 1e3
        out["random_access_replay_p99_ms"] = percentile(replay_s, 0.99) * 1e3
        out["random_access_speedup_p50"] = statistics.median(replay_s) / statistics.median(materialized_s)

        def rate(key: str) -> str:
            value = out.get(key)
            return f"{value / 1e6:8.3f} M tokens/s" if isinstance(value, float) else "       -"

        print(f"in-process GlobalBatchSource      {rate('in_process_tokens_per_s')}")
        for m in (1, 2):
            print(
                f"materialize M={m} (wall / steady)   {rate(f'materialize_M{m}_tokens_per_s')} / "
                f"{rate(f'materialize_M{m}_steady_tokens_per_s')}  digests equal: "
                f"{out[f'materialize_M{m}_digests_equal']}"
            )
        if args.service:
            print(f"live service M=1                  {rate('service_M1_tokens_per_s')}")
            print(
                f"service over the prefix           {rate('service_prefix_tokens_per_s')}  "
                f"(x{out['service_prefix_read_speedup']:.1f})"
            )
            for key, what in (("service_M1", "replayed"), ("service_prefix", "from the prefix")):
                print(
                    f"service past step, {what:15s}p50 {out[f'{key}_past_p50_ms']:8.2f} ms  "
                    f"p99 {out[f'{key}_past_p99_ms']:8.2f} ms"
                )
            print(f"service past step: prefix is x{out['service_past_speedup_p50']:.1f} faster at p50")
        print(
            f"past step, materialised           p50 {out['random_access_materialized_p50_ms']:8.2f} ms  "
            f"p99 {out['random_access_materialized_p99_ms']:8.2f} ms"
        )
        print(
            f"past step, restore + replay       p50 {out['random_access_replay_p50_ms']:8.2f} ms  "
            f"p99 {out['random_access_replay_p99_ms']:8.2f} ms  (x{out['random_access_speedup_p50']:.1f} at p50)"
        )
        print(f"disk                              {out['bytes_per_million_tokens'] / 1e6:8.3f} MB per million tokens")
        print("RESULT " + json.dumps(out))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
