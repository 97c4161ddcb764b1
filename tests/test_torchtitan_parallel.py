"""Pipeline (PP) and context parallelism (CP) with TorchTitan's real Trainer (llama3 debug model, CPU, gloo).

Each case is a dp=2 x {pp,cp}=2 mesh of 4 torchrun processes trained to step 2 with a DCP checkpoint, then resumed
by a dp=1 x {pp,cp}=2 mesh of 2 processes to step 4, in one of the three modes (local, service, dataset). Checked:

* every process got the rows of the dp rank TorchTitan built its loader with: the recording loader of
  ``tests/titan_helpers.py`` writes what each of the 4 (then 2) processes was handed, and each equals rows
  ``[r*B/W, (r+1)*B/W)`` of the golden global batch (``GlobalBatchSource`` checked against tests/golden/*.json, made
  by the independent oracle); TorchTitan's mesh puts ``pp`` outermost and ``cp`` inside ``dp`` (dp_rank = g mod 2
  under PP, g div 2 under CP), and the dp ranks recorded are exactly that layout;
* the dp leaders' slices joined per step give the golden digests;
* the losses of steps 1-4 equal the committed dp=1 losses of the same mesh (PP_LOSSES, CP_LOSSES), so the resume at
  another dp degree trains the fixed-W run; in local mode the peers received their leader's slices over gloo and the
  loader state saved in the DCP checkpoint is the leaders' collective Zephon checkpoint (dp=2 members).

Why the references are per mesh: TorchTitan seeds every PP stage differently (``distinct_seed_mesh_dims=["pp"]``) and
shards parameters with FSDP over the CP ranks, whose initialisation differs from DDP's; within one mesh the dp degree
changes nothing. CP needs ``seq_len`` divisible by cp x 128 (torch's FlexAttention block size under CP), so its cases
run tests/recipes/cp.toml (seq_len 256, B = 8); PP runs recipes/tiny.toml (B = 16).

The CPU shims are examples/torchtitan_cpu.py's (5: TorchTitan 0.3.0's per-microbatch pipeline call on torch 2.13;
6: gloo has no PREMUL_SUM for FSDP's reduce-scatter). Slow: 2 torchruns per case, ~120-260 s on 2 busy cores; CI's
check of the same loader with TorchTitan's mesh is tests/test_torchtitan_mesh.py (dp x tp, ``heavy``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_torchtitan_train import recorded_digests, torchtitan

from zephon_ray import GlobalBatchSource, Recipe

pytestmark = pytest.mark.spawns  # Ray, torchrun or other process trees (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4

# TorchTitan's losses at dp=1 of each mesh (same config, seed 0; torch 2.13 CPU), to 5 decimals: steps 1..4.
PP_LOSSES = [8.09438, 8.00380, 7.59164, 7.22268]
CP_LOSSES = [8.08256, 8.16198, 7.61417, 6.91282]

MESHES = {
    # name: (recipe, TorchTitan flag, reference losses, the dp rank of global rank g of 4 in TorchTitan's mesh)
    "pp": (ROOT / "recipes" / "tiny.toml", "--parallelism.pipeline_parallel_degree", PP_LOSSES, lambda g, dp: g % dp),
    "cp": (
        ROOT / "tests" / "recipes" / "cp.toml",
        "--parallelism.context_parallel_degree",
        CP_LOSSES,
        lambda g, dp: g // 2,
    ),
}


def _golden(recipe: Path) -> list[str]:
    record = json.loads((ROOT / "tests" / "golden" / f"{recipe.stem}.json").read_text())
    return [record["digests"][str(s)] for s in range(STEPS)]


def _mesh_args(flag: str, dp: int) -> tuple[str, ...]:
    return ("--parallelism.data_parallel_replicate_degree", str(dp), flag, "2")


def _check_every_rank(record: Path, recipe: Path, dp_of) -> dict[int, set[int]]:
    """Each process's recorded rows are its dp rank's slice of the golden global batch; returns {dp world: the
    global ranks recorded per step}, and checks the dp rank of every global rank against TorchTitan's layout."""
    source = GlobalBatchSource(Recipe.from_toml(recipe))
    golden = _golden(recipe)
    seen: dict[int, set[int]] = {}
    for path in sorted((record / "ranks").glob("step-*-global-*-of-*-dp-*-of-*.npz")):
        _, step, _, g, _, n, _, r, _, w = path.stem.split("-")
        step, g, n, r, w = int(step), int(g), int(n), int(r), int(w)
        batch = source.batch(step)
        assert batch.digest == golden[step], f"step {step}: the in-process reference is not the golden"
        assert r == dp_of(g, w), f"global rank {g} of {n} got dp rank {r} of {w}"
        want = batch.slice(r, w)
        got = np.load(path)
        assert np.array_equal(got["tokens"], want.tokens) and np.array_equal(got["positions"], want.positions), (
            f"step {step}: global rank {g} (dp rank {r} of {w}) got other rows than its dp rank's slice"
        )
        seen.setdefault(w, set()).add((step, g))
    return {w: {g for _, g in pairs} for w, pairs in seen.items()}


