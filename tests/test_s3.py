"""Object storage end to end (issue 15) against a real S3 API server on 127.0.0.1 (moto's server mode,
tests/s3_server.py): sources, identity, the storage layer, pre-tokenised copies, materialised runs, service state,
and the faults (missing bucket, refused credentials, an endpoint stopped mid-run). Digests are compared with the
same recipe on local disk. The multi-node, kill -9 and Ray Train runs are in tests/test_s3_cluster.py (slow)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests import s3_server
from tests.conftest import RECIPES, TINY, one_line, tiny_bucket
from tests.ports import Reserved

s3_server.configure_environment()  # at collection: before any test starts Ray, so Ray workers inherit it

STEPS = 6


@pytest.fixture(scope="module")
def bucket(s3):
    """A bucket holding the tiny recipe and its data under recipes/ (the same relative layout as the checkout)."""
    return tiny_bucket(s3, "zr-data")


@pytest.fixture(scope="module")
def remote_recipe(bucket):
    from zephon_ray import Recipe

    return Recipe.from_toml(f"s3://{bucket}/recipes/tiny.toml")


@pytest.fixture(autouse=True)
def endpoint_up(s3):
    """Every test starts (and leaves the next test) with the endpoint up and authentication off."""
    s3.start()
    yield
    s3.start()
    s3.require_auth(False)


# ------------------------------------------------------------------------------------------ the storage layer
def test_storage_layer_on_s3(s3):
    from zephon_ray import storage

    bucket = s3.new_bucket()
    root = storage.location(f"s3://{bucket}/run")
    storage.write_json(root.join("a", "doc.json"), {"format": "x/v1", "k": 1})
    storage.write_atomic(root.join("b.bin"), b"\x00" * 1000)
    assert storage.read_json(root.join("a/doc.json"), expect_format="x/v1") == {"format": "x/v1", "k": 1}
    assert storage.listing(root) == {"b.bin": 1000}
    assert storage.listing(root, recursive=True) == {"a/doc.json": 31, "b.bin": 1000}
    assert storage.sha256(root.join("b.bin")) == storage.sha256_bytes(b"\x00" * 1000)
    assert storage.exists(root.join("a")) and storage.is_dir(root.join("a")) and storage.is_file(root.join("b.bin"))
    assert not storage.exists(root.join("nothing"))
    with pytest.raises(storage.DocumentError) as info:
        storage.read_json(root.join("absent.json"), what="state")
    one_line(info.value, f"s3://{bucket}/run/absent.json: state missing")
    storage.delete_tree(root.join("a"))
    storage.delete(root.join("b.bin"))
    # Nothing left but (pyarrow's way of keeping an emptied directory) a zero-byte "run/" marker, which every
    # listing here skips.
    assert {k: v for k, v in s3.keys(bucket).items() if not k.endswith("/")} == {} and storage.listing(root) == {}
    with storage.spool(root.join("seg.parquet")) as tmp:
        Path(tmp).write_bytes(b"whole")
    assert storage.listing(root) == {"seg.parquet": 5}
    with pytest.raises(storage.StorageError) as info:
        storage.read_bytes(f"s3://zr-no-such-bucket-{bucket}/x.json")
    one_line(info.value, f"s3://zr-no-such-bucket-{bucket}/x.json", "does not exist")


def test_delete_tree_of_a_prefix_another_process_empties_meanwhile(s3):
    """A job's actors may remove their own files under a work prefix while the driver deletes the prefix: the
    driver saw a directory, and by the time it deletes, S3 holds nothing under it (pyarrow: "Path does not exist").
    That is the outcome delete_tree wants, not an error (seen in the slow docs test: `materialize --producers 2` to
    S3 failed on its .work-* prefix under load). The race is made exact: the real S3 filesystem, wrapped so that
    the first look at the prefix is followed at once by another client's removal of every key under it."""
    import pyarrow.fs as pafs

    from zephon_ray import storage
    from zephon_ray.storage.filesystems import resolve
    from zephon_ray.storage.locations import Location

    bucket = s3.new_bucket()
    real = resolve(f"s3://{bucket}/job/.work-1")  # with its pyarrow filesystem
    storage.write_json(real.join("aggregate", "member-0.json"), {"format": "x/v1"})
    storage.write_json(real.join("aggregate", "member-1.json"), {"format": "x/v1"})

    class OtherProcessEmptiesIt(pafs.FileSystemHandler):
        """The real filesystem, except that its first look at the prefix is followed by another client's removal
        of every key under it (markers included: boto3 deletes exact keys, pyarrow would recreate a parent)."""

        def __init__(self) -> None:
            self.raced = False

        def get_file_info(self, paths):
            infos = real.fs.get_file_info(paths)
            if not self.raced and real.path in paths:
                self.raced = True
                for key in [k for k in s3.keys(bucket) if k.startswith("job/.work-1")]:
                    s3.client().delete_object(Bucket=bucket, Key=key)
            return infos

        def get_file_info_selector(self, selector):
            return real.fs.get_file_info(selector)

        def delete_dir(self, path):
            real.fs.delete_dir(path)

        # the rest of the interface: the real filesystem's, unchanged
        def get_type_name(self):
            return "s3-emptied-meanwhile"

        def equals(self, other):
            return other is self

        def normalize_path(self, path):
            return real.fs.normalize_path(path)

        def create_dir(self, path, recursive):
            real.fs.create_dir(path, recursive=recursive)

        def delete_dir_contents(self, path, missing_dir_ok=False):
            real.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

        def delete_root_dir_contents(self):
            raise NotImplementedError

        def delete_file(self, path):
            real.fs.delete_file(path)

        def move(self, src, dest):
            real.fs.move(src, dest)

        def copy_file(self, src, dest):
            real.fs.copy_file(src, dest)

        def open_input_stream(self, path):
            return real.fs.open_input_stream(path)

        def open_input_file(self, path):
            return real.fs.open_input_file(path)

        def open_output_stream(self, path, metadata):
            return real.fs.open_output_stream(path, metadata=metadata)

        def open_append_stream(self, path, metadata):
            return real.fs.open_append_stream(path, metadata=metadata)

    with pytest.raises(FileNotFoundError):  # what pyarrow says of a prefix that holds nothing when it deletes
        real.fs.delete_dir(f"{bucket}/job/.work-never")
    handler = OtherProcessEmptiesIt()
    storage.delete_tree(Location(real.uri, real.path, real.scheme, pafs.PyFileSystem(handler)))
    assert handler.raced and not [k for k in s3.keys(bucket) if k.startswith("job/.work-1")]


