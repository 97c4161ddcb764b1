"""The ledger format (``zephon_ray.formats.ledger``) and the loader state's ``ledger`` key: the slice digest against its
written formula, a part's round trip through a local path, the segment id every rank computes alike, and one line
naming the file and key for each bad document."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from zephon_ray.formats import ledger
from zephon_ray.formats.ledger import LedgerError, Record


def _part(**kw):
    head = dict(run_id="r", fingerprint="f" * 64, parent="", first_step=0, next_step=2, world=2, rank=1,
                resumed=False)
    head.update({k: kw.pop(k) for k in list(kw) if k in head})
    seg = ledger.segment_id(**{k: head[k] for k in ("run_id", "fingerprint", "parent", "first_step", "next_step",
                                                   "world", "resumed")})
    records = kw.pop("records", [Record(0, 2, 1, "a" * 32), Record(1, 2, 1, "b" * 32)])
    return ledger.make_part(segment=seg, records=records, **head)


def test_slice_digest_is_the_written_formula():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=(3, 9), dtype=np.int64)  # any int dtype: hashed as little-endian int32
    positions = np.tile(np.arange(9), (3, 1))
    expected = hashlib.sha256(b"zephon-ray/ledger-slice/v1\n" + b"3 9\n" + tokens.astype("<i4").tobytes()
                              + positions.astype("<i4").tobytes()).hexdigest()[:32]
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
    assert seg.parts == {0: [Record(0, 2, 0, "c" * 32, 0, 0)],
                         1: [Record(0, 2, 1, "a" * 32), Record(1, 2, 1, "b" * 32)]}
    assert ledger.list_segments(tmp_path) == [part["segment"]]


def test_the_segment_id_depends_on_every_header_field():
    base = dict(run_id="r", fingerprint="f", parent="", first_step=0, next_step=2, world=2, resumed=False)
    ids = {ledger.segment_id(**base)}
    for key, value in (("run_id", "s"), ("fingerprint", "g"), ("parent", "0" * 24), ("first_step", 1),
                       ("next_step", 3), ("world", 3), ("resumed", True)):
        ids.add(ledger.segment_id(**(base | {key: value})))
    assert len(ids) == 8 and ledger.segment_id(**base) in ids


@pytest.mark.parametrize("change, message", [
    ({"format": "other"}, "not a ledger segment (key 'format' is 'other'"),
    ({"version": 2}, "ledger segment version 2 is not supported (expected 1)"),
    ({"extra": 1}, "ledger segment has unknown key 'extra'"),
    ({"world": 0}, "ledger key 'world' must be an int in [1, 10**12], got 0"),
    ({"rank": 5}, "rank 5 of 2 is impossible"),
    ({"next_step": 9}, "does not match its header"),
    ({"records": [[0, 2, 1, "a", 0]]}, "ledger record 0 must be [step, world, rank, digest, attempt, trained]"),
    ({"records": [[0, 2, 1, "a", -1, 1]]}, "ledger record 0 must be"),
])
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
        ledger.list_segments(tmp_path / "empty")
    ledger.write_part(tmp_path, part)
    stray = _part(first_step=0, next_step=3)  # another segment's part filed under this one
    (tmp_path / part["segment"] / "rank-00000-of-00002.json").write_text(json.dumps(stray))
    with pytest.raises(LedgerError, match="the part names segment .* not what its path says"):
        ledger.read_segment(tmp_path, part["segment"])


def test_the_loader_state_carries_a_valid_ledger_head():
    from zephon_ray.formats.loader_state import LoaderStateError, check_state, make_state

    state = make_state(run_id="r", fingerprint="f", next_step=4, zephon=None, ledger="0123456789abcdef01234567")
    assert check_state(state, run_id="r", fingerprint="f", recipe_name="x") == 4
    for bad in ("nothex", 7, "0" * 23):
        with pytest.raises(LoaderStateError, match="loader state key 'ledger' must be a ledger segment id"):
            check_state(state | {"ledger": bad}, run_id="r", fingerprint="f", recipe_name="x")
    with pytest.raises(LoaderStateError, match="version 2 is not supported.*version 3 'ledger'"):
        check_state({k: v for k, v in state.items() if k != "ledger"} | {"version": 2}, run_id="r",
                    fingerprint="f", recipe_name="x")
