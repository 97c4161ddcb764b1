"""Identical gradients at any W: the fixed-W run's final weights after W 7 -> 5 (and 8 -> 7 -> 5 -> 6 in the slow
set), with real DDP over gloo.

recipes/elastic.toml has B = 24 rows; 7 and 5 do not divide it (ranks hold 3 or 4, and 4 or 5 rows). Each segment
is W real processes (``torch.distributed`` over gloo, ``DistributedDataParallel``, whose all-reduce averages the
gradients over W) reading their slices through the loader core in dataset mode, resuming from the previous
segment's model, optimizer and loader state (``tests/train_helpers.py::ddp_segment``):

* scaling each rank's summed token loss by ``StepBatch.loss_scale()`` (W / the global batch's valid tokens) gives
  the fixed-W (W = 4) run's final weights within float tolerance;
* each rank's own mean loss (the "mean of means") on the same schedule does not, so the test can fail.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
SCHEDULES = {  # (W, train until step)
    "7_5": ((7, 4), (5, 8)),  # CI (heavy): 12 ranks in all, both counts uneven (3 or 4, and 4 or 5 rows)
    "8_7_5_6": ((8, 2), (7, 4), (5, 6), (6, 8)),  # slow: 26 ranks in all (45 s here)
}
FIXED = ((4, 8),)
TOLERANCE = 1e-5
# What every rank imports, loaded once in the fork server (each rank would spend ~2 s importing it on its own).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "zephon",
    "pyarrow.parquet",
    "zephon_ray.identity",
    "zephon_ray.stream.loader",
    "zephon_ray.stream.dataset",
    "train_helpers",
]


@pytest.fixture(scope="module")
def elastic_dir(ray_cluster, tmp_path_factory):
    from zephon_ray import Recipe
    from zephon_ray.jobs.materialize import materialize

    directory = tmp_path_factory.mktemp("uneven") / "elastic"
    materialize(Recipe.from_toml(ELASTIC), directory, range(0, 8), producers=1, segment_steps=8, progress=False)
    return str(directory)


def _train(work: Path, dataset_dir: str, schedule) -> dict:
    """Both weightings trained on ``schedule`` (``train_helpers.ddp_segment``): their final models by name."""
    from train_helpers import WEIGHTINGS, ddp_segment

    # forkserver: the ranks fork from a fresh server process that preloads torch (cheap starts), never from this
    # pytest process, which holds a Ray session.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    work.mkdir(parents=True)
    for segment, (world, until) in enumerate(schedule):
        init = work / f"init-{segment}"
        ranks = [
            context.Process(target=ddp_segment, args=(r, world, str(init), dataset_dir, ELASTIC, str(work), until))
            for r in range(world)
        ]
        [p.start() for p in ranks]
        [p.join(180) for p in ranks]
        for p in ranks:
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in ranks] == [0] * world, f"segment W={world} failed"
    return {name: torch.load(work / f"{name}.pt", weights_only=True)["model"] for name in WEIGHTINGS}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    "schedule", [pytest.param("7_5", marks=pytest.mark.heavy), pytest.param("8_7_5_6", marks=pytest.mark.slow)]
)
def test_final_weights_at_uneven_worlds_equal_the_fixed_w_run(elastic_dir, tmp_path, schedule):
    fixed = _train(tmp_path / "fixed", elastic_dir, FIXED)
    elastic = _train(tmp_path / "elastic", elastic_dir, SCHEDULES[schedule])
    assert _max_diff(elastic["token"], fixed["token"]) <= TOLERANCE
    # At W = 4 every rank has 6 rows: the mean of means IS the global mean there ...
    assert _max_diff(fixed["mean_of_means"], fixed["token"]) <= TOLERANCE
    # ... but not at 7 and 5, where ranks hold different row counts.
    assert _max_diff(elastic["mean_of_means"], fixed["token"]) > 10 * TOLERANCE
