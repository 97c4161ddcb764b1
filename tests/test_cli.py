"""The zephon-ray command: digest lines, readable show, clean one-line errors, bench."""

from __future__ import annotations

import json
import subprocess
import sys

import oracle
import pytest
from conftest import ROOT, TINY

GOLDEN = oracle.load_golden(TINY)["digests"]  # steps 0..169 of the tiny recipe, from the independent oracle


def run(*args, check=True):
    return subprocess.run(
        [sys.executable, "-m", "zephon_ray.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=check,
        cwd=ROOT,
    )


def test_digest_prints_one_line_per_step():
    out = run("digest", str(TINY), "--steps", "3:6").stdout.splitlines()
    assert out == [f"step {s} {GOLDEN[s]}" for s in range(3, 6)]


def test_show_summarises_a_step():
    out = run("show", str(TINY), "--step", "4", "--rows", "2").stdout
    assert GOLDEN[4] in out
    assert "16 x 65 tokens" in out and "prose" in out and "code" in out
    # the same tokens-per-step figure that `validate` prints (show once said 1040, counting each label token)
    assert "\ntokens/step 1024\n" in out and "\ntokens/step 1024\n" in run("validate", str(TINY)).stdout
    assert out.count("\nrow ") == 2


def test_user_errors_are_one_line_without_traceback(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("lanes = 8", "lanes = 0"))
    for args, needle in (
        (("digest", str(bad), "--steps", "0:2"), "'lanes'"),
        (("digest", str(TINY), "--steps", "5:2"), "--steps"),
        (("digest", str(tmp_path / "missing.toml"), "--steps", "0:1"), "missing.toml"),
    ):
        code, out, err = _main(capsys, *args)
        assert code == 2 and out == "", (args, code, out, err)
        assert needle in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


def test_corpus_command(tmp_path):
    out = run("corpus", str(tmp_path / "c"), "--formats", "jsonl", "--limit", "10").stdout
    assert "prose 10 records" in out
    assert (tmp_path / "c" / "jsonl" / "code" / "shard-00000.jsonl").is_file()


# ---------------------------------------------------------------------- validate / fingerprint / show --plot
def _main(capsys, *args):
    """The CLI in-process (no interpreter start-up): (exit code, stdout, stderr)."""
    from zephon_ray.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_validate_prints_fingerprint_and_geometry(capsys, tiny_recipe, reference_digests):
    code, out, _ = _main(capsys, "validate", "tiny")  # a bare name: the packaged recipe
    assert code == 0
    assert f"fingerprint {tiny_recipe.fingerprint}" in out
    assert "L=8 lanes x k=1 microbatches x m=2 rows = B=16 rows of seq_len 64+1" in out
    assert "tokens/step 1024" in out
    assert (
        "W (service) 1-16, any count up to B (dataset mode too); every rank gets B/W rows at W = 1 2 4 8 16" in out
        and "W (local)   1 2 4 8" in out
    )
    # ceil(16/W) x W - 16 padding rows per step for equal shapes: 3 -> 2, 5 -> 4, 7 -> 5
    assert "padding     rows per step for equal shapes (pad_slices) at W = 3: 2 (12%), 5: 4 (25%)," in out
    assert f"step 0      {reference_digests[0]}" in out

    code, out, _ = _main(capsys, "fingerprint", str(TINY))
    assert (code, out) == (0, tiny_recipe.fingerprint + "\n")


def test_validate_rejects_a_bad_recipe_in_one_line(capsys, tmp_path):
    cases = {
        "lanes = 8": ("lanes = 0", "'lanes'"),
        "seq_len = 64": ("seq_len = 64\nsurprise = 1", "'surprise'"),
        'packing = "wrap"': ('packing = "zigzag"', "'packing'"),
    }
    for old, (new, needle) in cases.items():
        bad = tmp_path / f"bad-{len(needle)}.toml"
        bad.write_text(TINY.read_text().replace("data/tiny", str(TINY.parent / "data" / "tiny")).replace(old, new))
        code, out, err = _main(capsys, "validate", str(bad))
        assert code == 2 and out == "", (old, out, err)
        assert needle in err and str(bad) in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _main(capsys, "validate", "no-such-recipe")
    assert code == 2 and "no-such-recipe" in err and "tiny" in err and len(err.strip().splitlines()) == 1

    # Loads, but Zephon cannot build it (no such field in the records): validate builds step 0 and says why.
    unbuildable = tmp_path / "no-field.toml"
    unbuildable.write_text(
        TINY.read_text()
        .replace("data/tiny", str(TINY.parent / "data" / "tiny"))
        .replace("seq_len = 64", 'seq_len = 64\ntext_field = "body"')
    )
    code, _, err = _main(capsys, "validate", "--no-build", str(unbuildable))
    assert code == 0, err
    code, out, err = _main(capsys, "validate", str(unbuildable))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "building step 0 failed" in err and "'body'" in err and str(unbuildable) in err


# Proves plots.py: `zephon-ray show --plot FILE` writes the PNG.
def test_show_plot_writes_a_png(capsys, tmp_path, tiny_recipe, reference_digests):
    from zephon_ray import GlobalBatchSource
    from zephon_ray.plots import batch_summary

    out_png = tmp_path / "step2.png"
    code, out, err = _main(capsys, "show", "tiny", "--step", "2", "--rows", "0", "--plot", str(out_png))
    assert code == 0, err
    assert reference_digests[2] in out and str(out_png) in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 20_000
    with GlobalBatchSource(tiny_recipe) as source:
        batch = source.batch(2)
    summary = batch_summary(batch)  # the numbers behind the panels
    assert summary.piece_lengths.sum() == batch.tokens.size  # every token is in exactly one document piece
    assert summary.pieces_per_row.sum() == summary.piece_lengths.size
    assert abs(sum(summary.source_share.values()) - 1) < 1e-9 and (summary.packing_efficiency == 1).all()


def test_document_pieces_follow_position_resets():
    import numpy as np

    from zephon_ray.plots import document_pieces

    lengths, per_row = document_pieces(np.array([[5, 6, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]))
    assert lengths.tolist() == [2, 3, 1, 6] and per_row.tolist() == [3, 1]


# ---------------------------------------------------------------------- show --docs, locate
def test_show_docs_names_every_rows_documents(capsys):
    """``show --docs``: each row of rank 1 of 3 (rows 5-9) with its pieces and their text; ``--json`` the same rows,
    whose text is the row's own bytes (tiny's byte tokenizer) and whose pieces tile every row."""
    from zephon_ray import GlobalBatchSource, Recipe

    code, out, err = _main(
        capsys, "show", "tiny", "--step", "3", "--docs", "--rank", "1", "--world", "3", "--chars", "20"
    )
    assert code == 0, err
    assert GOLDEN[3] in out and "5..9 of 16 (rank 1 of 3)" in out and out.count("\nrow ") == 5
    code, out, err = _main(capsys, "show", "tiny", "--step", "3", "--docs", "--json", "--rank", "1", "--world", "3")
    doc = json.loads(out)
    assert code == 0 and doc["digest"] == GOLDEN[3] and [r["row"] for r in doc["rows"]] == [5, 6, 7, 8, 9]
    with GlobalBatchSource(Recipe.from_toml(TINY)) as source:
        rows = source.batch(3).tokens
    for entry in doc["rows"]:
        assert entry["pieces"][0]["start"] == 0 and entry["pieces"][-1]["end"] == 65
        for p in entry["pieces"]:
            raw = bytes(int(t) for t in rows[entry["row"]][p["start"] : p["end"]] if t < 256)
            assert raw.decode("utf-8", errors="replace").startswith(p["text"]) and p["path"].endswith(p["shard"])


def test_show_docs_summarises_a_range_per_source_and_shard(capsys):
    code, out, err = _main(capsys, "show", "tiny", "--steps", "0:4", "--docs", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["tokens"] == 4 * 16 * 65, err
    sources = [r for r in doc["by"] if "shard" not in r]
    shards = [r for r in doc["by"] if "shard" in r]
    assert {r["source"] for r in sources} == {"prose", "code"}
    assert sum(r["tokens"] for r in sources) == sum(r["tokens"] for r in shards) == doc["tokens"]
    code, out, _ = _main(capsys, "show", "tiny", "--steps", "0:4", "--docs")
    assert code == 0 and "source prose:" in out and "  shard code/shard-0000" in out


@pytest.mark.heavy
def test_locate_finds_what_show_docs_names(capsys, ray_cluster):
    """A record that ``show --docs`` names at step 3 row 0: ``locate`` over steps 0:8 lists that piece, and every
    piece it lists is one ``show --docs --json`` names at its step and row."""
    code, out, err = _main(capsys, "show", "tiny", "--step", "3", "--docs", "--json")
    piece = json.loads(out)["rows"][0]["pieces"][0]
    code, out, err = _main(
        capsys,
        "locate",
        "tiny",
        "--source",
        piece["source"],
        "--shard",
        piece["shard"],
        "--record",
        str(piece["record"]),
        "--steps",
        "0:8",
        "--groups",
        "2",
        "--json",
        "--quiet",
    )
    assert code == 0, err
    hits = json.loads(out)["hits"]
    assert {"step": 3, "row": 0, "start": piece["start"], "end": piece["end"], "offset": piece["offset"]} in hits
    from zephon_ray import GlobalBatchSource, Recipe

    with GlobalBatchSource(Recipe.from_toml(TINY)) as source:
        for hit in hits:
            named = source.provenance(hit["step"]).rows[hit["row"]]
            assert any(
                (p.source, p.shard, p.record, p.start, p.end, p.offset)
                == (piece["source"], piece["shard"], piece["record"], hit["start"], hit["end"], hit["offset"])
                for p in named
            ), hit


# ---------------------------------------------------------------------- bad input: one line naming it, exit 2
def _bad_inputs(tmp_path):
    plot_dir = tmp_path / "SOME_DIR.png"
    plot_dir.mkdir()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    return [
        # (argv, what the one line must name)
        (("corpus", "/etc/passwd/sub"), "/etc/passwd"),
        (("corpus", str(full)), str(full)),
        (("corpus", str(tmp_path / "c"), "--formats", "jsonl,xml"), "'xml'"),
        (("corpus", str(tmp_path / "c"), "--limit", "0"), "--limit"),
        (("show", "tiny", "--plot", str(plot_dir)), str(plot_dir)),
        (("show", "tiny", "--plot", str(tmp_path / "no" / "such" / "x.png")), str(tmp_path / "no" / "such")),
        (("show", "tiny", "--step", "-1"), "--step"),
        (("fingerprint", "/bin/ls"), "/bin/ls"),
        (("digest", "tiny", "--steps", "0:1", "--via", "service", "--producers", "0"), "--producers"),
        (("digest", "tiny", "--steps", "0:1", "--via", "dataset"), "--dataset"),
        (("bench", "tiny", "--steps", "0"), "--steps"),
        (("bench", "tiny", "--producers", "3", "--via", "service"), "--producers 3"),
        (("no-such-command",), "no-such-command"),
        (("show", "tiny", "--steps", "0:2"), "--docs"),
        (("show", "tiny", "--docs", "--rank", "1"), "--world"),
        (("show", "tiny", "--docs", "--rank", "3", "--world", "3"), "--rank 3"),
        (("show", "tiny", "--docs", "--rank", "0", "--world", "17"), "17"),
        (("show", "tiny", "--docs", "--steps", "0:200001"), "--steps"),
        (("show", "tiny", "--docs", "--step", "2", "--steps", "0:2"), "--step"),
    ]


def test_bad_input_is_one_line_naming_it(capsys, tmp_path):
    """Every one: exit 2, one line on stderr naming the value at fault, nothing on stdout, nothing written."""
    cases = _bad_inputs(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for args, needle in cases:
        code, out, err = _main(capsys, *args)
        assert code == 2, (args, code, out, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
        assert err.startswith("zephon-ray") and needle in err, (args, needle, err)
        assert out == "", (args, out)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing half-written


def test_bad_input_from_a_real_process_is_one_line():
    """The same through a real interpreter (``python -m zephon_ray.cli``: exit status, stderr), once."""
    for args, needle in ((("corpus", "/etc/passwd/sub"), "/etc/passwd"),):
        result = run(*args, check=False)
        assert result.returncode == 2 and result.stdout == "", result
        assert len(result.stderr.strip().splitlines()) == 1 and needle in result.stderr, result.stderr


def test_a_bug_is_not_hidden_as_a_user_error(capsys, monkeypatch):
    """main() reports user errors as one line, and nothing else: a bug keeps its traceback."""
    import zephon_ray.cli as cli
    import zephon_ray.cli.data as data
    from zephon_ray.errors import UserInputError

    def buggy(args):
        raise KeyError("a bug")

    monkeypatch.setattr(data, "cmd_fingerprint", buggy)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["fingerprint", str(TINY)])
    for error in (RuntimeError("a bug"), PermissionError(13, "Permission denied", "/x"), AttributeError("bug")):
        monkeypatch.setattr(data, "cmd_fingerprint", lambda args, error=error: (_ for _ in ()).throw(error))
        with pytest.raises(type(error)):
            cli.main(["fingerprint", str(TINY)])

    def user_error(args):
        raise UserInputError("--thing 7: not a thing\nsecond line")

    monkeypatch.setattr(data, "cmd_fingerprint", user_error)
    code, out, err = _main(capsys, "fingerprint", str(TINY))
    assert (code, out, err) == (2, "", "zephon-ray: error: --thing 7: not a thing second line\n")


# ---------------------------------------------------------------------- bench
def test_bench_measures_and_reads_the_real_batches(capsys):
    """``zephon-ray bench`` (no checkout needed): it times real reads, and the last batch it read is the golden one."""
    code, out, err = _main(capsys, "bench", "tiny", "--steps", "3", "--warmup", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    local = report["paths"]["local"]
    assert local["steps"] == 3 and local["last_step"] == 3 and local["last_digest"] == GOLDEN[3]
    assert local["tokens_per_s"] > 0 and local["step_latency_p99_ms"] >= local["step_latency_p50_ms"] > 0
    assert report["tokens_per_step"] == 1024 and "ratio_service_over_local" not in report

    code, out, err = _main(capsys, "bench", "tiny", "--steps", "2", "--warmup", "0")
    assert code == 0 and "M tokens/s" in out and f"step 1 digest {GOLDEN[1]}" in out, (out, err)


def test_bench_both_paths_alternate_and_give_a_ratio(capsys, ray_cluster):
    code, out, err = _main(
        capsys, "bench", "tiny", "--via", "both", "--steps", "2", "--warmup", "1", "--rounds", "2", "--json"
    )
    assert code == 0, err
    report = json.loads(out)  # stdout is the JSON alone: Ray's notices go to stderr (test_ray_internals.py)
    assert set(report["paths"]) == {"local", "service"} and len(report["round_ratios"]) == 2
    for path in report["paths"].values():
        assert path["steps"] == 4 and path["last_step"] == 4 and path["last_digest"] == GOLDEN[4]
    assert report["ratio_service_over_local"] > 0 and report["producers"] == 1
