"""The ``zephon-ray`` command.

    zephon-ray digest RECIPE --steps A:B [--via local|service] [--producers M]
    zephon-ray show RECIPE --step S
    zephon-ray corpus OUT_DIR
    zephon-ray serve | status | stop      (the Ray data service)
    zephon-ray bench core|service|loader [ARGS]   (runs benchmarks/bench_<name>.py)

Errors in user input print one line ``zephon-ray: error: ...`` and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zephon_ray.recipe import Recipe


def parse_steps(text: str) -> range:
    """``A:B`` is steps A..B-1 (Python slice convention); a single ``S`` is just step S."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            steps = range(int(a), int(b))
        else:
            steps = range(int(text), int(text) + 1)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B (steps A..B-1) or a single step") from None
    if steps.start < 0 or len(steps) == 0:
        raise ValueError(f"--steps {text!r}: expected 0 <= A < B")
    return steps


def cmd_digest(args: argparse.Namespace) -> int:
    recipe = Recipe.from_toml(args.recipe)
    steps = parse_steps(args.steps)
    if args.via == "local":
        from zephon_ray.source import GlobalBatchSource

        with GlobalBatchSource(recipe) as source:
            for step in steps:
                print(f"step {step} {source.batch(step).digest}", flush=True)
        return 0
    from zephon_ray.service.cli import digest_via_service

    return digest_via_service(recipe, steps, args)


def cmd_show(args: argparse.Namespace) -> int:
    from zephon_ray.source import GlobalBatchSource
    from zephon_ray.tokenizers import build_tokenizer

    recipe = Recipe.from_toml(args.recipe)
    tokenizer = build_tokenizer(recipe.tokenizer)
    with GlobalBatchSource(recipe) as source:
        batch = source.batch(args.step)
    print(f"recipe      {recipe.describe()}")
    print(f"step        {batch.step}")
    print(f"digest      {batch.digest}")
    print(f"rows        {batch.num_rows} x {recipe.row_length} tokens "
          f"({recipe.lanes} lanes x {recipe.microbatches_per_lane} microbatches x {recipe.rows_per_microbatch} rows)")
    print(f"tokens      {batch.tokens.size}")
    shares = ", ".join(f"{name} {share:.1%}" for name, share in batch.source_share().items())
    print(f"sources     {shares}")
    for row in range(min(args.rows, batch.num_rows)):
        text = tokenizer.decode(batch.tokens[row][: args.chars * 2])[: args.chars]
        print(f"row {row:<4} lane {int(batch.lanes[row]):<3} {text!r}")
    return 0


def cmd_corpus(args: argparse.Namespace) -> int:
    from zephon_ray.corpus import write_corpus

    counts = write_corpus(args.out_dir, formats=tuple(args.formats.split(",")), limit=args.limit)
    print(f"wrote {args.out_dir}: " + ", ".join(f"{name} {n} records" for name, n in counts.items()))
    return 0


BENCHMARKS = ("core", "service", "loader")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run benchmarks/bench_<name>.py from the source checkout (benchmarks are not installed as a package)."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / f"bench_{args.name}.py"
    if not script.is_file():
        raise FileNotFoundError(f"benchmark script not found: {script} (benchmarks run from a source checkout)")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zephon-ray", description="Deterministic, step-keyed global batches for training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("digest", help="print 'step <s> <sha256>' for each step")
    p.add_argument("recipe")
    p.add_argument("--steps", required=True, help="A:B for steps A..B-1")
    p.add_argument("--via", choices=("local", "service"), default="local")
    p.add_argument("--producers", type=int, default=1, help="producer actors (service only)")
    p.add_argument("--name", default=None, help="use a running service by name instead of starting one")
    p.add_argument("--namespace", default="zephon-ray")
    p.add_argument("--address", default=None, help="Ray address; default starts a private local Ray")
    p.set_defaults(func=cmd_digest)

    p = sub.add_parser("show", help="summarise one global batch")
    p.add_argument("recipe")
    p.add_argument("--step", type=int, default=0)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--chars", type=int, default=72)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("corpus", help="write the stdlib prose/code corpus as JSONL and Parquet shards")
    p.add_argument("out_dir")
    p.add_argument("--formats", default="jsonl,parquet")
    p.add_argument("--limit", type=int, default=None, help="at most this many records per source")
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser("bench", help="run a benchmark from benchmarks/ (core, service, loader)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=cmd_bench)

    from zephon_ray.service.cli import add_service_commands

    add_service_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TimeoutError) as exc:
        parser.exit(2, f"zephon-ray: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
