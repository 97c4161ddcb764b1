"""What a producer's ``ray.put`` costs it: the stepper alone against the stepper and its puts, in one process.

    python benchmarks/bench_producer_put.py [--recipe recipes/mixture.toml] [--steps 300] [--rounds 2]

Each side steps a :class:`~zephon_ray.lanes.LaneStepper` over every lane (as a service producer with M = 1 does) for
``--steps`` steps after one warm-up step:
- ``stepper``: ``next_step()`` alone;
- ``stepper+put``: ``next_step()``, then :func:`~zephon_ray.service.server.producer.put_shards` (one object per lane and
  a container, owned by this process) on a private local Ray, as ``Producer.produce`` does.
Rounds alternate the order. Prints steps/s, this process's CPU per step and the wall time of the puts per step, and
the ratio of the two sides' rates (median of rounds). Why: on a 2-core machine Zephon's pipeline uses about 1.6
cores in-process, so a put's round trips to the object store wait for a core, and the service's end-to-end rate
with one producer (benchmarks/bench_service.py) cannot exceed the ``stepper+put`` rate. Figures:
docs/benchmarks.md, "The data service".
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


def run(recipe, steps: int, put: bool) -> dict[str, float]:
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
            if put:
                tp = time.perf_counter()
                put_shards(step, [shards[lane] for lane in stepper.lanes], held)
                put_s += time.perf_counter() - tp
        elapsed, cpu = time.perf_counter() - t0, process_cpu_s() - c0
    finally:
        stepper.close()
    return {"steps_per_s": steps / elapsed, "cpu_ms": cpu / steps * 1e3, "put_ms": put_s / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "mixture.toml"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import ray

    from zephon_ray import Recipe

    recipe = Recipe.from_toml(args.recipe)
    temp_dir = tempfile.mkdtemp(prefix="zr-bench-put-", dir="/tmp")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:
        ratios = []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {put: run(recipe, args.steps, put) for put in order}
            for put in (False, True):
                x = got[put]
                print(
                    f"round {r} {'stepper+put' if put else 'stepper':12s} {x['steps_per_s']:6.1f} steps/s  "
                    f"CPU {x['cpu_ms']:5.1f} ms a step  puts {x['put_ms']:5.2f} ms a step",
                    flush=True,
                )
            ratios.append(got[True]["steps_per_s"] / got[False]["steps_per_s"])
        print(
            f"stepper+put / stepper rate: {statistics.median(ratios):.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
        )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