def _saved_loader_state(checkpoint: Path, scratch: Path) -> dict:
    """The data loader's entry of a DCP checkpoint TorchTitan wrote."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(scratch))
    return torch.load(scratch, weights_only=False)["dataloader"]


def _run_case(mesh: str, mode: str, tmp_path: Path, request) -> None:
    recipe, flag, reference, dp_of = MESHES[mesh]
    env = {
        "ZEPHON_RAY_RECIPE": str(recipe),
        "ZEPHON_RAY_MODE": mode,
        "ZEPHON_RAY_RUN_ID": f"titan-{mesh}-{mode}",
        "PYTHONFAULTHANDLER": "1",
    }  # a crash in a rank prints its Python stack
    service = None
    if mode == "service":
        from service_helpers import NS, start_service

        ray = request.getfixturevalue("ray_cluster")
        service = start_service(str(recipe), tmp_path, f"titan-{mesh}")
        env.update(
            ZEPHON_RAY_SERVICE=service.name, ZEPHON_RAY_NAMESPACE=NS, RAY_ADDRESS=ray.get_runtime_context().gcs_address
        )
    elif mode == "dataset":
        from zephon_ray.jobs.materialize import materialize

        request.getfixturevalue("ray_cluster")
        directory = tmp_path / "materialized"
        materialize(Recipe.from_toml(recipe), directory, range(0, STEPS), producers=1, progress=False)
        env["ZEPHON_RAY_DATASET_DIR"] = str(directory)
    dump, record = tmp_path / "dump", tmp_path / "record"
    try:
        first = torchtitan(4, 2, dump, record, checkpoint=True, env_extra=env, args=_mesh_args(flag, 2))
        state = _saved_loader_state(dump / "checkpoint" / "step-2", tmp_path / "step-2.pt")
        assert state["next_step"] == 2
        if mode == "local":  # the 2 leaders' collective Zephon checkpoint, stored once for the 4 processes
            assert json.loads(state["zephon"])["zephon"]["world"]["world_size"] == 2
        second = torchtitan(2, STEPS, dump, record, checkpoint=True, env_extra=env, args=_mesh_args(flag, 1))
    finally:
        if service is not None:
            service.stop()
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4], (first, second)
    losses = {**first, **second}
    for step in range(STEPS):
        assert losses[step + 1] == pytest.approx(reference[step], abs=2e-5), (step, losses)
    assert recorded_digests(record) == dict(enumerate(_golden(recipe)))
    ranks = _check_every_rank(record, recipe, dp_of)
    assert ranks == {2: {0, 1, 2, 3}, 1: {0, 1}}, ranks  # every process of both meshes, every step


@pytest.mark.slow  # two 2-process torchruns (~40 s): the committed PP_LOSSES and CP_LOSSES
@pytest.mark.parametrize("mesh", ["pp", "cp"])
def test_reference_runs_match_their_committed_losses(mesh, tmp_path):
    recipe, flag, reference, _ = MESHES[mesh]
    losses = torchtitan(
        2,
        STEPS,
        tmp_path / "dump",
        tmp_path / "record",
        checkpoint=False,
        env_extra={"ZEPHON_RAY_RECIPE": str(recipe)},
        args=_mesh_args(flag, 1),
    )
    assert [losses[s] for s in range(1, STEPS + 1)] == pytest.approx(reference, abs=2e-5), losses
    assert recorded_digests(tmp_path / "record") == dict(enumerate(_golden(recipe)))


@pytest.mark.slow  # ~120-260 s each on 2 busy cores: 4 + 2 torchrun processes of the real Trainer
@pytest.mark.parametrize(
    "mesh, mode",
    [("pp", "local"), ("pp", "service"), ("pp", "dataset"), ("cp", "local"), ("cp", "service"), ("cp", "dataset")],
)
def test_dp2_mesh_resumed_at_dp1(mesh, mode, tmp_path, request):
    """dp=2 x {pp,cp}=2 to step 2, resumed at dp=1 x {pp,cp}=2 to step 4: every process got its dp rank's slice, the
    losses are the fixed-W ones; in local mode the peers received their leader's slices and the collective
    checkpoint has the 2 leaders."""
    _run_case(mesh, mode, tmp_path, request)
