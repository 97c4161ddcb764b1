"""Where the in-process source's memory grows: ``GlobalBatchSource`` reading steps in order.

    python benchmarks/bench_source_memory.py [--first 1000] [--last 6000]
    python benchmarks/bench_source_memory.py --time-every 5000 --last 40000

Reads steps 0..FIRST-1 of ``recipes/tiny.toml`` untraced, then steps FIRST..LAST-1 under ``tracemalloc``, and prints
the checkpoints the source keeps (``GlobalBatchSource`` keeps one anchor per ``anchor_every`` steps for good, besides
its ring of recent ones), the untraced time per step, and the traced allocations that grew most, by file; then the
newest kept checkpoint's size, kept (compressed JSON) and as JSON, and the untraced time to pack and unpack it. The RSS
under tracing counts tracemalloc's own records, so the growth is read from the allocations (docs/benchmarks.md, "The
soak"). ``--time-every K`` instead reads steps 0..LAST-1 untraced and prints, for every K steps, the time per step
and the part of it spent in Python's garbage collector (a ``gc.callbacks`` timer), so that a cost per step that
grows with the run shows.
"""

import argparse
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zephon_ray import GlobalBatchSource, Recipe  # noqa: E402
from zephon_ray.source import packed_state, unpacked_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=1000, help="steps read before tracing starts")
    ap.add_argument("--last", type=int, default=6000, help="one past the last step read")
    ap.add_argument("--time-every", type=int, default=0, help="only time steps 0..LAST-1, a line per this many")
    a = ap.parse_args()
    source = GlobalBatchSource(Recipe.from_toml(ROOT / "recipes" / "tiny.toml"))
    if a.time_every > 0:
        time_steps(source, a.last, a.time_every)
        return
    t0 = time.perf_counter()
    for step in range(a.first):
        source.batch(step)
    untraced_ms = (time.perf_counter() - t0) * 1e3 / max(1, a.first)
    tracemalloc.start(1)
    before, kept_before = tracemalloc.take_snapshot(), len(source._checkpoints)
    for step in range(a.first, a.last):
        source.batch(step)
    after, kept_after = tracemalloc.take_snapshot(), len(source._checkpoints)
    tracemalloc.stop()
    grown = after.compare_to(before, "filename")
    total = sum(s.size_diff for s in grown)
    print(
        f"steps {a.first}..{a.last}: kept checkpoints {kept_before} -> {kept_after}; {untraced_ms:.1f} ms a step "
        f"untraced; traced allocations +{total / 2**20:.2f} MB ({total / 1024 / (a.last - a.first):.2f} KB a step)"
    )
    for stat in grown[:6]:
        print(f"  {stat.size_diff / 2**20:+.2f} MB {stat.count_diff:+d} blocks  {stat.traceback}")
    newest = source._checkpoints[max(source._checkpoints)]
    t0 = time.perf_counter()
    for _ in range(20):
        state = unpacked_state(newest)
    t1 = time.perf_counter()
    for _ in range(20):
        packed_state(state)
    t2 = time.perf_counter()
    print(
        f"one kept checkpoint: {len(newest)} bytes kept, {len(json.dumps(state))} as JSON; "
        f"{(t2 - t1) / 20 * 1e3:.2f} ms to pack, {(t1 - t0) / 20 * 1e3:.2f} ms to unpack"
    )
    source.close()


def time_steps(source: GlobalBatchSource, last: int, every: int) -> None:
    in_gc = [0.0, 0.0]  # seconds spent in collections so far; when the running one started

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            in_gc[1] = time.perf_counter()
        else:
            in_gc[0] += time.perf_counter() - in_gc[1]

    gc.callbacks.append(on_gc)
    t0, gc0 = time.perf_counter(), 0.0
    for step in range(last):
        source.batch(step)
        if (step + 1) % every == 0:
            t = time.perf_counter()
            print(
                f"steps {step + 1 - every}..{step + 1}: {(t - t0) * 1e3 / every:.2f} ms a step, "
                f"{(in_gc[0] - gc0) * 1e3 / every:.2f} ms of it collecting garbage",
                flush=True,
            )
            t0, gc0 = t, in_gc[0]
    gc.callbacks.remove(on_gc)
    source.close()


if __name__ == "__main__":
    main()
