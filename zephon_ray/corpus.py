"""A real-text corpus that nobody on this team wrote, built from what every Python install has.

Two sources, so recipes can mix them:

- ``prose``: docstrings of the standard library's modules, classes and functions (English technical prose);
- ``code``: the standard library's ``.py`` sources, split into pieces of at most ``code_chars`` characters.

Guarantee: for a given Python version (the stdlib is the input) and the same arguments, the output files are
byte-identical. Limit: a different Python version gives a different corpus, and so different fingerprints.
Files are parsed with ``ast`` and never imported.

The corpus is written whole or not at all: into a temporary sibling of ``OUT_DIR``, renamed into place at the end.
``OUT_DIR`` must not exist yet (or be an empty directory), and its nearest existing ancestor must be a writable
directory (missing parents are created); anything
else is one :class:`~zephon_ray.errors.UserInputError` naming the path, before any work.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sysconfig
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from zephon_ray.checks import check_int
from zephon_ray.errors import UserInputError

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
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
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
            raise UserInputError(f"unknown corpus format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if limit is not None:
        check_int("corpus limit", limit, low=1, error=UserInputError)
    out = check_out_dir(out_dir)
    work = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        work.mkdir(parents=True)
    except OSError as exc:  # the user's path: e.g. under /proc, or a read-only mount that os.access cannot see
        raise UserInputError(f"corpus directory {out_dir}: cannot create it ({exc.strerror or exc})") from None
    try:
        counts = _write(work, formats, records_per_shard, limit, code_chars, progress)
        if out.is_dir():
            out.rmdir()  # empty (checked above); fails loudly if someone wrote into it meanwhile
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return counts


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` as a path the corpus can be created at, or one :class:`UserInputError` naming it."""
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise UserInputError(f"corpus directory {out_dir}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise UserInputError(f"corpus directory {out_dir}: exists and is not empty (choose a new directory)")
    existing = next(p for p in out.parents if p.exists())  # "/" at worst
    if not existing.is_dir():
        raise UserInputError(f"corpus directory {out_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserInputError(f"corpus directory {out_dir}: {existing} is not writable")
    return out


def _write(
    out: Path, formats: tuple[str, ...], records_per_shard: int, limit: int | None, code_chars: int, progress: bool
) -> dict[str, int]:
    files = stdlib_files()
    counts: dict[str, int] = {}

    def bar(desc: str) -> list[Path]:
        if not progress:
            return files
        from tqdm import tqdm

        return tqdm(files, desc=desc, unit="file", disable=None, leave=False)

    for fmt in formats:
        counts["prose"] = write_shards(
            prose_records(bar(f"{fmt} prose")), out / fmt / "prose", fmt, records_per_shard, limit
        )
        counts["code"] = write_shards(
            code_records(bar(f"{fmt} code"), code_chars), out / fmt / "code", fmt, records_per_shard, limit
        )
    return counts
