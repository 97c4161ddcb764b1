"""The third delivery path (zephon_ray/formats/materialized.py, zephon_ray/stream/dataset.py): a materialised directory
read with pyarrow gives the same batches, slices and digests as the in-process source, the CLI, the service and the
loader; damaged directories are one clear error each."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.conftest import TINY
from tests.test_pretokenize import tiny_variant

STEPS = 12


@pytest.fixture(scope="module")
def materialized_dir(ray_cluster, tiny_recipe, tmp_path_factory):
    from zephon_ray.jobs.materialize import materialize

    directory = tmp_path_factory.mktemp("materialized") / "run"
    materialize(tiny_recipe, directory, range(0, STEPS), producers=1, segment_steps=8, progress=False)
    return directory


@pytest.mark.parametrize("world", [1, 2, 4])
def test_batches_and_slices_equal_the_local_source(materialized_dir, tiny_recipe, reference_digests, world):
    from zephon_ray import GlobalBatchSource, MaterializedSource

    source = MaterializedSource(materialized_dir, recipe=tiny_recipe)
    assert source.steps == range(0, STEPS)
    with GlobalBatchSource(tiny_recipe) as local:
        for step in range(STEPS):
            want, got = local.batch(step), source.batch(step)
            assert got.digest == want.digest == reference_digests[step]
            assert np.array_equal(got.lanes, want.lanes) and got.source_tokens == want.source_tokens
            assert got.pad_token_id == want.pad_token_id and got.fingerprint == tiny_recipe.fingerprint
            for rank in range(world):
                a, b = want.slice(rank, world), source.slice(step, rank, world)
                assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.positions, b.positions)


def test_digest_via_dataset_prints_the_local_lines(materialized_dir, reference_digests, capsys):
    from zephon_ray.cli import main

    assert (
        main(["digest", str(TINY), "--steps", f"2:{STEPS}", "--via", "dataset", "--dataset", str(materialized_dir)])
        == 0
    )
    assert capsys.readouterr().out.splitlines() == [f"step {s} {reference_digests[s]}" for s in range(2, STEPS)]


def test_step_outside_the_range_and_another_recipe_are_clear_errors(materialized_dir, tmp_path, capsys):
    from zephon_ray import MaterializedSource, Recipe
    from zephon_ray.cli import main
    from zephon_ray.formats.materialized import MaterializedError

    source = MaterializedSource(materialized_dir)
    for step in (STEPS, -1, 10**9):
        with pytest.raises(MaterializedError, match=rf"step {step} is not materialised .*\(steps 0..{STEPS - 1};"):
            source.batch(step)
    other = Recipe.from_toml(tiny_variant(tmp_path, seed=99))
    with pytest.raises(MaterializedError, match=r"materialised from recipe fingerprint \w+, not .*recipe.toml"):
        MaterializedSource(materialized_dir, recipe=other)
    # On the command line: one line, and no step printed before the error.
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "digest",
                str(TINY),
                "--steps",
                f"{STEPS - 2}:{STEPS + 1}",
                "--via",
                "dataset",
                "--dataset",
                str(materialized_dir),
            ]
        )
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"zephon-ray: error: step {STEPS} is not materialised")


def _damage(directory, how):
    manifest = directory / "manifest.json"
    segment = sorted((directory / "segments").glob("*.parquet"))[0]
    if how == "missing-manifest":
        manifest.unlink()
        return r"manifest missing"
    if how == "corrupt-manifest":
        manifest.write_text(manifest.read_text()[:200])
        return r"manifest.json: corrupt manifest \(not valid JSON: Unterminated string"
    if how == "manifest-without-digests":
        data = json.loads(manifest.read_text())
        del data["digests"]
        manifest.write_text(json.dumps(data))
        return r"manifest.json: manifest key 'digests' missing \("
    if how == "manifest-without-geometry-rows":
        data = json.loads(manifest.read_text())
        del data["geometry"]["rows"]
        manifest.write_text(json.dumps(data))
        return r"manifest.json: manifest key 'geometry.rows' missing \("
    if how == "manifest-segment-without-sha256":
        data = json.loads(manifest.read_text())
        del data["segments"][1]["sha256"]
        manifest.write_text(json.dumps(data))
        return r"manifest.json: manifest key 'segments\[1\].sha256' missing \("
    if how == "truncated-segment":
        segment.write_bytes(segment.read_bytes()[:-64])
        return rf"{segment.name}: \d+ bytes, the manifest records \d+ \(truncated or rewritten; steps 0..7\)"
    if how == "missing-segment":
        segment.unlink()
        return rf"{segment.name}: segment missing"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "missing-manifest",
        "corrupt-manifest",
        "manifest-without-digests",
        "manifest-without-geometry-rows",
        "manifest-segment-without-sha256",
        "truncated-segment",
        "missing-segment",
    ],
)
def test_a_damaged_directory_is_one_clear_error(materialized_dir, tmp_path, how):
    from zephon_ray import MaterializedSource
    from zephon_ray.formats.materialized import MaterializedError

    copy = tmp_path / "copy"
    shutil.copytree(materialized_dir, copy)
    match = _damage(copy, how)
    with pytest.raises(MaterializedError, match=match) as info:
        MaterializedSource(copy)
    assert "\n" not in str(info.value) and str(copy) in str(info.value)


def test_a_row_group_corrupted_in_place_is_detected_on_read(materialized_dir, tmp_path, reference_digests):
    """Same size, other bytes (a flipped token): the read fails on the digest instead of returning wrong rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon_ray import MaterializedSource
    from zephon_ray.formats.materialized import MaterializedError

    copy = tmp_path / "copy"
    shutil.copytree(materialized_dir, copy)
    segment = sorted((copy / "segments").glob("*.parquet"))[0]
    table = pq.read_table(segment)
    tokens = table.column("tokens").combine_chunks()
    values = tokens.flatten().to_numpy().copy()
    values[5] = (values[5] + 1) % 250
    table = table.set_column(
        table.schema.get_field_index("tokens"),
        "tokens",
        pa.FixedSizeListArray.from_arrays(pa.array(values), tokens.type.list_size),
    )
    size = segment.stat().st_size
    pq.write_table(table, segment, row_group_size=16, compression="zstd")
    data = json.loads((copy / "manifest.json").read_text())
    data["segments"][0]["bytes"] = segment.stat().st_size  # only the digests can still tell
    (copy / "manifest.json").write_text(json.dumps(data))
    source = MaterializedSource(copy)
    assert source.batch(1).digest == reference_digests[1]
    with pytest.raises(MaterializedError, match=r"step 0 does not match its recorded digest"):
        source.batch(0)
    assert size > 0


