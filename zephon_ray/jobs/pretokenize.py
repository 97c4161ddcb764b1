"""Pre-tokenisation: a Ray Data job that turns a recipe's text sources into token-id Parquet shards.

    RECIPE ──► one task per input shard ──► map_batches on an ActorPoolStrategy of tokenizer actors
                                                 │  read shard, decode, tokenize, bracket [BOS, ..., EOS]
                                                 ▼
    OUT_DIR/sources/<name>/<same relative name>.parquet   (column ``input_ids``, list<int32>, record order kept)
    OUT_DIR/_progress/...json                            (one entry per finished shard: resume points)
    OUT_DIR/recipe.toml                                  (the same recipe over the token-id copies)
    OUT_DIR/manifest.json                                (written last: tokenizer identity, listing, counts)

Guarantee: the token ids of record i of shard f are exactly the ``input_ids`` Zephon's
``decode_text() → tokenize(special_tokens="bos_eos")`` would give record i of f, and every output shard has
the same records in the same order, so ``OUT_DIR/recipe.toml`` yields global batches with **the same digests**
as RECIPE (tests/test_pretokenize.py::test_pretokenized_digests_match_raw, for the byte tokenizer and a BPE
tokenizer). Ray Data only schedules the per-shard work: it never decides batch contents.

Limits:
- A shard is tokenised by one actor in one piece, so a shard must fit in an actor's memory.
- The pre-tokenised recipe has its own fingerprint (its shards are other files), so a loader state saved
  under RECIPE does not load under ``OUT_DIR/recipe.toml``: the digests are equal, the identities are not.
- The decode step mirrors Zephon 0.2.0's ``decode_text`` defaults (UTF-8, ``\\r\\n``/``\\r`` to ``\\n``) and the
  ``bos_eos`` bracketing; the digest-equality test is what pins that down for a new Zephon version.
- Only ``jsonl`` and ``parquet`` sources are read (the formats a recipe accepts).
- Actors write the token shards themselves: OUT_DIR must be on storage every node of the cluster reaches.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zephon_ray.recipe import Recipe, RecipeError
from zephon_ray.tokenizers import build_tokenizer, tokenizer_identity

MANIFEST_FORMAT = "zephon-ray/pretokenized/v1"
MANIFEST_NAME = "manifest.json"
RECIPE_NAME = "recipe.toml"
SOURCES_DIR = "sources"
PROGRESS_DIR = "_progress"
TOKEN_FIELD = "input_ids"
SPECIAL_TOKENS = "bos_eos"
TOKENIZE_BATCH = 512
PARQUET_COMPRESSION = "zstd"

# Manifest keys
KEY_FORMAT = "format"
KEY_TOKENIZER = "tokenizer"
KEY_SPECIAL_TOKENS = "special_tokens"
KEY_SOURCE_FINGERPRINT = "source_recipe_fingerprint"
KEY_SOURCES = "sources"
KEY_TOTALS = "totals"


class PretokenizeError(ValueError):
    """A pre-tokenisation that cannot run or a manifest that does not check out; the message names the file."""


# ---------------------------------------------------------------------- files
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp name in the same directory, fsync, rename over ``path``: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def shard_list(source: Any) -> list[tuple[str, int]]:
    """(name relative to the source directory, size) of every shard Zephon reads, in Zephon's order."""
    return [(s.name, s.size) if hasattr(s, "name") else (s[0], s[1]) for s in source.shards]


def output_name(relative: str) -> str:
    """``a/b.jsonl`` -> ``a/b.parquet``: the same relative name with the Parquet suffix."""
    stem, _, _ext = relative.rpartition(".")
    return f"{stem}.parquet"


# ---------------------------------------------------------------------- the per-shard work
@dataclass(frozen=True)
class ShardTask:
    source: str
    raw_path: str
    raw_format: str
    relative: str
    out_path: str
    progress_path: str


def read_texts(path: str, fmt: str, text_field: str) -> list[Any]:
    if fmt == "jsonl":
        texts = []
        with open(path, "rb") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if text_field not in record:
                    raise PretokenizeError(f"{path}:{number}: record has no field {text_field!r}")
                texts.append(record[text_field])
        return texts
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if text_field not in table.column_names:
        raise PretokenizeError(f"{path}: no column {text_field!r} (columns: {', '.join(table.column_names)})")
    return table.column(text_field).to_pylist()


