"""Per-step elasticity with torchft (``zephon_ray.stream.ft``), with real torchft parts: a Lighthouse, Managers over
``ProcessGroupGloo`` and TCPStores of their own.

* ``examples/torchft_churn.py`` end to end: 3 replica groups as processes, one SIGKILL in the middle of a step and
  one rejoin; every committed step's global batch (the participants' slices joined) equals the golden digests, and
  the final weights equal the failure-free run's.
* A quorum whose participant count does not divide the global batch stops with one line before any row is read.
* Loss weighting: with equal slices the mean of the groups' mean gradients (``manager.allreduce``'s AVG) is the
  global batch's gradient; a loss mask breaks that, and token-count weights through ``manager.allreduce`` (SUM)
  fix it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.spawns  # Ray, torchrun or other process trees (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
TINY = str(ROOT / "recipes" / "tiny.toml")
CHURN = ROOT / "examples" / "torchft_churn.py"
STEPS = 8
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "elastic.json").read_text())["digests"].items()}


@pytest.fixture(scope="module")
def elastic_dir(ray_cluster, tmp_path_factory):
    """Steps 0..7 of recipes/elastic.toml (B = 24 rows: 3 and 2 participants both divide it), materialised."""
    from zephon_ray import Recipe
    from zephon_ray.jobs.materialize import materialize

    directory = tmp_path_factory.mktemp("ft") / "elastic"
    materialize(Recipe.from_toml(ELASTIC), directory, range(0, STEPS), producers=1, segment_steps=8, progress=False)
    return str(directory)


def test_churn_one_kill_one_rejoin(elastic_dir, tmp_path):
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(CHURN), "--groups", "3", "--steps", str(STEPS), "--kill", "1@2", "--rejoin", "1@5",
           "--dataset-dir", elastic_dir, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "identical global batches: YES" in proc.stdout
    assert "final weights equal the failure-free run: YES" in proc.stdout
    summary = json.loads(out.read_text())
    steps = {int(s): v for s, v in summary["steps"].items()}
    assert sorted(steps) == list(range(STEPS))
    # 3 groups, group 1 killed in step 2 (2 participants from there), back at step 5 (3 again)
    assert [steps[s]["participants"] for s in range(STEPS)] == [3, 3, 2, 2, 2, 3, 3, 3], steps
    assert all(steps[s]["problem"] is None for s in steps)
    for s in range(STEPS):  # against the committed goldens (tests/oracle.py), not only GlobalBatchSource
        assert steps[s]["digest"] == summary["expected"][s] == GOLDEN.get(s, steps[s]["digest"]), s
    assert "attempts that should_commit() rejected: " in proc.stdout
    rejected = int(proc.stdout.split("attempts that should_commit() rejected: ")[1].split()[0])
    assert rejected >= 1, proc.stdout  # the kill hit step 2 in flight: the survivors' attempt did not commit


# ---------------------------------------------------------------------- real torchft Managers, one thread each
@contextmanager
def ft_groups(n: int):
    """``n`` replica groups in this process (a thread each): a Lighthouse, and per group a TCPStore and a Manager
    over ProcessGroupGloo. The first quorum waits for all n."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=n, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(n)]
    managers = [Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=1,
                        load_state_dict=lambda state: None, state_dict=lambda: {}, replica_id=f"group_{g}",
                        lighthouse_addr=lighthouse.address(), store_addr="127.0.0.1", store_port=stores[g].port,
                        rank=0, world_size=1, use_async_quorum=False, timeout=timedelta(seconds=30),
                        quorum_timeout=timedelta(seconds=60)) for g in range(n)]
    try:
        yield managers
    finally:
        for m in managers:
            m.shutdown(wait=False)
        lighthouse.shutdown()


def _in_parallel(fn, n: int) -> list:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def test_a_quorum_that_cannot_share_the_batch_stops_before_the_step(tmp_path):
    """tiny.toml has B = 16 rows: 3 participants cannot share it. One line, and nothing was read (the directory
    the source would read does not even exist)."""
    from zephon_ray.stream.ft import FtMembershipError, FtSlices, supported_participants
    from zephon_ray.stream.loader import LoaderConfig
    from zephon_ray import Recipe

    assert supported_participants(Recipe.from_toml(TINY)) == [1, 2, 4, 8, 16]
    config = LoaderConfig(recipe=TINY, mode="dataset", dataset_dir=str(tmp_path / "never-read"))
    with ft_groups(3) as managers:
        def step(g):
            managers[g].start_quorum()
            with FtSlices(config, manager=managers[g]) as slices:
                with pytest.raises(FtMembershipError) as info:
                    slices.next()
                return str(info.value)
        messages = _in_parallel(step, 3)
    for message in messages:
        assert "\n" not in message
        assert message.startswith("step 0: a quorum of 3 participants x dp 1 = 3 readers cannot share the recipe's "
                                  "global batch of 16 rows")
        assert "it supports [1, 2, 4, 8, 16] participants" in message and "the step was not run" in message


