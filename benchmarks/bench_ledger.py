"""The ledger's costs: hashing a rank's slice per step at seq_len 8,192, ledger bytes per step per rank, and the time
``zephon-ray audit`` takes over 100,000 steps.

    python benchmarks/bench_ledger.py [--steps 12] [--audit-steps 100000] [--audit-world 8] [--save-every 1000]

Part 1, hash cost: random int32 slices of 1, 4, 8 and 16 rows of 8,193 tokens (seq_len 8,192 + 1), each hashed
(tokens then positions) with sha256 (what ``formats.ledger.slice_digest`` uses), blake2b-128 and, when the package is
installed, xxh3-128; the median of 50 repetitions.

Part 2, share of a step: a real local-mode loader (W = 1) over the demo corpus with the recipe's seq_len set to
8,192 (12 lanes x 1 row: a 12-row slice of 8,193 tokens), ``--steps`` steps consumed back to back after one warm-up
step: the loader time per step as the trainer sees it (production when the prefetch thread falls behind, the
microbatch tensors, the ledger record), with the ledger's hashing and with it replaced by a constant, alternating
over 3 rounds; and ``slice_digest`` of the same slice timed on its own, as a share of that step time.

Part 3, audit: a synthetic ledger of ``--audit-steps`` steps at W = ``--audit-world`` written through
``formats.ledger.write_part`` (a segment every ``--save-every`` steps, as a trainer saving that often writes it), then
audited (structure only: no reference rows) as ``zephon-ray audit LEDGER`` does, before and after ``compact``.
``benchmarks/bench_ledger_scale.py`` takes the audit to 10^7 records and more.

Part 4, torchft: ``--ft-world`` readers' ``stream.ledger_recorder.FtLedger`` (what ``FtSlices`` uses) serve and commit
``--ft-steps`` steps, each commit appending the reader's part to its spool (a batch file per reader per flush): the
commit time per step, the files and bytes per step per reader, and the audit of that ledger.

Prints a table and one JSON line (prefixed ``RESULT``).
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


def _period(recipe: str, steps: int, hashing: bool) -> tuple[float, object]:
    """Milliseconds per step of a local-mode loader consumed back to back (the trainer's view: everything on its
    path, production included when the prefetch thread falls behind); with ``hashing`` False the ledger's digest is
    a constant (the loader without the ledger's cost)."""
    from zephon_ray.formats import ledger
    from zephon_ray.stream.loader import Loader, LoaderConfig

    real = ledger.slice_digest
    if not hashing:
        ledger.slice_digest = lambda tokens, positions: "0" * 32
    try:
        loader = Loader(LoaderConfig(recipe=recipe, mode="local", prefetch=2), rank=0, world=1)
        it = iter(loader)
        next(it)  # warm-up: the pipeline starts
        t0 = time.perf_counter()
        for _ in range(steps):
            batch = next(it)
        period = (time.perf_counter() - t0) * 1e3 / steps
        loader.close()
    finally:
        ledger.slice_digest = real
    return period, batch.slice


def step_share(steps: int, rounds: int = 3) -> dict:
    from zephon_ray.formats.ledger import slice_digest

    text = (ROOT / "recipes" / "demo.toml").read_text().replace("seq_len = 128", f"seq_len = {SEQ}")
    text = text.replace('"tokenizer/tokenizer.json"', f'"{ROOT / "recipes" / "tokenizer" / "tokenizer.json"}"')
    text = text.replace('"../data/', f'"{ROOT / "data"}/')
    with tempfile.TemporaryDirectory() as work:
        recipe = Path(work, "demo-8192.toml")
        recipe.write_text(text)
        on, off = [], []
        for r in range(rounds):  # alternate the order from one round to the next
            for hashing in (True, False) if r % 2 == 0 else (False, True):
                period, piece = _period(str(recipe), steps, hashing)
                (on if hashing else off).append(period)
    hash_ms = []
    for _ in range(20):
        t0 = time.perf_counter()
        slice_digest(piece.tokens, piece.positions)
        hash_ms.append((time.perf_counter() - t0) * 1e3)
    hashed, with_ledger, without = statistics.median(hash_ms), statistics.median(on), statistics.median(off)
    return {
        "rows": int(piece.tokens.shape[0]),
        "row_tokens": SEQ + 1,
        "step_ms": with_ledger,
        "step_ms_without_hashing": without,
        "hash_ms": hashed,
        "share_of_step": hashed / with_ledger,
    }


def audit_cost(steps: int, world: int, every: int) -> dict:
    from zephon_ray.formats import ledger
    from zephon_ray.jobs import audit

    with tempfile.TemporaryDirectory() as work:
        parent, t0 = "", time.perf_counter()
        for first in range(0, steps, every):
            end = min(steps, first + every)
            schedule = {"data_next": end, "phases": [[0, "sources", "f" * 64]]}  # as the loader records it
            seg = ledger.segment_id(
                run_id="bench",
                fingerprint="f" * 64,
                parent=parent,
                first_step=first,
                next_step=end,
                world=world,
                resumed=False,
                schedule=schedule,
            )
            for rank in range(world):
                records = [
                    ledger.Record(s, world, rank, hashlib.sha256(f"{s} {rank}".encode()).hexdigest()[:32])
                    for s in range(first, end)
                ]
                ledger.write_part(
                    work,
                    ledger.make_part(
                        run_id="bench",
                        fingerprint="f" * 64,
                        segment=seg,
                        parent=parent,
                        first_step=first,
                        next_step=end,
                        world=world,
                        rank=rank,
                        resumed=False,
                        schedule=schedule,
                        records=records,
                    ),
                )
            parent = seg
        write_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in Path(work).rglob("*.json"))
        t0 = time.perf_counter()
        report = audit.audit(work)
        audit_s = time.perf_counter() - t0
        assert report.clean and report.next_step == steps, report.findings[:3]
        ledger.compact(work)
        t0 = time.perf_counter()
        packed = audit.audit(work)
        packed_s = time.perf_counter() - t0
        assert packed.clean and packed.records == report.records
    return {
        "steps": steps,
        "world": world,
        "segments": len(report.lineage),
        "bytes": size,
        "bytes_per_step_per_rank": size / (steps * world),
        "write_s": write_s,
        "audit_s": audit_s,
        "audit_packed_s": packed_s,
    }


