"""The ledger format (``zephon_ray.formats.ledger``) and the loader state's ``ledger`` key: the slice digest against its
written formula, a part's round trip through a local path, the segment id every rank computes alike, and one line
naming the file and key for each bad document; compaction into packs (what it merges, how few packs remain, a real
process SIGKILLed at each of its commit points, findings that survive it, the command); the torchft spool (a real
process SIGKILLed between two flushes, a line cut short)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from zephon_ray.formats import ledger
from zephon_ray.formats.ledger import LedgerError, Record


def _sources_only(next_step: int) -> dict:
    """A ledger segment's schedule for a run of recipe fingerprint "f" * 64 without phases."""
    return {"data_next": next_step, "phases": [[0, "sources", "f" * 64]]}


def _part(**kw):
    """A part as LedgerRecorder writes it (format version 2: with its schedule); ``schedule=None``: version 1."""
    head = dict(run_id="r", fingerprint="f" * 64, parent="", first_step=0, next_step=2, world=2, rank=1, resumed=False)
    head.update({k: kw.pop(k) for k in list(kw) if k in head})
    head["schedule"] = kw.pop("schedule", _sources_only(head["next_step"]))
    seg = ledger.segment_id(
        **{
            k: head[k]
            for k in ("run_id", "fingerprint", "parent", "first_step", "next_step", "world", "resumed", "schedule")
        }
    )
    records = kw.pop("records", [Record(0, 2, 1, "a" * 32), Record(1, 2, 1, "b" * 32)])
    return ledger.make_part(segment=seg, records=records, **head)


def test_slice_digest_is_the_written_formula():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=(3, 9), dtype=np.int64)  # any int dtype: hashed as little-endian int32
    positions = np.tile(np.arange(9), (3, 1))
    expected = hashlib.sha256(
        b"zephon-ray/ledger-slice/v1\n" + b"3 9\n" + tokens.astype("<i4").tobytes() + positions.astype("<i4").tobytes()
    ).hexdigest()[:32]
    assert ledger.slice_digest(tokens, positions) == expected
    assert ledger.slice_digest(tokens[:2], positions[:2]) != expected  # the row count is part of it
    with pytest.raises(ValueError, match="must be equal 2-D shapes"):
        ledger.slice_digest(tokens, positions[:2])


def test_a_part_round_trips_and_its_segment_reads_back(tmp_path):
    part = _part()
    where = ledger.write_part(tmp_path, part)
    assert where.path.endswith(f"{part['segment']}/rank-00001-of-00002.json")
    assert ledger.read_part(where) == part
    other = _part(rank=0, records=[Record(0, 2, 0, "c" * 32, trained=0)])
    ledger.write_part(tmp_path, other)
    seg = ledger.read_segment(tmp_path, part["segment"])
    assert (seg.first_step, seg.next_step, seg.world, seg.parent) == (0, 2, 2, "")
    assert seg.parts == {
        0: [Record(0, 2, 0, "c" * 32, 0, 0)],
        1: [Record(0, 2, 1, "a" * 32), Record(1, 2, 1, "b" * 32)],
    }
    assert list(ledger.read_ledger(tmp_path)) == [part["segment"]]


