"""The price of a mixture-phase boundary, in-process: step times around a boundary against steps within a phase.

    python benchmarks/bench_phases.py [--recipe recipes/mixture.toml] [--at 20] [--steps 40] [--rounds 3]
    python benchmarks/bench_phases.py --service [--recipe recipes/tiny.toml] [--producers 2] [--rounds 3]

``--service``: the time for a running data service (a private local Ray) to apply a new phase
(``DataService.add_phase``). A consumer reads steps with the direct read path while the producers run ahead
(``window`` steps); then a phase is added two steps past the last one read, alternating the sources' weights, and
the consumer reads on. Reported per round, medians over rounds: the ``add_phase`` call (durable in ``state_dir``
when it returns), the coordinator's part of it, the steps and checkpoints it dropped, and the wait for the first
step of the new phase (the replacement producer group's start plus the boundary) against a read within a phase.

The recipe gets one phase at step ``--at`` (its first source's weight and the others' swapped, so the mixture really
changes), and a LaneStepper produces steps 0..steps-1 of it, timing each ``next_step()`` and assembling the global
batch (digest included). Reported: the median step time within the phases (excluding step 0 and the boundary step),
the boundary step's time, and what the boundary step spends finding the chunk where the new segment starts and the
stream's state there (``_enter_segment``, before the new pipeline's first microbatch). Medians over rounds. Then that
search alone after phases of ``--phase-chunks`` global chunks (:func:`boundary_cost`): as the stepper does it (its
chunk stream follows the rows), against a walk of Zephon's global chunk stream from the phase's start.
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
            _ = assemble(recipe, step, stepper.next_step()).digest
            times.append(time.perf_counter() - t0)
    finally:
        stepper.close()
    within = [t for s, t in enumerate(times) if s not in (0, at)]
    return {
        "within_ms": 1e3 * statistics.median(within),
        "boundary_ms": 1e3 * times[at],
        "enter_ms": 1e3 * spent["enter"],
        "first_step_ms": 1e3 * times[0],
    }


def boundary_cost(recipe, chunks: int) -> dict[str, float]:
    """What a boundary pays to find where the next phase starts, after a phase of ``chunks`` global chunks: every
    lane's last row drew from its last chunk of the phase. ``followed_ms``: as the stepper does it (its stream has
    followed the rows to within STREAM_LAG chunks during the phase; the boundary routes the lanes' positions and
    walks the rest); ``from_start_ms``: walking the stream from the phase's start, as a stepper without that would."""
    from zephon_ray.lanes import STREAM_LAG
    from zephon_ray.pipeline import build_work_source
    from zephon_ray.zephon_io import ChunkStream

    lanes = recipe.lanes
    positions = {lane: chunks // lanes - 1 for lane in range(lanes)}

    def boundary(stream: ChunkStream) -> float:
        t0 = time.perf_counter()
        stream.advance(max(stream.global_index(0, positions).values()) + 1)
        stream.state()
        return 1e3 * (time.perf_counter() - t0)

    followed = ChunkStream(build_work_source(recipe), lanes)
    t0 = time.perf_counter()
    followed.advance(max(0, chunks - STREAM_LAG + 1))  # paid during the phase, a few chunks per step
    follow_us = 1e6 * (time.perf_counter() - t0) / max(1, chunks - STREAM_LAG + 1)
    return {
        "chunks": chunks,
        "followed_ms": round(boundary(followed), 2),
        "from_start_ms": round(boundary(ChunkStream(build_work_source(recipe), lanes)), 2),
        "follow_us_per_chunk": round(follow_us, 1),
    }


def service_side(recipe_path: str, producers: int, rounds: int) -> None:
    import tempfile

    import ray

    from zephon_ray import DataService, Recipe

    recipe = Recipe.from_toml(recipe_path)
    names = recipe.source_names
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="zr-bench-phases-", dir="/tmp"),
    )
    state_dir = tempfile.mkdtemp(prefix="zr-bench-phases-state-")
    extra = dict(run_id="bench-phases", aggregate_store="torch://") if producers > 1 else {}
    svc = DataService.start(
        recipe,
        name="bench-phases",
        namespace="bench-phases",
        producers=producers,
        window=8,
        state_dir=state_dir,
        checkpoint_every=4,
        read_path="direct",
        **extra,
    )
    trainer = DataService.connect("bench-phases", namespace="bench-phases", consumer="trainer", read_path="direct")
    rows, step, within = [], 0, []
    try:
        for r in range(rounds):
            for _ in range(6):  # read within the current phase, then let the producers fill the window
                t0 = time.perf_counter()
                trainer.batch(step, track=True)
                within.append(time.perf_counter() - t0)
                step += 1
            deadline = time.monotonic() + 60
            while max(svc.status()["window"]["held_steps"], default=0) < step + 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            at = step + 2
            weights = {n: (1.0 if (i + r) % len(names) == 0 else 0.25) for i, n in enumerate(names)}
            t0 = time.perf_counter()
            result = svc.add_phase(f"bench{r}", at, weights)
            call_s = time.perf_counter() - t0
            for s in range(step, at):
                trainer.batch(s, track=True)
            t1 = time.perf_counter()
            trainer.batch(at, track=True)
            first_s = time.perf_counter() - t1
            rows.append(
                {
                    "round": r,
                    "at": at,
                    "call_s": call_s,
                    "coordinator_s": result["applied_s"],
                    "dropped_steps": len(result["dropped_steps"]),
                    "dropped_checkpoints": len(result["dropped_checkpoints"]),
                    "restart_from": result["restart_from"],
                    "first_step_s": first_s,
                    "apply_to_first_step_s": time.perf_counter() - t0,
                }
            )
            step = at + 1
    finally:
        svc.stop()
        ray.shutdown()
    print(
        f"{'round':>5}{'at':>5}{'call s':>9}{'coord s':>9}{'dropped':>9}{'ckpts':>7}{'from':>6}{'1st step s':>12}"
        f"{'total s':>9}"
    )
    for row in rows:
        print(
            f"{row['round']:>5}{row['at']:>5}{row['call_s']:>9.3f}{row['coordinator_s']:>9.3f}"
            f"{row['dropped_steps']:>9}{row['dropped_checkpoints']:>7}{row['restart_from']:>6}"
            f"{row['first_step_s']:>12.3f}{row['apply_to_first_step_s']:>9.3f}"
        )
    result = {
        key: round(statistics.median(r[key] for r in rows), 4)
        for key in ("call_s", "coordinator_s", "first_step_s", "apply_to_first_step_s")
    }
    result.update(
        within_read_ms=round(1e3 * statistics.median(within[1:]), 2),
        producers=producers,
        rounds=rounds,
        recipe=Path(recipe_path).name,
    )
    print(f"a read within a phase: {result['within_read_ms']} ms (median)")
    print("RESULT " + json.dumps(result, sort_keys=True))


