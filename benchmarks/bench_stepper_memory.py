"""The in-process stepper's memory over a long run, with and without its pipeline restarts, side by side.

    python benchmarks/bench_stepper_memory.py [--steps 20000] [--every 1000] [--seq-len 8192] [--restart-every 0,auto]

Each variant is one ``LaneStepper`` owning all 8 lanes of ``recipes/tiny.toml`` at ``--seq-len`` tokens a row (what an
M = 1 producer and the in-process source run), in its own process; the variants run at once, so they share the
machine's load. ``--restart-every``: steps between the stepper's pipeline restarts (``0``: never; ``auto``: the
stepper's own default, ``zephon_ray.lanes.RESTART_TOKENS``). Every ``--every`` steps it prints each variant's RSS and
the microbatches Zephon holds (``SampleBatch`` objects alive: the buffers of lanes that ran ahead), then each
variant's RSS growth per step from ``--warmup`` to the end (docs/benchmarks.md, "Memory over a long run").
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def worker(a: argparse.Namespace) -> None:
    import logging

    import psutil
    from bench_soak import write_recipe

    from zephon_ray.lanes import LaneStepper
    from zephon_ray.recipe import Recipe

    # Zephon logs each packing tail it drops (about 20 a step at seq_len 8,192): harmless here, and it buries the rows
    logging.getLogger("zephon._internal.ops.pack_sequences").setLevel(logging.ERROR)
    # tiny.toml at this seq_len, its phase past the run's end (a phase boundary starts a fresh pipeline itself)
    recipe = Recipe.from_toml(write_recipe(Path(tempfile.mkdtemp()) / "r.toml", a.steps + 1, a.seq_len))
    stepper = LaneStepper(recipe)
    if a.restart_every != "auto":
        stepper.restart_every = int(a.restart_every) or 10**15
    proc, start = psutil.Process(), time.time()
    try:
        for step in range(1, a.steps + 1):
            stepper.next_step()
            if step % a.every == 0:
                gc.collect()
                held = sum(1 for o in gc.get_objects() if type(o).__name__ == "SampleBatch")
                row = {"step": step, "rss_mb": proc.memory_info().rss / 2**20, "held": held}
                print(json.dumps({**row, "restarts": stepper.restarts, "s": time.time() - start}), flush=True)
    finally:
        stepper.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--restart-every", default="0,auto", help="variants: steps between restarts (0: never, auto)")
    ap.add_argument("--warmup", type=int, default=None, help="first step of the growth baseline (default: steps/4)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    variants = a.restart_every.split(",")
    warmup = a.warmup if a.warmup is not None else a.steps // 4
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", f"--restart-every={v}", f"--steps={a.steps}", f"--every={a.every}"]
            + [f"--seq-len={a.seq_len}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for v in variants
    ]
    print(f"LaneStepper, 8 lanes of tiny.toml at seq_len {a.seq_len}; RSS MB / microbatches held, by restart_every")
    print(f"{'step':>7}  " + "  ".join(f"{'restart ' + v:>24}" for v in variants))
    rows: list[list[dict]] = [[] for _ in variants]
    for _ in range(a.steps // a.every):
        for i, proc in enumerate(procs):
            line = proc.stdout.readline() if proc.stdout else ""
            if not line:
                sys.exit(f"variant restart_every={variants[i]} ended early (rc {proc.wait()})")
            rows[i].append(json.loads(line))
        step = rows[0][-1]["step"]
        print(
            f"{step:>7}  "
            + "  ".join(f"{r[-1]['rss_mb']:>12.1f} / {r[-1]['held']:>4} ({r[-1]['restarts']:>3})" for r in rows)
        )
    for proc in procs:
        proc.wait()
    for v, r in zip(variants, rows):
        base = next(row for row in r if row["step"] >= warmup)
        last = r[-1]
        growth = (last["rss_mb"] - base["rss_mb"]) * 1024 / max(1, last["step"] - base["step"])
        print(
            f"restart_every {v}: RSS {base['rss_mb']:.1f} MB at step {base['step']} -> {last['rss_mb']:.1f} at "
            f"{last['step']}: {growth:.2f} KB/step; microbatches held at most {max(x['held'] for x in r)}; "
            f"{last['restarts']} restarts; {last['step'] / last['s']:.1f} steps/s"
        )


if __name__ == "__main__":
    main()