def test_the_segment_id_depends_on_every_header_field():
    base = dict(
        run_id="r",
        fingerprint="f",
        parent="",
        first_step=0,
        next_step=2,
        world=2,
        resumed=False,
        schedule=_sources_only(2),
    )
    ids = {ledger.segment_id(**base)}
    for key, value in (
        ("run_id", "s"),
        ("fingerprint", "g"),
        ("parent", "0" * 24),
        ("first_step", 1),
        ("next_step", 3),
        ("world", 3),
        ("resumed", True),
        ("schedule", _sources_only(3)),
        ("schedule", None),
    ):  # None: a version-1 segment, whose id hashes no schedule
        ids.add(ledger.segment_id(**(base | {key: value})))
    assert len(ids) == 10 and ledger.segment_id(**base) in ids


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "other"}, "not a ledger segment (key 'format' is 'other'"),
        ({"version": 3}, "ledger segment version 3 is not supported (expected 1 or 2)"),
        ({"version": 1}, "ledger segment has unknown key 'schedule'"),
        ({"schedule": {"data_next": 2, "phases": []}}, 'ledger key \'schedule\' must be {"data_next": step, "phases"'),
        (
            {"schedule": {"data_next": 2, "phases": [[0, "sources", "f" * 64], [2, "late", "e" * 64]]}},
            "ledger key 'schedule' must be",
        ),  # a phase from data_next on made none of the segment's steps
        (
            {"schedule": {"data_next": 2, "phases": [[0, "sources", "f" * 64], [1, "late", "e" * 64]]}},
            "does not match its header",
        ),  # the id hashes the schedule: an edited one shows
        ({"extra": 1}, "ledger segment has unknown key 'extra'"),
        ({"world": 0}, "ledger key 'world' must be an int in [1, 10**12], got 0"),
        ({"rank": 5}, "rank 5 of 2 is impossible"),
        ({"next_step": 9}, "does not match its header"),
        (
            {"records": [[0, 2, 1, "a", 0]]},
            "ledger record 0 must be [step, world, rank, digest (32 hex digits), attempt, trained]",
        ),
        ({"records": [[0, 2, 1, "A" * 32, 0, 1]]}, "ledger record 0 must be"),
        ({"records": [[0, 2, 1, "a", -1, 1]]}, "ledger record 0 must be"),
    ],
)
def test_a_bad_part_is_one_line_naming_the_file_and_key(tmp_path, change, message):
    part = _part()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(part | change))
    with pytest.raises(LedgerError) as info:
        ledger.read_part(bad)
    text = str(info.value)
    assert text.startswith(f"{bad}: ") and message in text and "\n" not in text, text


def test_a_missing_key_a_missing_file_and_a_mixed_segment_are_named(tmp_path):
    part = _part()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({k: v for k, v in part.items() if k != "parent"}))
    with pytest.raises(LedgerError, match="ledger segment lacks key 'parent'"):
        ledger.read_part(bad)
    with pytest.raises(LedgerError, match="ledger segment missing"):
        ledger.read_part(tmp_path / "none.json")
    with pytest.raises(LedgerError, match="no ledger segments there"):
        ledger.read_ledger(tmp_path / "empty")
    ledger.write_part(tmp_path, part)
    stray = _part(first_step=0, next_step=3)  # another segment's part filed under this one
    (tmp_path / part["segment"] / "rank-00000-of-00002.json").write_text(json.dumps(stray))
    with pytest.raises(LedgerError, match="the part names segment .* not what its path says"):
        ledger.read_segment(tmp_path, part["segment"])


# Proves formats/loader_state.py: the state's `ledger` key names the segment that ends at next_step.
def test_the_loader_state_carries_a_valid_ledger_head():
    from zephon_ray.formats.loader_state import LoaderStateError, check_state, make_state

    state = make_state(run_id="r", fingerprint="f", next_step=4, zephon=None, ledger="0123456789abcdef01234567")
    assert check_state(state, run_id="r", fingerprint="f", recipe_name="x") == 4
    for bad in ("nothex", 7, "0" * 23):
        with pytest.raises(LoaderStateError, match="loader state key 'ledger' must be a ledger segment id"):
            check_state(state | {"ledger": bad}, run_id="r", fingerprint="f", recipe_name="x")
    with pytest.raises(LoaderStateError, match="version 2 is not supported.*version 3 'ledger'"):
        check_state(
            {k: v for k, v in state.items() if k != "ledger"} | {"version": 2},
            run_id="r",
            fingerprint="f",
            recipe_name="x",
        )


