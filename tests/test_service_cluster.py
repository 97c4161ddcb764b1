"""The service on a simulated multi-node cluster (``ray.cluster_utils.Cluster``, several raylets on one machine).

One head node (only the coordinator may go there) and two worker nodes (producers, the replayer, the reader).
1. Shard bytes never reach the coordinator's node unless a consumer there reads them: checked with Ray's own
   object-location table (``ray.experimental.get_object_locations``) and owner addresses: the producers put and
   own their shards (the tiny recipe's ~1 KiB shards too, with Ray's default 100 KiB inline limit), so none is
   inlined into the coordinator.
2. Node loss: the worker node that holds producers and shards is removed (``Cluster.remove_node``) while a reader
   on the other worker node reads on; lost steps are replayed and every digest equals the reference; the reader
   never sees a raw Ray error.

The cluster runs in a spawned driver process (Cluster.add_node/remove_node need a main thread and their own Ray
session), which writes a JSON summary that the test checks.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import pytest

from tests.conftest import run_spawned_driver
from zephon_ray import GlobalBatchSource, Recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny.toml"
STEPS = 16
DRIVER_TIMEOUT_S = 600


def _drive(summary: str) -> None:
    import ray

    from tests.ray_clusters import checkout_pythonpath, local_cluster, stop_quietly
    from zephon_ray import DataService
    from zephon_ray.service.config import ActorResources

    info: dict = {}
    try:
        # Ray's default inline limit (100 KiB): the producers ray.put their ~1 KiB shards, so they own them.
        with local_cluster("zr-svc-cluster-", {"num_cpus": 2, "resources": {"zr-coord": 1}}) as (cluster, temp_dir):
            svc = None
            try:
                workers = [cluster.add_node(num_cpus=2, resources={"zr-work": 1}, temp_dir=temp_dir) for _ in range(2)]
                ray.init(
                    address=cluster.address,
                    namespace="zr-svc-cluster",
                    log_to_driver=False,
                    runtime_env={"env_vars": {"PYTHONPATH": checkout_pythonpath()}},
                )
                head_id = ray.get_runtime_context().get_node_id()
                recipe = Recipe.from_toml(TINY)
                svc = DataService.start(
                    recipe,
                    name="cluster",
                    namespace="zr-svc-cluster",
                    producers=2,
                    run_id="cluster",
                    aggregate_store="torch://",
                    window=4,
                    checkpoint_every=4,
                    state_dir=os.path.join(temp_dir, "state"),
                    reconnect_timeout_s=240,
                    resources=ActorResources(
                        coordinator_resources={"zr-coord": 0.01},
                        producer_resources={"zr-work": 0.01},
                        replayer_resources={"zr-work": 0.01},
                    ),
                )

                @ray.remote(num_cpus=0.1, resources={"zr-work": 0.01}, max_retries=0)
                def read(steps):
                    from zephon_ray import compute_digest

                    client = DataService.connect("cluster", namespace="zr-svc-cluster", consumer="trainer")
                    out = []
                    for step in steps:
                        try:
                            part = client.slice(
                                step, 0, 1, track=True
                            )  # the whole batch as rank 0 of 1, like a trainer
                            out.append((step, None, compute_digest(part.tokens, part.positions), None))
                        except Exception as exc:  # noqa: BLE001 - the test checks that only clean errors appear
                            out.append((step, None, None, f"{type(exc).__module__}.{type(exc).__name__}: {exc}"))
                    return ray.get_runtime_context().get_node_id(), out

                reader_node, first = ray.get(read.remote(list(range(8))), timeout=240)
                deadline = time.monotonic() + 120
                # The producers fill the window ahead of the reader's cursor and the pump evicts the steps behind it:
                # wait until the window is full (keep_from .. keep_from + 3) and the same a second later (the
                # reader's last moves have arrived), or a step listed as held may be evicted before it is read below
                # (it then comes from a replay, elsewhere). This status is the one read below.
                settled = None
                while True:
                    w = (status := svc.status())["window"]
                    full = w["held_steps"] == list(range(w["keep_from"], w["keep_from"] + 4))
                    if full and settled == w["held_steps"]:
                        break
                    settled = w["held_steps"] if full else None
                    assert time.monotonic() < deadline, f"the window never settled: {w}"
                    time.sleep(1.0)
                info.update(
                    head=head_id,
                    coordinator_node=status["coordinator"]["node_id"],
                    reader_node=reader_node,
                    producer_nodes=[p["node_id"] for p in status["producers"]],
                    first=first,
                    held=status["window"]["held_steps"],
                )
                # The driver (on the coordinator's node) reads one held step; the others it only locates, never fetches.
                read_here = status["window"]["held_steps"][1]
                info["read_here"] = read_here
                info["read_here_digest"] = svc.batch(read_here).digest
                from zephon_ray.service.ray_internals import object_locations, owner_worker_id

                locations, owners = {}, set()
                for step in status["window"]["held_steps"]:
                    refs = svc.refs(step).lanes  # borrowed refs; nothing is fetched
                    found = object_locations(refs)
                    locations[step] = sorted({n for loc in found.values() for n in loc.get("node_ids", [])})
                    owners |= {owner_worker_id(ref) for ref in refs}
                    del refs
                info["locations"] = locations
                # Under load a producer group can be replaced (the watchdog) before or while the steps are located;
                # a retired group's shards stay readable, so their owners are producers that status() no longer
                # lists. The claim holds whatever the generation: no shard is the coordinator's or the driver's.
                # A step read again (a replay, after a lost shard or for a consumer behind the window) is put by
                # the replayer, which then owns it: a replayer is a producer of past steps here.
                later = svc.status()
                info["owners"] = sorted(owners)
                info["non_producer_owners"] = sorted(
                    owners
                    - {p["worker_id"] for s in (status, later) for p in s["producers"]}
                    - {r["worker_id"] for s in (status, later) for r in s["replayers"] if r}
                )
                info["generations"] = [status["generation"], later["generation"]]
                info["coordinator_and_driver"] = [
                    status["coordinator"]["worker_id"],
                    ray.get_runtime_context().get_worker_id(),
                ]

                # Node loss: remove the worker node that holds producer 0 (and the shards it produced).
                victim = status["producers"][0]["node_id"]
                node = next(n for n in workers if n.node_id == victim)
                info["removed"] = victim
                cluster.remove_node(node)
                t0 = time.monotonic()
                _, second = ray.get(read.remote(list(range(8, STEPS))), timeout=360)
                info["second"] = second
                info["after_loss_s"] = round(time.monotonic() - t0, 3)
                after = svc.status()
                info["after"] = {
                    "restarts": after["restarts"],
                    "replay": after["replay"],
                    "producer_nodes": [p["node_id"] for p in after["producers"]],
                }
            finally:
                stop_quietly(svc)
    except BaseException:  # noqa: BLE001 - reported to the test
        info["error"] = traceback.format_exc()
    finally:
        Path(summary).write_text(json.dumps(info, default=str))


@pytest.mark.slow  # a 3-raylet cluster takes minutes to start on 2 cores
@pytest.mark.timeout(DRIVER_TIMEOUT_S + 60)
def test_no_shard_bytes_on_coordinator_node_and_node_loss(tmp_path):
    with GlobalBatchSource(Recipe.from_toml(TINY)) as source:
        digests = [source.batch(s).digest for s in range(STEPS)]
    summary = tmp_path / "summary.json"
    info = run_spawned_driver(_drive, (str(summary),), summary, DRIVER_TIMEOUT_S)
    assert "error" not in info, info.get("error")
    print("service on a 3-node cluster:", json.dumps({k: info[k] for k in ("locations", "after_loss_s", "after")}))
    head = info["head"]
    assert info["coordinator_node"] == head and head not in info["producer_nodes"]
    assert [(s, d, e) for s, _, d, e in info["first"]] == [(s, digests[s], None) for s in range(8)]
    assert not set(info["owners"]) & set(info["coordinator_and_driver"]), info["owners"]
    if info["generations"] == [0, 0]:  # no producer group was replaced: every owner is a listed producer or replayer
        assert not info["non_producer_owners"], info
    else:
        print("producer group replaced while the steps were located:", info["generations"], info["non_producer_owners"])
    assert info["read_here_digest"] == digests[info["read_here"]]
    for step, nodes in info["locations"].items():
        assert nodes, f"step {step}: Ray knows no location of its shards"
        if int(step) == info["read_here"]:
            assert head in nodes  # a consumer on the coordinator's node read it: a copy there is expected
        else:
            assert head not in nodes, f"step {step}: shard bytes reached the coordinator's node {nodes}"
    # After the node loss: correct rows for every step, or a clean ServiceError; never a raw Ray error.
    for step, _, digest, error in info["second"]:
        if error is None:
            assert digest == digests[step], step
        else:
            assert error.startswith("zephon_ray.service.errors."), error
    assert sum(e is None for _, _, _, e in info["second"]) == STEPS - 8, info["second"]
    assert info["removed"] not in info["after"]["producer_nodes"] and info["after"]["restarts"] >= 1
