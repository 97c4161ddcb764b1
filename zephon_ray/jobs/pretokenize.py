"""Pre-tokenisation: a Ray Data job that turns a recipe's text sources into token-id Parquet shards.

    RECIPE ──► one task per input shard ──► map_batches on an ActorPoolStrategy of tokenizer actors
                                                 │  read shard, decode, tokenize, bracket [BOS, ..., EOS]
                                                 ▼
    OUT_DIR/sources/<name>/<same relative name>.parquet   (column ``input_ids``, list<int32>, record order kept)
    OUT_DIR/_progress/...json                            (one entry per finished shard: resume points)
    OUT_DIR/recipe.toml                                  (the same recipe over the token-id copies)
    OUT_DIR/manifest.json                                (written last: tokenizer identity, listing, counts)

The layout and manifest belong to :mod:`zephon_ray.formats.pretokenized`; every file goes through
:mod:`zephon_ray.storage`, so RECIPE's sources and OUT_DIR may each be a local directory or an object-store URI
(``s3://bucket/tokens``): raw shards are read through Zephon's storage router, token shards are written by the
actors as one atomic upload each, and the manifest's upload commits the copy.

Guarantee: the token ids of record i of shard f are exactly the ``input_ids`` Zephon's
``decode_text() → tokenize(special_tokens="bos_eos")`` would give record i of f, and every output shard has
the same records in the same order, so ``OUT_DIR/recipe.toml`` yields global batches with **the same digests**
as RECIPE (for the byte tokenizer and a BPE tokenizer alike). Ray Data only schedules the per-shard work: it never decides batch contents.

Limits:
- A shard is tokenised by one actor in one piece, so a shard must fit in an actor's memory.
- The pre-tokenised recipe has its own fingerprint (its shards are other files), so a loader state saved
  under RECIPE does not load under ``OUT_DIR/recipe.toml``: the digests are equal, the identities are not.
- The decode step mirrors Zephon 0.2.0's ``decode_text`` defaults (UTF-8, ``\\r\\n``/``\\r`` to ``\\n``) and the
  ``bos_eos`` bracketing; the digest-equality test is what pins that down for a new Zephon version.
- Only ``jsonl`` and ``parquet`` sources are read (the formats a recipe accepts).
- Actors write the token shards themselves: OUT_DIR must be on storage every node of the cluster reaches (an
  object-store URI is, with the same credentials on every node).
- Resuming re-reads each finished token shard once to check its sha256 (a download on an object store).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon_ray import storage, zephon_io
from zephon_ray.checks import check_int
from zephon_ray.formats.pretokenized import (
    build_manifest,
    output_name,
    progress_location,
    read_progress,
    shard_location,
    write_manifest,
    write_progress,
)
from zephon_ray.log_filters import quiet_known_noise
from zephon_ray.pretokenized_manifest import (
    KEY_SOURCE_FINGERPRINT,
    KEY_TOTALS,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    PROGRESS_DIR,
    RECIPE_NAME,
    SOURCES_DIR,
    SPECIAL_TOKENS,
    TOKEN_FIELD,
    PretokenizedError,
)
from zephon_ray.recipe import Recipe
from zephon_ray.tokenizers import build_tokenizer, tokenizer_identity

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "PROGRESS_DIR",
    "RECIPE_NAME",
    "SOURCES_DIR",
    "SPECIAL_TOKENS",
    "TOKEN_FIELD",
    "PretokenizeError",
    "PretokenizeResult",
    "pretokenize",
]
TOKENIZE_BATCH = 512
PARQUET_COMPRESSION = "zstd"

PretokenizeError = PretokenizedError
"""The one error of a pre-tokenisation (the format owner's class): the message names the file."""


def shard_list(source: Any) -> list[tuple[str, int]]:
    """(name relative to the source directory, size) of every shard Zephon reads, in Zephon's order."""
    return [(s.name, s.size) for s in source.shards]


# ---------------------------------------------------------------------- the per-shard work
@dataclass(frozen=True)
class ShardTask:
    source: str
    raw_path: str
    raw_format: str
    relative: str
    out_path: str
    progress_path: str


def _raw_bytes(path: str) -> bytes:
    """A raw shard's bytes: through Zephon's storage router for an object-store URI, else from local disk."""
    if storage.is_uri(path):
        try:
            return zephon_io.read_object(path)
        except zephon_io.ZephonIOError as exc:
            raise PretokenizeError(str(exc)) from None
    try:
        return storage.read_bytes(path)
    except (FileNotFoundError, storage.StorageError) as exc:
        raise PretokenizeError(str(exc)) from None


def read_texts(path: str, fmt: str, text_field: str) -> list[Any]:
    blob = _raw_bytes(path)
    if fmt == "jsonl":
        texts = []
        for number, line in enumerate(blob.split(b"\n"), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if text_field not in record:
                raise PretokenizeError(f"{path}:{number}: record has no field {text_field!r}")
            texts.append(record[text_field])
        return texts
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(pa.BufferReader(blob))
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
        batch = [decode(t) for t in texts[start : start + TOKENIZE_BATCH]]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            out.append(np.concatenate([bos, np.asarray(ids, dtype=np.int32), eos]))
    return out


def token_shard_bytes(ids: list[np.ndarray]) -> bytes:
    """One token-id Parquet shard (column ``input_ids``, list<int32>, record order kept), in memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = np.fromiter((len(x) for x in ids), dtype=np.int32, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({TOKEN_FIELD: column}), sink, compression=PARQUET_COMPRESSION)
    return sink.getvalue().to_pybytes()


class ShardTokenizer:
    """A Ray Data actor: tokenises whole shards, one per input row, and writes their token-id Parquet copies."""

    def __init__(self, tokenizer: str, text_field: str, identity: str) -> None:
        seen = tokenizer_identity(tokenizer)
        if seen != identity:  # another node may hold another file under the same path
            import socket

            raise PretokenizeError(
                f"tokenizer {tokenizer} on {socket.gethostname()} is {seen}, the driver's is {identity}"
            )
        self.tokenizer = build_tokenizer(tokenizer)
        self.text_field = text_field

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results: dict[str, list[Any]] = {
            "source": [],
            "relative": [],
            "records": [],
            "tokens": [],
            "bytes": [],
            "sha256": [],
        }
        for i in range(len(batch["source"])):
            task = ShardTask(**{key: str(batch[key][i]) for key in ShardTask.__dataclass_fields__})
            entry = tokenize_shard(task, self.tokenizer, self.text_field)
            for key in results:
                results[key].append(entry[key])
        return {key: np.asarray(values) for key, values in results.items()}


def tokenize_shard(task: ShardTask, tokenizer: Any, text_field: str) -> dict[str, Any]:
    texts = read_texts(task.raw_path, task.raw_format, text_field)
    ids = tokenize_texts(tokenizer, texts)
    blob = token_shard_bytes(ids)
    storage.write_atomic(task.out_path, blob)
    entry = {
        "source": task.source,
        "relative": task.relative,
        "records": len(ids),
        "tokens": int(sum(len(x) for x in ids)),
        "bytes": len(blob),
        "sha256": storage.sha256_bytes(blob),
    }
    # The shard is durable before its progress entry: an entry always describes a complete file.
    write_progress(storage.location(task.progress_path), entry)
    return entry


# ---------------------------------------------------------------------- the job
@dataclass(frozen=True)
class PretokenizeResult:
    out_dir: str
    """The copy's directory or prefix (an absolute local path or a URI)."""
    recipe_path: str
    shards: int
    shards_skipped: int
    records: int
    tokens: int
    bytes: int


def plan(recipe: Recipe, out: storage.Location) -> list[ShardTask]:
    tasks = []
    for source in recipe.sources:
        names = [rel for rel, _size in shard_list(source)]
        outs = [output_name(rel) for rel in names]
        if len(set(outs)) != len(outs) or sorted(outs) != outs:
            raise PretokenizeError(
                f"source '{source.name}' ({source.path}): its shard names do not keep their order (or collide) once "
                "renamed to .parquet; Zephon orders shards by name, so the copy would read records in another order"
            )
        for rel in names:
            tasks.append(
                ShardTask(
                    source=source.name,
                    raw_path=storage.location(source.path).join(rel).uri,
                    raw_format=source.format,
                    relative=rel,
                    out_path=shard_location(out, source.name, rel).uri,
                    progress_path=progress_location(out, source.name, rel).uri,
                )
            )
    return tasks


def finished_entry(task: ShardTask) -> dict[str, Any] | None:
    """The progress entry of a shard finished by an earlier (interrupted) run, if its output still verifies."""
    entry = read_progress(storage.location(task.progress_path))
    if entry is None:
        return None
    if storage.size(task.out_path) != entry.get("bytes") or storage.sha256(task.out_path) != entry.get("sha256"):
        return None
    return entry


def pretokenize(
    recipe: Recipe, out_dir: str | Any, *, actors: int | None = None, cpus_per_actor: float = 0.5, progress: bool = True
) -> PretokenizeResult:
    """Run the Ray Data job on the current Ray cluster (``ray.init`` first). Re-running is idempotent and
    resumes an interrupted run: shards whose output and progress entry exist and verify are skipped."""
    import ray
    from tqdm import tqdm

    if recipe.pretokenized is not None:
        raise PretokenizeError(f"{recipe.describe()} is already pre-tokenised (key 'pretokenized')")
    out = storage.location(out_dir)
    for source in recipe.sources:
        src = storage.location(source.path)
        if out.is_within(src) or src.is_within(out):
            raise PretokenizeError(f"OUT_DIR {out} overlaps source '{source.name}' ({source.path})")
    manifest_loc = out.join(MANIFEST_NAME)
    if storage.exists(manifest_loc):
        previous = storage.read_json(
            manifest_loc, error=PretokenizeError, what="pre-tokenisation manifest", missing_hint=""
        )
        found = previous.get(KEY_SOURCE_FINGERPRINT) if isinstance(previous, dict) else None
        if found != recipe.fingerprint:
            raise PretokenizeError(
                f"{out} holds a pre-tokenisation of another recipe (fingerprint {str(found)[:12]}, not "
                f"{recipe.fingerprint[:12]}); use a new OUT_DIR"
            )
    if actors is None:
        actors = max(1, int(ray.cluster_resources().get("CPU", 1)))
    check_int("actors", actors, low=1, high=1024, error=PretokenizeError)

    tasks = plan(recipe, out)
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
        _run_actor_pool(
            recipe, todo, entries, actors=actors, cpus_per_actor=cpus_per_actor, progress=progress, tqdm=tqdm
        )
    _check_counts(recipe, entries)
    recipe_loc = write_pretokenized_recipe(recipe, out)
    tokenizer = build_tokenizer(recipe.tokenizer)
    manifest = build_manifest(
        tokenizer_identity=tokenizer_identity(recipe.tokenizer),
        bos=tokenizer.bos_token_id,
        eos=tokenizer.eos_token_id,
        text_field=recipe.text_field,
        source_fingerprint=recipe.fingerprint,
        sources=[
            {
                "name": source.name,
                "raw_path": source.path,
                "raw_format": source.format,
                "shards": [_shard_entry(rel, size, entries[(source.name, rel)]) for rel, size in shard_list(source)],
            }
            for source in recipe.sources
        ],
    )
    write_manifest(out, manifest)  # last: the commit point
    _check_same_settings(recipe, Recipe.from_toml(recipe_loc.uri))
    totals = manifest[KEY_TOTALS]
    return PretokenizeResult(
        out_dir=out.uri,
        recipe_path=recipe_loc.uri,
        shards=len(tasks),
        shards_skipped=skipped,
        records=totals["records"],
        tokens=totals["tokens"],
        bytes=totals["bytes"],
    )


def _shard_entry(rel: str, size: int, entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "raw": rel,
        "raw_bytes": size,
        "out": output_name(rel),
        "records": int(entry["records"]),
        "tokens": int(entry["tokens"]),
        "bytes": int(entry["bytes"]),
        "sha256": str(entry["sha256"]),
    }


def _run_actor_pool(
    recipe: Recipe,
    todo: list[ShardTask],
    entries: dict,
    *,
    actors: int,
    cpus_per_actor: float,
    progress: bool,
    tqdm: Any,
) -> None:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # one tqdm bar of our own, in shards and tokens
    quiet_known_noise()  # Ray Data's 'Progress bars disabled' line, which the line above causes
    ctx.print_on_execution_start = False
    rows = [{key: getattr(t, key) for key in ShardTask.__dataclass_fields__} for t in todo]
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ShardTokenizer,
        fn_constructor_kwargs={
            "tokenizer": recipe.tokenizer,
            "text_field": recipe.text_field,
            "identity": tokenizer_identity(recipe.tokenizer),
        },
        compute=ray.data.ActorPoolStrategy(size=min(actors, len(rows))),
        batch_size=1,
        num_cpus=cpus_per_actor,
    )
    bar = tqdm(
        total=len(rows), unit="shard", desc="pretokenize", dynamic_ncols=True, disable=None if progress else True
    )  # None: a bar only on a terminal
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
        raise PretokenizeError(
            f"{tokens.path}: key {key!r} is {got.get(key)!r}, the source recipe has "
            f"{want.get(key)!r} (zephon-ray pretokenize does not carry this key over)"
        )
    assert raw.environment is not None and tokens.environment is not None  # a Recipe captures its environment
    if raw.environment.canonical() != tokens.environment.canonical():
        raise PretokenizeError(f"{tokens.path}: tokenizer or library versions differ from the source recipe")


def _zephon_records(source: Any) -> int:
    """Zephon's record count for a source: the recipe's row counts where it has them, else Zephon's own count."""
    if all(s.rows is not None for s in source.shards):
        return sum(int(s.rows) for s in source.shards)
    from zephon.io import Dataset

    zephon_io.storage()  # exports the S3 endpoint for Zephon; its discovery then reads every shard once to count
    return int(Dataset.from_path(source.name, str(source.path), fmt=source.format).total())


def _check_counts(recipe: Recipe, entries: dict) -> None:
    """Every output shard must hold as many records as Zephon counts in its input shard."""
    for source in recipe.sources:
        raw = _zephon_records(source)
        copied = sum(int(entries[(source.name, rel)]["records"]) for rel, _ in shard_list(source))
        if raw != copied:
            raise PretokenizeError(
                f"source '{source.name}': Zephon counts {raw} records in {source.path} but the token copy has "
                f"{copied}; blank or malformed lines are read differently, fix the shards first"
            )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def write_pretokenized_recipe(recipe: Recipe, out: storage.Location) -> storage.Location:
    """``OUT_DIR/recipe.toml``: every data-defining key of ``recipe``, sources pointing at the token copies."""
    top = {
        "seed": recipe.seed,
        "lanes": recipe.lanes,
        "microbatches_per_lane": recipe.microbatches_per_lane,
        "rows_per_microbatch": recipe.rows_per_microbatch,
        "seq_len": recipe.seq_len,
        "chunk_size": recipe.chunk_size,
        "tokenizer": recipe.tokenizer,
        "text_field": recipe.text_field,
        "packing": recipe.packing,
        "repeat": recipe.repeat,
        "pretokenized": MANIFEST_NAME,
    }
    for optional in ("flush_every_k_chunks", "packing_bins"):
        if getattr(recipe, optional, None) is not None:
            top[optional] = getattr(recipe, optional)
    lines = [
        f"# Written by `zephon-ray pretokenize` from {recipe.path or 'a recipe'}: the same recipe over token-id "
        "copies of its sources.",
        f"# Source recipe fingerprint {recipe.fingerprint}.",
    ]
    lines += [f"{key} = {_toml_value(value)}" for key, value in top.items()]
    lines += [
        "",
        "[shuffle]",
        f"shards = {_toml_value(recipe.shuffle.shards)}",
        f"within_shard = {_toml_value(recipe.shuffle.within_shard)}",
        f"reshuffle_on_repeat = {_toml_value(recipe.shuffle.reshuffle_on_repeat)}",
    ]
    for source in recipe.sources:
        lines += [
            "",
            "[[sources]]",
            f"name = {_toml_value(source.name)}",
            f"path = {_toml_value(SOURCES_DIR + '/' + source.name)}",
            'format = "parquet"',
            f"weight = {_toml_value(source.weight)}",
        ]
    loc = out.join(RECIPE_NAME)
    storage.write_atomic(loc, ("\n".join(lines) + "\n").encode())
    return loc