# ---------------------------------------------------------------------------------------------- compaction
def _digest(step: int, rank: int, world: int) -> str:
    return hashlib.sha256(f"{step} {rank} {world}".encode()).hexdigest()[:32]


def _write_run(ledger_dir, *, world: int, saves: list[int], parent: str = "", start: int = 0, run_id: str = "r") -> str:
    """A run's loose parts as LedgerRecorder writes them: every rank's part at each save (the first from step
    ``start``, continuing ``parent``); returns the head."""
    for end in saves:
        seg = ledger.segment_id(
            run_id=run_id,
            fingerprint="f" * 64,
            parent=parent,
            first_step=start,
            next_step=end,
            world=world,
            resumed=False,
            schedule=_sources_only(end),
        )
        for rank in range(world):
            ledger.write_part(
                ledger_dir,
                ledger.make_part(
                    run_id=run_id,
                    fingerprint="f" * 64,
                    segment=seg,
                    parent=parent,
                    first_step=start,
                    next_step=end,
                    world=world,
                    rank=rank,
                    resumed=False,
                    schedule=_sources_only(end),
                    records=[Record(s, world, rank, _digest(s, rank, world)) for s in range(start, end)],
                ),
            )
        parent, start = seg, end
    return parent


def _ledger_files(ledger_dir) -> list[str]:
    return sorted(str(p.relative_to(ledger_dir)) for p in ledger_dir.rglob("*") if p.is_file())


def _audit_lines(ledger_dir) -> tuple[list[str], int]:
    from zephon_ray.jobs.audit import audit

    report = audit(ledger_dir)
    return [f.line for f in report.findings] + report.notes + [report.verdict()], report.records


def test_compaction_merges_loose_parts_and_batches_into_one_pack_that_reads_the_same(tmp_path):
    """20 loose parts (W=4, 5 saves) and a torchft batch become one pack (3 files: two Parquet objects and the
    manifest); every record reads back equal, digests included, and the audit says the same."""
    head = _write_run(tmp_path, world=4, saves=[2, 4, 6, 8, 10])
    seg = ledger.segment_id(
        run_id="r",
        fingerprint="f" * 64,
        parent=head,
        first_step=10,
        next_step=11,
        world=2,
        resumed=False,
        schedule=_sources_only(11),
    )
    ledger.write_batch(
        tmp_path,
        [
            ledger.make_part(
                run_id="r",
                fingerprint="f" * 64,
                segment=seg,
                parent=head,
                first_step=10,
                next_step=11,
                world=2,
                rank=r,
                resumed=False,
                schedule=_sources_only(11),
                records=[Record(10, 2, r, _digest(10, r, 2), 1, 1)],
            )
            for r in range(2)
        ],
    )
    before, lines = ledger.read_ledger(tmp_path), _audit_lines(tmp_path)
    assert lines == (
        [
            "audit: clean: steps [0, 11) each trained exactly once in a lineage of 6 segment(s) (W 4 -> 2); "
            "rows not checked (no --recipe or --dataset)"
        ],
        42,
    )
    assert len(_ledger_files(tmp_path)) == 21
    result = ledger.compact(tmp_path)
    assert (result.files_before, result.files_after, result.parts, result.records) == (21, 3, 22, 42)
    assert _ledger_files(tmp_path) == [
        f"packs/{result.pack}.json",
        f"packs/{result.pack}.parts.parquet",
        f"packs/{result.pack}.segments.parquet",
    ]
    assert ledger.read_ledger(tmp_path) == before
    assert _audit_lines(tmp_path) == lines
    assert ledger.compact(tmp_path).pack is None  # nothing left to merge