def decode(value: Any) -> str:
    """Zephon 0.2.0 ``decode_text`` defaults: bytes as UTF-8 (strict), newlines normalised to ``\\n``."""
    text = bytes(value).decode("utf-8") if isinstance(value, (bytes, bytearray, memoryview)) else str(value)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def tokenize_texts(tokenizer: Any, texts: list[Any]) -> list[np.ndarray]:
    """``[BOS] + ids + [EOS]`` per text, as Zephon's ``tokenize(special_tokens="bos_eos")`` brackets them."""
    bos = np.asarray([tokenizer.bos_token_id], dtype=np.int32)
    eos = np.asarray([tokenizer.eos_token_id], dtype=np.int32)
    out: list[np.ndarray] = []
    for start in range(0, len(texts), TOKENIZE_BATCH):
        batch = [decode(t) for t in texts[start:start + TOKENIZE_BATCH]]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            out.append(np.concatenate([bos, np.asarray(ids, dtype=np.int32), eos]))
    return out


def write_token_shard(out_path: Path, ids: list[np.ndarray]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    table = pa.table({TOKEN_FIELD: column})
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".tmp-{out_path.name}.{os.getpid()}")
    pq.write_table(table, tmp, compression=PARQUET_COMPRESSION)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, out_path)
    fsync_dir(out_path.parent)


class ShardTokenizer:
    """A Ray Data actor: tokenises whole shards, one per input row, and writes their token-id Parquet copies."""

    def __init__(self, tokenizer: str, text_field: str, identity: str) -> None:
        seen = tokenizer_identity(tokenizer)
        if seen != identity:  # another node may hold another file under the same path
            import socket

            raise PretokenizeError(f"tokenizer {tokenizer} on {socket.gethostname()} is {seen}, the driver's is "
                                   f"{identity}")
        self.tokenizer = build_tokenizer(tokenizer)
        self.text_field = text_field

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results: dict[str, list[Any]] = {"source": [], "relative": [], "records": [], "tokens": [], "bytes": [],
                                         "sha256": []}
        for i in range(len(batch["source"])):
            task = ShardTask(**{key: str(batch[key][i]) for key in ShardTask.__dataclass_fields__})
            entry = tokenize_shard(task, self.tokenizer, self.text_field)
            for key in results:
                results[key].append(entry[key])
        return {key: np.asarray(values) for key, values in results.items()}


def tokenize_shard(task: ShardTask, tokenizer: Any, text_field: str) -> dict[str, Any]:
    texts = read_texts(task.raw_path, task.raw_format, text_field)
    ids = tokenize_texts(tokenizer, texts)
    out_path = Path(task.out_path)
    write_token_shard(out_path, ids)
    entry = {
        "source": task.source,
        "relative": task.relative,
        "records": len(ids),
        "tokens": int(sum(len(x) for x in ids)),
        "bytes": out_path.stat().st_size,
        "sha256": sha256_file(out_path),
    }
    # The shard is durable before its progress entry: an entry always describes a complete file.
    atomic_write_bytes(Path(task.progress_path), json_bytes(entry))
    return entry


# ---------------------------------------------------------------------- the job
@dataclass(frozen=True)
class PretokenizeResult:
    out_dir: Path
    recipe_path: Path
    shards: int
    shards_skipped: int
    records: int
    tokens: int
    bytes: int


def plan(recipe: Recipe, out_dir: Path) -> list[ShardTask]:
    tasks = []
    for source in recipe.sources:
        names = [rel for rel, _size in shard_list(source)]
        outs = [output_name(rel) for rel in names]
        if len(set(outs)) != len(outs) or sorted(outs) != outs:
            raise PretokenizeError(
                f"source '{source.name}' ({source.path}): its shard names do not keep their order (or collide) once "
                "renamed to .parquet; Zephon orders shards by name, so the copy would read records in another order"
            )
        for rel, out in zip(names, outs):
            tasks.append(ShardTask(
                source=source.name, raw_path=str(source.path / rel), raw_format=source.format, relative=rel,
                out_path=str(out_dir / SOURCES_DIR / source.name / out),
                progress_path=str(out_dir / PROGRESS_DIR / source.name / (out + ".json")),
            ))
    return tasks