# ------------------------------------------------------------------------------------------ sources and identity
def test_recipe_from_a_bucket_gives_local_digests(s3, bucket, remote_recipe, tiny_recipe, reference_digests):
    """Listed by Zephon's discovery through its storage router, identified by the listing's ETags (no shard is
    downloaded to fingerprint it), read by Zephon's shard cache: the batches of local disk."""
    from zephon_ray import GlobalBatchSource, Recipe

    with s3.recording() as rec:
        again = Recipe.from_toml(f"s3://{bucket}/recipes/tiny.toml")
    shard_reads = [u for u in rec.gets() if ".jsonl" in u.split("?")[0]]
    assert not shard_reads, shard_reads  # metadata only: listings, no object GET
    assert again.fingerprint == remote_recipe.fingerprint
    assert remote_recipe.sources[0].path == f"s3://{bucket}/recipes/data/tiny/prose"
    assert [s.name for s in remote_recipe.sources[0].shards] == [s.name for s in tiny_recipe.sources[0].shards]
    assert all(s.etag and s.sha256 is None and s.size > 0 for src in remote_recipe.sources for s in src.shards)
    assert remote_recipe.fingerprint != tiny_recipe.fingerprint  # other identity (ETags), same batches:
    with GlobalBatchSource(remote_recipe) as source:
        assert [source.batch(s).digest for s in range(STEPS)] == reference_digests[:STEPS]


def test_two_buckets_read_at_once_on_one_node(s3, remote_recipe, reference_digests):
    """Two recipes on two buckets read at the same time in one process, as two services (or a service and a
    notebook) of one node do: each set of remote roots has its own shard cache root, so Zephon's refusal of a root
    that a live process holds for other datasets (CacheInUseError) never meets them."""
    from zephon_ray import GlobalBatchSource, Recipe

    other = tiny_bucket(s3, "zr-data-other")
    with (
        GlobalBatchSource(remote_recipe) as first,
        GlobalBatchSource(Recipe.from_toml(f"s3://{other}/recipes/tiny.toml")) as second,
    ):
        for step in range(3):
            assert first.batch(step).digest == second.batch(step).digest == reference_digests[step]


