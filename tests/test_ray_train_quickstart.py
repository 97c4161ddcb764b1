"""``examples/ray_train_quickstart.py`` end to end, as a user runs it, in a Python whose ``torchtitan`` and ``triton``
imports are blocked: a plain Ray Train user needs neither.

The blocker is a ``sitecustomize`` on PYTHONPATH (a ``sys.meta_path`` finder raising ImportError), so it is active in
the driver and in every Ray worker process the driver's private Ray starts (each one records that it was). The
quickstart trains 1 worker to step 2, then resumes on 5 workers to step 4 (service mode: 5 does not divide the 24
rows). Its final checkpoint must hold the loader state at step 4 and the weights that an in-process reference
computes from ``GlobalBatchSource``'s rows at W=1: a wrong, missing or repeated row would change them.

That run is ``slow`` (two Ray Train jobs, 70-85 s in the default suite's company): Ray Train's resume at another W
stays in CI through tests/test_ray_train_elastic.py (a worker kill, then 2 -> 5; ``heavy``), and the quickstart
pair as examples/README.md writes it runs in the slow tests/test_docs_run.py. The default suite keeps the
quickstart's own promise here, cheaply: with torchtitan and triton blocked, the example imports and its dataset
hands a W=1 rank the committed golden rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.spawns  # Ray, torchrun or other process trees (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "ray_train_quickstart.py"
ELASTIC = ROOT / "recipes" / "elastic.toml"
BLOCKED = ("torchtitan", "triton")

_SITECUSTOMIZE = r'''
import os, sys

BLOCKED = {blocked!r}


class _Blocker:
    """Refuse the blocked packages, as in a Python that does not have them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            with open(os.path.join({log!r}, "attempts.log"), "a") as fh:
                fh.write(f"{{os.getpid()}} {{name}}\n")
            raise ImportError(f"{{name}} is blocked in this test (not installed for a plain Ray Train user)")
        return None


sys.meta_path.insert(0, _Blocker())
with open(os.path.join({log!r}, "installed.log"), "a") as fh:
    fh.write(f"{{os.getpid()}} {{' '.join(sys.argv)[:200]}}\n")
'''


def _reference_weights(steps: int) -> dict:
    """The quickstart's model and SGD at W=1, in this process, on GlobalBatchSource's rows."""
    import torch

    from zephon_ray import GlobalBatchSource, Recipe

    recipe = Recipe.from_toml(ELASTIC)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(259, 32), torch.nn.Linear(32, 259))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    with GlobalBatchSource(recipe) as source:
        for step in range(steps):
            ((inputs, labels),) = source.batch(step).slice(0, 1).microbatches(recipe.global_batch_rows)
            torch.nn.functional.cross_entropy(model(inputs["input"]).flatten(0, 1), labels.flatten()).backward()
            optim.step(), optim.zero_grad()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


_IMPORT_AND_READ = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("quickstart", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))  # every import the example makes, none of its run
from zephon_ray import compute_digest
from zephon_ray.integrations.ray_train import ZephonDataConfig, ZephonDataset
(shard,) = (s["train"] for s in ZephonDataConfig(run_id="qs").configure({"train": ZephonDataset(sys.argv[2])}, 1,
                                                                          None, None))
for batch in shard.iter_steps(until=3):
    print("step", batch.step, compute_digest(batch.slice.tokens, batch.slice.positions))
shard.close()
"""


def _blocked_env(tmp_path: Path) -> tuple[Path, dict]:
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(blocked=BLOCKED, log=str(block)))
    return block, {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), str(ROOT)]), "PYTHONUNBUFFERED": "1"}


def _code_lines(path: Path) -> int:
    """Lines of ``path`` after its module docstring that are neither blank nor only a comment."""
    import ast

    source = path.read_text()
    first = ast.parse(source).body[0]
    after = first.end_lineno if isinstance(first, ast.Expr) else 0
    return sum(1 for line in source.splitlines()[after:] if line.strip() and not line.strip().startswith("#"))


def test_the_docs_give_the_quickstarts_length():
    lines = _code_lines(QUICKSTART)
    assert f"script ({lines} code\nlines" in (ROOT / "docs" / "ray_train.md").read_text()
    assert f"script ({lines} code lines)" in (ROOT / "examples" / "README.md").read_text()


def test_quickstart_imports_and_reads_the_golden_rows_without_torchtitan(tmp_path):
    from conftest import golden_digests

    block, env = _blocked_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_AND_READ, str(QUICKSTART), str(ELASTIC)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    golden = golden_digests(ELASTIC)
    assert [line for line in proc.stdout.splitlines() if line.startswith("step ")] == [
        f"step {s} {golden[s]}" for s in range(3)
    ], proc.stdout[-2000:]
    installed = (block / "installed.log").read_text()  # the block was active in that process
    assert installed.strip(), "the sitecustomize blocker never ran"
    attempts = block / "attempts.log"  # torch may probe for triton (and copes); nothing may even try torchtitan
    tried = attempts.read_text() if attempts.exists() else ""
    assert "torchtitan" not in tried, tried[-2000:]


@pytest.mark.slow  # ~40 s alone, 70-85 s in the default suite's company; see the module docstring
@pytest.mark.timeout(600)
def test_quickstart_runs_without_torchtitan_and_resumes_at_another_w(tmp_path):
    block, env = _blocked_env(tmp_path)
    ray_tmp = tempfile.mkdtemp(prefix="zr-qs-", dir="/tmp")  # a private Ray; short: socket paths are <= 107 bytes
    env["RAY_TMPDIR"] = ray_tmp
    try:
        _run(tmp_path, block, env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _run(tmp_path: Path, block: Path, env: dict) -> None:
    check = subprocess.run([sys.executable, "-c", "import torchtitan"], env=env, capture_output=True, text=True)
    assert check.returncode != 0 and "blocked in this test" in check.stderr, check.stderr[-2000:]

    storage = tmp_path / "results"
    for world, steps in ((1, 2), (5, 4)):
        proc = subprocess.run(
            [sys.executable, str(QUICKSTART), str(world), str(steps), str(storage)],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert f"last step trained: {steps - 1}; resume: python {QUICKSTART} W STEPS {storage}" in proc.stdout, (
            proc.stdout[-2000:]
        )

    # The block was active in the driver and in the Ray workers (the train workers among them).
    installed = (block / "installed.log").read_text()
    assert "ray_train_quickstart.py" in installed and "default_worker.py" in installed, installed[-2000:]

    # The newest checkpoint: the loader state at step 4 (the keys of format v4) and the reference weights.
    import torch

    checkpoints = [p for p in storage.rglob("zephon_loader.json")]
    states = {json.loads(p.read_text())["next_step"]: p.parent for p in checkpoints}
    assert sorted(states) == [1, 2, 3, 4], sorted(states)
    final = states[4]
    state = json.loads((final / "zephon_loader.json").read_text())
    assert set(state) == {
        "version",
        "run_id",
        "fingerprint",
        "next_step",
        "zephon",
        "replayed_steps",
        "ledger",
        "run_schedule",
    }
    assert state["run_id"] == "quickstart" and state["zephon"] == ""  # service mode: no Zephon state in the loader
    weights = torch.load(final / "model.pt", weights_only=True)
    reference = _reference_weights(4)
    for name, want in reference.items():
        got = weights[name].numpy()
        assert np.allclose(got, want, atol=1e-5), (name, float(np.abs(got - want).max()))
    # and far from the weights of a run that skipped a step (so the comparison can tell)
    three = _reference_weights(3)
    assert max(float(np.abs(weights[n].numpy() - three[n]).max()) for n in three) > 1e-3
