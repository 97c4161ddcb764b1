"""Materialisation (zephon_ray/jobs/materialize.py): Ray Data lane-group actors on a private local Ray, real Zephon
ranks with collective checkpoints, step-keyed Parquet compared with the in-process reference digests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, run_spawned_driver
from tests.test_pretokenize import files_of, tiny_variant


@pytest.fixture(scope="module")
def materialized(ray_cluster, tiny_recipe, tmp_path_factory):
    """Steps 0:10 of the tiny recipe by M=2 lane-group actors (segments of 4), then extended to 0:14 by M=1."""
    from zephon_ray.jobs.materialize import materialize

    directory = tmp_path_factory.mktemp("mat") / "run"
    first = materialize(tiny_recipe, directory, range(0, 10), producers=2, segment_steps=4, progress=False)
    files_after_first = files_of(directory)
    second = materialize(tiny_recipe, directory, range(0, 14), producers=1, progress=False)
    return directory, first, second, files_after_first


def test_digests_match_the_reference_for_M_2_then_M_1(materialized, reference_digests):
    from zephon_ray.formats.materialized import MaterializedSource

    directory, first, second, _ = materialized
    assert (first.written, second.written) == (range(0, 10), range(10, 14))
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["digests"] == reference_digests[:14]
    assert [(s["first_step"], s["end_step"]) for s in manifest["segments"]] == [
        (0, 4),
        (4, 8),
        (8, 10),
        (10, 12),
        (12, 14),
    ]
    source = MaterializedSource(directory)
    assert [source.batch(s).digest for s in range(14)] == reference_digests[:14]


def test_one_row_group_per_step_in_canonical_order(materialized, tiny_recipe):
    import numpy as np
    import pyarrow.parquet as pq

    directory, *_ = materialized
    segment = pq.ParquetFile(sorted((directory / "segments").glob("*.parquet"))[1])  # steps 4..7
    assert segment.metadata.num_row_groups == 4
    group = segment.read_row_group(2)
    B = tiny_recipe.global_batch_rows
    assert group.column("step").to_pylist() == [6] * B
    assert group.column("row").to_pylist() == list(range(B))
    assert group.column("lane").to_pylist() == list(np.repeat(range(tiny_recipe.lanes), tiny_recipe.rows_per_lane))


def test_extending_never_rewrites_committed_files(materialized):
    directory, _, _, files_after_first = materialized
    now = files_of(directory)
    for name, data in files_after_first.items():
        if name != "manifest.json":
            assert now[name] == data, name


def test_nothing_to_do_when_already_materialised(materialized, tiny_recipe):
    from zephon_ray.jobs.materialize import materialize

    directory, *_ = materialized
    before = files_of(directory)
    result = materialize(tiny_recipe, directory, range(3, 9), progress=False)
    assert len(result.written) == 0 and (result.first_step, result.end_step) == (0, 14)
    assert files_of(directory) == before


@pytest.mark.parametrize(
    "steps, producers, match",
    [
        (range(20, 24), 1, r"ends at step 14; starting at 20 would leave a gap"),
        (range(14, 16), 3, r"producers 3 does not divide the recipe's 8 lanes"),
        (range(14, 10**13), 1, r"beyond the limit"),
    ],
)
def test_bad_requests_are_clear_errors_and_write_nothing(materialized, tiny_recipe, steps, producers, match):
    from zephon_ray.formats.materialized import MaterializedError
    from zephon_ray.jobs.materialize import materialize

    directory, *_ = materialized
    before = files_of(directory)
    with pytest.raises(MaterializedError, match=match):
        materialize(tiny_recipe, directory, steps, producers=producers, progress=False)
    assert files_of(directory) == before


def test_a_directory_of_another_recipe_is_refused(materialized, tmp_path):
    from zephon_ray import Recipe
    from zephon_ray.formats.materialized import MaterializedError
    from zephon_ray.jobs.materialize import materialize

    directory, *_ = materialized
    before = files_of(directory)
    other = Recipe.from_toml(tiny_variant(tmp_path, seed=99))
    with pytest.raises(MaterializedError, match=r"holds a materialisation of recipe fingerprint \w+, not"):
        materialize(other, directory, range(0, 20), progress=False)
    assert files_of(directory) == before


def test_bad_steps_on_the_command_line_is_one_line(tmp_path, capsys):
    from zephon_ray.cli import main

    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        main(["materialize", str(TINY), "--steps", "5:2", "--out", str(out)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["zephon-ray: error: --steps '5:2': expected 0 <= A < B"]
    assert not out.exists()


@pytest.mark.heavy
def test_killed_and_resumed_is_byte_identical(ray_cluster, tiny_recipe, tmp_path):
    """SIGKILL a real `zephon-ray materialize` process right after its first segment is committed, re-run the
    same job: every file equals an uninterrupted run's, byte for byte."""
    from zephon_ray.jobs.materialize import materialize

    steps, segment = 300, 2
    killed = tmp_path / "killed"
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zephon_ray.cli",
            "materialize",
            str(TINY),
            "--steps",
            f"0:{steps}",
            "--out",
            str(killed),
            "--segment-steps",
            str(segment),
            "--address",
            address,
            "--quiet",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "RAY_ADDRESS": address},
    )
    manifest = killed / "manifest.json"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if manifest.is_file() and json.loads(manifest.read_text())["end_step"] >= segment:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the job ended before it could be killed: {proc.stderr.read()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    committed = json.loads(manifest.read_text())["end_step"]
    assert segment <= committed < steps
    resumed = materialize(tiny_recipe, killed, range(0, steps), progress=False)
    assert resumed.written.start == committed

    reference = tmp_path / "reference"
    materialize(tiny_recipe, reference, range(0, steps), segment_steps=segment, progress=False)

    def data(files):
        return {name: blob for name, blob in files.items() if not name.startswith("checkpoints/")}

    killed_files, reference_files = files_of(killed), files_of(reference)
    assert data(killed_files) == data(reference_files)  # manifest and every segment
    assert killed_files.keys() == reference_files.keys()  # checkpoint bytes record Zephon's read-ahead (module doc)


# ---------------------------------------------------------------------- multi-node: a simulated 3-raylet cluster
MULTINODE_STEPS = (range(0, 10), range(0, 16))  # first run, then an extension of the same directory
MULTINODE_TIMEOUT_S = 300


def _materialize_on_two_nodes(directory: str, summary: str) -> None:
    """Spawned driver: a head (0 CPUs) plus worker nodes ``node_a`` and ``node_b`` (1 CPU each) on this machine.

    Runs every range of MULTINODE_STEPS with producers=2 and ``cpus_per_actor=0.75``, so each worker node fits
    exactly one lane-group actor and the head none. Records, per run, the node of every lane-group actor it started
    (Ray's own GCS actor table, ``ray._private.state.actors()``: the actors named
    ``MapWorker(MapBatches(LaneGroupWorker))`` and their address node id; the public ``ray.util.state`` needs the
    dashboard, which this head skips to start faster), then the digests read back through MaterializedSource, into
    a JSON ``summary`` that the test checks. Its own process, like tests/test_service_cluster.py: Cluster needs a
    Ray session of its own, apart from the session fixture's. materialize.py is used unchanged.
    """
    import traceback

    import ray
    from ray._private import state as ray_state

    from tests.ray_clusters import local_cluster
    from zephon_ray import Recipe
    from zephon_ray.formats.materialized import MaterializedSource
    from zephon_ray.jobs.materialize import materialize

    info: dict = {}
    t0 = time.monotonic()
    try:
        with local_cluster("zr-mat-cluster-", {"num_cpus": 0, "include_dashboard": False}) as (cluster, temp_dir):
            workers = {
                name: cluster.add_node(num_cpus=1, resources={name: 1}, temp_dir=temp_dir)
                for name in ("node_a", "node_b")
            }
            # No runtime_env: workers import zephon_ray like this process does, and start faster without one.
            ray.init(address=cluster.address, namespace="zr-mat-cluster", log_to_driver=False)
            info["cluster_s"] = round(time.monotonic() - t0, 1)
            info["head"] = cluster.head_node.node_id
            info["nodes"] = {name: node.node_id for name, node in workers.items()}
            info["driver_node"] = ray.get_runtime_context().get_node_id()
            job = ray.get_runtime_context().get_job_id()
            recipe = Recipe.from_toml(TINY)
            seen: set[str] = set()
            info["runs"] = []
            for steps in MULTINODE_STEPS:
                t = time.monotonic()
                result = materialize(
                    recipe, directory, steps, producers=2, segment_steps=4, cpus_per_actor=0.75, progress=False
                )
                actors = {
                    aid: a
                    for aid, a in ray_state.actors().items()
                    if "LaneGroupWorker" in a["ActorClassName"] and a["JobID"] == job
                }
                info["runs"].append(
                    {
                        "written": [result.written.start, result.written.stop],
                        "actor_nodes": sorted(a["Address"]["NodeID"] for aid, a in actors.items() if aid not in seen),
                        "seconds": round(time.monotonic() - t, 1),
                    }
                )
                seen |= actors.keys()
            source = MaterializedSource(directory, recipe=recipe)
            info["span"] = [source.first_step, source.end_step]
            info["digests"] = [source.batch(s).digest for s in range(source.first_step, source.end_step)]
            info["manifest_digests"] = json.loads((Path(directory) / "manifest.json").read_text())["digests"]
    except BaseException:  # noqa: BLE001 - reported to the test
        info["error"] = traceback.format_exc()
    finally:
        info["total_s"] = round(time.monotonic() - t0, 1)
        Path(summary).write_text(json.dumps(info))


@pytest.mark.slow  # the default suite's test_digests_match_the_reference_for_M_2_then_M_1 runs M=2 on one node
@pytest.mark.timeout(MULTINODE_TIMEOUT_S + 60)
def test_multi_node_lane_groups_match_the_reference_and_extend(tmp_path, reference_digests):
    """M=2 lane-group actors on two different worker nodes of a 3-raylet cluster (``ray.cluster_utils.Cluster``),
    for a new directory and again when extending it: every step's digest equals the in-process reference."""
    directory, summary = tmp_path / "run", tmp_path / "summary.json"
    info = run_spawned_driver(_materialize_on_two_nodes, (str(directory), str(summary)), summary, MULTINODE_TIMEOUT_S)
    assert "error" not in info, info["error"]
    print("materialise on a 3-node cluster:", json.dumps({k: info[k] for k in ("cluster_s", "runs", "total_s")}))
    workers = set(info["nodes"].values())
    assert len(workers) == 2 and info["head"] not in workers and info["driver_node"] == info["head"]
    assert [tuple(r["written"]) for r in info["runs"]] == [(0, 10), (10, 16)]
    for run in info["runs"]:  # both lane groups ran, one on each worker node, none on the driver's (head) node
        assert len(run["actor_nodes"]) == 2 and set(run["actor_nodes"]) == workers, run
    end = MULTINODE_STEPS[-1].stop
    assert info["span"] == [0, end]
    assert info["digests"] == reference_digests[:end]
    assert info["manifest_digests"] == reference_digests[:end]
