"""Loader benchmark: service mode vs local mode, alternating in rounds, the same work on both sides.

    python benchmarks/bench_loader.py [--recipe recipes/elastic.toml] [--world 2] [--steps 40] [--compute-ms 20]
                                      [--rounds 3]

Every round runs both sides, in alternating order (service first in even rounds, local first in odd ones), and
each side does exactly the same work: W readers (each a separate Ray actor process of a private local Ray) build
the framework-free loader core (``zephon_ray.stream.loader.Loader``, what the TorchTitan and Ray Train adapters
run), read steps ``0 .. --steps-1`` of the recipe while "training" ``--compute-ms`` per step, and take the loader
state at ``--steps``; then a resized group of ``--resize-world`` readers loads that state and reads step ``--steps``.
The service side starts a fresh service in every round (so it never serves a step from an earlier round) and waits
for its window to fill before the readers start: a running service is ahead of its trainers by design.

Measures, per side and round:

1. **wait in next()**: per step, the time a reader is blocked waiting for its step; p50 / p99 / mean over readers
   x steps (step 0, the cold start, is reported apart as "first step of a fresh loader");
2. **resized group to first batch**: loader construction + ``load_state_dict`` + first step, max over readers.

Prints the median over rounds of each number for both sides, the ratio local/service of those medians, and the
range of the per-round ratios (so a noisy round shows).
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

SIDES = ("service", "local")
ROWS = [
    ("wait in next() per step, p50", "wait_p50_ms"),
    ("wait in next() per step, p99", "wait_p99_ms"),
    ("wait in next() per step, mean", "wait_mean_ms"),
    ("first step of a fresh loader", "first_step_ms"),
    ("resized group to first batch", "resize_first_batch_ms"),
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[index]


class BenchReader:
    """One reader: builds the loader core and times it."""

    def __init__(self, rank: int, world: int, config: dict) -> None:
        self.rank, self.world, self.config = rank, world, config
        import zephon_ray.stream.loader  # noqa: F401 - keep the import out of the timings

    def ready(self) -> bool:
        return True

    def _build(self):
        from zephon_ray.stream.loader import Loader, LoaderConfig

        return Loader(LoaderConfig(**self.config), rank=self.rank, world=self.world)

    def waits(self, steps: int, compute_s: float) -> tuple[list[float], dict]:
        loader = self._build()
        it = iter(loader)
        waits = []
        for _ in range(steps):
            t = time.perf_counter()
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


def run_side(ray, Reader, side: str, args, work: Path, round_: int) -> dict[str, float]:
    from zephon_ray import DataService

    service = None
    name = f"bench-{round_}"
    if side == "service":
        config = {
            "recipe": args.recipe,
            "mode": "service",
            "service_name": name,
            "service_namespace": "zephon-ray-bench",
            "run_id": f"bench-{round_}",
            "prefetch": 4,
        }
        service = DataService.start(
            args.recipe,
            name=name,
            namespace="zephon-ray-bench",
            producers=args.producers,
            window=args.window,
            state_dir=str(work / f"svc-{round_}"),
            checkpoint_every=args.service_checkpoint_every,
            aggregate_store="torch://",
            run_id=name,
        )
        # Warm: wait until the producers filled the window. (Do not read a step from this driver: a tracked read
        # would make the driver a consumer whose cursor holds the window back until consumer_ttl_s.)
        deadline = time.monotonic() + 120
        while service.status()["window"]["next_step"] < args.window and time.monotonic() < deadline:
            time.sleep(0.2)
    else:
        config = {
            "recipe": args.recipe,
            "mode": "local",
            "run_id": f"bench-{round_}",
            "prefetch": 4,
            "aggregate_dir": str(work / f"agg-{round_}"),
            "checkpoint_every": args.steps,
        }
    try:
        readers = [Reader.remote(r, args.world, config) for r in range(args.world)]
        ray.get([r.ready.remote() for r in readers])
        out = ray.get([r.waits.remote(args.steps, args.compute_ms / 1000) for r in readers])
        waits = [w for per_reader, _ in out for w in per_reader[1:]]  # step 0 is the cold start
        state = out[0][1]
        assert all(o[1] == state for o in out), "loader states differ between readers"
        for r in readers:
            ray.kill(r)
        if side == "local":
            config = {**config, "aggregate_dir": str(work / f"agg-resize-{round_}")}
        resized = [Reader.remote(r, args.resize_world, config) for r in range(args.resize_world)]
        ray.get([r.ready.remote() for r in resized])
        firsts = ray.get([r.first_batch.remote(state) for r in resized])
        for r in resized:
            ray.kill(r)
    finally:
        if service is not None:
            service.stop()
    return {
        "first_step_ms": 1000 * statistics.mean(per_reader[0] for per_reader, _ in out),
        "wait_p50_ms": 1000 * percentile(waits, 50),
        "wait_p99_ms": 1000 * percentile(waits, 99),
        "wait_mean_ms": 1000 * statistics.mean(waits),
        "resize_first_batch_ms": 1000 * max(firsts),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "elastic.toml"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--resize-world", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--service-checkpoint-every", type=int, default=8)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the per-round results here")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 2:
        parser.error("need --rounds >= 1 and --steps >= 2")

    import ray

    work = Path(tempfile.mkdtemp(prefix="zephon-ray-bench-"))
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=str(work / "ray"),
        log_to_driver=False,
        namespace="zephon-ray-bench",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}},
    )
    Reader = ray.remote(num_cpus=0.25)(BenchReader)
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for round_ in range(args.rounds):
            order = SIDES if round_ % 2 == 0 else SIDES[::-1]
            results = {side: run_side(ray, Reader, side, args, work, round_) for side in order}
            rounds.append(results)
            print(
                f"round {round_} ({' then '.join(order)}): "
                + ", ".join(f"{side} wait p50 {results[side]['wait_p50_ms']:.2f} ms" for side in SIDES),
                flush=True,
            )
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"recipe {args.recipe}: W={args.world} -> {args.resize_world}, {args.steps} steps, {args.compute_ms:.0f} ms "
        f"compute per step, {args.producers} producers, {args.rounds} rounds alternating (median over rounds)"
    )
    print(f"{'':<36} {'service':>10} {'local':>10} {'local/service':>14} {'per-round ratio':>18}")
    for label, key in ROWS:
        s = statistics.median(r["service"][key] for r in rounds)
        l = statistics.median(r["local"][key] for r in rounds)
        per = [r["local"][key] / r["service"][key] for r in rounds if r["service"][key]]
        spread = f"{min(per):.1f}x..{max(per):.1f}x" if per else "-"
        print(f"{label:<36} {s:>8.2f}ms {l:>8.2f}ms {l / s if s else float('inf'):>13.1f}x {spread:>18}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