def finished_entry(task: ShardTask) -> dict[str, Any] | None:
    """The progress entry of a shard finished by an earlier (interrupted) run, if its output still verifies."""
    progress, out = Path(task.progress_path), Path(task.out_path)
    if not progress.is_file() or not out.is_file():
        return None
    try:
        entry = json.loads(progress.read_text())
    except (OSError, ValueError):
        return None
    if entry.get("bytes") != out.stat().st_size or entry.get("sha256") != sha256_file(out):
        return None
    return entry


def pretokenize(recipe: Recipe, out_dir: str | Path, *, actors: int | None = None,
                cpus_per_actor: float = 0.5, progress: bool = True) -> PretokenizeResult:
    """Run the Ray Data job on the current Ray cluster (``ray.init`` first). Re-running is idempotent and
    resumes an interrupted run: shards whose output and progress entry exist and verify are skipped."""
    import ray
    from tqdm import tqdm

    if recipe.pretokenized is not None:
        raise PretokenizeError(f"{recipe.describe()} is already pre-tokenised (key 'pretokenized')")
    out_dir = Path(out_dir).resolve()
    for source in recipe.sources:
        if out_dir == source.path or out_dir in source.path.parents or source.path in out_dir.parents:
            raise PretokenizeError(f"OUT_DIR {out_dir} overlaps source '{source.name}' ({source.path})")
    manifest_path = out_dir / MANIFEST_NAME
    if manifest_path.is_file():
        try:
            previous = json.loads(manifest_path.read_text())
        except ValueError as exc:
            raise PretokenizeError(f"{manifest_path}: not valid JSON ({exc}); remove it to start over") from None
        if previous.get(KEY_SOURCE_FINGERPRINT) != recipe.fingerprint:
            raise PretokenizeError(
                f"{out_dir} holds a pre-tokenisation of another recipe (fingerprint "
                f"{str(previous.get(KEY_SOURCE_FINGERPRINT))[:12]}, not {recipe.fingerprint[:12]}); use a new OUT_DIR"
            )
    if actors is None:
        actors = max(1, int(ray.cluster_resources().get("CPU", 1)))
    if isinstance(actors, bool) or not isinstance(actors, int) or not 1 <= actors <= 1024:
        raise PretokenizeError(f"actors must be an integer in [1, 1024], got {actors!r}")

    tasks = plan(recipe, out_dir)
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    todo = []
    for task in tasks:
        entry = finished_entry(task)
        if entry is None:
            todo.append(task)
        else:
            entries[(task.source, task.relative)] = entry
    skipped = len(entries)
    if todo:
        _run_actor_pool(recipe, todo, entries, actors=actors, cpus_per_actor=cpus_per_actor, progress=progress,
                        tqdm=tqdm)
    _check_counts(recipe, out_dir, entries)
    recipe_path = write_pretokenized_recipe(recipe, out_dir)
    manifest = build_manifest(recipe, entries)
    atomic_write_bytes(manifest_path, json_bytes(manifest))  # last: the commit point
    _check_same_settings(recipe, Recipe.from_toml(recipe_path))
    totals = manifest[KEY_TOTALS]
    return PretokenizeResult(out_dir=out_dir, recipe_path=recipe_path, shards=len(tasks), shards_skipped=skipped,
                             records=totals["records"], tokens=totals["tokens"], bytes=totals["bytes"])


def _run_actor_pool(recipe: Recipe, todo: list[ShardTask], entries: dict, *, actors: int, cpus_per_actor: float,
                    progress: bool, tqdm: Any) -> None:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # one tqdm bar of our own, in shards and tokens
    ctx.print_on_execution_start = False
    rows = [{key: getattr(t, key) for key in ShardTask.__dataclass_fields__} for t in todo]
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ShardTokenizer,
        fn_constructor_kwargs={"tokenizer": recipe.tokenizer, "text_field": recipe.text_field,
                               "identity": tokenizer_identity(recipe.tokenizer)},
        compute=ray.data.ActorPoolStrategy(size=min(actors, len(rows))),
        batch_size=1,
        num_cpus=cpus_per_actor,
    )
    bar = tqdm(total=len(rows), unit="shard", desc="pretokenize", disable=not progress, dynamic_ncols=True)
    tokens = 0
    try:
        for row in dataset.iter_rows():
            entry = {key: (value.item() if hasattr(value, "item") else value) for key, value in row.items()}
            entries[(entry["source"], entry["relative"])] = entry
            tokens += int(entry["tokens"])
            bar.set_postfix(tokens=f"{tokens:,}")
            bar.update(1)
    finally:
        bar.close()


