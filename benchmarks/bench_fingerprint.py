"""The cost of a content-covering fingerprint: hashing throughput (cold) and a warm, cached fingerprint of 10,000 shards.

    python benchmarks/bench_fingerprint.py [--mb 256] [--shards 10000] [--rounds 3]

Part 1, throughput: ``--mb`` MiB of JSONL in 64 shards, hashed with an empty hash cache by
``identity.digest_files`` (thread pool) and, side by side in the same run, by one thread calling
``hashlib.sha256`` over the same files (the floor). The files were just written, so the OS page cache is warm:
this measures the hashing, not the disk; a corpus read from disk is bounded by the disk instead.

Part 2, many small shards: ``--shards`` JSONL files of about 1 KiB in one source directory.
- cold: ``identity.source_identity`` with an empty hash cache (list, stat, hash every file, write the cache);
- warm: the same with the cache filled (list, stat, read the cache): the cost every later load pays;
- verify: ``source_identity(known=...)``, what ``verify_on_node`` does per source on a warm node;
- listing only: ``zephon_shard_listing`` (Zephon's discovery rule without hashing), the floor for warm;
- zephon counts: Zephon's own ``Dataset.from_path`` row counting, which ``Recipe.from_toml`` runs on an
  unindexed source anyway (it reads every file; an ``index.json`` makes it O(1)).
Each is the median of ``--rounds`` runs. Prints a table and one JSON line (prefixed ``RESULT``).
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
    from zephon_ray import identity

    identity.Environment.capture("bytes")  # import Zephon outside the timed regions
    result: dict = {}
    try:
        # ---------------------------------------------------------------- part 1: throughput
        big = write_shards(work / "big", 64, args.mb * (1 << 20) // 64)
        total = sum(p.stat().st_size for p in big)
        time.sleep(identity.RACY_WINDOW_S)
        pool_s, floor_s = [], []
        for _ in range(args.rounds):
            for f in (work / "cache").glob("*.json"):
                f.unlink()
            floor_s.append(timed(lambda: [hashlib.sha256(p.read_bytes()).hexdigest() for p in big]))
            pool_s.append(timed(lambda: identity.digest_files(big, progress=False, use_ray=False)))
        mb = total / (1 << 20)
        result["hash_mb"] = round(mb, 1)
        result["hash_pool_mb_s"] = round(mb / statistics.median(pool_s), 1)
        result["hash_one_thread_mb_s"] = round(mb / statistics.median(floor_s), 1)
        result["hash_pool_vs_one_thread"] = round(statistics.median(floor_s) / statistics.median(pool_s), 2)

        # ---------------------------------------------------------------- part 2: many small shards
        small_dir = work / "small"
        write_shards(small_dir, args.shards, 1024)
        time.sleep(identity.RACY_WINDOW_S)
        cold, warm, verify, listing, counts = [], [], [], [], []
        known = None
        for _ in range(args.rounds):
            for f in (work / "cache").glob("*.json"):
                f.unlink()
            cold.append(timed(lambda: identity.source_identity(small_dir, "jsonl", known=())))
            assert identity.last_report.hashed == args.shards
            _, known = identity.source_identity(small_dir, "jsonl", known=())
            assert identity.last_report.cached == args.shards
            warm.append(timed(lambda: identity.source_identity(small_dir, "jsonl", known=())))
            verify.append(timed(lambda: identity.source_identity(small_dir, "jsonl", known=known)))
            listing.append(timed(lambda: identity.zephon_shard_listing(small_dir, "jsonl")))
        for _ in range(max(1, args.rounds // 2)):
            counts.append(timed(lambda: identity.zephon_row_counts(small_dir, "jsonl")))
        result.update({
            "shards": args.shards,
            "cold_s": round(statistics.median(cold), 3),
            "warm_s": round(statistics.median(warm), 3),
            "verify_warm_s": round(statistics.median(verify), 3),
            "listing_only_s": round(statistics.median(listing), 3),
            "zephon_row_counts_s": round(statistics.median(counts), 3),
            "warm_per_shard_us": round(1e6 * statistics.median(warm) / args.shards, 1),
        })
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)

    print(f"hashing {result['hash_mb']} MiB, cold hash cache, warm page cache:")
    print(f"  digest_files (thread pool)   {result['hash_pool_mb_s']:>9} MB/s")
    print(f"  one thread, hashlib          {result['hash_one_thread_mb_s']:>9} MB/s"
          f"   (pool / one thread = {result['hash_pool_vs_one_thread']}x)")
    print(f"{result['shards']} shards of ~1 KiB:")
    for key, label in (("cold_s", "cold (hash all, write cache)"), ("warm_s", "warm (stat + cache)"),
                       ("verify_warm_s", "verify_on_node, warm"), ("listing_only_s", "listing only"),
                       ("zephon_row_counts_s", "Zephon's row counts (from_toml)")):
        print(f"  {label:<32} {result[key]:>8.3f} s")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
