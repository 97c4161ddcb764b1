"""Recipe loading: validation names the key or file at fault; the fingerprint tracks data, not path spelling."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, TINY

from zephon_ray import Recipe, RecipeError

FIXTURE = ROOT / "tests" / "fixtures" / "tiny"

BASE = f"""
seed = 1
lanes = 4
microbatches_per_lane = 1
rows_per_microbatch = 2
seq_len = 32
chunk_size = 8
tokenizer = "bytes"

[[sources]]
name = "prose"
path = "{FIXTURE / "prose"}"
weight = 0.6

[[sources]]
name = "code"
path = "{FIXTURE / "code"}"
weight = 0.4
"""


def write(tmp_path: Path, text: str, name: str = "r.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(tmp_path: Path, text: str) -> Recipe:
    return Recipe.from_toml(write(tmp_path, text))


def test_tiny_recipe_loads_with_resolved_paths(tiny_recipe):
    assert tiny_recipe.global_batch_rows == 16
    assert tiny_recipe.row_length == 65
    assert [s.name for s in tiny_recipe.sources] == ["prose", "code"]
    assert all(Path(s.path).is_absolute() and Path(s.path).is_dir() for s in tiny_recipe.sources)
    assert all(s.format == "jsonl" and s.shards for s in tiny_recipe.sources)
    assert len(tiny_recipe.fingerprint) == 64


def test_relative_paths_resolve_against_the_recipe_file(tmp_path):
    nested = tmp_path / "deep" / "er"
    nested.mkdir(parents=True)
    shutil.copytree(FIXTURE, tmp_path / "data")
    recipe = load(nested, BASE.replace(str(FIXTURE), "../../data"))
    assert recipe.sources[0].path == str((tmp_path / "data" / "prose").resolve())


def test_path_spelling_does_not_change_the_fingerprint(tmp_path):
    absolute = load(tmp_path, BASE)
    relative = Recipe.from_toml(write(FIXTURE.parent, BASE.replace(str(FIXTURE), "./tiny/../tiny"), "tmp-r.toml"))
    (FIXTURE.parent / "tmp-r.toml").unlink()
    with_aggregate = load(tmp_path, BASE + '\n[aggregate]\nstore = "torch://"\n')
    assert absolute.fingerprint == relative.fingerprint == with_aggregate.fingerprint


@pytest.mark.parametrize(
    "old,new",
    [
        ("seed = 1", "seed = 2"),
        ("lanes = 4", "lanes = 2"),
        ("microbatches_per_lane = 1", "microbatches_per_lane = 2"),
        ("rows_per_microbatch = 2", "rows_per_microbatch = 1"),
        ("seq_len = 32", "seq_len = 48"),
        ("chunk_size = 8", "chunk_size = 16"),
        ('tokenizer = "bytes"', 'tokenizer = "../../recipes/tokenizer/tokenizer.json"'),
        ("weight = 0.6", "weight = 0.5"),
        ('name = "code"', 'name = "source-code"'),
        ("seed = 1", 'seed = 1\npacking = "best_fit"\npacking_bins = 4'),
        ("seed = 1", 'seed = 1\npacking = "best_fit_wrap"'),
        ("seed = 1", "seed = 1\nrepeat = false"),
        ("seed = 1", "seed = 1\nflush_every_k_chunks = 3"),
        ("seed = 1", 'seed = 1\ntext_field = "origin"'),
        (None, "\n[shuffle]\nwithin_shard = false\n"),
        (None, "\n[shuffle]\nshards = false\n"),
    ],
)
def test_every_data_defining_key_changes_the_fingerprint(tmp_path, old, new):
    base = load(tmp_path, BASE)
    text = BASE + new if old is None else BASE.replace(old, new, 1)
    if "tokenizer.json" in new:
        text = text.replace("../../recipes", str(ROOT / "recipes"))
    assert text != BASE
    assert load(tmp_path, text).fingerprint != base.fingerprint


def test_shard_listing_is_part_of_the_fingerprint(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    text = BASE.replace(str(FIXTURE), str(data))
    before = load(tmp_path, text).fingerprint
    with open(data / "code" / "shard-00001.jsonl", "a") as fh:
        fh.write(json.dumps({"text": "one more record"}) + "\n")
    assert load(tmp_path, text).fingerprint != before


BAD = [
    # (description, edit applied to BASE, text the error must contain)
    ("misspelled top-level key", lambda t: t.replace("lanes = 4", "lane = 4"), "'lane'"),
    ("wrong type", lambda t: t.replace("seq_len = 32", 'seq_len = "32"'), "'seq_len'"),
    ("bool where an int belongs", lambda t: t.replace("lanes = 4", "lanes = true"), "'lanes'"),
    ("missing required key", lambda t: t.replace("seed = 1\n", ""), "'seed'"),
    ("zero size", lambda t: t.replace("rows_per_microbatch = 2", "rows_per_microbatch = 0"), "'rows_per_microbatch'"),
    (
        "negative size",
        lambda t: t.replace("microbatches_per_lane = 1", "microbatches_per_lane = -1"),
        "'microbatches_per_lane'",
    ),
    ("missing source dir", lambda t: t.replace(str(FIXTURE / "code"), "/nonexistent/code"), "/nonexistent/code"),
    ("chunk_size larger than a source", lambda t: t.replace("chunk_size = 8", "chunk_size = 100000"), "'chunk_size'"),
    (
        "missing tokenizer file",
        lambda t: t.replace('"bytes"', '"/nonexistent/tokenizer.json"'),
        "/nonexistent/tokenizer.json",
    ),
    ("unknown packing", lambda t: t.replace("seed = 1", 'seed = 1\npacking = "tetris"'), "'packing'"),
    (
        "best_fit without packing_bins",
        lambda t: t.replace("seed = 1", 'seed = 1\npacking = "best_fit"'),
        "'packing_bins'",
    ),
    ("packing_bins with wrap", lambda t: t.replace("seed = 1", "seed = 1\npacking_bins = 4"), "'packing_bins'"),
    ("negative weight", lambda t: t.replace("weight = 0.6", "weight = -1"), "'sources[0].weight'"),
    (
        "no positive weight",
        lambda t: t.replace("weight = 0.6", "weight = 0").replace("weight = 0.4", "weight = 0"),
        "'sources'",
    ),
    ("duplicate source name", lambda t: t.replace('name = "code"', 'name = "prose"'), "'sources[1].name'"),
    ("misspelled source key", lambda t: t.replace('name = "code"', 'nmae = "code"'), "'sources[1].nmae'"),
    ("unknown format", lambda t: t.replace('name = "code"', 'name = "code"\nformat = "csv"'), "'sources[1].format'"),
    ("misspelled shuffle key", lambda t: t + "\n[shuffle]\nshard = true\n", "'shuffle.shard'"),
    (
        "both aggregate store and dir",
        lambda t: t + '\n[aggregate]\nstore = "torch://"\ndir = "/tmp/x"\n',
        "'aggregate'",
    ),
    ("no sources", lambda t: t.split("[[sources]]")[0] + "sources = []\n", "'sources'"),
    ("not TOML", lambda t: t + "\nthis is = = not toml\n", "not valid TOML"),
]


@pytest.mark.parametrize("what,edit,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_recipes_raise_one_clear_error(tmp_path, what, edit, needle):
    with pytest.raises(RecipeError) as info:
        load(tmp_path, edit(BASE))
    message = str(info.value)
    assert needle in message, message
    assert str(tmp_path / "r.toml") in message or "recipe" in message
    assert "\n" not in message  # one line, no traceback dump


def test_empty_source_dir_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RecipeError, match=r"holds no shards \(\.jsonl, \.jsonl\.gz, .*\.parquet\): .*empty"):
        load(tmp_path, BASE.replace(str(FIXTURE / "code"), str(empty)))


def test_empty_shard_file_is_named(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    (data / "code" / "shard-00009.jsonl").write_text("")
    with pytest.raises(RecipeError, match="shard-00009.jsonl"):
        load(tmp_path, BASE.replace(str(FIXTURE), str(data)))


def test_missing_recipe_file_is_named(tmp_path):
    with pytest.raises(RecipeError, match="nope.toml"):
        Recipe.from_toml(tmp_path / "nope.toml")


def test_shipped_recipes_load():
    for name in ("tiny.toml",):
        assert Recipe.from_toml(TINY.parent / name).lanes == 8


def test_packing_bins_reach_zephon_and_wrapping_packers_build(tmp_path):
    """'best_fit' used to load and then fail at first use (Zephon requires num_bins); now the bins are part of the
    recipe and reach the pipeline. Only the wrapping packers are built here: a binned packer on small documents can
    keep Zephon's round-robin buffer growing for minutes before step 0 (docs/limits.md)."""
    from zephon_ray import GlobalBatchSource
    from zephon_ray.pipeline import build_pipeline

    binned = load(tmp_path, BASE.replace("seed = 1", 'seed = 1\npacking = "best_fit"\npacking_bins = 4', 1))
    assert binned.packing_bins == 4 and "packing_bins" in binned.canonical()
    build_pipeline(binned)  # Zephon validates num_bins when the pipeline is built: no "num_bins is required"
    recipe = load(tmp_path, BASE.replace("seed = 1", 'seed = 1\npacking = "best_fit_wrap"', 1))
    with GlobalBatchSource(recipe) as source:
        batch = source.batch(1)
    assert batch.tokens.shape == (recipe.global_batch_rows, recipe.row_length)