def _check_same_settings(raw: Recipe, tokens: Recipe) -> None:
    """The written recipe must differ from the raw one only in its sources (a guard for new recipe keys)."""
    ignore = ("sources", "environment")
    want = {k: v for k, v in raw.canonical().items() if k not in ignore}
    got = {k: v for k, v in tokens.canonical().items() if k not in ignore}
    if want != got:
        key = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))[0]
        raise PretokenizeError(f"{tokens.path}: key {key!r} is {got.get(key)!r}, the source recipe has "
                               f"{want.get(key)!r} (zephon-ray pretokenize does not carry this key over)")
    if raw.environment.canonical() != tokens.environment.canonical():
        raise PretokenizeError(f"{tokens.path}: tokenizer or library versions differ from the source recipe")


def _check_counts(recipe: Recipe, out_dir: Path, entries: dict) -> None:
    """Every output shard must hold as many records as Zephon counts in its input shard."""
    from zephon.io import Dataset

    for source in recipe.sources:
        raw = Dataset.from_path(source.name, str(source.path), fmt=source.format).total()
        copied = sum(int(entries[(source.name, rel)]["records"]) for rel, _ in shard_list(source))
        if int(raw) != copied:
            raise PretokenizeError(
                f"source '{source.name}': Zephon counts {raw} records in {source.path} but the token copy has "
                f"{copied}; blank or malformed lines are read differently, fix the shards first"
            )


