"""Pre-tokenisation: the Ray Data job's tokens/s with 1 and 2 actors, and what it buys the producers.

    python benchmarks/bench_pretokenize.py [--records 2000] [--tokens 1000000] [--rounds 3]

1. ``pretokenize`` of a BPE recipe (recipes/tokenizer, the stdlib prose/code corpus written to a temp dir) with 1
   and 2 tokenizer actors on a private local Ray: the same job into a fresh OUT_DIR each time, the two sides
   alternating which goes first in each of ``--rounds`` rounds (medians; the 2-vs-1 figure is the median of
   per-round ratios). Tokens/s is output tokens over wall time, actor start-up included; ``shard_tokens_per_s``
   excludes the pool start (first to last finished shard).
2. Producer throughput: a ``LaneStepper`` (what a service producer runs) over the raw BPE recipe and over its
   pre-tokenised copy, about ``--tokens`` tokens each, alternating A/B for ``--rounds`` rounds in one process; the
   ratio is the median of per-round ratios (target >= 3x). The digests of the two are checked equal on the way.
   Two geometries, because Zephon's engine costs about 2 ms per microbatch whatever its size: ``small`` (seq_len
   512, 4 rows per microbatch: 2 K tokens each, the pre-tokenised side is bound by that cost) and ``train``
   (seq_len 2048, 8 rows: 16 K tokens each, a training-sized microbatch, where tokenisation is what remains).
3. Projections: bytes on disk per million tokens (token shards, zstd Parquet, int32 ids), and the hours one
   tokenizer actor takes to pre-tokenise 1 B tokens at its steady rate (``shard_tokens_per_s``). The actor asks
   for 0.5 CPU, but HF ``tokenizers``' ``encode_batch`` runs on every core it finds: on this 2-core machine that
   is "one actor on 2 cores", not one core.

Prints a table and one JSON line (prefixed ``RESULT``). Timings on a shared machine are noisy: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "recipes" / "tokenizer" / "tokenizer.json"


GEOMETRIES = {"small": (512, 4), "train": (2048, 8)}
"""name: (seq_len, rows_per_microbatch)"""


def write_recipe(path: Path, corpus: Path, seq_len: int, rows_per_microbatch: int) -> Path:
    path.write_text(f"""seed = 7
lanes = 8
microbatches_per_lane = 2
rows_per_microbatch = {rows_per_microbatch}
seq_len = {seq_len}
chunk_size = 64
tokenizer = "{TOKENIZER}"
packing = "wrap"

[[sources]]
name = "prose"
path = "{corpus}/jsonl/prose"
weight = 0.7