def test_packs_stay_few_as_compactions_repeat(tmp_path):
    """40 saves, a compaction after each: a new pack merges the packs no larger than what it gathers, so the ledger
    holds O(log saves) packs, and every record is still there once."""
    head, counts = "", []
    for k in range(40):
        head = _write_run(tmp_path, world=2, saves=[5 * k + 5], parent=head, start=5 * k)
        ledger.compact(tmp_path)
        counts.append(len(ledger.containers(tmp_path).packs))
    assert max(counts) <= 6, counts  # log2(40) + 1
    lines, records = _audit_lines(tmp_path)
    assert records == 400 and lines[-1].startswith(
        "audit: clean: steps [0, 200) each trained exactly once in a lineage of 40 segment(s)"
    ), lines


KILLER = """
import os, sys, time
from zephon_ray.formats import ledger

def hook(stage):
    if stage == sys.argv[2]:
        open(sys.argv[3], "w").close()
        time.sleep(600)  # the test SIGKILLs this process here

ledger.compact(sys.argv[1], hook=hook)
"""


@pytest.mark.parametrize("stage", ["packed", "committed"])
def test_a_compaction_killed_at_each_point_audits_clean_and_a_rerun_finishes(tmp_path, stage):
    """A real process compacting a ledger (an older pack and new loose parts) is SIGKILLed after it uploaded the
    new pack's data objects ("packed": no manifest yet) or after its manifest ("committed": nothing deleted yet).
    The audit then reads the same records once each, with no duplicate counted; a re-run cleans up and finishes
    with one pack."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    head = _write_run(tmp_path / "ledger", world=3, saves=[4, 8])
    ledger.compact(tmp_path / "ledger")
    _write_run(tmp_path / "ledger", world=3, saves=[12, 16], parent=head, start=8)
    before, lines = ledger.read_ledger(tmp_path / "ledger"), _audit_lines(tmp_path / "ledger")
    assert lines == (
        [
            "audit: clean: steps [0, 16) each trained exactly once in a lineage of 4 segment(s) (W 3); "
            "rows not checked (no --recipe or --dataset)"
        ],
        48,
    )
    files_before = _ledger_files(tmp_path / "ledger")
    marker = tmp_path / "at-stage"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLER, str(tmp_path / "ledger"), stage, str(marker)],
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the compaction never reached " + stage
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    left = _ledger_files(tmp_path / "ledger")
    new = sorted(set(left) - set(files_before))
    assert set(files_before) <= set(left)  # nothing was deleted before the manifest
    pack = new[0].split(".")[0]  # the killed compaction's pack: its data, and its manifest once committed
    assert new == [f"{pack}.json"] * (stage == "committed") + [f"{pack}.parts.parquet", f"{pack}.segments.parquet"]
    assert ledger.read_ledger(tmp_path / "ledger") == before
    assert _audit_lines(tmp_path / "ledger") == lines  # 48 records: the copies were read once
    result = ledger.compact(tmp_path / "ledger")
    assert result.files_after == 3 and len(_ledger_files(tmp_path / "ledger")) == 3
    assert ledger.read_ledger(tmp_path / "ledger") == before
    assert _audit_lines(tmp_path / "ledger") == lines


def test_a_pack_of_an_unknown_version_or_cut_short_is_one_line(tmp_path):
    _write_run(tmp_path, world=2, saves=[3])
    pack = ledger.compact(tmp_path).pack
    manifest = tmp_path / "packs" / f"{pack}.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(doc | {"version": 7}))
    with pytest.raises(
        LedgerError, match=f"^{manifest}: ledger pack version 7 is not supported \\(expected 1 or 2\\)$"
    ):
        ledger.read_ledger(tmp_path)
    manifest.write_text(json.dumps(doc))
    data = tmp_path / "packs" / f"{pack}.parts.parquet"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(LedgerError, match=f"^{data}: ledger pack object is .* bytes, its manifest says"):
        ledger.read_ledger(tmp_path)


def test_a_ledger_of_format_version_1_reads_audits_and_compacts_with_its_schedule_unchecked(tmp_path):
    """A ledger written before segments recorded their schedule: version-1 loose parts, and a version-1 pack (its
    segments Parquet without the 'schedule' column, as such a pack was written), continued by a version-2 segment.
    Every record reads back, the audit is clean with one note naming the boundary it cannot check, and a compaction
    of the lot (a version-2 pack: null for the old segments) reads back the same."""
    import pyarrow.parquet as pq

    from zephon_ray.jobs.audit import audit

    def write_v1(start: int, end: int, parent: str) -> str:
        head = dict(
            run_id="r", fingerprint="f" * 64, parent=parent, first_step=start, next_step=end, world=1, resumed=False
        )
        seg = ledger.segment_id(**head)  # no schedule: the version-1 id
        part = ledger.make_part(
            **head, segment=seg, rank=0, records=[Record(s, 1, 0, _digest(s, 0, 1)) for s in range(start, end)]
        )
        assert part["version"] == 1 and "schedule" not in part
        ledger.write_part(tmp_path, part)
        return seg

    first = write_v1(0, 2, "")
    pack = ledger.compact(tmp_path).pack  # then made a version-1 pack, as an older release wrote it
    segments = tmp_path / "packs" / f"{pack}.segments.parquet"
    pq.write_table(pq.read_table(segments).drop_columns(["schedule"]), segments)
    manifest = tmp_path / "packs" / f"{pack}.json"
    doc = json.loads(manifest.read_text())
    doc["segments"]["bytes"] = segments.stat().st_size
    manifest.write_text(json.dumps(doc | {"version": 1}))
    second = write_v1(2, 4, first)
    head = _write_run(tmp_path, world=1, saves=[6], parent=second, start=4)  # the version-2 recorder continues it
    before = ledger.read_ledger(tmp_path)
    assert {sid: seg.schedule is None for sid, seg in before.items()} == {first: True, second: True, head: False}
    lines = _audit_lines(tmp_path)
    assert lines == (
        [
            f"schedule not checked at 2 segment boundary(ies) (the first: segment {second}, from step 2): "
            f"segment {first} (steps 0..1) is of ledger format version 1, which records no schedule",
            "audit: clean: steps [0, 6) each trained exactly once in a lineage of 3 segment(s) (W 1); "
            "rows not checked (no --recipe or --dataset)",
        ],
        6,
    )
    assert audit(tmp_path).head == head
    ledger.compact(tmp_path)
    assert json.loads(next((tmp_path / "packs").glob("*.json")).read_text())["version"] == ledger.PACK_VERSION == 2
    after = ledger.read_ledger(tmp_path)
    assert {k: (v.header, v.parts) for k, v in after.items()} == {k: (v.header, v.parts) for k, v in before.items()}
    assert _audit_lines(tmp_path) == lines


# ---------------------------------------------------------------------------------------------- torchft spool
FT_KILLER = """
import os, signal, sys
from zephon_ray.stream.ledger_recorder import FtLedger