def build_manifest(recipe: Recipe, entries: dict) -> dict[str, Any]:
    tokenizer = build_tokenizer(recipe.tokenizer)
    sources = []
    totals = {"records": 0, "tokens": 0, "bytes": 0}
    for source in recipe.sources:
        shards = []
        for rel, size in shard_list(source):
            entry = entries[(source.name, rel)]
            shards.append({"raw": rel, "raw_bytes": size, "out": output_name(rel), "records": int(entry["records"]),
                           "tokens": int(entry["tokens"]), "bytes": int(entry["bytes"]), "sha256": entry["sha256"]})
            for key in totals:
                totals[key] += int(entry[key])
        sources.append({"name": source.name, "raw_path": str(source.path), "raw_format": source.format,
                        "path": f"{SOURCES_DIR}/{source.name}", "shards": shards})
    return {
        KEY_FORMAT: MANIFEST_FORMAT,
        KEY_TOKENIZER: tokenizer_identity(recipe.tokenizer),
        KEY_SPECIAL_TOKENS: {"mode": SPECIAL_TOKENS, "bos": int(tokenizer.bos_token_id),
                             "eos": int(tokenizer.eos_token_id)},
        "token_field": TOKEN_FIELD,
        "text_field": recipe.text_field,
        KEY_SOURCE_FINGERPRINT: recipe.fingerprint,
        KEY_SOURCES: sources,
        KEY_TOTALS: totals,
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def write_pretokenized_recipe(recipe: Recipe, out_dir: Path) -> Path:
    """``OUT_DIR/recipe.toml``: every data-defining key of ``recipe``, sources pointing at the token copies."""
    top = {
        "seed": recipe.seed, "lanes": recipe.lanes, "microbatches_per_lane": recipe.microbatches_per_lane,
        "rows_per_microbatch": recipe.rows_per_microbatch, "seq_len": recipe.seq_len,
        "chunk_size": recipe.chunk_size, "tokenizer": recipe.tokenizer, "text_field": recipe.text_field,
        "packing": recipe.packing, "repeat": recipe.repeat, "pretokenized": MANIFEST_NAME,
    }
    for optional in ("flush_every_k_chunks", "packing_bins"):
        if getattr(recipe, optional, None) is not None:
            top[optional] = getattr(recipe, optional)
    lines = [f"# Written by `zephon-ray pretokenize` from {recipe.path or 'a recipe'}: the same recipe over token-id "
             "copies of its sources.", f"# Source recipe fingerprint {recipe.fingerprint}."]
    lines += [f"{key} = {_toml_value(value)}" for key, value in top.items()]
    lines += ["", "[shuffle]", f"shards = {_toml_value(recipe.shuffle.shards)}",
              f"within_shard = {_toml_value(recipe.shuffle.within_shard)}",
              f"reshuffle_on_repeat = {_toml_value(recipe.shuffle.reshuffle_on_repeat)}"]
    for source in recipe.sources:
        lines += ["", "[[sources]]", f"name = {_toml_value(source.name)}",
                  f"path = {_toml_value(SOURCES_DIR + '/' + source.name)}", 'format = "parquet"',
                  f"weight = {_toml_value(source.weight)}"]
    path = out_dir / RECIPE_NAME
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    return path


# ---------------------------------------------------------------------- checking a pre-tokenised recipe
def check_pretokenized(manifest_path: Path, tokenizer: str) -> dict[str, Any]:
    """Called by the recipe parser for ``pretokenized = "..."`` before it reads the sources: the manifest must
    exist and be complete, name the recipe's tokenizer, and every token shard it lists must be there, whole."""
    if not manifest_path.is_file():
        raise RecipeError(f"pre-tokenisation manifest not found: {manifest_path} (did `zephon-ray pretokenize` "
                          "finish? it writes the manifest last)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise RecipeError(f"{manifest_path}: corrupt pre-tokenisation manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get(KEY_FORMAT) != MANIFEST_FORMAT:
        got = manifest.get(KEY_FORMAT) if isinstance(manifest, dict) else type(manifest).__name__
        raise RecipeError(f"{manifest_path}: manifest format {got!r} is not {MANIFEST_FORMAT!r}")
    identity = tokenizer_identity(tokenizer)
    if manifest.get(KEY_TOKENIZER) != identity:
        raise RecipeError(
            f"{manifest_path}: the sources were pre-tokenised with tokenizer {manifest.get(KEY_TOKENIZER)!r}, but the "
            f"recipe names {tokenizer!r} ({identity}); token ids from one tokenizer cannot be used with another"
        )
    if manifest.get(KEY_SPECIAL_TOKENS, {}).get("mode") != SPECIAL_TOKENS:
        raise RecipeError(f"{manifest_path}: special-token mode {manifest.get(KEY_SPECIAL_TOKENS)!r} is not "
                          f"{SPECIAL_TOKENS!r}, the mode zephon-ray tokenises with")
    try:
        for source in manifest[KEY_SOURCES]:
            for shard in source["shards"]:
                path = manifest_path.parent / source["path"] / shard["out"]
                size = path.stat().st_size if path.is_file() else None
                if size != shard["bytes"]:
                    state = "missing" if size is None else f"{size} bytes, the manifest records {shard['bytes']}"
                    raise RecipeError(f"token shard {path}: {state} (truncated or rewritten; re-run pretokenize)")
    except (KeyError, TypeError) as exc:
        raise RecipeError(f"{manifest_path}: corrupt pre-tokenisation manifest (missing {exc})") from None
    return manifest


def check_pretokenized_sources(recipe: Recipe) -> None:
    """After the sources are read: each is a token copy the manifest lists, with exactly the listed shards."""
    manifest_path = Path(recipe.pretokenized)
    manifest = json.loads(manifest_path.read_text())
    listed = {s.get("name"): s for s in manifest.get(KEY_SOURCES, [])}
    for source in recipe.sources:
        entry = listed.get(source.name)
        if entry is None:
            raise RecipeError(f"{manifest_path}: source '{source.name}' is not in the pre-tokenisation manifest")
        if source.path != (manifest_path.parent / entry["path"]).resolve():
            raise RecipeError(f"source '{source.name}' reads {source.path}, not the token copy "
                              f"{manifest_path.parent / entry['path']} that {manifest_path} lists")
        want = {s["out"]: s["bytes"] for s in entry["shards"]}
        have = dict(shard_list(source))
        if want != have:
            diff = sorted(set(want.items()) ^ set(have.items()))
            raise RecipeError(
                f"{manifest_path}: source '{source.name}' ({source.path}) does not hold the token shards the manifest "
                f"lists (first difference: {diff[0][0]}; a missing or extra file)"
            )
