"""The pre-tokenised copy: its layout, manifest (read, write, check) and recipe file. Written by
:mod:`zephon_ray.jobs.pretokenize`; checked by the recipe parser for ``pretokenized = "manifest.json"``.

    OUT/sources/<name>/<same relative name>.parquet   token-id shards (column ``input_ids``, list<int32>)
    OUT/_progress/<name>/<shard>.parquet.json         one entry per finished shard (resume points)
    OUT/recipe.toml                                   the same recipe over the token-id copies
    OUT/manifest.json                                 written LAST: the commit point

OUT is a local directory or an object-store prefix (:mod:`zephon_ray.files`). Each shard, progress entry, recipe
and manifest is one atomic write; on an object store that is one upload each, and the manifest's upload is what
commits the copy (a reader that finds no manifest finds no copy).

Guarantee: :func:`check_manifest` accepts a manifest only if it is complete, names the recipe's tokenizer and
bracketing, and every token shard it lists is there with its recorded size; every failure is one
:class:`PretokenizedError` naming the file (tests/test_pretokenize.py).
"""

from __future__ import annotations

from typing import Any

from zephon_ray import files

MANIFEST_FORMAT = "zephon-ray/pretokenized/v1"
MANIFEST_NAME = "manifest.json"
RECIPE_NAME = "recipe.toml"
SOURCES_DIR = "sources"
PROGRESS_DIR = "_progress"
TOKEN_FIELD = "input_ids"
SPECIAL_TOKENS = "bos_eos"

# Manifest keys
KEY_FORMAT = "format"
KEY_TOKENIZER = "tokenizer"
KEY_SPECIAL_TOKENS = "special_tokens"
KEY_SOURCE_FINGERPRINT = "source_recipe_fingerprint"
KEY_SOURCES = "sources"
KEY_TOTALS = "totals"
SHARD_KEYS = ("raw", "raw_bytes", "out", "records", "tokens", "bytes", "sha256")
PROGRESS_KEYS = ("source", "relative", "records", "tokens", "bytes", "sha256")


class PretokenizedError(ValueError):
    """A pre-tokenisation that cannot run or a copy that does not check out; the message names the file."""


def output_name(relative: str) -> str:
    """``a/b.jsonl`` -> ``a/b.parquet``: the same relative name with the Parquet suffix."""
    stem, _, _ext = relative.rpartition(".")
    return f"{stem}.parquet"


def shard_location(out: files.Location, source: str, relative: str) -> files.Location:
    return out.join(SOURCES_DIR, source, output_name(relative))


def progress_location(out: files.Location, source: str, relative: str) -> files.Location:
    return out.join(PROGRESS_DIR, source, output_name(relative) + ".json")


