"""A real-text corpus that nobody on this team wrote, built from what every Python install has.

Two sources, so recipes can mix them:

- ``prose``: docstrings of the standard library's modules, classes and functions (English technical prose);
- ``code``: the standard library's ``.py`` sources, split into pieces of at most ``code_chars`` characters.

Guarantee: for a given Python version (the stdlib is the input) and the same arguments, the output files are
byte-identical. Limit: a different Python version gives a different corpus, and so different fingerprints.
Files are parsed with ``ast`` and never imported.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FORMATS = ("jsonl", "parquet")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo")
    files = [p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def prose_records(files: list[Path], min_chars: int = 200) -> Iterator[dict]:
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                yield {"text": doc, "origin": f"{path.stem}:{getattr(node, 'name', '<module>')}"}


def code_records(files: list[Path], code_chars: int = 4000) -> Iterator[dict]:
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for start in range(0, len(text), code_chars):
            piece = text[start : start + code_chars]
            if piece.strip():
                yield {"text": piece, "origin": f"{path.stem}:{start}"}


def write_shards(records: Iterator[dict], out_dir: Path, fmt: str, records_per_shard: int, limit: int | None) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    shard: list[dict] = []
    count = index = 0

    def flush() -> None:
        nonlocal index
        if not shard:
            return
        stem = out_dir / f"shard-{index:05d}"
        if fmt == "jsonl":
            with open(f"{stem}.jsonl", "w", encoding="utf-8") as fh:
                for rec in shard:
                    fh.write(json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n")
        else:
            table = pa.table({"text": [r["text"] for r in shard], "origin": [r["origin"] for r in shard]})
            pq.write_table(table, f"{stem}.parquet", compression="zstd")
        shard.clear()
        index += 1

    for rec in records:
        if limit is not None and count >= limit:
            break
        shard.append(rec)
        count += 1
        if len(shard) >= records_per_shard:
            flush()
    flush()
    return count


def write_corpus(
    out_dir: str | Path,
    *,
    formats: tuple[str, ...] = FORMATS,
    records_per_shard: int = 2000,
    limit: int | None = None,
    code_chars: int = 4000,
    progress: bool = False,
) -> dict[str, int]:
    """Write ``OUT/<format>/{prose,code}/shard-NNNNN.<ext>``; returns record counts per source.
    ``progress``: a tqdm bar per source and format over the stdlib files read (stderr, terminals only)."""
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown corpus format {fmt!r}; expected one of {', '.join(FORMATS)}")
    out = Path(out_dir)
    files = stdlib_files()
    counts: dict[str, int] = {}
    def bar(desc: str) -> list[Path]:
        if not progress:
            return files
        from tqdm import tqdm

        return tqdm(files, desc=desc, unit="file", disable=None, leave=False)

    for fmt in formats:
        counts["prose"] = write_shards(prose_records(bar(f"{fmt} prose")), out / fmt / "prose", fmt,
                                       records_per_shard, limit)
        counts["code"] = write_shards(code_records(bar(f"{fmt} code"), code_chars), out / fmt / "code", fmt,
                                      records_per_shard, limit)
    return counts
