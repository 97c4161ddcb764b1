"""The ledger at scale: how many files a run leaves before and after compaction, and the time and peak memory of
``zephon-ray audit`` over 10^5 .. 10^9 records.

    python benchmarks/bench_ledger_scale.py [--records 1e5,1e6,1e7] [--ranks 1000] [--save-every 500]
    python benchmarks/bench_ledger_scale.py --parts realistic,ft
    python benchmarks/bench_ledger_scale.py --parts reader0 [--reader0-steps 60000]

Part ``audit`` (default): for each record count N, a ledger of ``--ranks`` ranks saving every ``--save-every`` steps
for N / ranks steps, written by a generator through the real format code (``formats.ledger.PackWriter``, as
``zephon-ray ledger compact`` writes it: one pack), then audited (structure only, as ``zephon-ray audit DIR`` without
``--recipe``) in a fresh process: wall time of ``jobs.audit.audit`` (imports done before, pyarrow's lazy pandas import included) and the process's peak RSS
(``VmHWM``, imports included), and the wall time of the ``zephon-ray audit DIR`` command as a user runs it. 10^9 records is the 1,000-rank, 1,000,000-step run of the issue (16 GB of digests).

Part ``realistic``: 4 loaders saving every 100 steps for 20,000 steps through ``write_part`` (800 loose files), then
``compact``: files and bytes before and after, the compaction's time, the audit's time before and after.

Part ``ft``: 3 torchft readers (``stream.ledger_recorder.FtLedger``, its default flush) commit ``--ft-steps`` steps: the files
it leaves (a batch per reader per flush, against one file per step per reader before batching), the audit's time,
then after ``compact``.

Part ``reader0``: the memory of the trainer process whose reader 0 compacts. Four ``LedgerRecorder`` s (world 4, the
tiny recipe's schedule) hand out ``--reader0-steps`` steps and save every 100; reader 0 compacts every 64 saves, as
``LoaderConfig`` does by default. Two sides, each in a fresh process: the recorder's own compaction (a child process,
``stream.ledger_recorder.compact_in_child``), and the same compactions run in the recording process
(``formats.ledger.compact``). Reported: that process's RSS after each compaction.

Prints a table and one JSON line (prefixed ``RESULT``).
"""

from __future__ import annotations

import argparse
import binascii
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FP = "f" * 64


def _schedule(next_step: int) -> dict:
    """A segment's schedule as the loader records it, for a run without phases (ledger format version 2)."""
    return {"data_next": next_step, "phases": [[0, "sources", FP]]}