# ---------------------------------------------------------------------- write
def build_manifest(*, tokenizer_identity: str, bos: int, eos: int, text_field: str, source_fingerprint: str,
                   sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest document. ``sources``: ``[{"name", "raw_path", "raw_format", "shards": [entry, ...]}]`` with
    each shard entry holding :data:`SHARD_KEYS`."""
    totals = {"records": 0, "tokens": 0, "bytes": 0}
    out_sources = []
    for source in sources:
        for shard in source["shards"]:
            for key in totals:
                totals[key] += int(shard[key])
        out_sources.append({"name": source["name"], "raw_path": str(source["raw_path"]),
                            "raw_format": source["raw_format"], "path": f"{SOURCES_DIR}/{source['name']}",
                            "shards": source["shards"]})
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


def write_manifest(out: files.Location, manifest: dict[str, Any]) -> None:
    """The commit point: written after every shard, progress entry and the recipe file."""
    files.write_json(out.join(MANIFEST_NAME), manifest)


def write_progress(location: files.Location, entry: dict[str, Any]) -> None:
    files.write_json(location, entry)


def read_progress(location: files.Location) -> dict[str, Any] | None:
    """A finished shard's progress entry, or None when absent or unusable (the shard is then redone)."""
    try:
        entry = files.read_json(location, error=PretokenizedError, what="progress entry")
    except PretokenizedError:
        return None
    if not isinstance(entry, dict) or any(k not in entry for k in PROGRESS_KEYS):
        return None
    return entry


# ---------------------------------------------------------------------- read and check
def read_manifest(path: "str | files.Location") -> dict[str, Any]:
    """The parsed manifest, structurally checked, or one :class:`PretokenizedError` naming the file."""
    loc = files.location(path)
    manifest = files.read_json(
        loc, expect_format=MANIFEST_FORMAT, error=PretokenizedError, what="pre-tokenisation manifest",
        missing_hint=" (did `zephon-ray pretokenize` finish? it writes the manifest last)")
    try:
        for key in (KEY_TOKENIZER, KEY_SPECIAL_TOKENS, KEY_SOURCE_FINGERPRINT, KEY_SOURCES, KEY_TOTALS):
            manifest[key]
        for source in manifest[KEY_SOURCES]:
            str(source["name"]), str(source["path"])
            for shard in source["shards"]:
                for key in SHARD_KEYS:
                    shard[key]
                int(shard["bytes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PretokenizedError(f"{loc}: corrupt pre-tokenisation manifest (missing or bad {exc})") from None
    return manifest


def check_manifest(path: "str | files.Location", tokenizer_spec: str) -> dict[str, Any]:
    """Before a recipe's sources are read: the manifest must exist and be complete, name the recipe's tokenizer,
    and every token shard it lists must be there, whole (one listing per source, no shard read)."""
    from zephon_ray.tokenizers import tokenizer_identity

    loc = files.location(path)
    manifest = read_manifest(loc)
    identity = tokenizer_identity(tokenizer_spec)
    if manifest.get(KEY_TOKENIZER) != identity:
        raise PretokenizedError(
            f"{loc}: the sources were pre-tokenised with tokenizer {manifest.get(KEY_TOKENIZER)!r}, but the "
            f"recipe names {tokenizer_spec!r} ({identity}); token ids from one tokenizer cannot be used with another"
        )
    special = manifest.get(KEY_SPECIAL_TOKENS)
    if not isinstance(special, dict) or special.get("mode") != SPECIAL_TOKENS:
        raise PretokenizedError(f"{loc}: special-token mode {special!r} is not {SPECIAL_TOKENS!r}, the mode "
                                "zephon-ray tokenises with")
    for source in manifest[KEY_SOURCES]:
        directory = loc.parent.join(source["path"])
        present = files.listing(directory, recursive=True)
        for shard in source["shards"]:
            size = present.get(shard["out"])
            if size != shard["bytes"]:
                state = "missing" if size is None else f"{size} bytes, the manifest records {shard['bytes']}"
                raise PretokenizedError(f"token shard {directory.join(shard['out'])}: {state} (truncated or "
                                        "rewritten; re-run pretokenize)")
    return manifest


def check_sources(manifest_path: "str | files.Location", sources: Any) -> None:
    """After a recipe's sources are read: each is a token copy the manifest lists, with exactly the listed shards.
    ``sources``: the recipe's :class:`~zephon_ray.recipe.Source` objects (name, path, shards)."""
    loc = files.location(manifest_path)
    manifest = read_manifest(loc)
    listed = {s.get("name"): s for s in manifest[KEY_SOURCES]}
    for source in sources:
        entry = listed.get(source.name)
        if entry is None:
            raise PretokenizedError(f"{loc}: source '{source.name}' is not in the pre-tokenisation manifest")
        copy = loc.parent.join(entry["path"])
        if files.location(source.path) != copy:
            raise PretokenizedError(f"source '{source.name}' reads {source.path}, not the token copy {copy} that "
                                    f"{loc} lists")
        want = {s["out"]: s["bytes"] for s in entry["shards"]}
        have = {s.name: s.size for s in source.shards}
        if want != have:
            diff = sorted(set(want.items()) ^ set(have.items()))
            raise PretokenizedError(
                f"{loc}: source '{source.name}' ({source.path}) does not hold the token shards the manifest "
                f"lists (first difference: {diff[0][0]}; a missing or extra file)"
            )
