"""Loader benchmark: service mode vs local mode, side by side in one run.

    python benchmarks/bench_loader.py [--recipe recipes/elastic.toml] [--world 2] [--steps 40] [--compute-ms 20]

Measures, with every rank a separate Ray actor process (a private local Ray cluster started here):

1. **wait in next()**: per step, the time a rank spends blocked in ``next()`` for all of its microbatches, while
   it "trains" ``--compute-ms`` per step; p50 and p99 over ranks x steps. Service mode starts after the service
   is warm (its window filled); local mode runs Zephon for the rank's own lanes (directory aggregation).
2. **resize to first batch**: a new worker group of ``--resize-world`` ranks loads the loader state taken at step
   ``--steps`` (as Ray Train does after a resize) and fetches its first batch; the time from loader construction
   to that first microbatch, max over ranks.

Prints one table with the ratio local/service for each number.
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[index]


class BenchRank:
    """One data-parallel rank: builds a ZephonRayDataLoader and times it."""

    def __init__(self, rank: int, world: int, loader_kwargs: dict) -> None:
        self.rank, self.world, self.kwargs = rank, world, loader_kwargs
        # A real worker imports TorchTitan for its trainer anyway: keep that import out of the timings.
        import zephon_ray.integrations.torchtitan.loader  # noqa: F401

    def ready(self) -> bool:
        return True

    def _build(self):
        from zephon_ray.recipe import Recipe
        from zephon_ray.torchtitan import ZephonRayDataLoader

        recipe = Recipe.from_toml(self.kwargs["recipe"])
        lbs = recipe.global_batch_rows // self.world
        return ZephonRayDataLoader.Config(**self.kwargs).build(
            dp_world_size=self.world, dp_rank=self.rank, seq_len=recipe.seq_len, local_batch_size=lbs)

    def waits(self, steps: int, compute_s: float) -> tuple[list[float], dict]:
        loader = self._build()
        it = iter(loader)
        waits = []
        for _ in range(steps):
            t = time.perf_counter()
            for _ in range(loader.microbatches_per_step):
                next(it)
            waits.append(time.perf_counter() - t)
            time.sleep(compute_s)
        state = loader.state_dict()
        loader.close()
        return waits, state

    def first_batch(self, state: dict) -> float:
        t = time.perf_counter()
        loader = self._build()
        loader.load_state_dict(state)
        next(iter(loader))
        elapsed = time.perf_counter() - t
        loader.close()
        return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "elastic.toml"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--resize-world", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--service-checkpoint-every", type=int, default=8)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--modes", default="service,local")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    import ray

    from zephon_ray import DataService

    work = Path(tempfile.mkdtemp(prefix="zephon-ray-bench-"))
    ray.init(address="local", num_cpus=8, include_dashboard=False, _temp_dir=str(work / "ray"), log_to_driver=False,
             namespace="zephon-ray-bench",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}})
    Rank = ray.remote(num_cpus=0.25)(BenchRank)
    results: dict[str, dict[str, float]] = {}
    service = None
    try:
        service = DataService.start(args.recipe, name="bench", namespace="zephon-ray-bench",
                                    producers=args.producers, window=args.window, state_dir=str(work / "svc"),
                                    checkpoint_every=args.service_checkpoint_every, aggregate_store="torch://", run_id="bench")
        # Warm: wait until the producers filled the window. (Do not read a step from this driver: a tracked read
        # would make the driver a consumer whose cursor holds the window back until consumer_ttl_s.)
        deadline = time.monotonic() + 120
        while service.status()["window"]["next_step"] < args.window and time.monotonic() < deadline:
            time.sleep(0.2)
        modes = {
            "service": {"recipe": args.recipe, "mode": "service", "service_name": "bench",
                        "service_namespace": "zephon-ray-bench", "run_id": "bench", "prefetch": 4},
            "local": {"recipe": args.recipe, "mode": "local", "run_id": "bench", "prefetch": 4,
                      "aggregate_dir": str(work / "agg"), "checkpoint_every": args.steps},
        }
        for mode, kwargs in modes.items():
            if mode not in args.modes.split(","):
                continue
            ranks = [Rank.remote(r, args.world, kwargs) for r in range(args.world)]
            ray.get([r.ready.remote() for r in ranks])
            out = ray.get([r.waits.remote(args.steps, args.compute_ms / 1000) for r in ranks])
            waits = [w for per_rank, _ in out for w in per_rank[1:]]  # step 0 is the cold start
            state = out[0][1]
            assert all(o[1] == state for o in out), "loader states differ between ranks"
            for r in ranks:
                ray.kill(r)
            kwargs = {**kwargs, "aggregate_dir": str(work / f"agg-resize-{mode}")} if mode == "local" else kwargs
            resized = [Rank.remote(r, args.resize_world, kwargs) for r in range(args.resize_world)]
            ray.get([r.ready.remote() for r in resized])
            if args.verbose and mode == "service":
                print("service window before the resize:", service.status()["window"], flush=True)
            firsts = ray.get([r.first_batch.remote(state) for r in resized])
            if args.verbose:
                print(mode, "resized first batch per rank (s):", [round(f, 3) for f in firsts], flush=True)
            for r in resized:
                ray.kill(r)
            results[mode] = {
                "first_step_ms": 1000 * statistics.mean(per_rank[0] for per_rank, _ in out),
                "wait_p50_ms": 1000 * percentile(waits, 50),
                "wait_p99_ms": 1000 * percentile(waits, 99),
                "wait_mean_ms": 1000 * statistics.mean(waits),
                "resize_first_batch_ms": 1000 * max(firsts),
            }
    finally:
        if service is not None:
            service.stop()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    rows = [("wait in next() per step, p50", "wait_p50_ms"), ("wait in next() per step, p99", "wait_p99_ms"),
            ("wait in next() per step, mean", "wait_mean_ms"), ("first step of a fresh loader", "first_step_ms"),
            (f"resized group ({args.resize_world} ranks) to first batch", "resize_first_batch_ms")]
    print(f"recipe {args.recipe}: W={args.world}, {args.steps} steps, {args.compute_ms:.0f} ms compute per step, "
          f"{args.producers} producers")
    print(f"{'':<42} {'service':>10} {'local':>10} {'local/service':>14}")
    for label, key in rows:
        if len(results) < 2:
            print(label, results)
            continue
        s, l = results["service"][key], results["local"][key]
        print(f"{label:<42} {s:>8.2f}ms {l:>8.2f}ms {l / s if s else float('inf'):>13.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