def test_remote_identity_is_the_listing_and_etags(s3, tmp_path, capsys):
    """A rewritten object gets a new ETag: the fingerprint changes and verify_on_node names the shard and field.
    --verify-content hashes the bytes (a download) and equals the local sha256."""
    from zephon_ray import Recipe
    from zephon_ray.identity import IdentityMismatchError, verify_on_node

    bucket = s3.new_bucket()
    s3.upload_tree(RECIPES / "data" / "tiny", bucket, "data")
    text = TINY.read_text().replace('path = "data/tiny/', f'path = "s3://{bucket}/data/')
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(text)
    before = Recipe.from_toml(recipe_path)
    assert verify_on_node(before, before.fingerprint, where="test") == before.fingerprint
    verified = Recipe.from_toml(recipe_path, verify_content=True)
    local = Recipe.from_toml(TINY)
    assert [s.sha256 for s in verified.sources[0].shards] == [s.sha256 for s in local.sources[0].shards]
    assert verified.fingerprint != before.fingerprint
    assert verify_on_node(verified, verified.fingerprint) == verified.fingerprint
    from zephon_ray.cli import main

    assert main(["fingerprint", str(recipe_path), "--verify-content"]) == 0
    assert main(["fingerprint", str(recipe_path)]) == 0
    assert capsys.readouterr().out.split() == [verified.fingerprint, before.fingerprint]

    shard = RECIPES / "data" / "tiny" / "code" / "shard-00001.jsonl"
    blob = shard.read_bytes()
    s3.client().put_object(Bucket=bucket, Key="data/code/shard-00001.jsonl", Body=blob.replace(b"e", b"E", 1))
    after = Recipe.from_toml(recipe_path)
    assert after.fingerprint != before.fingerprint
    with pytest.raises(IdentityMismatchError) as info:
        verify_on_node(before, before.fingerprint, where="producer for lanes (0,)")
    one_line(info.value, "producer for lanes (0,)", "source 'code'", "shard-00001.jsonl: etag")
    with pytest.raises(IdentityMismatchError) as info:
        verify_on_node(verified, where="rank 1")
    one_line(info.value, "shard-00001.jsonl: sha256")