@pytest.mark.heavy
def test_to_dataset_reads_the_parquet_lazily(materialized_dir, tiny_recipe, reference_digests):
    from zephon_ray import GlobalBatchSource, MaterializedSource, compute_digest
    from zephon_ray.formats.materialized import batch_table, dataset_schema

    dataset = MaterializedSource(materialized_dir).to_dataset()  # lazy: nothing is read until consumed
    B, T = tiny_recipe.global_batch_rows, tiny_recipe.row_length
    # ONE row schema: a materialised directory's view and the service's (batch_table) are the same.
    with GlobalBatchSource(tiny_recipe) as local:
        assert batch_table(local.batch(3)).schema == dataset_schema(T)
    rows = dataset.take_all()
    assert dataset.schema().base_schema == dataset_schema(T)
    assert len(rows) == STEPS * B
    assert {r["digest"] for r in rows if r["step"] == 5} == {reference_digests[5]}
    step3 = sorted((r for r in rows if r["step"] == 3), key=lambda r: r["row"])
    tokens = np.stack([np.asarray(r["tokens"]) for r in step3]).reshape(B, T)
    positions = np.stack([np.asarray(r["positions"]) for r in step3]).reshape(B, T)
    assert compute_digest(tokens, positions) == reference_digests[3]


@pytest.mark.slow  # starts a DataService next to the Ray Data jobs
def test_service_batches_and_lazy_export_equal_the_materialised_ones(
    materialized_dir, ray_cluster, tiny_recipe, tmp_path
):
    from zephon_ray import DataService, MaterializedSource

    source = MaterializedSource(materialized_dir)
    service = DataService.start(
        tiny_recipe,
        name="materialized-check",
        namespace="zephon-ray-tests-h4",
        state_dir=tmp_path / "state",
        window=4,
        checkpoint_every=4,
    )
    try:
        for step in range(4):
            assert service.batch(step).digest == source.digest(step)
        for world in (2, 4):
            for rank in range(world):
                a, b = service.slice(5, rank, world, track=False), source.slice(5, rank, world)
                assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.positions, b.positions)
        exported = service.to_dataset(range(6, 8))  # lazy: nothing read until consumed
        digests = {row["step"]: row["digest"] for row in exported.select_columns(["step", "digest"]).take_all()}
        assert digests == {6: source.digest(6), 7: source.digest(7)}
        assert exported.schema().base_schema == source.to_dataset().schema().base_schema
    finally:
        service.stop()


