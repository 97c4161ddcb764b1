"""Every shell command of README.md, docs/*.md, examples/README.md and service/README.md runs in a test, as written,
in the order shown (tests/doc_commands.py extracts them and says what a test changes: private paths and Ray
addresses only).

- ``FAST``: run by this module's default-suite test, each checked on what it prints (a few seconds each).
- ``SLOW``: run by the ``slow`` test named with them (they start a Ray, a cluster or a training run; `make test-all`
  or ``-m slow``), in document order within that test.
- ``NOT_RUN``: the few that cannot run here, each with the reason and the test that covers its code instead.

``test_every_doc_command_is_run_or_excused`` (default suite) fails on a doc command in none of the three, so a new
command in the docs needs a test, and on an entry whose command left the docs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import doc_commands
import numpy as np
import pytest
from conftest import ROOT
from doc_commands import DOCS, Here, commands, run_in_order, shell_env


def _golden_lines(recipe: str, first: int, stop: int) -> list[str]:
    import oracle

    golden = oracle.load_golden(ROOT / "recipes" / recipe)["digests"]
    return [f"step {s} {golden[s]}" for s in range(first, stop)]


def _fingerprint(recipe: str = "tiny.toml") -> str:
    from zephon_ray import Recipe

    return Recipe.from_toml(ROOT / "recipes" / recipe).fingerprint


FAST = {  # command -> a check of what it printed
    ". .venv/bin/activate": lambda out: out == "",
    "zephon-ray validate tiny": lambda out: f"fingerprint {_fingerprint()}" in out and "W (service) 1-16" in out,
    "zephon-ray digest tiny --steps 0:4": lambda out: out.splitlines() == _golden_lines("tiny.toml", 0, 4),
    "zephon-ray show tiny --step 3": lambda out: (
        _golden_lines("tiny.toml", 3, 4)[0].replace("step 3 ", "digest      ") in out
    ),
    "zephon-ray bench tiny --steps 32": lambda out: "tokens/s" in out,
    "zephon-ray validate recipes/mixture.toml": lambda out: f"fingerprint {_fingerprint('mixture.toml')}" in out,
    "zephon-ray fingerprint tiny": lambda out: out.strip() == _fingerprint(),
}

README_RAY = "test_readme_ray_commands"
DEPLOYMENT = "test_deployment_cluster_commands"
QUICKSTART = "test_quickstart_commands"
TITAN = "test_torchtitan_cpu_commands"
ELASTIC = "test_elastic_resume_commands"
S3 = "test_deployment_object_storage_commands"
SLOW = {  # command -> the slow test (in this module) that runs it
    "zephon-ray digest tiny --steps 0:4 --via service --producers 2": README_RAY,
    "zephon-ray materialize tiny --steps 0:32 --out /tmp/zr-tiny": README_RAY,
    "zephon-ray digest tiny --steps 0:4 --via dataset --dataset /tmp/zr-tiny": README_RAY,
    "ray start --head --num-cpus=8 --include-dashboard=true --dashboard-host=127.0.0.1": DEPLOYMENT,
    "export RAY_AUTH_MODE=token": DEPLOYMENT,
    "ray job submit --address http://127.0.0.1:8265 --entrypoint-num-cpus 0 --working-dir . -- python "
    "service/start.py recipes/tiny.toml --name run7 --namespace zr --producers 2 --window 8 --checkpoint-every 8 "
    "--state-dir /shared/zr/run7 --aggregate-store torch:// --run-id run7": DEPLOYMENT,
    "zephon-ray status --name run7 --namespace zr --address 127.0.0.1:6379": DEPLOYMENT,
    "zephon-ray rescale 4 --name run7 --namespace zr --address 127.0.0.1:6379": DEPLOYMENT,
    "zephon-ray release trainer-old --name run7 --namespace zr": DEPLOYMENT,
    "zephon-ray add-phase anneal --start-step 9000 --weight prose=1 --name run7 --namespace zr": DEPLOYMENT,
    "zephon-ray stop --name run7 --namespace zr": DEPLOYMENT,
    "zephon-ray inspect /shared/zr/run7": DEPLOYMENT,
    "ray job submit --address http://127.0.0.1:8265 --entrypoint-num-cpus 0 --working-dir . -- python "
    "service/start.py recipes/tiny.toml --name run7 --namespace zr --producers 2 --state-dir /shared/zr/run7 "
    "--aggregate-store torch:// --run-id run7": DEPLOYMENT,
    "QS=$(mktemp -d)": QUICKSTART,
    "python examples/ray_train_quickstart.py 4 4 $QS": QUICKSTART,
    "python examples/ray_train_quickstart.py 5 8 $QS": QUICKSTART,
    "TITAN=$(mktemp -d)": TITAN,
    "PYTHONPATH=. torchrun --standalone --nproc_per_node 2 -m torchtitan.train --module examples.torchtitan_cpu "
    "--config zephon_llama3_debugmodel_cpu --training.steps 2 --checkpoint.enable --checkpoint.interval 2 "
    "--dump_folder $TITAN": TITAN,
    "PYTHONPATH=. torchrun --standalone --nproc_per_node 1 -m torchtitan.train --module examples.torchtitan_cpu "
    "--config zephon_llama3_debugmodel_cpu --training.steps 4 --checkpoint.enable --checkpoint.interval 2 "
    "--dump_folder $TITAN": TITAN,
    "python examples/elastic_resume.py": ELASTIC,
    "python examples/elastic_resume.py --mode local": ELASTIC,
    "ZEPHON_RAY_AGGREGATE_DIR=/tmp/agg python examples/elastic_resume.py --mode local": ELASTIC,
    "python examples/elastic_resume.py --trainer torchtitan": ELASTIC,
    'python -c "import pyarrow.fs as pafs; from zephon_ray import storage; '
    "d = storage.location('s3://$BUCKET/recipes'); "
    "pafs.copy_files('recipes', d.path, destination_filesystem=storage.filesystem(d))\"": S3,
    "zephon-ray validate s3://$BUCKET/recipes/tiny.toml": S3,
    "zephon-ray fingerprint s3://$BUCKET/recipes/tiny.toml --verify-content": S3,
    "zephon-ray serve s3://$BUCKET/recipes/tiny.toml --name run7 --namespace zr --producers 2 --state-dir "
    "s3://$BUCKET/runs/run7/state --aggregate-store torch:// --run-id run7 --address 127.0.0.1:6379": S3,
    "zephon-ray digest s3://$BUCKET/recipes/tiny.toml --steps 0:4 --via service --name run7 --namespace zr "
    "--address 127.0.0.1:6379": S3,
    "zephon-ray inspect s3://$BUCKET/runs/run7/state": S3,
    "zephon-ray stop --name run7 --namespace zr --address 127.0.0.1:6379": S3,
    "zephon-ray materialize s3://$BUCKET/recipes/tiny.toml --steps 0:32 --out s3://$BUCKET/runs/run7/materialized "
    "--producers 2 --address 127.0.0.1:6379 --quiet": S3,
    "zephon-ray digest s3://$BUCKET/recipes/tiny.toml --steps 0:4 --via dataset --dataset "
    "s3://$BUCKET/runs/run7/materialized": S3,
    "zephon-ray pretokenize s3://$BUCKET/recipes/tiny.toml s3://$BUCKET/tokens/tiny --address 127.0.0.1:6379 "
    "--quiet": S3,
}

_S3 = (
    "placeholders (`...`, minio.internal, my-bucket) for the user's S3 settings: " + S3 + " sets the same "
    "variables to its local S3's, and runs the rest of the block as written"
)
NOT_RUN = {  # command -> why no test runs it here, and what covers its code
    "make demo": "creates .venv and installs everything (network); its program, examples/elastic_resume.py --recipe "
    "recipes/demo.toml, runs in tests/test_demo.py (slow)",
    "make test": "the default suite itself (CI runs it; docs/benchmarks.md records fresh-clone runs)",
    "python examples/spike_workflow.py": "runs as written in tests/test_spike_workflow.py (slow)",
    "python examples/spike_workflow.py --no-locate": "the same workflow as tests/test_spike_workflow.py (slow) runs, "
    "less its last part",
    "zephon-ray serve tiny --name run7 --state-dir s3://bucket/run7": "needs a cluster and the bucket s3://bucket; "
    "serve on a real head runs as written in " + DEPLOYMENT + " (service/start.py is serve)",
    "pip install torch==2.13.0 <index flags>": "a placeholder for the user's index flags; installs from the network",
    "pip install .": "installs from the network; tests/test_packaging.py installs the wheel into a fresh virtualenv",
    "export AWS_REGION=us-east-1 AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...": _S3,
    "export AWS_ENDPOINT_URL=http://minio.internal:9000": _S3,
    "export BUCKET=my-bucket RAY_AUTH_MODE=token": _S3,
    "torchrun --nproc_per_node 8 -m torchtitan.train --module zephon_ray.integrations.torchtitan --config "
    "zephon_llama3_debugmodel --training.steps 100": "needs 8 GPUs; the CPU registry's torchrun pair runs in " + TITAN,
}


# ---- the index: every command is run or excused ---------------------------------------------------------------


def test_every_fence_names_its_language():
    bare = [f"{doc.relative_to(ROOT)}:{line}" for doc in DOCS for lang, line, _ in doc_commands.fences(doc) if not lang]
    assert not bare, f"fences without a language (```bash for commands, ```text otherwise): {bare}"


def test_every_doc_command_is_run_or_excused():
    found = commands()
    texts = {c.text for c in found}
    unlisted = [str(c) for c in found if c.text not in FAST and c.text not in SLOW and c.text not in NOT_RUN]
    assert not unlisted, (
        "doc commands that no test runs: run them in tests/test_docs_run.py (FAST or SLOW) or "
        f"say in NOT_RUN why they cannot run here: {unlisted}"
    )
    stale = [t for t in (*FAST, *SLOW, *NOT_RUN) if t not in texts]
    assert not stale, f"listed commands that no doc shows any more: {stale}"
    twice = set(FAST) & set(SLOW) | (set(FAST) | set(SLOW)) & set(NOT_RUN)
    assert not twice, twice
    for test in set(SLOW.values()):
        assert any(m.name == "slow" for m in getattr(globals()[test], "pytestmark", [])), f"{test} is not slow"


def _doc_commands(doc: str, texts=None) -> list:
    """The commands of ``doc`` that run in the calling test, in document order."""
    picked = [c for c in commands() if c.doc == doc and (texts is None or c.text in texts)]
    assert picked, f"{doc}: none of the listed commands"
    return picked


# ---- FAST: the default suite -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", list(FAST))
def test_fast_doc_commands_run_as_written(text, tmp_path):
    command = next(c for c in commands() if c.text == text)
    ((_, out),) = run_in_order([command], Here(tmp_path), shell_env(), timeout=120)
    assert FAST[text](out), f"{command} printed:\n{out[:1500]}"


# ---- SLOW ------------------------------------------------------------------------------------------------------


def _mine(test: str, doc: str) -> list:
    return _doc_commands(doc, {t for t, owner in SLOW.items() if owner == test})


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_ray_commands(tmp_path):
    """The README's service digest, materialise (Ray Data) and dataset digest: each a private local Ray."""
    done = run_in_order(_mine(README_RAY, "README.md"), Here(tmp_path), shell_env(), timeout=540)
    want = _golden_lines("tiny.toml", 0, 4)
    digests = [out for c, out in done if c.text.startswith("zephon-ray digest")]
    assert [[ln for ln in out.splitlines() if ln.startswith("step ")] for out in digests] == [want, want], digests
    assert (tmp_path / "tmp" / "zr-tiny").is_dir()