[[sources]]
name = "code"
path = "{corpus}/jsonl/code"
weight = 0.3
""")
    return path


def stepper_tokens_per_s(recipe, steps: int) -> tuple[float, list[str]]:
    from zephon_ray.lanes import LaneStepper
    from zephon_ray.source import assemble

    stepper = LaneStepper(recipe)
    assemble(recipe, 0, stepper.next_step())  # first batch: pipeline start-up, not throughput
    digests = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        digests.append(assemble(recipe, step, stepper.next_step()).digest)
    elapsed = time.perf_counter() - t0
    stepper.close()
    return steps * recipe.tokens_per_step / elapsed, digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000, help="records per source in the corpus")
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens per producer measurement")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import ray

    from zephon_ray.corpus import write_corpus
    from zephon_ray.jobs.pretokenize import pretokenize
    from zephon_ray.recipe import Recipe

    work = Path(tempfile.mkdtemp(prefix="bench-pretok-"))
    ray_tmp = tempfile.mkdtemp(prefix="bench-pretok-ray-", dir="/tmp")
    try:
        write_corpus(work / "corpus", formats=("jsonl",), limit=args.records, records_per_shard=250)
        raw = {
            name: Recipe.from_toml(write_recipe(work / f"raw-{name}.toml", work / "corpus", seq_len, rows))
            for name, (seq_len, rows) in GEOMETRIES.items()
        }
        ray.init(
            address="local",
            num_cpus=max(2, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            _temp_dir=ray_tmp,
        )
        # The same job (all shards of the same recipe into a fresh OUT_DIR) with 1 and 2 actors, alternating which
        # goes first in each of --rounds rounds; medians per side and the median of per-round ratios.
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for r in range(args.rounds):
            for actors in (1, 2) if r % 2 == 0 else (2, 1):
                out = work / (f"tokens-{actors}" if r == 0 else f"tokens-{actors}-r{r}")
                t0 = time.perf_counter()
                result = pretokenize(raw["small"], out, actors=actors, progress=False)
                run = {
                    "wall_s": time.perf_counter() - t0,
                    "tokens": result.tokens,
                    "bytes": result.bytes,
                    "shards": result.shards,
                }
                run["tokens_per_s"] = result.tokens / run["wall_s"]
                shard_times = sorted(p.stat().st_mtime for p in (out / "_progress").rglob("*.json"))
                span = shard_times[-1] - shard_times[0]
                run["shard_tokens_per_s"] = (
                    result.tokens * (len(shard_times) - 1) / len(shard_times) / span if span > 0 else None
                )
                runs[actors].append(run)
        jobs = {}
        for actors, values in runs.items():
            shard_rates = [v["shard_tokens_per_s"] for v in values if v["shard_tokens_per_s"]]
            jobs[actors] = {
                **values[0],
                "wall_s": statistics.median(v["wall_s"] for v in values),
                "tokens_per_s": statistics.median(v["tokens_per_s"] for v in values),
                "shard_tokens_per_s": statistics.median(shard_rates) if shard_rates else None,
            }
        scaling_ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(runs[1], runs[2])]
        # The same token shards again, with the recipe.toml of the training geometry.
        tokens = {
            "small": Recipe.from_toml(work / "tokens-1" / "recipe.toml"),
            "train": Recipe.from_toml(
                pretokenize(raw["train"], work / "tokens-train", actors=2, progress=False).recipe_path
            ),
        }
        ray.shutdown()
        same_files = all(
            (work / "tokens-1" / p.relative_to(work / "tokens-2")).read_bytes() == p.read_bytes()
            for p in (work / "tokens-2" / "sources").rglob("*.parquet")
        )

        producers = {}
        for name, (seq_len, rows) in GEOMETRIES.items():
            raw_g, tokens_g = raw[name], tokens[name]
            steps = max(3, args.tokens // raw_g.tokens_per_step)
            raw_rates, tok_rates, ratios = [], [], []
            for _ in range(args.rounds):
                r_raw, d_raw = stepper_tokens_per_s(raw_g, steps)
                r_tok, d_tok = stepper_tokens_per_s(tokens_g, steps)
                if d_raw != d_tok:
                    raise SystemExit(f"{name}: digests differ between the raw and the pre-tokenised recipe")
                raw_rates.append(r_raw)
                tok_rates.append(r_tok)
                ratios.append(r_tok / r_raw)
            producers[name] = {
                "steps": steps,
                "seq_len": seq_len,
                "rows_per_microbatch": rows,
                "raw_bpe_tokens_per_s": statistics.median(raw_rates),
                "pretokenized_tokens_per_s": statistics.median(tok_rates),
                "speedup": statistics.median(ratios),
                "round_ratios": ratios,
            }

        one = jobs[1]
        result = {
            "pretokenize_tokens_per_s_1_actor": one["tokens_per_s"],
            "pretokenize_tokens_per_s_2_actors": jobs[2]["tokens_per_s"],
            "pretokenize_scaling_2_vs_1": statistics.median(scaling_ratios),
            "pretokenize_scaling_round_ratios": scaling_ratios,
            "pretokenize_shard_tokens_per_s_1_actor": one["shard_tokens_per_s"],
            "pretokenize_shard_tokens_per_s_2_actors": jobs[2]["shard_tokens_per_s"],
            "tokens": one["tokens"],
            "shards": one["shards"],
            "same_files_1_vs_2_actors": same_files,
            "producers": producers,
            "bytes_per_million_tokens": one["bytes"] / one["tokens"] * 1e6,
            # the steady per-shard rate of one actor (pool start-up is a fixed cost, not a per-token one)
            "hours_one_actor_per_billion_tokens": 1e9 / (one["shard_tokens_per_s"] or one["tokens_per_s"]) / 3600,
            "cpus": os.cpu_count(),
            "rounds": args.rounds,
        }
        print(
            f"pretokenize, 1 actor      {one['tokens_per_s'] / 1e6:8.3f} M tokens/s  ({one['wall_s']:.1f} s wall, "
            f"{one['tokens']} tokens, {one['shards']} shards)"
        )
        print(
            f"pretokenize, 2 actors     {jobs[2]['tokens_per_s'] / 1e6:8.3f} M tokens/s  "
            f"({jobs[2]['wall_s']:.1f} s wall)  x{result['pretokenize_scaling_2_vs_1']:.2f}"
        )
        for name, p in producers.items():
            print(
                f"producer {name:5s} raw BPE   {p['raw_bpe_tokens_per_s'] / 1e6:8.3f} M tokens/s  "
                f"(seq_len {p['seq_len']}, {p['rows_per_microbatch']} rows per microbatch)"
            )
            print(
                f"producer {name:5s} token ids {p['pretokenized_tokens_per_s'] / 1e6:8.3f} M tokens/s  "
                f"x{p['speedup']:.2f} (median of per-round ratios "
                f"{', '.join(f'{r:.2f}' for r in p['round_ratios'])})"
            )
        print(f"disk                      {result['bytes_per_million_tokens'] / 1e6:8.3f} MB per million tokens")
        print(
            f"one actor, 1 B tokens     {result['hours_one_actor_per_billion_tokens']:8.2f} hours "
            f"({os.cpu_count()} cores)"
        )
        print("RESULT " + json.dumps(result))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