# ---------------------------------------------------------------------- the service over a materialised prefix
@pytest.mark.heavy
def test_service_serves_a_materialised_prefix_then_producers_from_its_end(
    materialized_dir, ray_cluster, tiny_recipe, reference_digests, tmp_path
):
    """Steps 0..11 are read from the directory (in the Replayer, no Zephon), steps 12.. come from 2 producers
    restored from the directory's step-12 checkpoint (it was written with M=1). Every rank's slice at W = 1, 2, 4
    joins into the reference digest across the boundary, and a restart whose consumer committed inside the prefix
    starts its producers at 12 again."""
    from zephon_ray import DataService, MaterializedSource
    from zephon_ray.batch import compute_digest

    options = dict(
        name="prefix",
        namespace="zr-prefix",
        state_dir=tmp_path / "state",
        window=4,
        checkpoint_every=4,
        producers=2,
        run_id="prefix",
        aggregate_store="torch://",
        materialized_dir=str(materialized_dir),
    )
    with DataService.start(tiny_recipe, **options) as service:
        status = service.status()
        assert status["materialized"] == {"dir": str(materialized_dir.resolve()), "first_step": 0, "end_step": STEPS}
        assert (status["start"]["start_step"], status["start"]["checkpoint_step"]) == (STEPS, STEPS)
        for step in range(STEPS + 6):
            world = (1, 2, 4)[step % 3]
            rows = [service.slice(step, rank, world, track=True) for rank in range(world)]
            joined = [np.concatenate([getattr(r, key) for r in rows]) for key in ("tokens", "positions")]
            assert compute_digest(*joined) == reference_digests[step], f"step {step}, W={world}"
        status = service.status()
        replay = status["replay"]
        # each prefix step read once from the directory, shared by the ranks of its W; no Zephon replay at all
        assert replay["materialized_reads"] == replay["submitted"] == STEPS and replay["last"] is None
        assert status["throughput"]["produced_steps"] < STEPS  # producers never made the prefix
        assert min(status["window"]["held_steps"]) >= STEPS
        service.commit(6)
    with DataService.start(tiny_recipe, **options) as service:
        status = service.status()
        assert (status["start"]["start_step"], status["start"]["replay_steps"]) == (STEPS, 0)
        batch = service.batch(6)
        assert batch.digest == reference_digests[6]
        assert batch.source_tokens == MaterializedSource(materialized_dir).batch(6).source_tokens
        assert service.batch(STEPS).digest == reference_digests[STEPS]


