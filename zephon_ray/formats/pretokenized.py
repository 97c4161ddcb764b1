"""The pre-tokenised copy: its layout, manifest (read, write, check) and recipe file. Written by
:mod:`zephon_ray.jobs.pretokenize`; checked by the recipe parser for ``pretokenized = "manifest.json"``.

    OUT/sources/<name>/<same relative name>.parquet   token-id shards (column ``input_ids``, list<int32>)
    OUT/_progress/<name>/<shard>.parquet.json         one entry per finished shard (resume points)
    OUT/recipe.toml                                   the same recipe over the token-id copies
    OUT/manifest.json                                 written LAST: the commit point

OUT is a local directory or an object-store prefix (:mod:`zephon_ray.storage`). Each shard, progress entry, recipe
and manifest is one atomic write; on an object store that is one upload each, and the manifest's upload is what
commits the copy (a reader that finds no manifest finds no copy).

Guarantee: :func:`check_manifest` accepts a manifest only if it is complete, names the recipe's tokenizer and
bracketing, and every token shard it lists is there with its recorded size; every failure is one
:class:`PretokenizedError` naming the file. The manifest's format and checks are
defined in :mod:`zephon_ray.pretokenized_manifest`.
"""

from __future__ import annotations

from typing import Any

from zephon_ray import storage
from zephon_ray.pretokenized_manifest import (  # the manifest's format, shared with the recipe's checks
    KEY_FORMAT,
    KEY_SOURCE_FINGERPRINT,
    KEY_SOURCES,
    KEY_SPECIAL_TOKENS,
    KEY_TOKENIZER,
    KEY_TOTALS,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    PROGRESS_DIR,
    SOURCES_DIR,
    SPECIAL_TOKENS,
    TOKEN_FIELD,
    PretokenizedError,
)

PROGRESS_KEYS = ("source", "relative", "records", "tokens", "bytes", "sha256")


def output_name(relative: str) -> str:
    """``a/b.jsonl`` -> ``a/b.parquet``: the same relative name with the Parquet suffix."""
    stem, _, _ext = relative.rpartition(".")
    return f"{stem}.parquet"


def shard_location(out: storage.Location, source: str, relative: str) -> storage.Location:
    return out.join(SOURCES_DIR, source, output_name(relative))


def progress_location(out: storage.Location, source: str, relative: str) -> storage.Location:
    return out.join(PROGRESS_DIR, source, output_name(relative) + ".json")


# ---------------------------------------------------------------------- write
def build_manifest(
    *,
    tokenizer_identity: str,
    bos: int,
    eos: int,
    text_field: str,
    source_fingerprint: str,
    sources: list[dict[str, Any]],
) -> dict[str, Any]:
    """The manifest document. ``sources``: ``[{"name", "raw_path", "raw_format", "shards": [entry, ...]}]`` with
    each shard entry holding :data:`zephon_ray.pretokenized_manifest.SHARD_KEYS`."""
    totals = {"records": 0, "tokens": 0, "bytes": 0}
    out_sources = []
    for source in sources:
        for shard in source["shards"]:
            for key in totals:
                totals[key] += int(shard[key])
        out_sources.append(
            {
                "name": source["name"],
                "raw_path": str(source["raw_path"]),
                "raw_format": source["raw_format"],
                "path": f"{SOURCES_DIR}/{source['name']}",
                "shards": source["shards"],
            }
        )
    return {
        KEY_FORMAT: MANIFEST_FORMAT,
        KEY_TOKENIZER: tokenizer_identity,
        KEY_SPECIAL_TOKENS: {"mode": SPECIAL_TOKENS, "bos": int(bos), "eos": int(eos)},
        "token_field": TOKEN_FIELD,
        "text_field": text_field,
        KEY_SOURCE_FINGERPRINT: source_fingerprint,
        KEY_SOURCES: out_sources,
        KEY_TOTALS: totals,
    }


def write_manifest(out: storage.Location, manifest: dict[str, Any]) -> None:
    """The commit point: written after every shard, progress entry and the recipe file."""
    storage.write_json(out.join(MANIFEST_NAME), manifest)


def write_progress(location: storage.Location, entry: dict[str, Any]) -> None:
    storage.write_json(location, entry)


def read_progress(location: storage.Location) -> dict[str, Any] | None:
    """A finished shard's progress entry, or None when absent or unusable (the shard is then redone)."""
    try:
        entry = storage.read_json(location, error=PretokenizedError, what="progress entry")
    except PretokenizedError:
        return None
    if not isinstance(entry, dict) or any(k not in entry for k in PROGRESS_KEYS):
        return None
    return entry
