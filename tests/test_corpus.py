"""The stdlib corpus: real text, deterministic bytes, JSONL and Parquet that Zephon reads the same."""

from __future__ import annotations

import hashlib

import pyarrow.parquet as pq
import pytest

from zephon_ray import GlobalBatchSource, Recipe
from zephon_ray.corpus import write_corpus
from zephon_ray.errors import UserInputError


def tree_digest(root):
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix == ".jsonl"):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def test_corpus_is_deterministic_and_real(tmp_path):
    a = write_corpus(tmp_path / "a", records_per_shard=50, limit=150)
    b = write_corpus(tmp_path / "b", records_per_shard=50, limit=150)
    assert a == b == {"prose": 150, "code": 150}
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    assert len(list((tmp_path / "a" / "jsonl" / "prose").glob("*.jsonl"))) == 3
    table = pq.read_table(tmp_path / "a" / "parquet" / "code" / "shard-00000.parquet")
    assert table.num_rows == 50 and "def " in "".join(table.column("text").to_pylist())


def test_parquet_and_jsonl_copies_give_the_same_batches(tmp_path):
    write_corpus(tmp_path, records_per_shard=100, limit=200)
    digests = {}
    for fmt in ("jsonl", "parquet"):
        recipe = Recipe.from_dict(
            {
                "seed": 3,
                "lanes": 2,
                "microbatches_per_lane": 1,
                "rows_per_microbatch": 2,
                "seq_len": 64,
                "chunk_size": 16,
                "tokenizer": "bytes",
                "sources": [
                    {"name": "prose", "path": str(tmp_path / fmt / "prose"), "weight": 0.5},
                    {"name": "code", "path": str(tmp_path / fmt / "code"), "weight": 0.5},
                ],
            }
        )
        with GlobalBatchSource(recipe) as source:
            digests[fmt] = [source.batch(s).digest for s in range(3)]
    assert digests["jsonl"] == digests["parquet"]


# Proves corpus.py: a bad OUT_DIR is one UserInputError naming it, before any work.
def test_bad_out_dir_is_one_error_and_writes_nothing(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, needle in (
        (a_file / "sub", f"{a_file} is not a directory"),
        (a_file, "is not a directory"),
        (full, "not empty"),
        ("/proc/no/such", "cannot create"),
    ):
        with pytest.raises(UserInputError, match="corpus directory") as info:
            write_corpus(out, formats=("jsonl",), limit=2)
        assert needle in str(info.value) and "\n" not in str(info.value)
    for kwargs, needle in (({"formats": ("xml",)}, "'xml'"), ({"limit": 0}, "limit")):
        with pytest.raises(UserInputError, match=needle):
            write_corpus(tmp_path / "new", **kwargs)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a-file", "full", "keep.txt"]  # nothing written


def test_corpus_is_written_whole_into_a_new_or_empty_directory(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_corpus(empty, formats=("jsonl",), limit=3) == {"prose": 3, "code": 3}
    assert write_corpus(tmp_path / "new" / "parents", formats=("jsonl",), limit=3)["code"] == 3
    assert tree_digest(empty) == tree_digest(tmp_path / "new" / "parents")
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]  # no work directory left behind
