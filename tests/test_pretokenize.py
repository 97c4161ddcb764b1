"""Pre-tokenisation (zephon_ray/jobs/pretokenize.py): a real Ray Data actor pool on a private local Ray, real Zephon
packing from the token-id copies, digests compared with the raw recipe's."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY

BPE_TOKENIZER = ROOT / "recipes" / "tokenizer" / "tokenizer.json"
STEPS = 8


def tiny_variant(tmp: Path, *, tokenizer: str | None = None, seed: int | None = None) -> Path:
    """recipes/tiny.toml with absolute source paths, optionally another tokenizer or seed."""
    text = re.sub(r'^path = "(?!/)', f'path = "{TINY.parent}/', TINY.read_text(), flags=re.M)
    if tokenizer is not None:
        text = text.replace('tokenizer = "bytes"', f'tokenizer = "{tokenizer}"')
    if seed is not None:
        text = text.replace("seed = 1234", f"seed = {seed}")
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "recipe.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def pretokenized(ray_cluster, tmp_path_factory):
    """{"bytes": (raw recipe, result), "bpe": (raw recipe, result)}, each pre-tokenised once with 2 actors."""
    from zephon_ray import Recipe
    from zephon_ray.jobs.pretokenize import pretokenize

    out = {}
    for name, tokenizer in (("bytes", None), ("bpe", str(BPE_TOKENIZER))):
        base = tmp_path_factory.mktemp(f"pretok-{name}")
        raw = Recipe.from_toml(tiny_variant(base / "raw", tokenizer=tokenizer))
        out[name] = (raw, pretokenize(raw, base / "tokens", actors=2, progress=False))
    return out


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
# Proves jobs/pretokenize.py: the pre-tokenised copy's recipe gives the raw recipe's digests.
def test_pretokenized_digests_match_raw(pretokenized, tokenizer):
    from zephon_ray import GlobalBatchSource, Recipe

    raw, result = pretokenized[tokenizer]
    tokens = Recipe.from_toml(result.recipe_path)
    assert tokens.pretokenized is not None and raw.pretokenized is None
    assert tokens.fingerprint != raw.fingerprint  # other files: equal batches, distinct identities
    assert result.shards == 4 and result.records == 240 and result.tokens > 0
    with GlobalBatchSource(raw) as a, GlobalBatchSource(tokens) as b:
        for step in range(STEPS):
            x, y = a.batch(step), b.batch(step)
            assert x.digest == y.digest, f"step {step}"
            assert x.source_tokens == y.source_tokens


def test_digest_command_prints_the_same_lines(pretokenized, capsys):
    from zephon_ray.cli import main

    raw, result = pretokenized["bpe"]
    assert main(["digest", str(raw.path), "--steps", f"0:{STEPS}"]) == 0
    want = capsys.readouterr().out
    assert main(["digest", str(result.recipe_path), "--steps", f"0:{STEPS}"]) == 0
    assert capsys.readouterr().out == want
    assert len(want.splitlines()) == STEPS


def test_shards_keep_names_order_and_counts(pretokenized):
    import pyarrow.parquet as pq

    raw, result = pretokenized["bytes"]
    manifest = json.loads((Path(result.out_dir) / "manifest.json").read_text())
    assert manifest["source_recipe_fingerprint"] == raw.fingerprint
    for source, listed in zip(raw.sources, manifest["sources"]):
        raw_names = [s.name for s in source.shards]
        assert [s["raw"] for s in listed["shards"]] == raw_names
        for shard in listed["shards"]:
            table = pq.read_table(Path(result.out_dir) / listed["path"] / shard["out"])
            assert table.num_rows == shard["records"]
            first = table.column("input_ids")[0].as_py()
            # the first record of the shard, bracketed as Zephon's tokenize(special_tokens="bos_eos") does
            text = json.loads((Path(source.path) / shard["raw"]).read_text().splitlines()[0])["text"]
            assert first == [256, *text.replace("\r\n", "\n").encode(), 257]


def test_rerun_is_idempotent_and_resumes(pretokenized, tmp_path):
    """An interrupted run (manifest never written, one shard lost, one half-written) resumes: only those two shards
    are redone and every file comes out byte-identical."""
    from zephon_ray.jobs.pretokenize import pretokenize

    raw, result = pretokenized["bytes"]
    copy = tmp_path / "tokens"
    shutil.copytree(result.out_dir, copy)
    before = files_of(copy)
    again = pretokenize(raw, copy, actors=1, progress=False)
    assert again.shards_skipped == 4 and files_of(copy) == before

    (copy / "manifest.json").unlink()
    lost = sorted((copy / "sources" / "prose").glob("*.parquet"))[0]
    lost.unlink()
    half = sorted((copy / "sources" / "code").glob("*.parquet"))[1]
    half.write_bytes(half.read_bytes()[: half.stat().st_size // 2])
    resumed = pretokenize(raw, copy, actors=1, progress=False)
    assert resumed.shards_skipped == 2
    assert files_of(copy) == before


def bad_copy(result, tmp_path: Path) -> Path:
    copy = tmp_path / "tokens"
    shutil.copytree(result.out_dir, copy)
    return copy


def test_tokenizer_differing_from_manifest_is_one_clear_error(pretokenized, tmp_path):
    from zephon_ray import Recipe, RecipeError

    _, result = pretokenized["bytes"]
    copy = bad_copy(result, tmp_path)
    recipe = copy / "recipe.toml"
    recipe.write_text(recipe.read_text().replace('tokenizer = "bytes"', f'tokenizer = "{BPE_TOKENIZER}"'))
    with pytest.raises(RecipeError, match=r"key 'pretokenized'.*pre-tokenised with tokenizer 'bytes/v1'"):
        Recipe.from_toml(recipe)


@pytest.mark.parametrize("damage", ["missing", "corrupt", "truncated-shard"])
def test_damaged_pretokenization_is_one_clear_error(pretokenized, tmp_path, damage):
    from zephon_ray import Recipe, RecipeError

    _, result = pretokenized["bytes"]
    copy = bad_copy(result, tmp_path)
    if damage == "missing":
        (copy / "manifest.json").unlink()
        match = "manifest.json: pre-tokenisation manifest missing"
    elif damage == "corrupt":
        (copy / "manifest.json").write_text('{"format": "zephon-ray/pretok')
        match = "corrupt pre-tokenisation manifest"
    else:
        shard = sorted((copy / "sources" / "code").glob("*.parquet"))[0]
        shard.write_bytes(shard.read_bytes()[:-100])
        match = f"token shard .*{shard.name}: \\d+ bytes, the manifest records"
    with pytest.raises(RecipeError, match=match):
        Recipe.from_toml(copy / "recipe.toml")


def test_out_dir_of_another_recipe_is_refused(pretokenized, tmp_path):
    from zephon_ray import Recipe
    from zephon_ray.jobs.pretokenize import PretokenizeError, pretokenize

    _, result = pretokenized["bytes"]
    copy = bad_copy(result, tmp_path)
    before = files_of(copy)
    other = Recipe.from_toml(tiny_variant(tmp_path / "other", seed=99))
    with pytest.raises(PretokenizeError, match="pre-tokenisation of another recipe"):
        pretokenize(other, copy, actors=1, progress=False)
    assert files_of(copy) == before
