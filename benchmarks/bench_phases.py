"""The price of a mixture-phase boundary, in-process: step times around a boundary against steps within a phase.

    python benchmarks/bench_phases.py [--recipe recipes/mixture.toml] [--at 20] [--steps 40] [--rounds 3]

The recipe gets one phase at step ``--at`` (its first source's weight and the others' swapped, so the mixture really
changes), and a LaneStepper produces steps 0..steps-1 of it, timing each ``next_step()`` and assembling the global
batch (digest included). Reported: the median step time within the phases (excluding step 0 and the boundary step),
the boundary step's time, and what the boundary step spends finding the chunk where the new segment starts and the
stream's state there (``_enter_segment``, before the new pipeline's first microbatch). Medians over rounds. It also
measures the part of that switch which grows with the phase's length: walking Zephon's global chunk stream from the
previous boundary (``zephon_io.work_source_state_at``) and its chunk routing (``zephon_io.global_chunk_index``), per
global chunk, over ``--walk`` chunks.
Prints a table and one JSON line (prefixed ``RESULT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_round(recipe, steps: int, at: int) -> dict[str, float]:
    from zephon_ray.lanes import LaneStepper
    from zephon_ray.source import assemble

    stepper = LaneStepper(recipe)
    enter = stepper._enter_segment
    spent = {}

    def timed_enter(index: int) -> None:
        t0 = time.perf_counter()
        enter(index)
        spent["enter"] = time.perf_counter() - t0

    stepper._enter_segment = timed_enter  # measure the switch itself, same code path
    times = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            assemble(recipe, step, stepper.next_step()).digest
            times.append(time.perf_counter() - t0)
    finally:
        stepper.close()
    within = [t for s, t in enumerate(times) if s not in (0, at)]
    return {"within_ms": 1e3 * statistics.median(within), "boundary_ms": 1e3 * times[at],
            "enter_ms": 1e3 * spent["enter"], "first_step_ms": 1e3 * times[0]}


def walk(recipe, chunks: int) -> float:
    """Microseconds per global chunk to reach the stream's state ``chunks`` chunks on and to route as many."""
    from zephon_ray.pipeline import build_work_source
    from zephon_ray.zephon_io import global_chunk_index, work_source_state_at

    work = build_work_source(recipe)
    t0 = time.perf_counter()
    work_source_state_at(work, recipe.lanes, chunks)
    global_chunk_index(work, recipe.lanes, 0, {lane: chunks // recipe.lanes - 2 for lane in range(recipe.lanes)})
    return 1e6 * (time.perf_counter() - t0) / chunks


def main() -> None:
    from zephon_ray import Recipe
    from zephon_ray.recipe import Phase

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "mixture.toml"))
    parser.add_argument("--at", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--walk", type=int, default=20000)
    args = parser.parse_args()
    base = Recipe.from_toml(args.recipe)
    weights = tuple(reversed([s.weight for s in base.sources]))
    recipe = dataclasses.replace(base, phases=(Phase("switch", args.at, weights),))
    rounds = [one_round(recipe, args.steps, args.at) for _ in range(args.rounds)]
    result = {key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]}
    result.update(walk_us_per_chunk=round(walk(recipe, args.walk), 1))
    result.update(recipe=Path(args.recipe).name, at=args.at, steps=args.steps, rounds=args.rounds,
                  ratio=round(result["boundary_ms"] / result["within_ms"], 1))
    print(f"{'recipe':<16}{'within ms':>12}{'boundary ms':>14}{'switch ms':>12}{'first step ms':>16}{'ratio':>8}")
    print(f"{result['recipe']:<16}{result['within_ms']:>12}{result['boundary_ms']:>14}{result['enter_ms']:>12}"
          f"{result['first_step_ms']:>16}{result['ratio']:>8}")
    print(f"walking the global chunk stream: {result['walk_us_per_chunk']} us per chunk ({args.walk} chunks)")
    print("RESULT " + json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
