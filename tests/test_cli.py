"""The zephon-ray command: digest lines, readable show, clean one-line errors."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, TINY


def run(*args, check=True):
    return subprocess.run(
        [sys.executable, "-m", "zephon_ray.cli", *args], capture_output=True, text=True, timeout=300, check=check,
        cwd=ROOT,
    )


def test_digest_prints_one_line_per_step(reference_digests):
    out = run("digest", str(TINY), "--steps", "3:6").stdout.splitlines()
    assert out == [f"step {s} {reference_digests[s]}" for s in range(3, 6)]


def test_show_summarises_a_step(reference_digests):
    out = run("show", str(TINY), "--step", "4", "--rows", "2").stdout
    assert reference_digests[4] in out
    assert "16 x 65 tokens" in out and "prose" in out and "code" in out
    assert out.count("\nrow ") == 2


def test_user_errors_are_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("lanes = 8", "lanes = 0"))
    for args, needle in (
        (("digest", str(bad), "--steps", "0:2"), "'lanes'"),
        (("digest", str(TINY), "--steps", "5:2"), "--steps"),
        (("digest", str(tmp_path / "missing.toml"), "--steps", "0:1"), "missing.toml"),
    ):
        result = run(*args, check=False)
        assert result.returncode == 2, result
        assert needle in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_corpus_command(tmp_path):
    out = run("corpus", str(tmp_path / "c"), "--formats", "jsonl", "--limit", "10").stdout
    assert "prose 10 records" in out
    assert (tmp_path / "c" / "jsonl" / "code" / "shard-00000.jsonl").is_file()
