"""What a producer's ``ray.put`` costs it: the stepper alone against the stepper and its puts, in one process.

    python benchmarks/bench_producer_put.py [--recipe recipes/mixture.toml] [--steps 300] [--rounds 3]

Each side steps a :class:`~zephon_ray.lanes.LaneStepper` over every lane (as a service producer with M = 1 does) for
``--steps`` steps after one warm-up step:
- ``stepper``: ``next_step()`` alone;
- ``packed``: ``next_step()``, then :func:`~zephon_ray.service.server.producer.put_shards` (the lanes in packs of at
  most ``ServiceConfig.pack_bytes``, and a container, owned by this process) on a private local Ray, as ``Producer.produce`` does;
- ``per-lane``: the same with one object per lane (``pack_bytes=0``).
Rounds rotate the order. Prints steps/s, this process's CPU per step and the wall time of the puts per step, and
each put side's rate over the stepper's (median of rounds). Why: on a 2-core machine Zephon's pipeline uses about
1.6 cores in-process, so a put's round trips to the object store wait for a core, and the service's end-to-end rate
with one producer (benchmarks/bench_service.py) cannot exceed the ``packed`` rate. Figures: docs/benchmarks.md,
"The service".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def process_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def run(recipe, steps: int, pack_bytes: int | None) -> dict[str, float]:
    from zephon_ray.lanes import LaneStepper
    from zephon_ray.service.server.producer import OwnedRefs, put_shards

    stepper = LaneStepper(recipe)
    stepper.keep_positions = True  # as Producer does
    held = OwnedRefs(16)
    try:
        stepper.next_step()
        put_s = 0.0
        c0, t0 = process_cpu_s(), time.perf_counter()
        for step in range(1, steps + 1):
            shards = stepper.next_step()
            if pack_bytes is not None:
                tp = time.perf_counter()
                put_shards(step, [shards[lane] for lane in stepper.lanes], pack_bytes, held)
                put_s += time.perf_counter() - tp
        elapsed, cpu = time.perf_counter() - t0, process_cpu_s() - c0
    finally:
        stepper.close()
    return {"steps_per_s": steps / elapsed, "cpu_ms": cpu / steps * 1e3, "put_ms": put_s / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "mixture.toml"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import ray

    from zephon_ray import Recipe

    recipe = Recipe.from_toml(args.recipe)
    temp_dir = tempfile.mkdtemp(prefix="zr-bench-put-", dir="/tmp")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        from zephon_ray.service.config import ServiceConfig

        sides = {
            "stepper": None,
            "packed": ServiceConfig().pack_bytes,
            "per-lane": 0,
        }  # each side's pack_bytes (None: no puts)
        ratios: dict[str, list[float]] = {"packed": [], "per-lane": []}
        names = list(sides)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            got = {name: run(recipe, args.steps, sides[name]) for name in order}
            for name in names:
                x = got[name]
                print(
                    f"round {r} {name:8s} {x['steps_per_s']:6.1f} steps/s  "
                    f"CPU {x['cpu_ms']:5.1f} ms a step  puts {x['put_ms']:5.2f} ms a step",
                    flush=True,
                )
            for name in ratios:
                ratios[name].append(got[name]["steps_per_s"] / got["stepper"]["steps_per_s"])
        for name, values in ratios.items():
            print(
                f"{name} / stepper rate: {statistics.median(values):.2f} (rounds: {', '.join(f'{x:.2f}' for x in values)})"
            )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