def main() -> None:
    from zephon_ray import Recipe
    from zephon_ray.recipe import Phase

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe", default=None, help="default: recipes/mixture.toml (recipes/tiny.toml with --service)"
    )
    parser.add_argument("--at", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--phase-chunks",
        default="1000,100000,1000000",
        help="phase lengths (global chunks) at which to price a boundary's search",
    )
    parser.add_argument("--service", action="store_true", help="time add_phase on a running data service")
    parser.add_argument("--producers", type=int, default=2)
    args = parser.parse_args()
    if args.service:
        service_side(args.recipe or str(ROOT / "recipes" / "tiny.toml"), args.producers, args.rounds)
        return
    args.recipe = args.recipe or str(ROOT / "recipes" / "mixture.toml")
    base = Recipe.from_toml(args.recipe)
    weights = tuple(reversed([s.weight for s in base.sources]))
    recipe = dataclasses.replace(base, phases=(Phase("switch", args.at, weights),))
    rounds = [one_round(recipe, args.steps, args.at) for _ in range(args.rounds)]
    result = {key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]}
    result.update(boundaries=[boundary_cost(recipe, int(n)) for n in args.phase_chunks.split(",")])
    result.update(
        recipe=Path(args.recipe).name,
        at=args.at,
        steps=args.steps,
        rounds=args.rounds,
        ratio=round(result["boundary_ms"] / result["within_ms"], 1),
    )
    print(f"{'recipe':<16}{'within ms':>12}{'boundary ms':>14}{'switch ms':>12}{'first step ms':>16}{'ratio':>8}")
    print(
        f"{result['recipe']:<16}{result['within_ms']:>12}{result['boundary_ms']:>14}{result['enter_ms']:>12}"
        f"{result['first_step_ms']:>16}{result['ratio']:>8}"
    )
    print(f"{'phase chunks':>14}{'boundary ms':>13}{'without following ms':>22}{'following us/chunk':>20}")
    for row in result["boundaries"]:
        print(f"{row['chunks']:>14,}{row['followed_ms']:>13}{row['from_start_ms']:>22}{row['follow_us_per_chunk']:>20}")
    print("RESULT " + json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
