"""``locate`` (zephon_ray/jobs/locate.py): a planted record, found everywhere it was trained and nowhere else.

The corpus: 16 records of each tiny source, plus one planted record in prose/shard-00000.jsonl (record 5) whose text
is 150 BEL characters, a byte no other record holds. The brute force needs no provenance: it scans the batch path's
rows (GlobalBatchSource) for runs of that byte, each with the BOS before it and the EOS after it when they are in the
same row, and compares them with locate's hits; a hit's offset is checked against the run it names (0 when it starts
at the BOS). In-process (``scan_all``, the scan every lane-group actor runs: the default suite) and as the Ray Data
job with 2 lane groups (``locate``, ray_cluster; slow: ``tests/test_cli.py::test_locate_finds_what_show_docs_names``,
heavy, runs the job too).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

DATA = ROOT / "recipes" / "data" / "tiny"
MARK = 7  # BEL: in no record of tiny
MARK_LENGTH = 150
BOS, EOS = 256, 257
STEPS = range(10, 130)


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("planted")
    for source in ("prose", "code"):
        lines = (DATA / source / "shard-00000.jsonl").read_text().splitlines()[:16]
        assert not any(chr(MARK) in json.loads(line)["text"] for line in lines)
        if source == "prose":
            lines.insert(5, json.dumps({"text": chr(MARK) * MARK_LENGTH}))
        (root / source).mkdir()
        (root / source / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    recipe = root / "planted.toml"
    recipe.write_text(f"""seed = 5
lanes = 4
microbatches_per_lane = 1
rows_per_microbatch = 2
seq_len = 64
chunk_size = 8
flush_every_k_chunks = 2
tokenizer = "bytes"
packing = "wrap"

[[sources]]
name = "prose"
path = "{root / "prose"}"
weight = 0.5

[[sources]]
name = "code"
path = "{root / "code"}"
weight = 0.5
""")
    return recipe


def brute_force(recipe, steps: range) -> tuple[list[tuple[int, int, int, int]], dict[int, np.ndarray]]:
    """(step, row, start, end) of every run of the planted byte in the batch path's rows, with its BOS before and
    its EOS after when they are in the same row; and the rows of every step."""
    from zephon_ray import GlobalBatchSource

    spans, rows = [], {}
    with GlobalBatchSource(recipe) as source:
        for step in steps:
            rows[step] = source.batch(step).tokens
            for r, row in enumerate(rows[step]):
                marked = np.concatenate([[False], row == MARK, [False]]).astype(np.int8)
                edges = np.flatnonzero(np.diff(marked))
                for a, b in zip(edges[::2], edges[1::2]):
                    a -= int(a > 0 and row[a - 1] == BOS)
                    b += int(b < len(row) and row[b] == EOS)
                    spans.append((step, r, int(a), int(b)))
    return spans, rows


def check(hits, recipe, steps: range) -> None:
    """Every hit holding a planted byte is a brute-force span and the reverse; every hit's tokens are the planted
    document's at its offset (so a piece that is only the BOS, at a row's end, or only the EOS, at a row's start,
    which hold no planted byte, is checked too)."""
    truth, rows = brute_force(recipe, steps)
    document = np.asarray([BOS] + [MARK] * MARK_LENGTH + [EOS])
    for h in hits:
        assert np.array_equal(rows[h.step][h.row][h.start : h.end], document[h.offset : h.offset + h.end - h.start]), h
    spans = [(h.step, h.row, h.start, h.end) for h in hits if (rows[h.step][h.row][h.start : h.end] == MARK).any()]
    assert sorted(spans) == sorted(truth), (spans[:6], truth[:6])
    assert len({h.step for h in hits}) >= 3  # trained in several epochs of the range: the check can fail


def test_scan_finds_every_piece_and_nothing_else(planted):
    from zephon_ray import Recipe
    from zephon_ray.jobs.locate import record_ref, scan_all

    recipe = Recipe.from_toml(planted)
    target = record_ref(recipe, "prose", "shard-00000.jsonl", 5)
    hits = scan_all(recipe, target, STEPS)
    check(hits, recipe, STEPS)
    assert all(STEPS.start <= h.step < STEPS.stop for h in hits)


@pytest.mark.slow  # 40-50 s on the shared 2-core VM, mostly actor start; test_cli runs the job in the default suite
def test_locate_as_a_ray_data_job_with_two_lane_groups(planted, ray_cluster):
    from zephon_ray import Recipe
    from zephon_ray.jobs.locate import locate, record_ref, scan_all

    recipe = Recipe.from_toml(planted)
    target = record_ref(recipe, "prose", str(planted.parent / "prose" / "shard-00000.jsonl"), 5)  # a full path
    hits = locate(recipe, target, STEPS, groups=2, cpus_per_actor=0.25, progress=False)
    assert hits == scan_all(recipe, target, STEPS)
    check(hits, recipe, STEPS)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (("--source", "poetry", "--shard", "shard-00000.jsonl", "--record", "1"), "--source 'poetry'"),
        (("--source", "prose", "--shard", "shard-9.jsonl", "--record", "1"), "--shard 'shard-9.jsonl'"),
        (("--source", "prose", "--shard", "shard-00000.jsonl", "--record", "17"), "--record must be an int in [0, 16]"),
        (
            ("--source", "prose", "--shard", "shard-00000.jsonl", "--record", "1", "--steps", "0:1000000000"),
            "--steps end",
        ),
        (("--source", "prose", "--shard", "shard-00000.jsonl", "--record", "1", "--groups", "3"), "--groups 3"),
    ],
)
def test_bad_references_are_one_line(capsys, planted, flags, needle):
    from zephon_ray.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["locate", str(planted), *flags, "--quiet"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_training_step_inverts_data_step_and_names_the_skip():
    """With two ``[[skips]]``, every data step is read by exactly one training step or skipped by one named entry."""
    from zephon_ray import Recipe
    from zephon_ray.jobs.locate import training_step

    recipe = Recipe.from_toml(ROOT / "recipes" / "tiny.toml").with_skip("spike-1", 10, 14).with_skip("spike-2", 20, 23)
    read = {recipe.data_step(t): t for t in range(60)}
    for d in range(max(read)):
        step, skip = training_step(recipe, d)
        if d in read:
            assert (step, skip) == (read[d], None)
        else:
            assert step is None and skip == ("spike-1" if d < 20 else "spike-2"), d
    assert [d for d in range(40) if d not in read] == [10, 11, 12, 13, 24, 25, 26]