ft = FtLedger(run_id="ft", fingerprint="f" * 64, ledger_dir=sys.argv[1], flush_records=3,
              schedule=lambda n: {"data_next": n, "phases": [[0, "sources", "f" * 64]]})
for step in range(int(sys.argv[2])):
    ft.served(step, 1, 2, "%032x" % step)
    ft.commit(step)
os.kill(os.getpid(), signal.SIGKILL)  # between two flushes: steps since the last batch are only in the spool
"""


def test_a_torchft_reader_killed_between_flushes_loses_nothing_it_committed(tmp_path):
    """A real process commits steps 0..10 through FtLedger (a batch file once more than 3 parts wait; the step in
    flight stays spooled) and SIGKILLs itself after step 10's commit returned: steps 9 and 10 are only in its spool. The audit reads them there; the next
    FtLedger on this host flushes the dead reader's spool into a batch, and compaction packs the lot."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from zephon_ray.formats.ledger import read_spool
    from zephon_ray.stream.ledger_recorder import FtLedger

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", FT_KILLER, str(tmp_path), "11"], timeout=120, env={**os.environ, "PYTHONPATH": str(root)}
    )
    assert proc.returncode == -9
    spools = sorted((tmp_path / "spool").iterdir())
    assert len(spools) == 1 and [p["first_step"] for p in read_spool(spools[0])] == [9, 10]
    assert len(list((tmp_path / "batches").iterdir())) == 3  # steps 0..2, 3..5, 6..8: one file per flush
    records = sorted(
        (r.step, r.rank, r.world)
        for seg in ledger.read_ledger(tmp_path).values()
        for rs in seg.parts.values()
        for r in rs
    )
    assert records == [(s, 1, 2) for s in range(11)]
    FtLedger(run_id="ft", fingerprint="f" * 64, ledger_dir=str(tmp_path), schedule=_sources_only)  # flushed on restart
    assert not list((tmp_path / "spool").iterdir()) and len(list((tmp_path / "batches").iterdir())) == 4
    ledger.compact(tmp_path)
    assert (
        sorted(
            (r.step, r.rank, r.world)
            for seg in ledger.read_ledger(tmp_path).values()
            for rs in seg.parts.values()
            for r in rs
        )
        == records
    )