@pytest.fixture
def private_head(tmp_path):
    """The flags that make the doc's `ray start --head` a private cluster (its own --temp-dir, held ports), and
    its cleanup: the processes that name that temp dir, by PID (tests/ray_clusters.py; never `ray stop`)."""
    from tests.ray_clusters import ray_head

    with ray_head("zrdoc-") as head:  # short: Ray's socket paths live under it
        yield Here(tmp_path, dashboard=head.dashboard, gcs=head.gcs, head_flags=" ".join(head.flags))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deployment_cluster_commands(private_head):
    """docs/deployment.md's cluster start and `ray job submit --working-dir .`, then its operations block on that
    service (docs/recipes.md's add-phase among them), then service/README.md's submit of the same service."""
    here = private_head
    start = run_in_order(_mine(DEPLOYMENT, "docs/deployment.md")[:3], here, shell_env(), timeout=400)
    assert "succeeded" in start[-1][1] and "serving" in start[-1][1], start[-1][1][-3000:]
    # A shell on a node of the cluster: ray.init() finds it (here through RAY_ADDRESS), and the export above holds.
    node_env = shell_env({"RAY_AUTH_MODE": "token", "RAY_ADDRESS": here.gcs})
    # The job whose cursor the operations block releases: it read step 0 as 'trainer-old' and died (no release).
    dead_job = (
        "import ray; from zephon_ray import DataService; ray.init(); "
        "svc = DataService.connect('run7', namespace='zr', consumer='trainer-old', timeout_s=120); "
        "print('read', svc.slice(0, 0, 1, track=True).tokens.shape[0])"
    )
    read = subprocess.run(
        [sys.executable, "-c", dead_job], cwd=ROOT, env=node_env, capture_output=True, text=True, timeout=300
    )
    assert read.returncode == 0 and read.stdout.startswith("read "), read.stderr[-3000:]
    ops = run_in_order(_mine(DEPLOYMENT, "docs/deployment.md")[3:], here, node_env, timeout=400)
    out = dict((c.text.split(" --")[0], o) for c, o in ops)
    assert "producers   2" in out["zephon-ray status"], out["zephon-ray status"]
    assert "stopped 'run7'" in out["zephon-ray stop"], out["zephon-ray stop"]
    assert "checkpoint" in out["zephon-ray inspect /shared/zr/run7"], out["zephon-ray inspect /shared/zr/run7"]
    again = run_in_order(_mine(DEPLOYMENT, "service/README.md"), here, node_env, timeout=300)
    assert "succeeded" in again[0][1] and "serving" in again[0][1], again[0][1][-3000:]
    stop = next(c for c in commands() if c.text == "zephon-ray stop --name run7 --namespace zr")
    run_in_order([stop], here, node_env, timeout=120)


