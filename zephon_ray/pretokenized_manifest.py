"""The pre-tokenised copy's manifest as a recipe reads it: its format and keys, and the checks a recipe runs on
``pretokenized = "manifest.json"`` before and after its sources are read. Core, so that the recipe and the pipeline
need nothing from :mod:`zephon_ray.formats`; the copy's layout and its writers are in
:mod:`zephon_ray.formats.pretokenized`.

Guarantee: :func:`check_manifest` accepts a manifest only if it is complete, names the recipe's tokenizer and
bracketing, and every token shard it lists is there with its recorded size; every failure is one
:class:`PretokenizedError` naming the file.
"""

from __future__ import annotations

from typing import Any

from zephon_ray import storage

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


class PretokenizedError(ValueError):
    """A pre-tokenisation that cannot run or a copy that does not check out; the message names the file."""


# ---------------------------------------------------------------------- read and check
def read_manifest(path: str | storage.Location) -> dict[str, Any]:
    """The parsed manifest, structurally checked, or one :class:`PretokenizedError` naming the file."""
    loc = storage.location(path)
    manifest = storage.read_json(
        loc,
        expect_format=MANIFEST_FORMAT,
        error=PretokenizedError,
        what="pre-tokenisation manifest",
        missing_hint=" (did `zephon-ray pretokenize` finish? it writes the manifest last)",
    )
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


def check_manifest(path: str | storage.Location, tokenizer_spec: str) -> dict[str, Any]:
    """Before a recipe's sources are read: the manifest must exist and be complete, name the recipe's tokenizer,
    and every token shard it lists must be there, whole (one listing per source, no shard read)."""
    from zephon_ray.tokenizers import tokenizer_identity

    loc = storage.location(path)
    manifest = read_manifest(loc)
    identity = tokenizer_identity(tokenizer_spec)
    if manifest.get(KEY_TOKENIZER) != identity:
        raise PretokenizedError(
            f"{loc}: the sources were pre-tokenised with tokenizer {manifest.get(KEY_TOKENIZER)!r}, but the "
            f"recipe names {tokenizer_spec!r} ({identity}); token ids from one tokenizer cannot be used with another"
        )
    special = manifest.get(KEY_SPECIAL_TOKENS)
    if not isinstance(special, dict) or special.get("mode") != SPECIAL_TOKENS:
        raise PretokenizedError(
            f"{loc}: special-token mode {special!r} is not {SPECIAL_TOKENS!r}, the mode zephon-ray tokenises with"
        )
    for source in manifest[KEY_SOURCES]:
        directory = loc.parent.join(source["path"])
        present = storage.listing(directory, recursive=True)
        for shard in source["shards"]:
            size = present.get(shard["out"])
            if size != shard["bytes"]:
                state = "missing" if size is None else f"{size} bytes, the manifest records {shard['bytes']}"
                raise PretokenizedError(
                    f"token shard {directory.join(shard['out'])}: {state} (truncated or rewritten; re-run pretokenize)"
                )
    return manifest


def check_sources(manifest_path: str | storage.Location, sources: Any) -> None:
    """After a recipe's sources are read: each is a token copy the manifest lists, with exactly the listed shards.
    ``sources``: the recipe's :class:`~zephon_ray.recipe.Source` objects (name, path, shards)."""
    loc = storage.location(manifest_path)
    manifest = read_manifest(loc)
    listed = {s.get("name"): s for s in manifest[KEY_SOURCES]}
    for source in sources:
        entry = listed.get(source.name)
        if entry is None:
            raise PretokenizedError(f"{loc}: source '{source.name}' is not in the pre-tokenisation manifest")
        copy = loc.parent.join(entry["path"])
        if storage.location(source.path) != copy:
            raise PretokenizedError(
                f"source '{source.name}' reads {source.path}, not the token copy {copy} that {loc} lists"
            )
        want = {s["out"]: s["bytes"] for s in entry["shards"]}
        have = {s.name: s.size for s in source.shards}
        if want != have:
            diff = sorted(set(want.items()) ^ set(have.items()))
            raise PretokenizedError(
                f"{loc}: source '{source.name}' ({source.path}) does not hold the token shards the manifest "
                f"lists (first difference: {diff[0][0]}; a missing or extra file)"
            )
