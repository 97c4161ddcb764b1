"""Ray alone (no zephon-ray): the machine's CPU to start one actor, with and without a job ``runtime_env``.

    python benchmarks/ray_actor_start_cost.py [--actors 18] [--rounds 2]

Starts a private local Ray twice, once plain and once with ``runtime_env={"env_vars": {"PYTHONPATH": ...}}`` (a
common way to give workers a checkout's modules), then starts, pings and kills ``--actors`` trivial actors (6 at a
time) and prints the CPU the whole machine spent per actor (``/proc/stat``: every process, Ray's daemons included), after
subtracting the machine's idle CPU over the same time (measured first, with the cluster up and no actor). Rounds
alternate the two modes, so that drift in the machine's load hits both. Linux only; run it on an otherwise idle
machine.

Why it matters: a job with a ``runtime_env`` has every worker process set up by Ray's ``setup_worker.py`` and its
runtime-env agent before ``default_worker.py`` starts, so each actor costs more CPU and starts later. The test
suite starts a few hundred actors (``benchmarks/suite_cpu.py``), so its session Rays pass PYTHONPATH through the
raylet's environment instead (tests/conftest.py). Measured figures: docs/benchmarks.md, "The test suite".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent (user, nice, system, irq, softirq) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def cost_per_actor(actors: int, runtime_env: dict | None) -> float:
    import ray

    temp_dir = tempfile.mkdtemp(prefix="zr-cost-", dir="/tmp")
    kwargs = {"runtime_env": runtime_env} if runtime_env else {}
    ray.init(address="local", num_cpus=8, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False, **kwargs)
    try:

        @ray.remote(num_cpus=0.1)
        class Trivial:
            def pid(self) -> int:
                return os.getpid()

        ray.get(Trivial.remote().pid.remote(), timeout=120)  # the job's first worker: not counted
        time.sleep(2)
        c0, t0 = machine_cpu_s(), time.monotonic()
        time.sleep(5)
        idle_per_s = (machine_cpu_s() - c0) / (time.monotonic() - t0)
        c0, t0 = machine_cpu_s(), time.monotonic()
        for start in range(0, actors, 6):
            group = [Trivial.remote() for _ in range(min(6, actors - start))]
            ray.get([a.pid.remote() for a in group], timeout=120)
            for actor in group:
                ray.kill(actor)
        time.sleep(2)  # the killed workers' exit
        spent = machine_cpu_s() - c0 - idle_per_s * (time.monotonic() - t0)
        return spent / actors
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    env = {"env_vars": {"PYTHONPATH": os.getcwd()}}
    results: dict[str, list[float]] = {"plain": [], "runtime_env": []}
    for _ in range(args.rounds):
        results["plain"].append(cost_per_actor(args.actors, None))
        results["runtime_env"].append(cost_per_actor(args.actors, env))
    for mode, values in results.items():
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"{mode:12s} {statistics.median(values):.2f} CPU-s per actor  (rounds: {rounds})")
    ratio = statistics.median(results["runtime_env"]) / statistics.median(results["plain"])
    print(f"runtime_env / plain: {ratio:.2f}x")


if __name__ == "__main__":
    main()