def test_local_mode_is_refused_with_the_reason():
    from zephon_ray.stream.ft import FtSlices
    from zephon_ray.stream.loader import LoaderConfig

    class NotAManager:
        pass

    with pytest.raises(ValueError, match="mode 'local' is not supported.*lanes' Zephon state"):
        FtSlices(LoaderConfig(recipe=TINY, mode="local"), manager=NotAManager())
    with pytest.raises(TypeError, match="no current_step"):
        FtSlices(LoaderConfig(recipe=TINY, mode="dataset", dataset_dir="/x"), manager=NotAManager())


def _bigram():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(259, 16), torch.nn.Linear(16, 259))


def _masked(labels):
    """A loss mask that depends on the content (as a padding packer's or an SFT mask's does): so the groups'
    valid-token counts differ."""
    labels = labels.clone()
    labels[labels % 5 == 0] = -100
    return labels


def _grads(model, inputs, labels, reduction: str):
    import torch

    model.zero_grad(set_to_none=True)
    logits = model(inputs["input"])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction=reduction)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_loss_weighting_mean_of_means_and_token_weights(elastic_dir):
    """3 groups read their slices of step 0 through FtSlices. Mean of the groups' mean gradients (AVG) equals the
    global batch's mean gradient when every group averages the same number of tokens; with a loss mask it does
    not; summed losses and token counts all-reduced with SUM (token_weighted) give the global gradient again."""
    import torch
    from torch.distributed import ReduceOp

    from zephon_ray import GlobalBatchSource, Recipe
    from zephon_ray.stream.ft import FtSlices, token_weighted
    from zephon_ray.stream.loader import LoaderConfig

    recipe = Recipe.from_toml(ELASTIC)
    with GlobalBatchSource(recipe) as source:
        (inputs, labels), = source.batch(0).slice(0, 1).microbatches(recipe.global_batch_rows)
    initial = _bigram()
    want = _grads(copy.deepcopy(initial), inputs, labels, "mean")
    want_masked = _grads(copy.deepcopy(initial), inputs, _masked(labels), "mean")

    config = LoaderConfig(recipe=ELASTIC, mode="dataset", dataset_dir=elastic_dir)
    with ft_groups(3) as managers:
        def group(g):
            m = managers[g]
            m.start_quorum()
            with FtSlices(config, manager=m) as slices:
                batch = slices.next()
            (x, y), = batch.microbatches
            model = copy.deepcopy(initial)  # not _bigram(): torch.manual_seed is global, the threads would race
            avg = _grads(model, x, y, "mean")
            for grad in avg:
                m.allreduce(grad).wait()  # torchft's default: the mean over participants
            avg_masked = _grads(model, x, _masked(y), "mean")
            for grad in avg_masked:
                m.allreduce(grad).wait()
            summed = _grads(model, x, _masked(y), "sum")
            tokens = torch.tensor((_masked(y) != -100).sum().item())
            fixed = token_weighted(summed, tokens, lambda t: m.allreduce(t, reduce_op=ReduceOp.SUM).wait())
            return batch.slice.num_rows, int(tokens), avg, avg_masked, fixed
        results = _in_parallel(group, 3)

    assert [r[0] for r in results] == [8, 8, 8]  # equal slices: B / P rows each
    assert len({r[1] for r in results}) > 1, "the mask should leave the groups different token counts"
    for _, _, avg, avg_masked, fixed in results:
        for got, ref in zip(avg, want):
            assert torch.allclose(got, ref, atol=1e-6), float((got - ref).abs().max())
        assert max(float((g - r).abs().max()) for g, r in zip(avg_masked, want_masked)) > 1e-4
        for got, ref in zip(fixed, want_masked):
            assert torch.allclose(got, ref, atol=1e-6), float((got - ref).abs().max())


def test_validate_lists_the_participant_counts():
    proc = subprocess.run([sys.executable, "-m", "zephon_ray.cli", "validate", ELASTIC, "--no-build"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("P (torchft)"))
    assert line == "P (torchft) dp=1: 1 2 3 4 6 8 12 24; dp=2: 1 2 3 4 6 12; dp=4: 1 2 3 6; dp=8: 1 3"
