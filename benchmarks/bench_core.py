"""In-process throughput: GlobalBatchSource against a bare Zephon pipeline doing the same work, same run.

    python benchmarks/bench_core.py [--recipe recipes/mixture.toml] [--steps 40] [--rounds 3]

Both sides do the same Zephon work: the identical pipeline (same recipe, same build, ``zephon_ray.pipeline``) yields
the same ``steps x L x k`` microbatches, counted and checked equal on both sides. Each side is timed from building
its pipeline to its last step (so pipeline start and the first microbatch are on both clocks). The bare side only
touches each microbatch's token arrays; the GlobalBatchSource side also files microbatches by lane, stacks rows,
takes a Zephon checkpoint every ``checkpoint_every`` (8) steps for random access and computes the sha256 digest:
the ratio is what that costs. Rounds alternate the order (bare first, then GlobalBatchSource first, ...) so that
machine noise and warm caches favour neither side; the ratio is the median of the per-round ratios.

It also measures the cost of ``batch(s)`` for a step 1, 10 and 100 steps behind the current position. The head is
placed so that no probe lands on a checkpoint step or near step 0 (step 0 is served by a fresh pipeline, without a
restore): every probe pays one Zephon restore plus the few steps of replay that it prints next to its time.
Prints a table and one JSON line (prefixed ``RESULT``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bare_zephon(recipe, steps: int) -> tuple[float, int]:
    """(tokens/s, microbatches) for ``steps`` steps' microbatches straight from the Zephon pipeline."""
    from zephon_ray.pipeline import build_pipeline

    t0 = time.perf_counter()
    it = iter(build_pipeline(recipe))
    tokens = microbatches = 0
    for _ in range(steps * recipe.lanes * recipe.microbatches_per_lane):
        mb = next(it)
        microbatches += 1
        tokens += sum(int(rec.payload["input_ids"].shape[0]) - 1 for rec in mb.records)
    elapsed = time.perf_counter() - t0
    it.close()
    assert tokens == steps * recipe.tokens_per_step, (tokens, steps * recipe.tokens_per_step)
    return tokens / elapsed, microbatches


def global_batch_source(recipe, steps: int) -> tuple[float, int]:
    """(tokens/s, microbatches) for ``steps`` global batches, digests included."""
    from zephon_ray import GlobalBatchSource

    t0 = time.perf_counter()
    source = GlobalBatchSource(recipe)
    for s in range(steps):
        _ = source.batch(s).digest
    elapsed = time.perf_counter() - t0
    source.close()
    return steps * recipe.tokens_per_step / elapsed, steps * recipe.lanes * recipe.microbatches_per_lane


SIDES = {"bare": bare_zephon, "source": global_batch_source}


CHECKPOINT_EVERY = 8


def probe_head(behind: list[int], checkpoint_every: int = CHECKPOINT_EVERY) -> int:
    """A head step from which no probe ``head - b`` is a checkpoint step or within two checkpoints of step 0."""
    head = max(behind) + 2 * checkpoint_every + 1
    while any((head - b) % checkpoint_every == 0 for b in behind):
        head += 1
    return head


def random_access(recipe, behind: list[int], repeats: int = 3) -> dict[int, float]:
    from zephon_ray import GlobalBatchSource

    costs: dict[int, list[float]] = {b: [] for b in behind}
    with GlobalBatchSource(recipe, cache_steps=1, checkpoint_every=CHECKPOINT_EVERY) as source:
        head = probe_head(behind)
        source.batch(head)
        for _ in range(repeats):
            for b in behind:
                source.batch(head)  # back to the head before each probe
                t0 = time.perf_counter()
                source.batch(head - b)
                costs[b].append(time.perf_counter() - t0)
    return {b: statistics.median(v) for b, v in costs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "mixture.toml"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from zephon_ray import Recipe

    recipe = Recipe.from_toml(args.recipe)
    print(
        f"recipe {recipe.describe()}: {recipe.global_batch_rows} rows x {recipe.seq_len} = "
        f"{recipe.tokens_per_step} tokens/step, {args.steps} steps x {args.rounds} rounds"
    )
    for side in SIDES.values():
        side(recipe, 2)  # warm caches (catalog, tokenizer, page cache) for both sides
    rows = []
    for r in range(args.rounds):
        order = ["bare", "source"] if r % 2 == 0 else ["source", "bare"]
        got = {name: SIDES[name](recipe, args.steps) for name in order}
        assert got["bare"][1] == got["source"][1], f"the sides did different work: {got}"  # same microbatches
        b, g = got["bare"][0], got["source"][0]
        rows.append((b, g, g / b))
        print(
            f"round {r} ({' then '.join(order)}): bare zephon {b / 1e6:.3f} M tok/s   GlobalBatchSource "
            f"{g / 1e6:.3f} M tok/s   ratio {g / b:.3f}"
        )
    ratio = statistics.median(x[2] for x in rows)
    behind = random_access(recipe, [1, 10, 100])
    head = probe_head(list(behind))
    for b, cost in behind.items():
        print(
            f"batch(s) {b:>3} steps behind (step {head - b}, restore + {(head - b) % CHECKPOINT_EVERY} steps of "
            f"replay): {cost * 1e3:8.1f} ms"
        )
    print(f"median ratio GlobalBatchSource / bare Zephon: {ratio:.3f}")
    print(
        "RESULT "
        + json.dumps(
            {
                "recipe": str(args.recipe),
                "steps": args.steps,
                "rounds": args.rounds,
                "bare_tokens_per_s": [x[0] for x in rows],
                "source_tokens_per_s": [x[1] for x in rows],
                "median_ratio": ratio,
                "behind_ms": {str(b): c * 1e3 for b, c in behind.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
