"""TP/PP/CP meshes in local mode: one Zephon participant per dp rank, the same slice on every peer of a dp group.

Four gloo processes form a dp=2 x tp=2 mesh (TorchTitan's layout: tp innermost, dp_rank = rank // tp) and drive
the loader exactly as TorchTitan's Trainer does (``dp_world_size``/``dp_rank`` only; ``WORLD_SIZE`` is 4). The
global digests equal the reference, the tp peers' rows are identical, the state is identical on all four ranks and
its collective Zephon checkpoint has exactly 2 members. The state then resumes on dp=1 x tp=2 with the reference
batches, reporting the replayed step; a leader's failure reaches its peer as a PeerError, not a hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawns  # Ray, torchrun or other process trees (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.toml")
TP = 2

_WORKER = r"""
import json, os, sys
import numpy as np
import torch.distributed as dist
from zephon_ray import compute_digest
from zephon_ray.torchtitan import ZephonRayDataLoader

phase, state_path, out, tp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dp_world, dp_rank = world // tp, rank // tp          # TorchTitan's mesh: [dp, tp], tp innermost
loader = ZephonRayDataLoader.Config(recipe=os.environ["RECIPE"], mode="local", run_id="mesh",
                                    aggregate_store="torch://", checkpoint_every=2).build(
    dp_world_size=dp_world, dp_rank=dp_rank, seq_len=64, local_batch_size=4, snapshot_every_n_steps=None)
template = loader.state_dict()                        # TorchTitan takes one before iterating (collective here)
if phase == "load":
    loader.load_state_dict(json.load(open(state_path)))
it = loader.steps()                                  # whole steps: each with its RankSlice
digests, peers_identical = [], True
for _ in range(3):
    s = next(it).slice
    parts = [None] * world
    dist.all_gather_object(parts, (dp_rank, s.tokens, s.positions))
    for p in parts:                                   # every tp peer holds its dp group's rows, bit for bit
        lead = parts[p[0] * tp]
        peers_identical &= np.array_equal(p[1], lead[1]) and np.array_equal(p[2], lead[2])
    leaders = [parts[d * tp] for d in range(dp_world)]
    digests.append(compute_digest(np.concatenate([p[1] for p in leaders]), np.concatenate([p[2] for p in leaders])))
state = loader.state_dict()
# A leader that fails tells its peers (a PeerError naming the step) instead of leaving them in a collective.
peers = loader.core.peers
try:
    peers.share_slice(99, None, None, (8, 65), error=RuntimeError("leader broke") if peers.is_leader else None)
    failure = None
except Exception as exc:
    failure = f"{type(exc).__name__}: {exc}"
states = [None] * world
dist.all_gather_object(states, (state, loader.stats, loader.core._stream is not None, failure))
if rank == 0:
    json.dump({"digests": digests, "peers_identical": bool(peers_identical), "state": state,
               "states_identical": all(s[0] == state for s in states), "stats": [s[1] for s in states],
               "zephon_ranks": [s[2] for s in states], "failures": [s[3] for s in states],
               "template": template}, open(out, "w"))
loader.close()
dist.destroy_process_group()
"""


def _torchrun(tmp_path: Path, nproc: int, phase: str) -> dict:
    script = tmp_path / "mesh_worker.py"
    script.write_text(_WORKER)
    out = tmp_path / f"{phase}.json"
    env = {**os.environ, "RECIPE": TINY, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("ZEPHON_RAY_AGGREGATE_DIR", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        phase,
        str(tmp_path / "state.json"),
        str(out),
        str(TP),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.heavy
def test_dp2_tp2_matches_reference_and_resumes_at_dp1_tp2(tmp_path, reference_digests):
    first = _torchrun(tmp_path, 4, "save")
    assert first["digests"] == reference_digests[0:3]
    assert first["peers_identical"] and first["states_identical"]
    assert first["zephon_ranks"] == [True, False, True, False]  # one Zephon participant per dp rank
    assert first["failures"][0] == first["failures"][2] == "RuntimeError: leader broke"
    assert "rank 3: the leader of dp group 1 (global rank 2) failed at step 99" in first["failures"][3]
    state = first["state"]
    assert state["next_step"] == 3
    zephon = json.loads(state["zephon"])
    assert zephon["next_step"] == 2  # checkpoints every 2 steps
    assert zephon["zephon"]["world"]["world_size"] == 2  # the collective checkpoint has dp_world_size members
    (tmp_path / "state.json").write_text(json.dumps(state))

    resumed = _torchrun(tmp_path, 2, "load")  # dp=1 x tp=2
    assert resumed["digests"] == reference_digests[3:6]
    assert resumed["peers_identical"] and resumed["states_identical"]
    assert resumed["zephon_ranks"] == [True, False]
    # Resumed at step 3 from the step-2 checkpoint: one replayed step, reported on every rank and in the state.
    assert [s["replayed_steps"] for s in resumed["stats"]] == [1, 1]
    assert resumed["state"]["replayed_steps"] == 1 and resumed["state"]["next_step"] == 6
    leader, peer = resumed["failures"]
    assert leader == "RuntimeError: leader broke"
    assert peer.startswith("PeerError: rank 1: the leader of dp group 0 (global rank 0) failed at step 99")
