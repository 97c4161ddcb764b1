"""How a Ray actor's CPU reads three ways, over the same idle seconds: the process total (``/proc/PID/stat``, 10 ms
ticks scaled from the scheduler's run time), the sum of its threads' ``stat`` (each charged by sampling at the
tick) and the sum of its threads' ``schedstat`` (run time in ns). Why ``bench_service_load.py`` reads schedstat.

    python benchmarks/bench_cpu_accounting.py [--seconds 60]

Linux only. Used for docs/scaling.md ("Why per-thread ticks read low").
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench_service_load import cpu_seconds, thread_seconds


def _threads(pid: int, source: str) -> float:
    return sum(thread_seconds(pid, tid, source) for tid in os.listdir(f"/proc/{pid}/task"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    import ray

    temp_dir = tempfile.mkdtemp(prefix="zr-bench-acct-", dir="/tmp")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0.1)
        class Bare:
            def pid(self) -> int:
                return os.getpid()

        actor = Bare.remote()
        pid = ray.get(actor.pid.remote())
        time.sleep(3.0)  # start-up done
        readers = {
            "process total": lambda p: cpu_seconds([p]),
            "threads' stat ticks": lambda p: _threads(p, "stat"),
            "threads' schedstat": lambda p: _threads(p, "schedstat"),
        }
        before, t0 = {k: f(pid) for k, f in readers.items()}, time.perf_counter()
        time.sleep(args.seconds)
        after, wall = {k: f(pid) for k, f in readers.items()}, time.perf_counter() - t0
        print(
            f"an idle bare Ray actor over {wall:.0f} s, CPU-ms/s: "
            + "; ".join(f"{k} {(after[k] - before[k]) / wall * 1e3:.2f}" for k in readers),
            flush=True,
        )
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
