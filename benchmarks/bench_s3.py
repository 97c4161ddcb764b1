"""Object storage against local disk, side by side in one run, on a real S3 API server on 127.0.0.1 (moto).

    python benchmarks/bench_s3.py [--records 2000] [--steps 60] [--probes 60] [--objects 10000] [--rounds 3]

1. Producer tokens/s: a ``LaneStepper`` (what a service producer runs) over the same recipe with its sources on
   local disk and in a bucket, timed from pipeline build to the last of ``--steps`` steps, the two sides
   alternating their order in ``--rounds`` rounds. Every S3 round starts with an empty Zephon shard cache (a fresh
   ``ZEPHON_RAY_SHARD_CACHE``), so it pays the downloads; digests are checked equal on the way. Ratio: the median
   of per-round ratios.
2. A past step from a materialised run: the same directory (written once locally, uploaded byte for byte) read
   through ``MaterializedSource`` from local disk and from the bucket (one row group: ranged GETs), the sides
   interleaved per probe over ``--probes`` random steps in each round; p50 and p99 of each.
3. The cost of a fingerprint of ``--objects`` remote objects: ``identity.source_identity`` on a prefix of that
   many small JSONL objects (one paginated listing with ETags; no object is downloaded) against the same files on
   local disk with a warm hash cache (what a later load pays there: a listing and a stat per file), alternating.

The server runs in this process (moto is a test dependency: ``pip install -e .[test]``), so the S3 side measures
the protocol and the code path on loopback, not a network. Prints a table and one JSON line (``RESULT``).
Timings on a shared machine are noisy: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def write_recipe(path: Path, sources: str) -> Path:
    path.write_text(f"""seed = 7
lanes = 8
microbatches_per_lane = 1
rows_per_microbatch = 4
seq_len = 512
chunk_size = 64
tokenizer = "bytes"
packing = "wrap"

[[sources]]
name = "prose"
path = "{sources}/prose"
weight = 0.7

