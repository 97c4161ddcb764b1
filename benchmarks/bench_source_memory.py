"""Where the in-process source's memory grows: ``GlobalBatchSource`` reading steps in order.

    python benchmarks/bench_source_memory.py [--first 1000] [--last 6000]

Reads steps 0..FIRST-1 of ``recipes/tiny.toml`` untraced, then steps FIRST..LAST-1 under ``tracemalloc``, and prints
the checkpoints the source keeps (``GlobalBatchSource`` keeps one anchor per ``anchor_every`` steps for good, besides
its ring of recent ones), the untraced time per step, and the traced allocations that grew most, by file. One kept
checkpoint's size as JSON is printed for comparison. The RSS under tracing counts tracemalloc's own records, so the
growth is read from the allocations (docs/benchmarks.md, "The soak").
"""

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zephon_ray import GlobalBatchSource, Recipe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=1000, help="steps read before tracing starts")
    ap.add_argument("--last", type=int, default=6000, help="one past the last step read")
    a = ap.parse_args()
    source = GlobalBatchSource(Recipe.from_toml(ROOT / "recipes" / "tiny.toml"))
    t0 = time.perf_counter()
    for step in range(a.first):
        source.batch(step)
    untraced_ms = (time.perf_counter() - t0) * 1e3 / max(1, a.first)
    tracemalloc.start(1)
    before, kept_before = tracemalloc.take_snapshot(), len(source._checkpoints)
    for step in range(a.first, a.last):
        source.batch(step)
    after, kept_after = tracemalloc.take_snapshot(), len(source._checkpoints)
    grown = after.compare_to(before, "filename")
    total = sum(s.size_diff for s in grown)
    print(
        f"steps {a.first}..{a.last}: kept checkpoints {kept_before} -> {kept_after}; {untraced_ms:.1f} ms a step "
        f"untraced; traced allocations +{total / 2**20:.2f} MB ({total / 1024 / (a.last - a.first):.2f} KB a step)"
    )
    for stat in grown[:6]:
        print(f"  {stat.size_diff / 2**20:+.2f} MB {stat.count_diff:+d} blocks  {stat.traceback}")
    print(f"one kept checkpoint as JSON: {len(json.dumps(source._checkpoints[max(source._checkpoints)]))} bytes")
    source.close()


if __name__ == "__main__":
    main()
