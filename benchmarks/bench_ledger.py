"""The ledger's costs: hashing a rank's slice per step at seq_len 8,192, ledger bytes per step per rank, and the time
``zephon-ray audit`` takes over 100,000 steps.

    python benchmarks/bench_ledger.py [--steps 12] [--audit-steps 100000] [--audit-world 8] [--save-every 1000]

Part 1, hash cost: random int32 slices of 1, 4, 8 and 16 rows of 8,193 tokens (seq_len 8,192 + 1), each hashed
(tokens then positions) with sha256 (what ``formats.ledger.slice_digest`` uses), blake2b-128 and, when the package is
installed, xxh3-128; the median of 50 repetitions.

Part 2, share of a step: a real local-mode loader (W = 1) over the demo corpus with the recipe's seq_len set to
8,192 (12 lanes x 1 row: a 12-row slice of 8,193 tokens), ``--steps`` steps after one warm-up step; each step's
loader time (``next()``: Zephon's production, the slice, the microbatch tensors and the ledger record) against the
``slice_digest`` of the same slice, timed again on its own. The local mode is the slowest source (it tokenizes);
the share is also given against the microbatch copy alone, the floor of any source's per-step work.

Part 3, audit: a synthetic ledger of ``--audit-steps`` steps at W = ``--audit-world`` written through
``formats.ledger.write_part`` (a segment every ``--save-every`` steps, as a trainer saving that often writes it), then
read back and audited (structure only: no reference rows) as ``zephon-ray audit LEDGER`` does. Prints a table and one
JSON line (prefixed ``RESULT``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ = 8192


def hash_costs() -> dict:
    from zephon_ray.formats.ledger import slice_digest

    hashers = {"sha256": lambda: hashlib.sha256(), "blake2b-128": lambda: hashlib.blake2b(digest_size=16)}
    try:
        import xxhash

        hashers["xxh3-128"] = lambda: xxhash.xxh3_128()
    except ImportError:
        pass
    rng = np.random.default_rng(0)
    out: dict = {}
    for rows in (1, 4, 8, 16):
        tokens = rng.integers(0, 100_000, size=(rows, SEQ + 1), dtype=np.int32)
        positions = np.tile(np.arange(SEQ + 1, dtype=np.int32), (rows, 1))
        row: dict = {}
        for name, make in hashers.items():
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                h = make()
                h.update(tokens.data)
                h.update(positions.data)
                h.hexdigest()
                times.append(time.perf_counter() - t0)
            row[name] = statistics.median(times) * 1e3
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            slice_digest(tokens, positions)
            times.append(time.perf_counter() - t0)
        row["slice_digest"] = statistics.median(times) * 1e3
        out[rows] = row
    return out


def step_share(steps: int) -> dict:
    from zephon_ray.formats.ledger import slice_digest
    from zephon_ray.stream.loader import Loader, LoaderConfig

    text = (ROOT / "recipes" / "demo.toml").read_text().replace("seq_len = 128", f"seq_len = {SEQ}")
    text = text.replace('"tokenizer/tokenizer.json"', f'"{ROOT / "recipes" / "tokenizer" / "tokenizer.json"}"')
    text = text.replace('"../data/', f'"{ROOT / "data"}/')
    with tempfile.TemporaryDirectory() as work:
        recipe = Path(work, "demo-8192.toml")
        recipe.write_text(text)
        loader = Loader(LoaderConfig(recipe=str(recipe), mode="local", prefetch=1), rank=0, world=1)
        it = iter(loader)
        next(it)  # warm-up: the pipeline starts
        step_ms, hash_ms, copy_ms, rows = [], [], [], 0
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = next(it)
            step_ms.append((time.perf_counter() - t0) * 1e3)
            piece = batch.slice
            rows = piece.tokens.shape[0]
            t0 = time.perf_counter()
            slice_digest(piece.tokens, piece.positions)
            hash_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            list(piece.microbatches(rows))
            copy_ms.append((time.perf_counter() - t0) * 1e3)
        loader.close()
    step, hashed, copied = (statistics.median(v) for v in (step_ms, hash_ms, copy_ms))
    return {"rows": rows, "row_tokens": SEQ + 1, "step_ms": step, "hash_ms": hashed, "copy_ms": copied,
            "share_of_step": hashed / step, "hash_over_copy": hashed / copied}


def audit_cost(steps: int, world: int, every: int) -> dict:
    from zephon_ray import audit
    from zephon_ray.formats import ledger

    with tempfile.TemporaryDirectory() as work:
        parent, t0 = "", time.perf_counter()
        for first in range(0, steps, every):
            end = min(steps, first + every)
            seg = ledger.segment_id(run_id="bench", fingerprint="f" * 64, parent=parent, first_step=first,
                                    next_step=end, world=world, resumed=False)
            for rank in range(world):
                records = [ledger.Record(s, world, rank, hashlib.sha256(f"{s} {rank}".encode()).hexdigest()[:32])
                           for s in range(first, end)]
                ledger.write_part(work, ledger.make_part(run_id="bench", fingerprint="f" * 64, segment=seg,
                                                         parent=parent, first_step=first, next_step=end, world=world,
                                                         rank=rank, resumed=False, records=records))
            parent = seg
        write_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in Path(work).rglob("*.json"))
        t0 = time.perf_counter()
        segments = audit.read_ledger(work)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = audit.audit(segments, audit.find_head(segments))
        check_s = time.perf_counter() - t0
        assert report.clean and report.next_step == steps, report.findings[:3]
    return {"steps": steps, "world": world, "segments": len(segments), "bytes": size,
            "bytes_per_step_per_rank": size / (steps * world), "write_s": write_s, "read_s": read_s,
            "check_s": check_s, "audit_s": read_s + check_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--audit-steps", type=int, default=100_000)
    parser.add_argument("--audit-world", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=1000)
    args = parser.parse_args()

    costs = hash_costs()
    names = list(next(iter(costs.values())))
    print(f"hash cost per slice of seq_len {SEQ} rows, ms (median of 50)")
    print(f"{'rows':>5} " + " ".join(f"{n:>13}" for n in names))
    for rows, row in costs.items():
        print(f"{rows:>5} " + " ".join(f"{row[n]:>13.3f}" for n in names))
    share = step_share(args.steps)
    print(f"\nlocal-mode loader, W=1, {share['rows']} rows x {share['row_tokens']} tokens per step (median of "
          f"{args.steps} steps)")
    print(f"  step {share['step_ms']:.1f} ms, slice_digest {share['hash_ms']:.2f} ms "
          f"({share['share_of_step']:.2%} of the step), microbatch copy {share['copy_ms']:.2f} ms "
          f"(hash = {share['hash_over_copy']:.2f}x the copy)")
    cost = audit_cost(args.audit_steps, args.audit_world, args.save_every)
    print(f"\naudit of {cost['steps']} steps at W={cost['world']} ({cost['segments']} segments, "
          f"{cost['bytes'] / 1e6:.1f} MB, {cost['bytes_per_step_per_rank']:.1f} bytes per step per rank): "
          f"read {cost['read_s']:.2f} s + check {cost['check_s']:.2f} s = {cost['audit_s']:.2f} s "
          f"(writing it took {cost['write_s']:.2f} s)")
    print("RESULT " + json.dumps({"hash_ms": costs, "step": share, "audit": cost}))


if __name__ == "__main__":
    main()