@pytest.fixture
def short_tmp():
    """A TMPDIR for commands that make their own (``$(mktemp -d)``) and start a Ray under it: short, because Ray's
    socket paths live under it and may not exceed 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="zrdoc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_commands(short_tmp):
    """examples/README.md's quickstart pair: 4 workers to step 4, then 5 (not dividing the 24 rows) to step 8 from
    its checkpoint; the final weights are those of the W=1 reference trained on the reference's rows."""
    import torch
    from test_ray_train_quickstart import _reference_weights

    mine = _mine(QUICKSTART, "examples/README.md")
    done = run_in_order(mine, Here(short_tmp), shell_env({"TMPDIR": str(short_tmp)}), timeout=800)
    assert [ln.split(";")[0] for _, out in done for ln in out.splitlines() if ln.startswith("last step trained")] == [
        "last step trained: 3",
        "last step trained: 7",
    ], done[-1][1][-3000:]
    (storage,) = short_tmp.glob("tmp.*")  # QS
    final = max(storage.rglob("zephon_loader.json"), key=lambda p: json.loads(p.read_text())["next_step"]).parent
    assert json.loads((final / "zephon_loader.json").read_text())["next_step"] == 8
    weights = torch.load(final / "model.pt", weights_only=True)
    for name, want in _reference_weights(8).items():
        assert np.allclose(weights[name].numpy(), want, atol=1e-5), name


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchtitan_cpu_commands(tmp_path):
    """examples/README.md's (and docs/torchtitan.md's, the same text) torchrun pair on the CPU registry."""
    run_in_order(_mine(TITAN, "examples/README.md"), Here(tmp_path), shell_env({"TMPDIR": str(tmp_path)}), timeout=800)
    steps = sorted(p.name for p in tmp_path.glob("tmp.*/checkpoint/step-*"))  # TITAN: mktemp -d in TMPDIR
    assert steps == ["step-2", "step-4"], steps  # the second run resumed at step 2 and trained to 4


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("text", [t for t, owner in SLOW.items() if owner == ELASTIC])
def test_elastic_resume_commands(text, tmp_path):
    """Each of examples/README.md's elastic_resume commands (minutes each; the torchtitan one about a quarter hour
    on 2 cores). The script makes its own work directory (a new one in /tmp: its Ray's socket paths must stay under
    107 bytes, so no TMPDIR of ours)."""
    ((_, out),) = run_in_order(_doc_commands("examples/README.md", {text}), Here(tmp_path), shell_env(), timeout=1750)
    assert "identical global batches: YES" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deployment_object_storage_commands(private_head, s3):
    """docs/deployment.md's cloud block on a private head (its `ray start --head` as above) and a local S3 (moto,
    tests/s3_server.py): the recipe copied into the bucket, validated, served with its state in the bucket, read,
    inspected, stopped, materialised there, read back and pre-tokenised. The block's three `export` lines are
    placeholders; the environment holds the same variables, set to the local S3's."""
    here = private_head
    env = shell_env({"BUCKET": s3.new_bucket("zr-docs"), "RAY_AUTH_MODE": "token"})
    head = next(c for c in commands() if c.text.startswith("ray start --head"))
    done = run_in_order([head, *_mine(S3, "docs/deployment.md")], here, env, timeout=800)
    out = {c.text: o for c, o in done}
    digests = [o for t, o in out.items() if t.startswith("zephon-ray digest")]
    want = _golden_lines("tiny.toml", 0, 4)
    assert [[ln for ln in o.splitlines() if ln.startswith("step ")] for o in digests] == [want, want], digests
    validated = re.search(
        r"fingerprint ([0-9a-f]{16,})", next(o for t, o in out.items() if t.startswith("zephon-ray validate"))
    )
    verified = next(o for t, o in out.items() if t.startswith("zephon-ray fingerprint")).strip()
    # other identities than the checkout's (ETags; the bytes hashed), the same batches (tests/test_s3.py)
    assert validated and re.fullmatch(r"[0-9a-f]{16,}", verified) and verified != validated.group(1), out