@pytest.mark.parametrize(
    "what", ["missing bucket", "missing prefix", "prefix with no shards", "wrong credentials", "unreachable endpoint"]
)
def test_bad_remote_sources_are_one_line(s3, bucket, tmp_path, monkeypatch, what):
    from zephon_ray import Recipe, RecipeError, storage, zephon_io

    source = f"s3://{bucket}/recipes/data/tiny/code"
    needle = source
    closed = Reserved()  # held for the whole test: refuses connections, and no server can take it meanwhile
    if what == "missing bucket":
        source = needle = f"s3://zr-absent-{bucket}/data"
        expect = "does not exist"
    elif what == "missing prefix":
        source = needle = f"s3://{bucket}/recipes/data/nothing-here"
        expect = "no objects under"
    elif what == "prefix with no shards":
        s3.client().put_object(Bucket=bucket, Key="recipes/notes/README.txt", Body=b"hello")
        source = needle = f"s3://{bucket}/recipes/notes"
        expect = "holds no shards"
    elif what == "wrong credentials":
        s3.require_auth(True)
        expect = "access denied"
    else:
        monkeypatch.setenv("S3_ENDPOINT_URL", "")  # recorded, so restored after the test: Ray workers inherit it
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.port}")
        monkeypatch.setenv(storage.RETRY_BUDGET_ENV, "2")  # a spent budget (default 600 s) is what is shown here
        storage.clear_filesystem_cache()
        zephon_io.reset_storage()
        expect = "cannot"
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(
        TINY.read_text()
        .replace('"data/tiny/code"', f'"{source}"')
        .replace('path = "data/tiny/prose"', f'path = "{RECIPES / "data" / "tiny" / "prose"}"')
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(RecipeError) as info:
            Recipe.from_toml(recipe_path)
    finally:
        closed.release()
        s3.require_auth(False)
        storage.clear_filesystem_cache()
        zephon_io.reset_storage()
    one_line(info.value, "key 'sources[1].path'", needle, expect)
    assert time.monotonic() - t0 < 180  # bounded (obstore's own retry inside each try, then the 2 s budget)


# ------------------------------------------------------------------------------------------ faults on the read path
@pytest.mark.heavy
def test_endpoint_stopped_then_restarted(s3, materialized_s3, reference_digests, monkeypatch):
    """Reads of a materialised run on S3 while the endpoint is down: retried for the storage budget, then one clean
    error naming the object; an endpoint back within the budget (default 600 s) is waited for, and the same source
    reads on."""
    # The retry budget of zephon_ray/storage/retries.py, end to end: waited out, then one line.
    from zephon_ray import MaterializedSource, storage
    from zephon_ray.formats.materialized import MaterializedError

    source = MaterializedSource(materialized_s3)
    assert source.batch(1).digest == reference_digests[1]
    s3.stop()
    t0 = time.monotonic()
    storage.set_retry_budget(3)
    try:
        with pytest.raises(MaterializedError) as info:
            source.batch(7)  # a segment whose footer is not cached yet
    finally:
        storage.set_retry_budget(None)
    failed_after = time.monotonic() - t0
    one_line(info.value, materialized_s3, "still failing after")
    assert failed_after < 60, failed_after  # a 3 s budget, ZEPHON_RAY_S3_MAX_ATTEMPTS=3 attempts, 1 s connects
    # Down now, back 5 s later, within the (default) budget: the read in flight waits and succeeds.
    restarter = threading.Timer(5.0, s3.start)
    restarter.start()
    try:
        assert source.batch(7).digest == reference_digests[7]
    finally:
        restarter.join()
    assert [source.batch(s).digest for s in range(STEPS)] == reference_digests[:STEPS]
    assert storage.read_json(f"{materialized_s3}/manifest.json")["end_step"] == 10


# ------------------------------------------------------------------------------------------ Ray Data jobs
@pytest.fixture(scope="module")
def materialized_s3(ray_cluster, s3, remote_recipe):
    """Steps 0:6 of the tiny recipe from the bucket, materialised into another bucket by M=2 lane groups (their
    collective checkpoints meet in the bucket too), then extended to 0:10 by M=1."""
    from zephon_ray.jobs.materialize import materialize

    out = f"s3://{s3.new_bucket('zr-mat')}/runs/tiny"
    first = materialize(remote_recipe, out, range(0, 6), producers=2, segment_steps=4, progress=False)
    second = materialize(remote_recipe, out, range(0, 10), progress=False)
    assert (first.written, second.written) == (range(0, 6), range(6, 10))
    return out


# Proves formats/materialized.py: a directory in a bucket commits, extends and reads back as a local one does.
@pytest.mark.heavy
def test_materialize_to_s3_extend_and_read_back(s3, bucket, materialized_s3, reference_digests, tiny_recipe, capsys):
    from zephon_ray import MaterializedSource
    from zephon_ray.cli import main

    out_bucket, prefix = materialized_s3[5:].split("/", 1)
    objects = sorted(k[len(prefix) + 1 :] for k in s3.keys(out_bucket) if not k.endswith("/"))  # no dir markers
    assert objects == [
        "checkpoints/step-000000000004.json",
        "checkpoints/step-000000000006.json",
        "checkpoints/step-000000000008.json",
        "checkpoints/step-000000000010.json",
        "manifest.json",
        "segments/steps-000000000000-000000000004.parquet",
        "segments/steps-000000000004-000000000006.parquet",
        "segments/steps-000000000006-000000000008.parquet",
        "segments/steps-000000000008-000000000010.parquet",
    ], objects  # no .work-* or temp objects
    with MaterializedSource(materialized_s3) as source:
        assert [source.batch(s).digest for s in range(10)] == reference_digests[:10]
        source.verify()
        rows = source.to_dataset().take_all()  # Ray Data reads through the same pyarrow filesystem
    step3 = sorted((r for r in rows if r["step"] == 3), key=lambda r: r["row"])
    assert {r["digest"] for r in step3} == {reference_digests[3]} and len(rows) == 10 * tiny_recipe.global_batch_rows
    # The CLI's --via dataset over the same URIs, the recipe read from the bucket too.
    assert (
        main(
            [
                "digest",
                f"s3://{bucket}/recipes/tiny.toml",
                "--steps",
                "2:10",
                "--via",
                "dataset",
                "--dataset",
                materialized_s3,
            ]
        )
        == 0
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("\x1b[33m(raylet)")]
    assert lines == [f"step {s} {reference_digests[s]}" for s in range(2, 10)]


def test_loader_dataset_mode_reads_s3(bucket, materialized_s3):
    """The loader's mode="dataset" over the materialised run in the bucket: each rank gets its slice."""
    from zephon_ray import MaterializedSource
    from zephon_ray.torchtitan import ZephonRayDataLoader

    source = MaterializedSource(materialized_s3)
    cfg = ZephonRayDataLoader.Config(
        recipe=f"s3://{bucket}/recipes/tiny.toml", mode="dataset", dataset_dir=materialized_s3
    )
    for rank in range(2):
        with cfg.build(dp_world_size=2, dp_rank=rank, seq_len=64, local_batch_size=2) as loader:
            it = iter(loader)
            for step in range(2):
                rows = []
                for _ in range(loader.microbatches_per_step):
                    inputs, labels = next(it)
                    rows.append(np.concatenate([inputs["input"].numpy(), labels.numpy()[:, -1:]], axis=1))
                assert np.array_equal(np.concatenate(rows), source.slice(step, rank, 2).tokens)


@pytest.mark.parametrize("damage", ["manifest deleted", "segment missing"])
def test_damaged_materialized_dir_on_s3_is_one_line(s3, materialized_s3, damage):
    from zephon_ray import MaterializedSource
    from zephon_ray.formats.materialized import MaterializedError

    bucket = s3.new_bucket("zr-damaged")
    client = s3.client()
    src_bucket, prefix = materialized_s3[5:].split("/", 1)
    for key in s3.keys(src_bucket, prefix):
        client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": src_bucket, "Key": key})
    copy = f"s3://{bucket}/{prefix}"
    if damage == "manifest deleted":
        client.delete_object(Bucket=bucket, Key=f"{prefix}/manifest.json")
        needle = f"{copy}/manifest.json: manifest missing"
    else:
        segment = sorted(k for k in s3.keys(bucket, f"{prefix}/segments/"))[1]
        client.delete_object(Bucket=bucket, Key=segment)
        needle = f"s3://{bucket}/{segment}: segment missing"
    with pytest.raises(MaterializedError) as info:
        MaterializedSource(copy)
    one_line(info.value, needle)


@pytest.mark.heavy
def test_pretokenize_s3_to_s3(ray_cluster, s3, remote_recipe, reference_digests):
    """Raw shards read through Zephon's router, token shards written by the actors into another bucket, manifest
    last; the copy's recipe (in the bucket) gives the raw recipe's digests."""
    from zephon_ray import GlobalBatchSource, Recipe
    from zephon_ray.jobs.pretokenize import pretokenize

    out = f"s3://{s3.new_bucket('zr-tok')}/tiny-tokens"
    result = pretokenize(remote_recipe, out, actors=2, progress=False)
    assert result.recipe_path == f"{out}/recipe.toml" and result.shards == 4 and result.records == 240
    tokens = Recipe.from_toml(result.recipe_path)
    assert tokens.pretokenized == f"{out}/manifest.json"
    with GlobalBatchSource(tokens) as source:
        assert [source.batch(s).digest for s in range(STEPS)] == reference_digests[:STEPS]
    again = pretokenize(remote_recipe, out, actors=1, progress=False)  # idempotent: every shard verifies
    assert again.shards_skipped == again.shards == 4


# ------------------------------------------------------------------------------------------ service state on S3
def test_inspect_a_state_dir_on_s3(s3, tiny_recipe, capsys):
    from zephon_ray.cli import main
    from zephon_ray.formats.service_state import ServiceState
    from zephon_ray.lanes import LaneStepper

    state_dir = f"s3://{s3.new_bucket('zr-state')}/run7"
    state = ServiceState.open(tiny_recipe, state_dir, keep_checkpoints=2, anchor_every=8)
    stepper = LaneStepper(tiny_recipe)
    try:
        for _ in range(4):
            stepper.next_step()
        state.write_checkpoint(stepper.checkpoint())
    finally:
        stepper.close()
    state.add_commit(4, "trainer")
    assert main(["inspect", state_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state_dir"] == state_dir and report["checkpoints"]["steps"] == [4]
    assert report["commits"]["by_consumer"] == {"trainer": 4}
    reopened = ServiceState.open(tiny_recipe, state_dir)
    assert reopened.read_checkpoint(4)["next_step"] == 4 and reopened.consumer_commits() == {"trainer": 4}
    # a phase a running service accepted is recorded in the bucket: the checkpoint after it goes, the phase stays
    added = tiny_recipe.with_phase("anneal", 2, {"prose": 1.0})
    assert reopened.add_phase(added, "anneal") == [4]
    assert ServiceState.open(tiny_recipe, state_dir).recipe.fingerprint == added.fingerprint
    assert main(["inspect", state_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fingerprint"] == added.fingerprint and report["checkpoints"]["steps"] == []
    assert [(p["name"], p["added"]) for p in report["schedule"]] == [("sources", False), ("anneal", True)]


@pytest.mark.heavy
def test_service_two_producers_state_dir_on_s3_and_a_cold_restart(ray_cluster, s3, remote_recipe, reference_digests):
    """Sources in one bucket, state_dir in another; 2 producers (each a Zephon rank reading through its shard
    cache); a commit; then the service stopped and started cold from the bucket state resumes at the commit."""
    from zephon_ray import DataService

    state_dir = f"s3://{s3.new_bucket('zr-state')}/services/run1"
    service = DataService.start(
        remote_recipe,
        name="s3-two",
        namespace="zr-s3-tests",
        state_dir=state_dir,
        producers=2,
        aggregate_store="torch://",
        run_id="s3-two",
        checkpoint_every=2,
        window=4,
    )
    try:
        assert [service.batch(s, track=True).digest for s in range(STEPS)] == reference_digests[:STEPS]
        service.commit(4)
    finally:
        service.stop()
    bucket, prefix = state_dir[5:].split("/", 1)
    names = {k[len(prefix) + 1 :] for k in s3.keys(bucket) if not k.endswith("/")}
    assert {"service.json", "commits.json", "checkpoints/step-000000000002.json"} <= names, names
    service = DataService.start(
        remote_recipe, name="s3-two", namespace="zr-s3-tests", state_dir=state_dir, checkpoint_every=2, window=4
    )
    try:
        start = service.status()["start"]
        assert start["start_step"] == 4 and start["checkpoint_step"] == 4, start
        assert service.batch(5).digest == reference_digests[5]
    finally:
        service.stop()


def test_local_loader_mode_reads_the_bucket(bucket, tiny_recipe):
    """The loader's mode="local" (each rank runs Zephon for its own lanes) over the recipe in the bucket."""
    from zephon_ray import GlobalBatchSource
    from zephon_ray.torchtitan import ZephonRayDataLoader

    cfg = ZephonRayDataLoader.Config(recipe=f"s3://{bucket}/recipes/tiny.toml", mode="local")
    with (
        GlobalBatchSource(tiny_recipe) as source,
        cfg.build(dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=4) as loader,
    ):
        it = iter(loader)
        for step in range(3):
            rows = []
            for _ in range(loader.microbatches_per_step):
                inputs, labels = next(it)
                rows.append(np.concatenate([inputs["input"].numpy(), labels.numpy()[:, -1:]], axis=1))
            assert np.array_equal(np.concatenate(rows), source.batch(step).tokens)


def test_ray_train_checkpoint_on_s3_restores(s3, bucket, tmp_path):
    """A Ray Train shard's loader state saved into a ``ray.train.Checkpoint`` that lives in the bucket (Ray
    Train's own pyarrow filesystem, as ``RunConfig(**storage.ray_train_storage("s3://..."))`` gives it), restored by
    a fresh shard: the next step is the same rows. The TorchTrainer run at W 2 -> 1 is in test_s3_cluster.py."""
    import pickle

    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    from zephon_ray import GlobalBatchSource, Recipe, storage
    from zephon_ray.batch import compute_digest
    from zephon_ray.integrations.ray_train import ZephonDataConfig, ZephonDataset

    recipe_uri = f"s3://{bucket}/recipes/tiny.toml"
    (shard,) = (
        s["train"]
        for s in ZephonDataConfig(run_id="r", local_batch_size=4, checkpoint_every=2).configure(
            {"train": ZephonDataset(recipe_uri)}, 1, None, None
        )
    )
    shard = pickle.loads(pickle.dumps(shard))
    with GlobalBatchSource(Recipe.from_toml(recipe_uri)) as source:
        expected = [source.batch(s).digest for s in range(4)]
    run_storage = storage.ray_train_storage(f"s3://{s3.new_bucket('zr-train')}/runs")
    try:
        assert [compute_digest(b.slice.tokens, b.slice.positions) for b in shard.iter_steps(until=2)] == expected[:2]
        shard.save(tmp_path)
    finally:
        shard.close()
    remote = f"{run_storage['storage_path']}/checkpoint_000001"
    pafs.copy_files(str(tmp_path), remote, destination_filesystem=run_storage["storage_filesystem"])
    fresh = pickle.loads(pickle.dumps(shard))
    try:
        assert fresh.restore(Checkpoint(remote, filesystem=run_storage["storage_filesystem"])) == 2
        (batch,) = fresh.iter_steps(until=3)
        assert compute_digest(batch.slice.tokens, batch.slice.positions) == expected[2]
    finally:
        fresh.close()


def test_a_ledger_and_its_loader_state_in_a_bucket_audit_clean(s3, bucket, capsys):
    """Every save writes its ledger segment to the bucket (``ledger_dir = s3://...``), and ``zephon-ray audit`` reads
    the loader state and the ledger from there; a resume from an older state is a discarded branch there too."""
    from zephon_ray import storage
    from zephon_ray.cli import main
    from zephon_ray.stream.loader import Loader, LoaderConfig

    base = f"s3://{s3.new_bucket('zr-ledger')}/run"
    config = LoaderConfig(
        recipe=f"s3://{bucket}/recipes/tiny.toml", mode="local", run_id="s3", ledger_dir=f"{base}/ledger"
    )

    def train(state, steps):
        with Loader(config, rank=0, world=1) as loader:
            if state is not None:
                loader.load_state_dict(state)
            it = iter(loader)
            for _ in range(steps):
                loader.commit(next(it).step)
            return loader.state_dict()

    first = train(None, 2)
    train(first, 2)  # abandoned: the run resumes from `first` again
    final = train(first, 3)
    storage.write_json(f"{base}/ckpt/zephon_loader.json", final)
    capsys.readouterr()
    assert main(["audit", f"{base}/ckpt", "--ledger", f"{base}/ledger", "--recipe", config.recipe]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("note: discarded branch: steps 2..3 at W=1") and lines[1] == (
        "audit: clean: steps [0, 5) each trained exactly once in a lineage of 2 segment(s) (W 1); 5 slice digests "
        "matched the recipe's global batches"
    ), lines


def test_missing_bucket_and_wrong_credentials_for_what_we_write(s3, materialized_s3, tiny_recipe):
    """The storage layer's faults are one line naming the URI, and nothing is written: a state_dir or a
    materialised directory in a bucket that does not exist, or read with credentials the store refuses."""
    from zephon_ray import MaterializedSource, storage
    from zephon_ray.formats.materialized import MaterializedError
    from zephon_ray.formats.service_state import ServiceState, ServiceStateError, check_state_dir

    missing = f"s3://zr-absent-{s3.new_bucket()}"
    with pytest.raises(ServiceStateError) as info:
        check_state_dir(tiny_recipe, f"{missing}/state")
    one_line(info.value, f"{missing}/state/service.json", "does not exist")
    with pytest.raises(ServiceStateError):
        ServiceState.open(tiny_recipe, f"{missing}/state")
    with pytest.raises(MaterializedError) as info:
        MaterializedSource(f"{missing}/run")
    one_line(info.value, f"{missing}/run", "does not exist")
    s3.require_auth(True)
    try:
        storage.clear_filesystem_cache()
        with pytest.raises(MaterializedError) as info:
            MaterializedSource(materialized_s3)
        one_line(info.value, materialized_s3, "access denied", "check the credentials")
    finally:
        s3.require_auth(False)
        storage.clear_filesystem_cache()