[[sources]]
name = "code"
path = "{sources}/code"
weight = 0.3
""")
    return path


def run_stepper(recipe, steps: int) -> tuple[float, list[str]]:
    from zephon_ray.lanes import LaneStepper
    from zephon_ray.source import assemble

    t0 = time.perf_counter()
    stepper = LaneStepper(recipe)
    try:
        digests = [assemble(recipe, s, stepper.next_step()).digest for s in range(steps)]
    finally:
        stepper.close()
    return time.perf_counter() - t0, digests


def upload(server, local: Path, bucket: str, prefix: str, threads: int = 16) -> None:
    client = server.client()
    paths = [p for p in sorted(local.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(local)}"), paths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000, help="records per source of the corpus")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--probes", type=int, default=60)
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for name, low, high in (
        ("records", 100, 10**6),
        ("steps", 2, 10**5),
        ("probes", 1, 10**5),
        ("objects", 1, 10**6),
        ("rounds", 1, 50),
    ):
        if not low <= getattr(args, name) <= high:
            parser.error(f"--{name} must be in [{low}, {high}]")

    from tests import s3_server

    server = s3_server.configure_environment()
    server.start()
    work = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    os.environ["ZEPHON_RAY_CACHE_DIR"] = str(work / "hash-cache")
    out: dict = {"rounds": args.rounds, "cpus": os.cpu_count()}
    try:
        from zephon_ray import Recipe, identity, storage
        from zephon_ray.corpus import write_corpus
        from zephon_ray.formats.materialized import (
            KEY_CHECKPOINTS,
            KEY_DIGESTS,
            KEY_END,
            KEY_FINGERPRINT,
            KEY_FIRST,
            KEY_FORMAT,
            KEY_GEOMETRY,
            KEY_SEGMENT_STEPS,
            KEY_SEGMENTS,
            KEY_SOURCE_TOKENS,
            MANIFEST_FORMAT,
            MaterializedSource,
            SegmentWriter,
        )
        from zephon_ray.hash_cache import HashReport
        from zephon_ray.source import GlobalBatchSource

        # ------------------------------------------------------------------ 1. producer tokens/s
        write_corpus(work / "corpus", formats=("jsonl",), limit=args.records, records_per_shard=250)
        bucket = server.new_bucket("bench")
        upload(server, work / "corpus" / "jsonl", bucket, "corpus")
        local = Recipe.from_toml(write_recipe(work / "local.toml", str(work / "corpus" / "jsonl")))
        remote = Recipe.from_toml(write_recipe(work / "s3.toml", f"s3://{bucket}/corpus"))
        tokens = args.steps * local.tokens_per_step
        local_s, s3_s, ratios = [], [], []
        for r in range(args.rounds):
            result = {}
            for side in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
                if side == "s3":
                    os.environ["ZEPHON_RAY_SHARD_CACHE"] = str(work / f"shard-cache-{r}")  # cold: downloads
                result[side] = run_stepper(local if side == "local" else remote, args.steps)
            if result["local"][1] != result["s3"][1]:
                raise SystemExit("digests differ between local disk and S3")
            local_s.append(result["local"][0])
            s3_s.append(result["s3"][0])
            ratios.append(result["local"][0] / result["s3"][0])
        out.update(
            {
                "producer_tokens": tokens,
                "producer_local_tokens_per_s": tokens / statistics.median(local_s),
                "producer_s3_tokens_per_s": tokens / statistics.median(s3_s),
                "producer_s3_vs_local": statistics.median(ratios),
                "producer_round_ratios": ratios,
            }
        )

        # ------------------------------------------------------------------ 2. a past step from a materialised run
        mat = storage.location(work / "materialized")
        manifest = {
            KEY_FORMAT: MANIFEST_FORMAT,
            KEY_FINGERPRINT: local.fingerprint,
            KEY_FIRST: 0,
            KEY_END: 0,
            KEY_GEOMETRY: {
                "lanes": local.lanes,
                "rows": local.global_batch_rows,
                "row_length": local.row_length,
                "sources": list(local.source_names),
            },
            KEY_SEGMENT_STEPS: 16,
            KEY_SEGMENTS: [],
            KEY_DIGESTS: [],
            KEY_SOURCE_TOKENS: [],
            KEY_CHECKPOINTS: {},
        }
        writer = SegmentWriter(
            mat, manifest, lanes=local.lanes, rows_per_lane=local.rows_per_lane, row_length=local.row_length
        )
        with GlobalBatchSource(local) as source:
            for step in range(args.steps):
                b = source.batch(step)
                end = (step + 1) % 16 == 0 or step + 1 == args.steps
                writer.add(
                    step,
                    b.tokens,
                    b.positions,
                    [b.source_tokens[n] for n in local.source_names],
                    json.dumps({"bench": step}) if end else "",
                )
        upload(server, Path(mat.path), bucket, "materialized")
        sources = {"local": MaterializedSource(mat.path), "s3": MaterializedSource(f"s3://{bucket}/materialized")}
        for src in sources.values():
            for seg_first in range(0, args.steps, 16):
                src.batch(seg_first)  # open every footer once on both sides: the probes time row-group reads
        reads: dict[str, list[float]] = {"local": [], "s3": []}
        rng = random.Random(0)
        for r in range(args.rounds):
            for step in (rng.randrange(args.steps) for _ in range(args.probes)):
                for side in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
                    t0 = time.perf_counter()
                    digest = sources[side].batch(step).digest
                    reads[side].append(time.perf_counter() - t0)
                    assert digest == manifest[KEY_DIGESTS][step]
        for side, values in reads.items():
            out[f"past_step_{side}_p50_ms"] = statistics.median(values) * 1e3
            out[f"past_step_{side}_p99_ms"] = percentile(values, 0.99) * 1e3
        out["past_step_s3_vs_local_p50"] = out["past_step_s3_p50_ms"] / out["past_step_local_p50_ms"]
        out["past_step_s3_vs_local_p99"] = out["past_step_s3_p99_ms"] / out["past_step_local_p99_ms"]

        # ------------------------------------------------------------------ 3. fingerprint of many objects
        many = work / "many"
        many.mkdir()
        line = json.dumps({"text": "lorem ipsum dolor sit amet " * 4}) + "\n"
        for i in range(args.objects):
            (many / f"shard-{i:06d}.jsonl").write_text(f'{{"text": "shard {i}"}}\n' + line * 8)
        t0 = time.perf_counter()
        upload(server, many, bucket, "many", threads=32)
        out["objects_upload_s"] = time.perf_counter() - t0
        time.sleep(2.1)  # past the hash cache's racy window, so the local side is warm after one pass
        _, known = identity.source_identity(many, "jsonl", known=())
        remote_prefix = f"s3://{bucket}/many"
        local_fp, remote_fp = [], []
        for r in range(args.rounds):
            for side in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
                report = HashReport()
                t0 = time.perf_counter()
                if side == "local":
                    _, shards = identity.source_identity(many, "jsonl", known=known, report=report)
                    local_fp.append(time.perf_counter() - t0)
                    assert report.hashed == 0 and len(shards) == args.objects
                else:
                    _, shards = identity.source_identity(remote_prefix, "jsonl")
                    remote_fp.append(time.perf_counter() - t0)
                    assert len(shards) == args.objects and all(s.etag for s in shards)
        out.update(
            {
                "objects": args.objects,
                "fingerprint_remote_s": statistics.median(remote_fp),
                "fingerprint_local_warm_s": statistics.median(local_fp),
                "fingerprint_remote_per_object_us": 1e6 * statistics.median(remote_fp) / args.objects,
                "fingerprint_remote_vs_local_warm": statistics.median(remote_fp) / statistics.median(local_fp),
            }
        )
        with server.recording() as rec:
            identity.source_identity(remote_prefix, "jsonl")
        out["fingerprint_remote_object_gets"] = sum(1 for u in rec.gets() if ".jsonl" in u.split("?")[0])
        out["fingerprint_remote_requests"] = len(rec.requests)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"producer, local disk        {out['producer_local_tokens_per_s'] / 1e6:8.3f} M tokens/s")
    print(
        f"producer, S3 (cold cache)   {out['producer_s3_tokens_per_s'] / 1e6:8.3f} M tokens/s   "
        f"S3/local x{out['producer_s3_vs_local']:.2f} (rounds {', '.join(f'{x:.2f}' for x in out['producer_round_ratios'])})"
    )
    for side in ("local", "s3"):
        print(
            f"past step, materialised {side:5s} p50 {out[f'past_step_{side}_p50_ms']:8.2f} ms  "
            f"p99 {out[f'past_step_{side}_p99_ms']:8.2f} ms"
        )
    print(
        f"past step S3/local          p50 x{out['past_step_s3_vs_local_p50']:.2f}  p99 x{out['past_step_s3_vs_local_p99']:.2f}"
    )
    print(
        f"fingerprint, {out['objects']} objects   S3 {out['fingerprint_remote_s']:.3f} s "
        f"({out['fingerprint_remote_per_object_us']:.0f} us/object, {out['fingerprint_remote_requests']} requests, "
        f"{out['fingerprint_remote_object_gets']} object GETs)  local warm {out['fingerprint_local_warm_s']:.3f} s  "
        f"x{out['fingerprint_remote_vs_local_warm']:.2f}"
    )
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
