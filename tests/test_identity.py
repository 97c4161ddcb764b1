"""Identity: the fingerprint changes exactly when Zephon's batches change, and every node proves it sees the data.

Every "changes the batches" claim here is checked on real batch digests (``GlobalBatchSource``), never assumed.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from conftest import RECIPES, run_ranks, wait_until

from zephon_ray import GlobalBatchSource, Recipe, hash_cache, identity, storage
from zephon_ray.hash_cache import HashReport
from zephon_ray.identity import (
    CheckpointDisagreementError,
    IdentityMismatchError,
    check_checkpoint_agreement,
    verify_on_node,
    zephon_shard_listing,
)

FIXTURE = RECIPES / "data" / "tiny"
STEPS = (0, 1, 2)

RECIPE = """
seed = 7
lanes = 2
microbatches_per_lane = 1
rows_per_microbatch = 2
seq_len = 32
chunk_size = 8
tokenizer = "bytes"

[[sources]]
name = "prose"
path = "{root}/prose"
weight = 0.5

[[sources]]
name = "code"
path = "{root}/code"
weight = 0.5
"""


@pytest.fixture(autouse=True)
def private_hash_cache(tmp_path, monkeypatch):
    """Each test gets its own hash cache (never the user's) and a short racy window, so cached entries exist."""
    monkeypatch.setenv(hash_cache.CACHE_DIR_ENV, str(tmp_path / "hash-cache"))
    monkeypatch.setattr(hash_cache, "RACY_WINDOW_S", 0.2)


def copy_fixture(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "data"
    shutil.copytree(FIXTURE, data)
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(root=data))
    wait_past_racy_window(data)  # so the first load caches the hashes
    return data, recipe


def wait_past_racy_window(root: Path) -> None:
    """Return once every file under ``root`` last changed more than the hash cache's racy window ago (a load then
    caches its hash)."""

    def settled() -> bool:
        stats = [p.stat() for p in root.rglob("*") if p.is_file()]
        newest = max(max(st.st_mtime_ns, st.st_ctime_ns) for st in stats)
        return time.time_ns() - newest > hash_cache.RACY_WINDOW_S * 1e9

    wait_until(settled, 30, f"the files under {root} older than the hash cache's racy window", interval_s=0.05)


def observe(recipe_path: Path) -> tuple[str, list[str]]:
    recipe = Recipe.from_toml(recipe_path)
    with GlobalBatchSource(recipe) as source:
        return recipe.fingerprint, [source.batch(s).digest for s in STEPS]


def swap_text_letters(path: Path) -> None:
    """Same size, same line count, different records: swap 'o' and 'i' inside every "text" value."""
    lines = path.read_bytes().split(b"\n")
    out = []
    for line in lines:
        at = line.find(b'"text": "')
        if at >= 0:
            head, tail = line[: at + 9], line[at + 9 :]
            line = head + tail.translate(bytes.maketrans(b"oi", b"io"))
        out.append(line)
    path.write_bytes(b"\n".join(out))


def write_records(path: Path, n: int, tag: str) -> None:
    text = "".join(json.dumps({"text": f"{tag} record {i} " + "lorem ipsum " * 20}) + "\n" for i in range(n))
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def build_index(directory: Path, drop_first: bool = False) -> None:
    """Zephon's own index builder; optionally drop the first shard (the one the first steps of RECIPE read)."""
    from zephon.build_index import build_index as zephon_build_index

    zephon_build_index("jsonl", directory, progress=False)
    if drop_first:
        index = json.loads((directory / "index.json").read_text())
        index["shards"] = index["shards"][1:]
        (directory / "index.json").write_text(json.dumps(index))


def rewrite_in_place_same_size_and_mtime(data: Path) -> None:
    shard = data / "prose" / "shard-00000.jsonl"
    before = shard.stat()
    swap_text_letters(shard)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def subdirectory(directory: Path) -> Path:
    (directory / "more").mkdir()
    return directory / "more"


# (edit, does Zephon read it?) -- the second item is our expectation; the test checks it against the batches.
EDITS = {
    "jsonl.gz beside the shards": (lambda d: write_records(d / "prose" / "shard-00002.jsonl.gz", 40, "gz"), True),
    "index.json naming the same shards": (lambda d: build_index(d / "prose"), False),
    "index.json naming a subset": (lambda d: build_index(d / "prose", drop_first=True), True),
    "shard in a subdirectory": (
        lambda d: write_records(subdirectory(d / "prose") / "shard-00002.jsonl", 40, "s"),
        False,
    ),
    "rewrite in place, same size and mtime": (rewrite_in_place_same_size_and_mtime, True),
    "unrelated files (.json, .txt)": (
        lambda d: [
            write_records(d / "prose" / "extra.json", 40, "json"),
            (d / "code" / "NOTES.txt").write_text("hello"),
        ],
        False,
    ),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_fingerprint_changes_exactly_when_the_batches_change(tmp_path, name):
    edit, zephon_reads_it = EDITS[name]
    data, recipe = copy_fixture(tmp_path)
    fingerprint, digests = observe(recipe)
    edit(data)
    new_fingerprint, new_digests = observe(recipe)
    assert (new_digests != digests) is zephon_reads_it, f"{name}: the batches {'did not ' * zephon_reads_it}change"
    assert (new_fingerprint != fingerprint) is zephon_reads_it, f"{name}: the fingerprint disagrees with the batches"


LAYOUTS = {
    "flat": lambda d: None,
    "compressed beside": lambda d: write_records(d / "shard-00002.jsonl.gz", 10, "gz"),
    "subdirectory": lambda d: write_records(subdirectory(d) / "x.jsonl", 10, "sub"),
    "json and txt files": lambda d: (write_records(d / "a.json", 10, "j"), (d / "b.txt").write_text("x")),
    "index of every shard": lambda d: build_index(d),
    "index of a subset": lambda d: build_index(d, drop_first=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
# Proves identity.py: the shard listing is what Zephon's discover() lists, on every layout.
def test_listing_agrees_with_zephon_discovery(tmp_path, layout):
    from zephon._internal.io.formats import ensure_builtin_formats
    from zephon._internal.io.formats.base import get_format
    from zephon._internal.io.storage import RouterStorageBackend

    directory = tmp_path / "src"
    shutil.copytree(FIXTURE / "prose", directory)
    LAYOUTS[layout](directory)
    ensure_builtin_formats(required={"jsonl"})
    _, meta = get_format("jsonl").discover(str(directory), RouterStorageBackend())
    zephon_names = [(meta[i].get("zip") or meta[i]["raw"])["basename"] for i in sorted(meta)]
    kind, ours = zephon_shard_listing(directory, "jsonl")
    assert [name for name, _ in ours] == zephon_names
    assert kind == (identity.LISTING_INDEX if "index" in layout else identity.LISTING_SCAN)


def test_parquet_listing_agrees_with_zephon_discovery(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from zephon.io import Dataset

    directory = tmp_path / "pq"
    (directory / "nested").mkdir(parents=True)
    for name in ("b.parquet", "a.parquet", "nested/c.parquet"):
        pq.write_table(pa.table({"text": [f"{name} {i}" for i in range(5)]}), directory / name)
    (directory / "a.parquet.bak").write_text("x")
    kind, ours = zephon_shard_listing(directory, "parquet")
    assert (kind, [n for n, _ in ours]) == (identity.LISTING_SCAN, ["a.parquet", "b.parquet"])
    assert Dataset.from_path("pq", str(directory), fmt="parquet").shard_count() == 2


# Proves hash_cache.py: a rewrite in place with its size and mtime restored is still rehashed.
def test_hash_cache_is_used_and_never_trusted_blindly(tmp_path):
    data, _ = copy_fixture(tmp_path)
    prose = data / "prose"

    def identify():
        report = HashReport()
        return identity.source_identity(prose, "jsonl", report=report)[1], report

    first, report = identify()
    assert report.hashed == 2
    again, report = identify()
    assert again == first and (report.cached, report.hashed) == (2, 0)

    rewrite_in_place_same_size_and_mtime(data)  # same size and mtime: only the ctime tells
    wait_past_racy_window(data)  # so the new hash is cached
    rewritten, report = identify()
    assert report.hashed == 1
    assert rewritten[0].sha256 == storage.sha256_file(prose / "shard-00000.jsonl") != first[0].sha256
    assert rewritten[1] == first[1]

    for manifest in hash_cache.cache_dir().glob("*.json"):  # a corrupt cache is ignored and rebuilt
        manifest.write_text("{not json")
    after_corruption, report = identify()
    assert after_corruption == rewritten and report.hashed == 2
    _, report = identify()
    assert report.cached == 2


def test_fresh_files_are_not_cached(tmp_path, monkeypatch):
    """Timestamps tick coarsely: a file written moments ago could be rewritten within the same tick."""
    # The module's 0.2 s window would let a stall of a loaded machine between the write and the reads age the file;
    # this test is about a file inside the window, whatever the machine does.
    monkeypatch.setattr(hash_cache, "RACY_WINDOW_S", 3600)
    directory = tmp_path / "fresh"
    directory.mkdir()
    write_records(directory / "a.jsonl", 5, "a")
    identity.source_identity(directory, "jsonl")
    report = HashReport()
    identity.source_identity(directory, "jsonl", report=report)
    assert report.hashed == 1


def test_environment_is_part_of_the_fingerprint(tiny_recipe):
    env = tiny_recipe.environment
    assert env.zephon and env.tokenizers and env.digest_format == "zephon-ray/global-batch/v1"
    for field in ("tokenizer", "zephon", "tokenizers", "digest_format"):
        other = dataclasses.replace(tiny_recipe, environment=dataclasses.replace(env, **{field: "other"}))
        assert other.fingerprint != tiny_recipe.fingerprint, field


# ------------------------------------------------------------------------------------------ verify_on_node
def test_verify_on_node_passes_on_the_same_data(tmp_path):
    _, recipe_path = copy_fixture(tmp_path)
    recipe = Recipe.from_toml(recipe_path)
    assert verify_on_node(recipe, recipe.fingerprint, where="test") == recipe.fingerprint


def test_verify_on_node_names_the_file_and_field(tmp_path):
    data, recipe_path = copy_fixture(tmp_path)
    recipe = Recipe.from_toml(recipe_path)
    rewrite_in_place_same_size_and_mtime(data)
    with pytest.raises(IdentityMismatchError) as info:
        verify_on_node(recipe, recipe.fingerprint, where="producer for lanes (0,)")
    message = str(info.value)
    sha_here = storage.sha256_file(data / "prose" / "shard-00000.jsonl")
    for needle in (
        "producer for lanes (0,)",
        "host ",
        "source 'prose'",
        "shard-00000.jsonl",
        "sha256",
        sha_here[:12],
        recipe.sources[0].shards[0].sha256[:12],
    ):
        assert needle in message, message
    assert "\n" not in message


def test_verify_on_node_names_missing_and_extra_shards_and_versions(tmp_path):
    data, recipe_path = copy_fixture(tmp_path)
    recipe = Recipe.from_toml(recipe_path)
    (data / "code" / "shard-00001.jsonl").rename(data / "code" / "shard-00001.jsonl.gz.bak")
    write_records(data / "prose" / "shard-00009.jsonl.gz", 10, "extra")
    with pytest.raises(IdentityMismatchError) as info:
        verify_on_node(recipe, where="rank 3")
    message = str(info.value)
    assert "source 'code'" in message and "shard-00001.jsonl: missing here" in message, message
    assert "shard-00009.jsonl.gz: present here" in message, message

    stale = dataclasses.replace(recipe, environment=dataclasses.replace(recipe.environment, zephon="0.1.0"))
    shutil.rmtree(data)
    shutil.copytree(FIXTURE, data)
    with pytest.raises(IdentityMismatchError, match=r"zephon: 0\.2\.0 here, 0\.1\.0 in the recipe's fingerprint"):
        verify_on_node(stale, where="rank 0")


def test_verify_on_node_refuses_a_recipe_with_another_fingerprint(tiny_recipe):
    with pytest.raises(IdentityMismatchError, match="expected 000000000000"):
        verify_on_node(tiny_recipe, "0" * 64, where="replayer")


# ------------------------------------------------------------------------------------------ collective agreement
def test_checkpoint_agreement_with_real_collective_checkpoints(tmp_path):
    """Two real Zephon ranks take one collective checkpoint through a directory; a tampered copy is named."""
    from zephon_ray.lanes import LaneStepper
    from zephon_ray.pipeline import LaneGroup

    recipe = Recipe.from_toml(RECIPES / "tiny.toml")
    steppers = [
        LaneStepper(
            recipe,
            LaneGroup(count=2, index=g, run_id="agree", aggregate_dir=str(tmp_path / "agg"), aggregate_timeout_s=60),
        )
        for g in range(2)
    ]

    def run(g: int):
        steppers[g].next_step()
        return steppers[g].checkpoint()

    try:
        states = run_ranks(2, run, timeout_s=120)
    finally:
        for s in steppers:
            s.close()
    assert all(s is not None for s in states)
    assert check_checkpoint_agreement(states) is states[0]

    tampered = json.loads(json.dumps(states[1]))
    tampered["next_step"] = tampered["next_step"] + 1
    with pytest.raises(CheckpointDisagreementError, match=r"rank 1 has [0-9a-f]{12}.*previous durable checkpoint"):
        check_checkpoint_agreement([states[0], tampered], what="collective checkpoint at step 1")
    with pytest.raises(CheckpointDisagreementError, match=r"rank 0 has"):
        check_checkpoint_agreement([tampered, states[0], states[1]])


def test_local_mode_rank_verifies_before_serving(tmp_path):
    from zephon_ray.pipeline import LaneGroup
    from zephon_ray.stream.local import LocalSlices

    data, recipe_path = copy_fixture(tmp_path)
    recipe = Recipe.from_toml(recipe_path)
    (data / "code" / "shard-00000.jsonl").write_text((data / "code" / "shard-00000.jsonl").read_text() + "\n")
    with pytest.raises(IdentityMismatchError, match=r"local-mode rank 1 of 2 on host .*shard-00000\.jsonl: size"):
        LocalSlices(recipe, rank=1, world=2, lane_group=LaneGroup(), depth=1, checkpoint_every=0)


# ------------------------------------------------------------------------------------------ two nodes, two views
def _can_unshare_mounts() -> bool:
    import subprocess

    try:
        return (
            subprocess.run(
                ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=10
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def _two_node_driver(recipe_path: str, prose: str, modified: str, out: str) -> None:
    """Runs in a spawned process (it owns its own Ray cluster). Node B is a real second raylet started with
    ``ray start`` inside its own mount namespace, where a modified copy of the prose source is bind-mounted over the
    recipe's path: every worker on node B sees other bytes at the same path, as a node with a stale copy would."""
    import signal
    import subprocess
    import sys

    import ray

    from tests.ray_clusters import local_cluster
    from zephon_ray.service import ActorResources, DataService

    info: dict = {}
    try:
        with local_cluster("zr-identity-", {"num_cpus": 2, "resources": {"node_a": 1}}) as (cluster, temp_dir):
            node_b = None
            try:
                ray_cli = str(Path(sys.executable).with_name("ray"))
                script = (
                    'mount --bind "$1" "$2" && exec "$3" start --address="$4" --num-cpus=2 '
                    '--resources=\'{"node_b": 1}\' --block --disable-usage-stats --temp-dir="$5"'
                )
                node_b = subprocess.Popen(
                    [
                        "unshare",
                        "-m",
                        "--propagation",
                        "private",
                        "sh",
                        "-c",
                        script,
                        "sh",
                        modified,
                        prose,
                        ray_cli,
                        cluster.address,
                        temp_dir,
                    ],
                    start_new_session=True,
                    stdout=subprocess.DEVNULL,
                    stderr=open(os.path.join(temp_dir, "node_b.log"), "w"),
                    # A loaded 2-core machine starts node B's agents slowly; Ray's default wait (about 15 s) is too
                    # short.
                    env={**os.environ, "RAY_agent_register_timeout_ms": "180000"},
                )
                ray.init(address=cluster.address, namespace="zr-identity", log_to_driver=False)
                deadline = time.time() + 120
                while not any(n["Alive"] and "node_b" in n["Resources"] for n in ray.nodes()):
                    assert time.time() < deadline and node_b.poll() is None, "node B did not join"
                    time.sleep(0.5)
                info["node_b_id"] = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_b" in n["Resources"])

                recipe = Recipe.from_toml(recipe_path)
                check = ray.remote(num_cpus=0.1, max_retries=0)(verify_on_node)
                info["node_a"] = ray.get(
                    check.options(resources={"node_a": 0.1}).remote(
                        recipe, recipe.fingerprint, where="check on node A"
                    ),
                    timeout=120,
                )
                try:
                    ray.get(
                        check.options(resources={"node_b": 0.1}).remote(
                            recipe, recipe.fingerprint, where="check on node B"
                        ),
                        timeout=120,
                    )
                    info["node_b"] = "passed"
                except IdentityMismatchError as exc:
                    info["node_b"] = str(getattr(exc, "cause", exc))
                    info["node_b_type"] = type(getattr(exc, "cause", exc)).__name__

                started = time.time()
                try:
                    svc = DataService.start(
                        recipe,
                        name="identity-check",
                        namespace="zr-identity",
                        producers=1,
                        resources=ActorResources(producer_resources={"node_b": 0.1}),
                    )
                    try:
                        svc.batch(0, timeout=120)
                        info["service"] = "served"
                    finally:
                        svc.stop()
                except Exception as exc:  # noqa: BLE001 - the test asserts on the message
                    info["service"] = f"{type(exc).__name__}: {exc}"
                info["service_s"] = time.time() - started
            finally:
                if node_b is not None:
                    os.killpg(node_b.pid, signal.SIGTERM)
                    try:
                        node_b.wait(30)
                    except subprocess.TimeoutExpired:
                        os.killpg(node_b.pid, signal.SIGKILL)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        info["error"] = repr(exc)
    finally:
        Path(out).write_text(json.dumps(info))


@pytest.mark.slow  # about 2 minutes on 2 cores, most of it starting the two raylets
@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs mount namespaces (unshare -m) to give node B its own view")
def test_a_node_with_a_different_copy_of_a_shard_is_named(tmp_path):
    """verify_on_node on node B names node B, the file and the field; node A passes; and a service whose producer
    lands on node B fails to start with that one error (not retries)."""
    import multiprocessing

    data, recipe_path = copy_fixture(tmp_path)
    modified = tmp_path / "node-b-prose"
    shutil.copytree(data / "prose", modified)
    swap_text_letters(modified / "shard-00001.jsonl")
    out = tmp_path / "out.json"
    proc = multiprocessing.get_context("spawn").Process(
        target=_two_node_driver, args=(str(recipe_path), str(data / "prose"), str(modified), str(out))
    )
    proc.start()
    proc.join(600)
    assert proc.exitcode == 0 and out.exists(), proc.exitcode
    info = json.loads(out.read_text())
    assert "error" not in info, info
    recipe = Recipe.from_toml(recipe_path)
    assert info["node_a"] == recipe.fingerprint  # node A sees the recipe's data
    message = info["node_b"]
    assert info.get("node_b_type") == "IdentityMismatchError", message
    for needle in (
        "check on node B",
        f"ray node {info['node_b_id'][:12]}",
        "source 'prose'",
        "shard-00001.jsonl",
        "sha256",
        storage.sha256_file(modified / "shard-00001.jsonl")[:12],
    ):
        assert needle in message, message
    service = info["service"]
    assert service.startswith("ServiceError:") and "IdentityMismatchError" in service, service
    for needle in (f"ray node {info['node_b_id'][:12]}", "shard-00001.jsonl: sha256"):
        assert needle in service, service
    assert "\n" not in service


def test_hashing_through_ray_tasks_on_this_node(ray_cluster, tmp_path):
    """With Ray up and many files, hashes come from Ray tasks pinned to this node; they equal hashlib's."""
    directory = tmp_path / "many"
    directory.mkdir()
    paths = []
    for i in range(hash_cache.RAY_MIN_FILES):
        paths.append(directory / f"s{i:04d}.jsonl")
        paths[-1].write_text(json.dumps({"text": f"record {i}"}) + "\n")
    report = HashReport()
    digests = hash_cache.digest_files(paths, progress=False, report=report)
    assert report.via == "ray" and report.hashed == len(paths)
    assert digests == {p: storage.sha256_file(p) for p in paths}


# ------------------------------------------------------------------------------------------ the Zephon fence
def test_zephon_internals_fence():
    """Every private Zephon name zephon-ray uses lives in zephon_ray/zephon_io.py, and still exists with the shape
    we rely on. When a Zephon release moves or changes one, this fails and names it; fix zephon_io.py (only)."""
    import ast
    import importlib
    import inspect

    from zephon_ray import zephon_io

    for module, name in zephon_io.FENCED_NAMES:
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            pytest.fail(f"Zephon changed: {module}.{name} is gone ({exc}); update zephon_ray/zephon_io.py")
        assert value is not None, f"{module}.{name}"
    for fmt, method in zephon_io.FENCED_METHODS:
        assert callable(getattr(zephon_io.format_handler(fmt), method, None)), (
            f"Zephon changed: the {fmt} format handler has no {method}(); update zephon_ray/zephon_io.py"
        )
    router = zephon_io.storage()
    assert callable(getattr(router, "_backend_for", None)), "Zephon changed: RouterStorageBackend._backend_for"
    from zephon._internal.io.storage.s3 import S3Backend

    assert callable(getattr(S3Backend, "_get_store", None)), "Zephon changed: S3Backend._get_store"
    assert "fmt" in inspect.signature(router.canonical_root).parameters
    assert set(zephon_io.format_suffixes("jsonl")) >= {".jsonl", ".jsonl.gz", ".jsonl.zst"}
    assert zephon_io.format_suffixes("parquet") == (".parquet",)
    # The rule for trusting an index, on a real index from Zephon's own builder (and a broken one).
    assert not zephon_io.usable_index("jsonl", {"shards": []})
    # Nothing else in the package imports zephon._internal.
    package = Path(zephon_io.__file__).parent
    for path in package.rglob("*.py"):
        if path.name == "zephon_io.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                assert not name.startswith("zephon._internal"), f"{path} imports {name}: use zephon_ray/zephon_io.py"


def test_zephon_index_rule_through_the_fence(tmp_path):
    directory = tmp_path / "src"
    shutil.copytree(FIXTURE / "prose", directory)
    build_index(directory)
    index = json.loads((directory / "index.json").read_text())
    from zephon_ray import zephon_io

    assert zephon_io.usable_index("jsonl", index)
    index["shards"][0]["num_rows"] = -1
    assert not zephon_io.usable_index("jsonl", index)