def test_mixed_formats_name_the_format_key(tmp_path):
    """A typed error (MixedFormatsError) picks the key, not the message text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    pq.write_table(pa.table({"text": ["x"] * 10}), data / "code" / "extra.parquet")
    with pytest.raises(RecipeError, match=r"key 'sources\[1\]\.format': .* mixes jsonl and parquet shards"):
        load(tmp_path, BASE.replace(str(FIXTURE), str(data)))


def _load_without_override(recipe_path: Path) -> str:
    """Load ``recipe_path`` in a child process that cannot read what the test made unreadable; returns its stdout.
    As root (which reads everything) the child runs under ``setpriv`` without the capabilities that bypass file
    permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom zephon_ray import Recipe, RecipeError\n"
        "try:\n    Recipe.from_toml(sys.argv[1])\n    print('LOADED')\n"
        "except RecipeError as exc:\n    print('ERROR', exc)\n"
    )
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: file permissions cannot be enforced")
        drop = "-dac_override,-dac_read_search"
        prefix = [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}"]
    env = {**os.environ, "ZEPHON_RAY_CACHE_DIR": str(recipe_path.parent / "cache")}
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", code, str(recipe_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(recipe_path.parent),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


@pytest.mark.parametrize("what", ["unreadable shard", "unlistable directory"])
def test_permission_denied_on_a_source_is_one_line(tmp_path, what):
    """A PermissionError on a source (a shard without read permission, a directory that cannot be listed) is one
    RecipeError naming the key and the file, never a traceback."""
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    recipe = write(tmp_path, BASE.replace(str(FIXTURE), str(data)))
    if what == "unreadable shard":
        target, needle = data / "code" / "shard-00001.jsonl", "shard-00001.jsonl"
        os.chmod(target, 0o000)
    else:
        target, needle = data / "code", str(data / "code")
        os.chmod(target, 0o311)  # traverse, but not list
    try:
        out = _load_without_override(recipe)
    finally:
        os.chmod(target, 0o755)
    assert out.startswith("ERROR ") and "\n" not in out, out
    assert "key 'sources[1].path'" in out and needle in out and "Permission denied" in out, out