def test_service_config_checks_the_materialised_prefix_before_anything_starts(materialized_dir, tiny_recipe, tmp_path):
    from zephon_ray import DataService, Recipe
    from zephon_ray.service.config import ServiceConfig
    from zephon_ray.service.server.launch import check_materialized_dir  # the check start() runs

    with pytest.raises(ValueError, match="materialized_dir must be a non-empty path string"):
        ServiceConfig(materialized_dir="")
    with pytest.raises(ValueError, match="materialized_dir: materialised directory not found"):
        check_materialized_dir(tiny_recipe, str(tmp_path / "nope"))
    other = Recipe.from_toml(tiny_variant(tmp_path / "other", seed=99))
    with pytest.raises(ValueError, match="materialized_dir: .*materialised from recipe fingerprint"):
        check_materialized_dir(other, str(materialized_dir))
    broken = tmp_path / "broken"
    shutil.copytree(materialized_dir, broken)
    (broken / "checkpoints" / f"step-{STEPS:012d}.json").unlink()
    with pytest.raises(ValueError, match=f"step-{STEPS:012d}.json: checkpoint missing"):
        check_materialized_dir(tiny_recipe, str(broken))
    state_dir = tmp_path / "state"
    with pytest.raises(ValueError, match="materialized_dir"):
        DataService.start(tiny_recipe, state_dir=state_dir, materialized_dir=str(broken))
    assert not state_dir.exists()  # refused before anything was written


# ---------------------------------------------------------------------- the loader's mode="dataset"
def _loader(mode, rank=0, world=1, **kw):
    from zephon_ray.torchtitan import ZephonRayDataLoader

    cfg = ZephonRayDataLoader.Config(recipe=str(TINY), mode=mode, **kw)
    return cfg.build(dp_world_size=world, dp_rank=rank, seq_len=64, local_batch_size=2)


def _take_steps(loader, steps):
    """The rows of ``steps`` global steps (each a list of microbatches) from an iterator over ``loader``."""
    out = []
    it = iter(loader)
    for _ in range(steps):
        rows = []
        for _ in range(loader.microbatches_per_step):
            inputs, labels = next(it)
            rows.append(np.concatenate([inputs["input"].numpy(), labels.numpy()[:, -1:]], axis=1))
        out.append(np.concatenate(rows))
    return out


def test_loader_dataset_mode_serves_each_rank_its_slice(materialized_dir, tiny_recipe):
    from zephon_ray import MaterializedSource

    source = MaterializedSource(materialized_dir)
    for rank in range(2):
        with _loader("dataset", rank=rank, world=2, dataset_dir=str(materialized_dir)) as loader:
            got = _take_steps(loader, 3)
        for step in range(3):
            assert np.array_equal(got[step], source.slice(step, rank, 2).tokens)


def test_loader_switches_modes_at_a_resume(materialized_dir, tiny_recipe):
    """dataset -> local -> dataset: the state is the same dict, and the next step is the same rows."""
    from zephon_ray import MaterializedSource

    source = MaterializedSource(materialized_dir)
    with _loader("dataset", dataset_dir=str(materialized_dir)) as loader:
        _take_steps(loader, 3)
        state = loader.state_dict()
    assert state["next_step"] == 3 and state["fingerprint"] == tiny_recipe.fingerprint
    with _loader("local") as local:
        local.load_state_dict(json.loads(json.dumps(state)))
        (rows,) = _take_steps(local, 1)
        assert np.array_equal(rows, source.batch(3).tokens)
        state = local.state_dict()
    with _loader("dataset", dataset_dir=str(materialized_dir)) as loader:
        loader.load_state_dict(state)
        (rows,) = _take_steps(loader, 1)
        assert np.array_equal(rows, source.batch(4).tokens)


def test_loader_dataset_mode_validation(materialized_dir, tmp_path):
    from zephon_ray.formats.materialized import MaterializedError

    with pytest.raises(ValueError, match="'dataset_dir' is required with mode='dataset'"):
        _loader("dataset")
    with pytest.raises(ValueError, match="only used by it"):
        _loader("local", dataset_dir=str(materialized_dir))
    with pytest.raises(MaterializedError, match="materialised directory not found"):
        _loader("dataset", dataset_dir=str(tmp_path / "nope"))
    with _loader("dataset", dataset_dir=str(materialized_dir)) as loader:
        loader.load_state_dict({**loader.state_dict(), "next_step": STEPS})
        with pytest.raises(MaterializedError, match=f"step {STEPS} is not materialised"):
            next(iter(loader))
