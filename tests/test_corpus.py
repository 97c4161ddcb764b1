"""The stdlib corpus: real text, deterministic bytes, JSONL and Parquet that Zephon reads the same."""

from __future__ import annotations

import hashlib

import pyarrow.parquet as pq

from zephon_ray import GlobalBatchSource, Recipe
from zephon_ray.corpus import write_corpus


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
                "seed": 3, "lanes": 2, "microbatches_per_lane": 1, "rows_per_microbatch": 2, "seq_len": 64,
                "chunk_size": 16, "tokenizer": "bytes",
                "sources": [
                    {"name": "prose", "path": str(tmp_path / fmt / "prose"), "weight": 0.5},
                    {"name": "code", "path": str(tmp_path / fmt / "code"), "weight": 0.5},
                ],
            }
        )
        with GlobalBatchSource(recipe) as source:
            digests[fmt] = [source.batch(s).digest for s in range(3)]
    assert digests["jsonl"] == digests["parquet"]
