"""What a process's native heap kept, from jemalloc's heap-profile dumps: live bytes by allocation stack over time.

    # 1. a soak with Ray's own jemalloc in every process, profiling on (a dump per 2 GiB a process allocates)
    LD_PRELOAD=$VENV/lib/python3.11/site-packages/ray/core/libjemalloc.so RAY_LD_PRELOAD_ON_WORKERS=1 \
    MALLOC_CONF=prof:true,lg_prof_sample:15,lg_prof_interval:31,prof_prefix:/tmp/heap/p \
        python benchmarks/bench_soak.py --steps 16000 --every 2000 --warmup 2000 --worlds 2 ...
    # 2. one process's dumps (its pid is in the soak's RESULT line, e.g. producer0_pid)
    python benchmarks/heap_dumps.py /tmp/heap/p PID [--skip 3] [--top 8]

Prints the sampled live bytes of each dump (jemalloc's ``heap_v2`` format, unbiased as jeprof does), then the stacks
whose live bytes grew most from the ``--skip``-th dump to the last, each as its three innermost frames (symbolised
with ``addr2line`` from the dump's own map of libraries) and its live KB in ten dumps spread over the run. Limits:
a sample stands for ``2**lg_prof_sample`` bytes on average, so a total is good to about the square root of
(total x sample) (about 2 MB on a 135 MB heap at 32 KiB); pymalloc's arenas come from ``mmap``, not malloc, and are
not in the dumps; the profiler's own records make the process's RSS grow faster than unprofiled.
"""

import argparse
import collections
import glob
import math
import re
import subprocess
from pathlib import Path

SKIP = ("je_", "prof_", "imalloc", "malloc", "_PyObject_Malloc", "PyDataMem", "PyMem", "_PyMem", "default_malloc")


def parse(path: str) -> tuple[dict[tuple[int, ...], float], list[tuple[int, int, int, str]]]:
    """(live bytes by stack, executable mappings) of one dump."""
    lines = Path(path).read_text().splitlines()
    period = int(re.match(r"heap_v2/(\d+)", lines[0]).group(1))
    stacks: dict[tuple[int, ...], float] = {}
    maps, stack, in_maps = [], None, False
    for line in lines[1:]:
        if line.startswith("MAPPED_LIBRARIES"):
            in_maps = True
        elif in_maps:
            parts = line.split()
            if len(parts) >= 6 and "x" in parts[1]:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                maps.append((start, end, int(parts[2], 16), parts[5]))
        elif line.startswith("@"):
            stack = tuple(int(x, 16) for x in line[1:].split())
        elif stack is not None and (m := re.match(r"\s+t\*: (\d+): (\d+) \[", line)):
            objects, nbytes = int(m.group(1)), int(m.group(2))
            if objects:  # jemalloc samples by bytes: scale each stack's bytes back up, as jeprof does
                nbytes /= 1 - math.exp(-nbytes / objects / period)
            stacks[stack] = stacks.get(stack, 0.0) + nbytes
            stack = None
    return stacks, maps


def symbols(addresses: set[int], maps: list[tuple[int, int, int, str]]) -> dict[int, str]:
    by_file = collections.defaultdict(list)
    for address in addresses:
        for start, end, offset, path in maps:
            if start <= address < end:
                by_file[path].append((address, address - start + offset - 1))  # a return address: the call is before
                break
    names = {}
    for path, items in by_file.items():
        for i in range(0, len(items), 2000):
            chunk = items[i : i + 2000]
            out = subprocess.run(
                ["addr2line", "-f", "-C", "-e", path, *(hex(off) for _, off in chunk)], capture_output=True, text=True
            ).stdout.splitlines()
            names.update((address, name) for (address, _), name in zip(chunk, out[0::2]))
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefix", help="jemalloc's prof_prefix")
    ap.add_argument("pid", type=int)
    ap.add_argument("--skip", type=int, default=3, help="dumps of the warm-up, left out")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    files = sorted(glob.glob(f"{a.prefix}.{a.pid}.*.heap"), key=lambda f: int(f.split(".")[-2].lstrip("i")))
    files = files[a.skip :]
    if len(files) < 2:
        raise SystemExit(f"fewer than 2 dumps of pid {a.pid} at {a.prefix} after the first {a.skip}")
    dumps = [parse(f) for f in files]
    maps = dumps[-1][1]
    names = symbols({x for stacks, _ in dumps for stack in stacks for x in stack[:12]}, maps)

    def label(stack: tuple[int, ...]) -> str:
        frames = [names.get(x, "?") for x in stack[:12]]
        return " < ".join(f[:48] for f in frames if f != "?" and not f.startswith(SKIP))[:200] or "?"

    by_label = []
    for stacks, _ in dumps:
        totals: collections.Counter[str] = collections.Counter()
        for stack, nbytes in stacks.items():
            totals[label(stack)] += nbytes
        by_label.append(totals)
    spread = sorted({round(i * (len(dumps) - 1) / 9) for i in range(10)})
    print(f"{len(files)} dumps of pid {a.pid}; live MB:", [round(sum(t.values()) / 1e6, 2) for t in by_label])
    first, last = by_label[0], by_label[-1]
    grown = sorted(set(first) | set(last), key=lambda k: first.get(k, 0) - last.get(k, 0))[: a.top]
    for key in grown:
        print(f"{(last.get(key, 0) - first.get(key, 0)) / 1e3:+9.0f} KB  {key}")
        print(" " * 13, "KB:", [round(by_label[i].get(key, 0) / 1e3) for i in spread])


if __name__ == "__main__":
    main()
