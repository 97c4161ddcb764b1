"""Where a command's CPU goes, by kind of process: run it and sample every process's CPU time from /proc.

    python benchmarks/suite_cpu.py                       # the default suite, as `make test` runs it
    python benchmarks/suite_cpu.py -- pytest -q tests/test_metrics.py

Every process that starts while the command runs is sampled 4 times a second (``/proc/<pid>/stat``: utime +
stime); its last sample is its CPU. A Ray worker is named by its title (``ray::Producer``, ``ray::IDLE``, ...),
read again while it is still ``default_worker.py`` or ``ray::IDLE``: a task worker that went back to idle keeps the
name of the last task seen. Limits: a process that lives less than
a sample's interval is missed; Linux only. Used for docs/benchmarks.md, "The test suite".
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

KINDS = (
    "gcs_server",
    "raylet/raylet",
    "default_worker.py",
    "agent.py",
    "dashboard.py",
    "log_monitor.py",
    "monitor.py",
    "torch.distributed.run",
    "torchtitan.train",
    "ipykernel",
    "azurite",
    "fake-gcs",
    "multiprocessing",
    "zephon_ray.cli",
    "zephon-ray",
    "examples/",
    "execnet",
    "pytest",
)


def kind(cmd: str) -> str:
    if cmd.startswith("ray::"):
        return "ray::" + re.sub(r"[.:(].*", "", cmd.split()[0][len("ray::") :])
    if "import sys;exec(eval(sys.stdin" in cmd:  # a pytest-xdist worker
        return "pytest worker"
    return next((k for k in KINDS if k in cmd), cmd[:50])


def sample(seen: dict[str, list]) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            ticks, key = int(fields[11]) + int(fields[12]), f"{pid}:{fields[19]}"  # utime + stime; start time
            if key not in seen or seen[key][1].startswith("ray::IDLE") or "default_worker.py" in seen[key][1]:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
                if cmd.strip() or key not in seen:
                    seen[key] = [ticks, cmd.strip()]
            seen[key][0] = ticks
        except (OSError, IndexError, ValueError):
            continue  # gone between listdir and read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="*", help="the command (default: the default suite, -n 3 --dist loadgroup)")
    args = parser.parse_args()
    command = args.command or [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup"]
    before: dict[str, list] = {}
    sample(before)
    seen: dict[str, list] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen)
        time.sleep(0.25)
    wall = time.monotonic() - t0
    hz = os.sysconf("SC_CLK_TCK")
    cpu, count = collections.Counter(), collections.Counter()
    for key, (ticks, cmd) in seen.items():
        if key in before or not cmd:  # running before the command, or a kernel thread
            continue
        cpu[kind(cmd)] += ticks / hz
        count[kind(cmd)] += 1
    total = sum(cpu.values())
    print(
        f"rc {proc.returncode}, wall {wall:.0f} s, CPU {total:.0f} s in {sum(count.values())} processes "
        f"({total / wall:.2f} cores of {os.cpu_count()})"
    )
    for name, seconds in cpu.most_common(25):
        print(f"{seconds:8.1f} CPU-s {count[name]:5d} processes  {name}")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