def test_a_spool_line_cut_short_is_left_out_and_a_later_line_of_a_step_wins(tmp_path):
    part = _part(first_step=0, next_step=1, world=1, rank=0, records=[Record(0, 1, 0, "a" * 32)])
    again = _part(first_step=0, next_step=1, world=1, rank=0, records=[Record(0, 1, 0, "a" * 32, 1, 2)])
    spool = tmp_path / "x.jsonl"
    spool.write_text(json.dumps(part) + "\n" + json.dumps(again) + "\n" + json.dumps(part)[:30])
    assert ledger.read_spool(spool) == [again]
    spool.write_text(json.dumps(part)[:30] + "\n" + json.dumps(again) + "\n")
    with pytest.raises(LedgerError, match=f"^{spool}: line 1 of the ledger spool is not JSON$"):
        ledger.read_spool(spool)


def test_what_the_audit_finds_in_a_part_survives_compaction(tmp_path):
    """A pack stores a record column only where it differs from the part's default (its steps, W and rank, attempt 0,
    trained once): a step never trained, one trained twice on a later attempt, a step missing and a record of
    another rank read back the same, and the audit names the same findings after compaction."""
    seg = ledger.segment_id(
        run_id="r",
        fingerprint="f" * 64,
        parent="",
        first_step=0,
        next_step=4,
        world=2,
        resumed=False,
        schedule=_sources_only(4),
    )
    records = {
        0: [
            Record(0, 2, 0, _digest(0, 0, 2), 0, 0),
            Record(1, 2, 0, _digest(1, 0, 2), 1, 2),
            Record(3, 2, 0, _digest(3, 0, 2)),
        ],
        1: [Record(s, 2, 1 if s != 2 else 0, _digest(s, 1, 2)) for s in range(4)],
    }
    for rank, recs in records.items():
        ledger.write_part(
            tmp_path,
            ledger.make_part(
                run_id="r",
                fingerprint="f" * 64,
                segment=seg,
                parent="",
                first_step=0,
                next_step=4,
                world=2,
                rank=rank,
                resumed=False,
                schedule=_sources_only(4),
                records=recs,
            ),
        )
    before, lines = ledger.read_ledger(tmp_path), _audit_lines(tmp_path)
    assert lines[0] == [
        "step 0: skipped: rank 0 of 2 was handed it but never trained it",
        "step 1: trained twice: rank 0 of 2 trained it 2 times (its record is attempt 1: an earlier "
        "attempt that torchft rejected was applied too)",
        "step 2: skipped: rank 0 of 2 has no record of it",
        "step 2: split: the part of rank 1 of 2 holds a record of rank 0 of 2",
        "audit: 4 finding(s) in steps [0, 4) (W 2)",
    ], lines
    ledger.compact(tmp_path)
    assert ledger.read_ledger(tmp_path) == before and _audit_lines(tmp_path) == lines