def ft_cost(steps: int, world: int) -> dict:
    from zephon_ray.jobs import audit
    from zephon_ray.stream.ledger_recorder import FtLedger

    with tempfile.TemporaryDirectory() as work:
        readers = [
            FtLedger(
                run_id="bench",
                fingerprint="f" * 64,
                ledger_dir=work,
                schedule=lambda n: {"data_next": n, "phases": [[0, "sources", "f" * 64]]},
            )
            for _ in range(world)
        ]
        commit_s = 0.0
        for step in range(steps):
            for rank, reader in enumerate(readers):
                reader.served(step, rank, world, hashlib.sha256(f"{step} {rank}".encode()).hexdigest()[:32])
                t0 = time.perf_counter()
                reader.commit(step)
                commit_s += time.perf_counter() - t0
        for reader in readers:
            reader.close()
        paths = [p for p in Path(work).rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in paths)
        t0 = time.perf_counter()
        report = audit.audit(work)
        audit_s = time.perf_counter() - t0
        assert report.clean and report.next_step == steps, report.findings[:3]
    return {
        "steps": steps,
        "world": world,
        "files": len(paths),
        "bytes_per_step_per_reader": size / (steps * world),
        "commit_ms_per_step": 1e3 * commit_s / (steps * world),
        "audit_s": audit_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--audit-steps", type=int, default=100_000)
    parser.add_argument("--audit-world", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=1000)
    parser.add_argument("--ft-steps", type=int, default=2000)
    parser.add_argument("--ft-world", type=int, default=3)
    args = parser.parse_args()

    costs = hash_costs()
    names = list(next(iter(costs.values())))
    print(f"hash cost per slice of seq_len {SEQ} rows, ms (median of 50)")
    print(f"{'rows':>5} " + " ".join(f"{n:>13}" for n in names))
    for rows, row in costs.items():
        print(f"{rows:>5} " + " ".join(f"{row[n]:>13.3f}" for n in names))
    share = step_share(args.steps)
    print(
        f"\nlocal-mode loader, W=1, {share['rows']} rows x {share['row_tokens']} tokens per step ({args.steps} "
        "steps back to back, median of 3 rounds)"
    )
    print(
        f"  slice_digest {share['hash_ms']:.2f} ms = {share['share_of_step']:.2%} of a step's loader time "
        f"({share['step_ms']:.1f} ms per step with the ledger, {share['step_ms_without_hashing']:.1f} ms without "
        "hashing: the digest is taken in the prefetch thread)"
    )
    cost = audit_cost(args.audit_steps, args.audit_world, args.save_every)
    print(
        f"\naudit of {cost['steps']} steps at W={cost['world']} ({cost['segments']} segments, "
        f"{cost['bytes'] / 1e6:.1f} MB, {cost['bytes_per_step_per_rank']:.1f} bytes per step per rank): "
        f"{cost['audit_s']:.2f} s loose, {cost['audit_packed_s']:.2f} s compacted (writing it took "
        f"{cost['write_s']:.2f} s)"
    )
    ft = ft_cost(args.ft_steps, args.ft_world)
    print(
        f"\ntorchft (FtLedger): {ft['steps']} committed steps at W={ft['world']} ({ft['files']} files): "
        f"{ft['commit_ms_per_step']:.2f} ms per commit per reader, {ft['bytes_per_step_per_reader']:.0f} bytes per "
        f"step per reader; audit {ft['audit_s']:.2f} s"
    )
    print("RESULT " + json.dumps({"hash_ms": costs, "step": share, "audit": cost, "torchft": ft}))


if __name__ == "__main__":
    main()
