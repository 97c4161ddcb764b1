"""The cost of a content-covering fingerprint: hashing throughput (cold) and a warm, cached fingerprint of 10,000 shards.

    python benchmarks/bench_fingerprint.py [--mb 256] [--shards 10000] [--rounds 3]

Part 1, throughput: ``--mb`` MiB of JSONL in 64 shards, hashed with an empty hash cache by
``hash_cache.digest_files`` (thread pool) and, side by side in the same run, by one thread calling
``hashlib.sha256`` over the same files (the floor). The files were just written, so the OS page cache is warm:
this measures the hashing, not the disk; a corpus read from disk is bounded by the disk instead.

Part 2, many small shards: ``--shards`` JSONL files of about 1 KiB in one source directory, and a recipe over it.
- cold: ``Recipe.from_toml`` with an empty hash cache (list, stat, hash every file, write the cache, and Zephon's
  row counts);
- warm: ``Recipe.from_toml`` with the cache filled: what every later load pays, Zephon's row counting included (it
  reads every file of an unindexed source; an ``index.json`` makes it O(1));
- identity only: ``identity.source_identity(known=())`` (list, stat, read the cache; no row counts): the part of
  ``warm`` that the hash cache makes cheap;
- verify: ``source_identity(known=recipe's shards)``, what ``verify_on_node`` does per source on a warm node;
- listing only: ``zephon_shard_listing`` (Zephon's discovery rule without hashing), the floor;
- zephon counts: Zephon's own ``Dataset.from_path`` row counting alone.
Every round runs cold first (it needs the empty cache), then the warm measurements in an order that flips from
one round to the next. Each figure is the median over ``--rounds`` rounds. Prints a table and one JSON line
(prefixed ``RESULT``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def write_shards(directory: Path, count: int, size: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"text": "lorem ipsum dolor sit amet " * 4}) + "\n"
    body = (line * (size // len(line) + 1))[:size].rsplit("\n", 1)[0] + "\n"
    paths = []
    for i in range(count):
        p = directory / f"shard-{i:06d}.jsonl"
        p.write_text(f'{{"text": "shard {i}"}}\n' + body)
        paths.append(p)
    return paths


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB hashed for the throughput part")
    parser.add_argument("--shards", type=int, default=10_000, help="small shards for the warm-fingerprint part")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (1 <= args.mb <= 16384 and 1 <= args.shards <= 1_000_000 and 1 <= args.rounds <= 50):
        parser.error("--mb must be in [1, 16384], --shards in [1, 1000000], --rounds in [1, 50]")

    work = Path(tempfile.mkdtemp(prefix="zr-bench-fp-"))
    os.environ["ZEPHON_RAY_CACHE_DIR"] = str(work / "cache")
    from zephon_ray import hash_cache, identity
    from zephon_ray.hash_cache import HashReport

    identity.Environment.capture("bytes")  # import Zephon outside the timed regions
    result: dict = {}
    try:
        # ---------------------------------------------------------------- part 1: throughput
        big = write_shards(work / "big", 64, args.mb * (1 << 20) // 64)
        total = sum(p.stat().st_size for p in big)
        time.sleep(hash_cache.RACY_WINDOW_S)
        pool_s, floor_s = [], []
        for r in range(args.rounds):  # the two sides alternate which goes first
            for f in (work / "cache").glob("*.json"):
                f.unlink()
            sides = [
                (floor_s, lambda: [hashlib.sha256(p.read_bytes()).hexdigest() for p in big]),
                (pool_s, lambda: hash_cache.digest_files(big, progress=False, use_ray=False)),
            ]
            for times, fn in sides if r % 2 == 0 else sides[::-1]:
                times.append(timed(fn))
        mb = total / (1 << 20)
        result["hash_mb"] = round(mb, 1)
        result["hash_pool_mb_s"] = round(mb / statistics.median(pool_s), 1)
        result["hash_one_thread_mb_s"] = round(mb / statistics.median(floor_s), 1)
        result["hash_pool_vs_one_thread"] = round(statistics.median(floor_s) / statistics.median(pool_s), 2)

        # ---------------------------------------------------------------- part 2: many small shards
        from zephon_ray import Recipe

        small_dir = work / "small"
        write_shards(small_dir, args.shards, 1024)
        recipe_path = work / "small.toml"
        recipe_path.write_text(f"""seed = 1\nlanes = 2\nmicrobatches_per_lane = 1\nrows_per_microbatch = 2\n
seq_len = 64\nchunk_size = 64\ntokenizer = "bytes"\n\n[[sources]]\nname = "small"\npath = "{small_dir}"\n""")
        time.sleep(hash_cache.RACY_WINDOW_S)
        timings: dict[str, list[float]] = {k: [] for k in ("cold", "warm", "identity", "verify", "listing", "counts")}
        for r in range(args.rounds):
            for f in (work / "cache").glob("*.json"):
                f.unlink()
            report = HashReport()
            t0 = time.perf_counter()
            recipe = Recipe.from_toml(recipe_path)
            timings["cold"].append(time.perf_counter() - t0)
            _, known = identity.source_identity(small_dir, "jsonl", known=(), report=report)
            assert report.cached == args.shards  # the cold load filled the cache
            assert [s.sha256 for s in known] == [s.sha256 for s in recipe.sources[0].shards]
            measures = {
                "warm": lambda: Recipe.from_toml(recipe_path),
                "identity": lambda: identity.source_identity(small_dir, "jsonl", known=()),
                "verify": lambda recipe=recipe: identity.source_identity(
                    small_dir, "jsonl", known=recipe.sources[0].shards
                ),
                "listing": lambda: identity.zephon_shard_listing(small_dir, "jsonl"),
                "counts": lambda: identity.zephon_row_counts(str(small_dir), "jsonl"),
            }
            order = list(measures) if r % 2 == 0 else list(reversed(measures))
            for key in order:
                timings[key].append(timed(measures[key]))
        med = {k: statistics.median(v) for k, v in timings.items()}
        result.update(
            {
                "shards": args.shards,
                "cold_s": round(med["cold"], 3),
                "warm_s": round(med["warm"], 3),
                "identity_only_warm_s": round(med["identity"], 3),
                "verify_warm_s": round(med["verify"], 3),
                "listing_only_s": round(med["listing"], 3),
                "zephon_row_counts_s": round(med["counts"], 3),
                "warm_per_shard_us": round(1e6 * med["warm"] / args.shards, 1),
                "row_counts_share_of_warm": round(med["counts"] / med["warm"], 2),
            }
        )
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)

    print(f"hashing {result['hash_mb']} MiB, cold hash cache, warm page cache:")
    print(f"  digest_files (thread pool)   {result['hash_pool_mb_s']:>9} MB/s")
    print(
        f"  one thread, hashlib          {result['hash_one_thread_mb_s']:>9} MB/s"
        f"   (pool / one thread = {result['hash_pool_vs_one_thread']}x)"
    )
    print(f"{result['shards']} shards of ~1 KiB:")
    for key, label in (
        ("cold_s", "cold Recipe.from_toml"),
        ("warm_s", "warm Recipe.from_toml"),
        ("identity_only_warm_s", "  of which identity (cache)"),
        ("zephon_row_counts_s", "  of which Zephon's row counts"),
        ("verify_warm_s", "verify_on_node, warm"),
        ("listing_only_s", "listing only"),
    ):
        print(f"  {label:<32} {result[key]:>8.3f} s")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