def test_the_compact_command_says_what_it_merged_and_refuses_a_directory_without_a_ledger(tmp_path, capsys):
    from zephon_ray.cli import main

    directory = tmp_path / "ledger"
    _write_run(directory, world=2, saves=[3, 6])
    assert main(["ledger", "compact", str(directory)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    pack = ledger.containers(directory).packs
    assert line == f"{directory}: packed 4 part(s), 12 record(s) into {next(iter(pack))}; 4 -> 3 ledger file(s)"
    assert main(["ledger", "compact", str(directory)]) == 0
    assert capsys.readouterr().out == f"{directory}: nothing to merge; 3 -> 3 ledger file(s)\n"
    with pytest.raises(SystemExit) as info:
        main(["ledger", "compact", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err == (
        f"zephon-ray: error: {tmp_path / 'empty'}: no ledger segments there (not a "
        "ledger directory, or nothing was saved)\n"
    ), err


def test_a_group_healed_under_the_async_quorum_follows_the_participants_lineage(tmp_path):
    """TorchTitan's torchft trainer heals groups *during* a step (torchft's async quorum). Two FtLedgers play two
    groups. Step 0: both participate and B heals from A (torchft's init_sync) before applying it: B keeps its rows of
    step 0 and commits them under A's head. B dies; A commits steps 1 and 2 alone. B's new process holds placeholder
    rows at step 3 (torchft zeroes them), heals with A's state from before step 3 and applies the step: it writes
    nothing for step 3 and its head becomes A's segment of it, so both commit steps 4 and 5 at W 2 under one parent.
    The audit finds one lineage, W 2 -> 1 -> 2, each step once."""
    from zephon_ray.jobs.audit import audit
    from zephon_ray.stream.ledger_recorder import FtLedger

    def D(text: str) -> str:  # a slice digest: 32 hex digits
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def ledger():
        return FtLedger(run_id="ft", fingerprint="f" * 64, ledger_dir=str(tmp_path / "ledger"), schedule=_sources_only)

    def step(readers, s, world):
        for rank, reader in enumerate(readers):
            reader.check(s)
            reader.served(s, rank, world, D(f"{rank}-{s}-{world}"))
        return [reader.commit(s) for reader in readers]

    a, b = ledger(), ledger()
    for rank, reader in enumerate((a, b)):
        reader.check(0)
        reader.served(0, rank, 2, D(f"{rank}-0-2"))
    b.resume(a.head, a.next_step)  # init_sync: A's state at the quorum of step 0
    a.commit(0)
    b.commit(0)
    assert a.head == b.head and b.next_step == 1
    b.close()  # killed: its parts are in the spool, read where they are
    step([a], 1, 1)
    step([a], 2, 1)
    b = ledger()  # a new process of group B
    peer_state = (a.head, a.next_step)  # what the heal carries: A's state at the quorum of step 3
    a.check(3)
    a.served(3, 0, 1, D("0-3-1"))
    b.placeholder(3, 1)  # not participating: step 3's W is A's alone
    b.resume(*peer_state)
    a.commit(3)
    assert b.commit_placeholder() and (b.head, b.next_step) == (a.head, 4)
    step([a, b], 4, 2)
    step([a, b], 5, 2)
    assert a.head == b.head
    assert not b.commit_placeholder()  # nothing held: the position is never guessed
    for reader in (a, b):
        reader.close()
    report = audit(str(tmp_path / "ledger"))
    assert report.clean, [f.line for f in report.findings]
    assert report.next_step == 6 and report.records == 2 + 1 + 1 + 1 + 2 + 2
    assert [seg.world for seg in report.lineage] == [2, 1, 1, 1, 2, 2]


def test_a_compaction_in_a_child_process_fails_in_one_line_naming_the_directory(tmp_path):
    """Reader 0 compacts in a child process (``compact_in_child``): a child that fails is one line naming the
    directory and the child's own error, and one past its deadline is killed, in one line naming the deadline."""
    from zephon_ray.stream.ledger_recorder import compact_in_child

    empty = tmp_path / "not-a-ledger"
    empty.mkdir()
    with pytest.raises(RuntimeError) as failed:
        compact_in_child(str(empty))
    line = str(failed.value)
    assert "\n" not in line and "Traceback" not in line, line
    assert str(empty) in line and "no ledger segments" in line and "status 2" in line, line
    with pytest.raises(TimeoutError, match=r"not-a-ledger: compaction killed after 0 s"):
        compact_in_child(str(empty), timeout_s=0.001)  # a Python start alone takes longer


def _reader_zero(recipe, directory, run_id: str, compact_every: int):
    """A local-mode loader of ``recipe`` at rank 0 of 1, writing its ledger to ``directory``."""
    from zephon_ray.stream.loader import Loader, LoaderConfig

    config = LoaderConfig(
        recipe=str(recipe.path),
        mode="local",
        run_id=run_id,
        ledger_dir=str(directory),
        ledger_compact_every=compact_every,
    )
    return Loader(config, rank=0, world=1)


def _save_every_step(loader, saves: int) -> str:
    """A local-mode reader 0 reads and saves ``saves`` times, waiting for each compaction it starts; the last head."""
    it = iter(loader)
    for _ in range(saves):
        next(it)
        head = loader.state_dict()["ledger"]
        loader._ledger.wait_compacted(60)  # the test looks at the directory: let the compaction finish
    return head


def test_a_reader_zero_compaction_that_fails_is_logged_and_never_fails_the_trainer(
    tmp_path, tiny_recipe, monkeypatch, caplog
):
    """Reader 0's compaction child cannot start (no interpreter at ``sys.executable``): ``state_dict`` still returns
    and every part is still written; one warning line names the directory, and the next interval tries again."""
    import logging
    import sys

    directory = tmp_path / "ledger"
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))
    with (
        caplog.at_level(logging.WARNING, logger="zephon_ray"),
        _reader_zero(tiny_recipe, directory, "failing-compaction", 2) as loader,
    ):
        _save_every_step(loader, 4)
    failed = [r.getMessage() for r in caplog.records if "compaction failed" in r.getMessage()]
    assert len(failed) == 2, failed  # saves 2 and 4: each interval tried again
    assert all(str(directory) in m and "\n" not in m for m in failed), failed
    found = ledger.containers(directory)
    assert not found.packs and sum(len(v) for v in found.loose.values()) == 4, (found.packs, found.loose)


def test_reader_zero_compacts_as_the_run_saves(tmp_path, tiny_recipe):
    """A local-mode reader saving after every step, with ``ledger_compact_every=4``: reader 0 compacts in the
    background every 4 saves, so after 13 saves the directory holds a few packs and at most 4 saves' loose parts, not
    13 parts; the audit of the lineage reads the same steps and rows from them (clean, 13 slice digests matched)."""
    from zephon_ray import GlobalBatchSource
    from zephon_ray.jobs.audit import audit

    directory = tmp_path / "ledger"
    with _reader_zero(tiny_recipe, directory, "compacting", 4) as loader:
        head = _save_every_step(loader, 13)
    found = ledger.containers(directory)
    assert found.packs and sum(len(v) for v in found.loose.values()) <= 4, (found.packs, found.loose)
    assert found.file_count < 13
    with GlobalBatchSource(tiny_recipe) as source:
        batches = {s: source.batch(s) for s in range(13)}
    report = audit(directory, head, reference=lambda s: (batches[s].tokens, batches[s].positions), rows=16)
    assert report.clean and report.digests_checked == 13, [f.line for f in report.findings]