def _hexes(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.frombuffer(binascii.hexlify(rng.bytes(16 * n)), dtype="S32")


def generate(ledger_dir: str, *, ranks: int, steps: int, save_every: int) -> dict:
    """One pack holding the parts of a run of ``ranks`` ranks saving every ``save_every`` steps."""
    from zephon_ray import storage
    from zephon_ray.formats import ledger

    rng = np.random.default_rng(0)
    table = ledger.SegmentTable()
    writer = ledger.PackWriter(storage.location(ledger_dir), table)
    parent = ""
    for first in range(0, steps, save_every):
        end = min(steps, first + save_every)
        sid = ledger.segment_id(
            run_id="bench",
            fingerprint=FP,
            parent=parent,
            first_step=first,
            next_step=end,
            world=ranks,
            resumed=False,
            schedule=_schedule(end),
        )
        code = table.add(
            ledger.Segment(sid, parent, "bench", FP, first, end, ranks, False, ledger.schedule_text(_schedule(end))),
            "generator",
        )
        n = end - first
        per = max(1, ledger.ROW_GROUP_RECORDS // n)  # ranks per batch
        for lo in range(0, ranks, per):
            hi = min(ranks, lo + per)
            m = (hi - lo) * n
            rank = np.arange(lo, hi, dtype=np.int64)
            writer.add(
                ledger.Parts(
                    np.full(hi - lo, code, dtype=np.int64),
                    rank,
                    np.arange(0, m + 1, n, dtype=np.int64),
                    np.tile(np.arange(first, end, dtype=np.int64), hi - lo),
                    np.full(m, ranks, dtype=np.int64),
                    np.repeat(rank, n),
                    np.zeros(m, dtype=np.int64),
                    np.ones(m, dtype=np.int64),
                    _hexes(rng, m),
                    "generator",
                )
            )
        parent = sid
    manifest = writer.commit([])
    size = sum(p.stat().st_size for p in Path(ledger_dir).rglob("*") if p.is_file())
    return {
        "records": manifest["parts"]["records"],
        "parts": manifest["parts"]["rows"],
        "segments": manifest["segments"]["rows"],
        "bytes": size,
    }


def audit_in_child(ledger_dir: str) -> dict:
    """``jobs.audit.audit`` of the directory in a fresh process: its wall time and peak RSS; and the wall time of
    the whole ``zephon-ray audit DIR`` command (Python's start and the imports included)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, __file__, "--audit-child", ledger_dir], capture_output=True, text=True, check=True, env=env
    )
    t0 = time.perf_counter()
    cli = subprocess.run(
        [sys.executable, "-m", "zephon_ray.cli", "audit", ledger_dir], capture_output=True, text=True, env=env
    )
    command_s = time.perf_counter() - t0
    assert cli.returncode == 0 and cli.stdout.startswith("audit: clean"), cli.stdout + cli.stderr
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "command_s": command_s}


def peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM (getrusage's ru_maxrss keeps the high-water mark of the parent a
    subprocess forked from, across the exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _audit_child(ledger_dir: str) -> None:
    import pyarrow.parquet  # noqa: F401 - imported before the clock starts: the audit's own cost is timed

    try:
        import pandas  # noqa: F401 - pyarrow imports it at its first conversion when it is installed (1-2 s)
    except ImportError:
        pass

    from zephon_ray.jobs.audit import audit

    t0 = time.perf_counter()
    report = audit(ledger_dir)
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss_mb": peak_rss_mb(),
                "clean": report.clean,
                "records": report.records,
                "next_step": report.next_step,
                "verdict": report.verdict(),
            }
        )
    )


def audit_scale(counts: list[int], ranks: int, save_every: int) -> list[dict]:
    rows = []
    for n in counts:
        steps = max(1, n // ranks)
        with tempfile.TemporaryDirectory(dir=os.environ.get("ZEPHON_RAY_BENCH_DIR")) as work:
            t0 = time.perf_counter()
            made = generate(work, ranks=ranks, steps=steps, save_every=min(save_every, steps))
            write_s = time.perf_counter() - t0
            got = audit_in_child(work)
            assert got["clean"] and got["records"] == made["records"] == ranks * steps, got
        row = {
            "records": made["records"],
            "ranks": ranks,
            "steps": steps,
            "segments": made["segments"],
            "parts": made["parts"],
            "bytes": made["bytes"],
            "generate_s": write_s,
            **got,
        }
        rows.append(row)
        print(
            f"{row['records']:>13,} records ({ranks} ranks x {steps:,} steps, {row['segments']} segments, "
            f"{row['parts']:,} parts, {row['bytes'] / 1e6:,.1f} MB): audit {row['seconds']:.2f} s, peak RSS "
            f"{row['peak_rss_mb']:.0f} MB; the zephon-ray audit command {row['command_s']:.2f} s (generated in "
            f"{write_s:.1f} s)",
            flush=True,
        )
    return rows


def _tree(directory: str) -> tuple[int, int]:
    paths = [p for p in Path(directory).rglob("*") if p.is_file()]
    return len(paths), sum(p.stat().st_size for p in paths)


def realistic(ranks: int = 4, steps: int = 20_000, every: int = 100) -> dict:
    import hashlib

    from zephon_ray.formats import ledger

    with tempfile.TemporaryDirectory() as work:
        parent = ""
        for first in range(0, steps, every):
            sid = ledger.segment_id(
                run_id="bench",
                fingerprint=FP,
                parent=parent,
                first_step=first,
                next_step=first + every,
                world=ranks,
                resumed=False,
                schedule=_schedule(first + every),
            )
            for rank in range(ranks):
                records = [
                    ledger.Record(s, ranks, rank, hashlib.sha256(f"{s} {rank}".encode()).hexdigest()[:32])
                    for s in range(first, first + every)
                ]
                ledger.write_part(
                    work,
                    ledger.make_part(
                        run_id="bench",
                        fingerprint=FP,
                        segment=sid,
                        parent=parent,
                        first_step=first,
                        next_step=first + every,
                        world=ranks,
                        rank=rank,
                        resumed=False,
                        schedule=_schedule(first + every),
                        records=records,
                    ),
                )
            parent = sid
        files_before, bytes_before = _tree(work)
        audit_before = audit_in_child(work)
        t0 = time.perf_counter()
        result = ledger.compact(work)
        compact_s = time.perf_counter() - t0
        files_after, bytes_after = _tree(work)
        audit_after = audit_in_child(work)
        assert audit_before["verdict"] == audit_after["verdict"] and audit_after["clean"], (audit_before, audit_after)
    return {
        "ranks": ranks,
        "steps": steps,
        "save_every": every,
        "files_before": files_before,
        "bytes_before": bytes_before,
        "files_after": files_after,
        "bytes_after": bytes_after,
        "compact_s": compact_s,
        "audit_before_s": audit_before["seconds"],
        "audit_after_s": audit_after["seconds"],
        "records": result.records,
    }


def reader0_side(steps: int, in_process: bool, ranks: int = 4, every: int = 100, compact_every: int = 64) -> dict:
    """One side of part ``reader0``, in this (fresh) process: RSS in MB after each compaction."""
    import types

    import psutil

    from zephon_ray import Recipe
    from zephon_ray.formats import ledger
    from zephon_ray.stream.ledger_recorder import COMPACT_TIMEOUT_S, LedgerRecorder

    recipe = Recipe.from_toml(ROOT / "recipes" / "tiny.toml")
    rss: list[tuple[int, float]] = []
    with tempfile.TemporaryDirectory() as work:
        recorders = [
            LedgerRecorder(
                run_id="bench",
                fingerprint=FP,
                rank=r,
                world=ranks,
                ledger_dir=work,
                compact_every=0 if in_process else compact_every,
            )
            for r in range(ranks)
        ]
        for first in range(0, steps, every):
            for r, recorder in enumerate(recorders):
                for s in range(first, first + every):
                    recorder.handed(types.SimpleNamespace(step=s, ledger_digest=f"{s:016x}{r:016x}"))
                recorder.seal(first + every, recipe)
            saves = first // every + 1
            if saves % compact_every == 0:
                if in_process:
                    ledger.compact(work)
                else:
                    recorders[0].wait_compacted(COMPACT_TIMEOUT_S)
                rss.append((first + every, psutil.Process().memory_info().rss / 2**20))
        files, size = _tree(work)
    return {"in_process": in_process, "steps": steps, "rss_mb": rss, "files": files, "bytes": size}


def reader0(steps: int) -> dict:
    """Both sides of part ``reader0``, each in a fresh process."""
    sides = {}
    for name, flag in (("child", "0"), ("in_process", "1")):
        out = subprocess.run(
            [sys.executable, __file__, "--reader0-child", str(steps), flag],
            capture_output=True,
            text=True,
            check=True,
            timeout=3600,  # 200,000 steps took about 100 s a side here
        )
        sides[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return sides


def ft(steps: int, world: int = 3) -> dict:
    import hashlib

    from zephon_ray.formats import ledger
    from zephon_ray.stream.ledger_recorder import FtLedger

    with tempfile.TemporaryDirectory() as work:
        readers = [FtLedger(run_id="bench", fingerprint=FP, ledger_dir=work, schedule=_schedule) for _ in range(world)]
        t0 = time.perf_counter()
        for step in range(steps):
            for rank, reader in enumerate(readers):
                reader.served(step, rank, world, hashlib.sha256(f"{step} {rank}".encode()).hexdigest()[:32])
                reader.commit(step)
        commit_s = time.perf_counter() - t0
        for reader in readers:
            reader.close()
        files_before, bytes_before = _tree(work)
        audit_before = audit_in_child(work)
        ledger.compact(work)
        files_after, bytes_after = _tree(work)
        audit_after = audit_in_child(work)
        assert audit_before["clean"] and audit_after["clean"] and audit_after["records"] == steps * world
    return {
        "steps": steps,
        "world": world,
        "commit_ms": 1e3 * commit_s / (steps * world),
        "files_batched": files_before,
        "files_one_per_step": steps * world,
        "bytes": bytes_before,
        "audit_s": audit_before["seconds"],
        "peak_rss_mb": audit_before["peak_rss_mb"],
        "files_compacted": files_after,
        "audit_compacted_s": audit_after["seconds"],
        "peak_rss_compacted_mb": audit_after["peak_rss_mb"],
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--audit-child":
        return _audit_child(sys.argv[2])
    if len(sys.argv) == 4 and sys.argv[1] == "--reader0-child":
        print(json.dumps(reader0_side(int(sys.argv[2]), in_process=sys.argv[3] == "1")))
        return None
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="audit", help="comma-separated: audit, realistic, ft, reader0")
    parser.add_argument("--records", default="1e5,1e6,1e7")
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--ft-steps", type=int, default=100_000)
    parser.add_argument("--reader0-steps", type=int, default=60_000)
    args = parser.parse_args()
    parts = args.parts.split(",")
    result: dict = {"cpus": os.cpu_count()}
    if "audit" in parts:
        result["audit"] = audit_scale([int(float(x)) for x in args.records.split(",")], args.ranks, args.save_every)
    if "realistic" in parts:
        r = result["realistic"] = realistic()
        print(
            f"\n{r['ranks']} loaders, a save every {r['save_every']} steps, {r['steps']:,} steps: "
            f"{r['files_before']} files ({r['bytes_before'] / 1e6:.1f} MB) -> {r['files_after']} files "
            f"({r['bytes_after'] / 1e6:.2f} MB) after compact ({r['compact_s']:.1f} s); audit "
            f"{r['audit_before_s']:.2f} s -> {r['audit_after_s']:.2f} s",
            flush=True,
        )
    if "ft" in parts:
        f = result["ft"] = ft(args.ft_steps)
        print(
            f"\ntorchft, {f['world']} readers x {f['steps']:,} committed steps: {f['files_batched']} files batched "
            f"(one per step per reader: {f['files_one_per_step']:,}), {f['commit_ms']:.2f} ms per commit; audit "
            f"{f['audit_s']:.2f} s (peak RSS {f['peak_rss_mb']:.0f} MB); compacted to {f['files_compacted']} "
            f"files: audit {f['audit_compacted_s']:.2f} s (peak RSS {f['peak_rss_compacted_mb']:.0f} MB)",
            flush=True,
        )
    if "reader0" in parts:
        r0 = result["reader0"] = reader0(args.reader0_steps)
        print(f"\nthe recording process's RSS in MB after each compaction ({args.reader0_steps:,} steps, 4 readers):")
        print(f"{'step':>8} | {'compacting in a child':>22} | {'compacting in process':>22}")
        for (step, child), (_, inproc) in zip(r0["child"]["rss_mb"], r0["in_process"]["rss_mb"]):
            print(f"{step:>8} | {child:>22.1f} | {inproc:>22.1f}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
