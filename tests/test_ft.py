"""Per-step elasticity with torchft (``zephon_ray.stream.ft``), with real torchft parts: a Lighthouse, Managers over
``ProcessGroupGloo`` and TCPStores of their own.

* ``examples/torchft_churn.py`` end to end on recipes/tiny.toml (B = 16 rows): 3 replica groups as processes (3 does
  not divide 16: 5, 5 and 6 rows), one SIGKILL in the middle of a step (2 groups) and one rejoin (3 again); every
  committed step's global batch (the participants' slices joined) equals the golden digests, and the final weights
  equal the failure-free run's.
* A quorum with more readers than the global batch has rows stops with one line before any row is read.
* Loss weighting at an uneven P: the mean of the groups' mean gradients (``manager.allreduce``'s AVG) is not the
  global batch's gradient; the summed loss scaled by ``batch.loss_scale()`` with AVG is; with a loss mask,
  token-count weights through ``manager.allreduce`` (SUM) are too.
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

import pytest

pytestmark = pytest.mark.spawns  # Ray, torchrun or other process trees (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
TINY = str(ROOT / "recipes" / "tiny.toml")
CHURN = ROOT / "examples" / "torchft_churn.py"
STEPS = 8
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "tiny.json").read_text())["digests"].items()}


@pytest.fixture(scope="module")
def tiny_dir(ray_cluster, tmp_path_factory):
    """Steps 0..7 of recipes/tiny.toml (B = 16 rows: 3 participants hold 5, 5 and 6 rows), materialised."""
    from zephon_ray import Recipe
    from zephon_ray.jobs.materialize import materialize

    directory = tmp_path_factory.mktemp("ft") / "tiny"
    materialize(Recipe.from_toml(TINY), directory, range(0, STEPS), producers=1, segment_steps=8, progress=False)
    return str(directory)


CHURNS = {  # events -> participants per step, each step's W in the ledger, the records served again (step, rank)
    "one kill": (["--kill", "1@2", "--rejoin", "1@5"], [3, 3, 2, 2, 2, 3, 3, 3], [(2, 0), (2, 1)]),
    "two kills": (
        ["--kill", "1@2", "--rejoin", "1@4", "--kill", "2@6"],
        [3, 3, 2, 2, 3, 3, 2, 2],
        [(2, 0), (2, 1), (6, 0), (6, 1)],
    ),
}


@pytest.mark.parametrize(
    "churn", [pytest.param("one kill", marks=pytest.mark.heavy), pytest.param("two kills", marks=pytest.mark.slow)]
)  # ~45 s: the churn, outside the default
def test_churn_kills_and_a_rejoin_at_a_participant_count_not_dividing_B_audit_clean(tiny_dir, tmp_path, churn):
    """Group 1 is killed in step 2 (2 participants from there) and comes back (3 again); in "two kills", group 2 is
    killed in step 6 too. Also the ledger: every group's FtSlices writes its committed steps, and the run ends with
    ``zephon-ray audit`` of it (against the materialised rows, themselves checked against the goldens): clean, each
    step once at the W it was committed at, and a step a kill hit is recorded as served again (attempt 1), its
    rejected attempt nowhere. Each group's ledger moves its spooled parts into a batch file once more than 2 wait:
    group 1 is killed with steps 0 and 1 only in its spool (between two flushes), which its next life flushes; the
    run writes batch files, not a file per step, and compacted into one pack (a dead group's spool included) it
    audits the same."""
    from zephon_ray.formats.ledger import compact, containers, read_ledger
    from zephon_ray.jobs.audit import audit

    events, participants, served_again = CHURNS[churn]
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        str(CHURN),
        "--groups",
        "3",
        "--steps",
        str(STEPS),
        *events,
        "--recipe",
        TINY,
        "--dataset-dir",
        tiny_dir,
        "--json",
        str(out),
        "--ledger",
        str(tmp_path / "ledger"),
        "--ledger-flush-records",
        "2",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "identical global batches: YES" in proc.stdout
    assert "final weights equal the failure-free run: YES" in proc.stdout
    summary = json.loads(out.read_text())
    steps = {int(s): v for s, v in summary["steps"].items()}
    assert sorted(steps) == list(range(STEPS))
    assert [steps[s]["participants"] for s in range(STEPS)] == participants, steps
    assert all(steps[s]["problem"] is None for s in steps)
    for s in range(STEPS):  # against the committed goldens (tests/oracle.py), not only GlobalBatchSource
        assert steps[s]["digest"] == summary["expected"][s] == GOLDEN.get(s, steps[s]["digest"]), s
    assert "attempts that should_commit() rejected: " in proc.stdout
    rejected = int(proc.stdout.split("attempts that should_commit() rejected: ")[1].split()[0])
    assert rejected >= len(served_again) // 2, proc.stdout  # each kill hit a step in flight: the survivors' attempt
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("audit: "))  # did not commit
    worlds = " -> ".join(str(p) for i, p in enumerate(participants) if i == 0 or participants[i - 1] != p)
    assert verdict == (
        f"audit: clean: steps [0, {STEPS}) each trained exactly once in a lineage of {STEPS} "
        f"segment(s) (W {worlds}); {sum(participants)} slice digests matched the recipe's global "
        "batches"
    ), proc.stdout
    records = {
        (r.step, r.world, r.rank): r
        for seg in read_ledger(str(tmp_path / "ledger")).values()
        for rs in seg.parts.values()
        for r in rs
    }
    assert sorted({s for s, _, _ in records}) == list(range(STEPS))
    assert all(r.trained == 1 for r in records.values())
    assert {s: w for s, w, _ in records} == dict(enumerate(participants))  # no record of a rejected attempt
    assert len(records) == sum(participants)
    assert sorted((s, r) for (s, _, r), rec in records.items() if rec.attempt) == served_again
    found = containers(tmp_path / "ledger")
    # A group killed and never rejoined ("two kills": group 2) leaves its spool, read where it is; a rejoined one's
    # next life flushed it.
    assert not found.loose and not found.packs and len(found.batches) >= 3, found
    assert len(found.spools) == (churn == "two kills"), found
    assert found.file_count < sum(participants), found  # batch files, not one file per committed step per reader
    before = audit(str(tmp_path / "ledger"))
    compact(tmp_path / "ledger")
    after = audit(str(tmp_path / "ledger"))
    assert (
        containers(tmp_path / "ledger").file_count == 3
        and after.clean
        and after.records == before.records == sum(participants)
        and after.verdict() == before.verdict()
    )


def _churn_schedule(seed: int) -> list[str]:
    """One or two kills of groups 1 and 2 (group 0 lives throughout) at random steps of 1..STEPS-2, each killed
    group rejoining later or never: the example's --kill/--rejoin arguments."""
    import random

    rng = random.Random(seed)
    events = []
    for group in rng.sample([1, 2], rng.randint(1, 2)):
        killed = rng.randint(1, STEPS - 2)
        events += ["--kill", f"{group}@{killed}"]
        if rng.random() < 0.6:
            events += ["--rejoin", f"{group}@{rng.randint(killed + 1, STEPS - 1)}"]
    return events


@pytest.mark.slow
def test_churn_fuzz(tiny_dir, tmp_path):
    """Random churn schedules (``ZR_FT_FUZZ_SEEDS``, default 1-6) through examples/torchft_churn.py with its ledger:
    every run gives the failure-free run's global batches and final weights, and its audit is clean."""
    first, _, last = os.environ.get("ZR_FT_FUZZ_SEEDS", "1-6").partition("-")
    for seed in range(int(first), int(last or first) + 1):
        events = _churn_schedule(seed)
        work = tmp_path / f"seed-{seed}"
        work.mkdir()
        cmd = [
            sys.executable,
            str(CHURN),
            "--groups",
            "3",
            "--steps",
            str(STEPS),
            *events,
            "--recipe",
            TINY,
            "--dataset-dir",
            tiny_dir,
            "--ledger",
            str(work / "ledger"),
            "--ledger-flush-records",
            "2",
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=400, cwd=work, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        where = f"seed {seed}, events {' '.join(events)}"
        assert proc.returncode == 0, (where, (proc.stdout + proc.stderr)[-3000:])
        assert "identical global batches: YES" in proc.stdout, (where, proc.stdout[-3000:])
        assert "final weights equal the failure-free run: YES" in proc.stdout, (where, proc.stdout[-3000:])
        verdict = next(line for line in proc.stdout.splitlines() if line.startswith("audit: "))
        assert verdict.startswith(f"audit: clean: steps [0, {STEPS}) each trained exactly once"), (where, verdict)


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
    managers = [
        Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
            min_replica_size=1,
            load_state_dict=lambda state: None,
            state_dict=lambda: {},
            replica_id=f"group_{g}",
            lighthouse_addr=lighthouse.address(),
            store_addr="127.0.0.1",
            store_port=stores[g].port,
            rank=0,
            world_size=1,
            use_async_quorum=False,
            timeout=timedelta(seconds=30),
            quorum_timeout=timedelta(seconds=60),
        )
        for g in range(n)
    ]
    try:
        yield managers
    finally:
        for m in managers:
            m.shutdown(wait=False)
        lighthouse.shutdown()


def _in_parallel(fn, n: int) -> list:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))


def test_a_quorum_with_more_readers_than_rows_stops_before_the_step(tmp_path):
    """tiny.toml has B = 16 rows: 3 participants x dp 6 = 18 readers cannot share it (a reader would get no row).
    One line, and nothing was read (the directory the source would read does not even exist)."""
    from zephon_ray import Recipe
    from zephon_ray.stream.ft import FtMembershipError, FtSlices, supported_participants
    from zephon_ray.stream.loader import LoaderConfig

    assert supported_participants(Recipe.from_toml(TINY)) == list(range(1, 17))
    assert supported_participants(Recipe.from_toml(TINY), dp=6) == [1, 2]
    config = LoaderConfig(recipe=TINY, mode="dataset", dataset_dir=str(tmp_path / "never-read"))
    with ft_groups(3) as managers:

        def step(g):
            managers[g].start_quorum()
            with FtSlices(config, manager=managers[g], dp=6) as slices:
                with pytest.raises(FtMembershipError) as info:
                    slices.next()
                return str(info.value)

        messages = _in_parallel(step, 3)
    for message in messages:
        assert "\n" not in message
        assert message.startswith(
            "step 0: a quorum of 3 participants x dp 6 = 18 readers cannot share the recipe's global batch of 16 rows"
        )
        assert "it supports 1-2 participants" in message and "the step was not run" in message


def test_the_churn_examples_rejoin_wait_ends_in_one_line_when_the_new_group_exits_first():
    """examples/torchft_churn.py holds the live groups until a rejoining group has asked the (real) Lighthouse for a
    quorum, as its status page counts. A new process that exits without asking ends that wait at once, in one line
    naming the group, instead of at the 120 s bound or never."""
    import importlib.util
    import time

    from torchft.coordination import LighthouseServer

    from tests.conftest import one_line

    spec = importlib.util.spec_from_file_location("torchft_churn", CHURN)
    churn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(churn)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=2000, heartbeat_timeout_ms=2000)
    try:
        exited = subprocess.Popen([sys.executable, "-c", "pass"])
        exited.wait(60)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            churn._wait_joined(lighthouse.address(), 1, exited)
        assert time.monotonic() - t0 < 30
        one_line(info.value, "group 1 (a new process) never asked the Lighthouse for a quorum")
    finally:
        lighthouse.shutdown()


def test_the_churn_examples_rejoin_wait_ends_in_one_line_when_the_status_page_changes():
    """The rejoin wait reads the count of askers from the Lighthouse's status page (torchft 0.2.0's wording). A page
    without it (another torchft version, another server on the port) ends the wait at once, in one line naming the
    page, rather than after the 120 s bound with a wrong reason. The page here is a plain HTTP server's, on
    127.0.0.1."""
    import http.server
    import importlib.util
    import threading

    from tests.conftest import one_line

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html><body>Lighthouse: quorum 3, 2 replicas live</body></html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    spec = importlib.util.spec_from_file_location("torchft_churn", CHURN)
    churn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(churn)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(RuntimeError) as info:
            churn._wait_joined(address, 1, running)
        one_line(info.value, f"the Lighthouse's status page at {address}/status no longer says who asked for a quorum")
        assert running.poll() is None  # it ended on the page, not on the process
    finally:
        running.kill()
        running.wait(30)
        server.shutdown()
        server.server_close()


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
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction=reduction
    )
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_loss_weighting_at_an_uneven_participant_count(tiny_dir):
    """3 groups read their slices of step 0 of tiny.toml (16 rows: 5, 5 and 6) through FtSlices. The mean of the
    groups' mean gradients (AVG) is not the global batch's mean gradient; each group's summed loss scaled by
    ``batch.loss_scale()`` (3 / 1024 tokens), then AVG, is. With a loss mask (token counts differ by content),
    summed losses and token counts all-reduced with SUM (token_weighted) give the masked global gradient."""
    import torch
    from torch.distributed import ReduceOp

    from zephon_ray import Recipe
    from zephon_ray.formats.materialized import MaterializedSource
    from zephon_ray.stream.ft import FtSlices, token_weighted
    from zephon_ray.stream.loader import LoaderConfig

    recipe = Recipe.from_toml(TINY)
    with MaterializedSource(tiny_dir, recipe=recipe) as source:  # its digest is checked against the golden
        whole = source.batch(0)
    assert whole.digest == GOLDEN[0]
    ((inputs, labels),) = whole.slice(0, 1).microbatches(recipe.global_batch_rows)
    initial = _bigram()
    want = _grads(copy.deepcopy(initial), inputs, labels, "mean")
    want_masked = _grads(copy.deepcopy(initial), inputs, _masked(labels), "mean")

    config = LoaderConfig(recipe=TINY, mode="dataset", dataset_dir=tiny_dir)
    with ft_groups(3) as managers:

        def group(g):
            m = managers[g]
            m.start_quorum()
            with FtSlices(config, manager=m) as slices:
                batch = slices.next()
            ((x, y),) = batch.microbatches
            model = copy.deepcopy(initial)  # not _bigram(): torch.manual_seed is global, the threads would race
            mean_of_means = _grads(model, x, y, "mean")
            for grad in mean_of_means:
                m.allreduce(grad).wait()  # torchft's default: the mean over participants
            scaled = [g * batch.loss_scale() for g in _grads(model, x, y, "sum")]
            for grad in scaled:
                m.allreduce(grad).wait()
            summed = _grads(model, x, _masked(y), "sum")
            tokens = torch.tensor((_masked(y) != -100).sum().item())
            fixed = token_weighted(summed, tokens, lambda t: m.allreduce(t, reduce_op=ReduceOp.SUM).wait())
            return batch.slice.num_rows, mean_of_means, scaled, fixed

        results = _in_parallel(group, 3)

    assert [r[0] for r in results] == [5, 5, 6]  # rows [0, 5), [5, 10), [10, 16)
    for _, mean_of_means, scaled, fixed in results:
        assert max(float((g - r).abs().max()) for g, r in zip(mean_of_means, want)) > 1e-5
        for got, ref in zip(scaled, want):
            assert torch.allclose(got, ref, atol=1e-6), float((got - ref).abs().max())
        for got, ref in zip(fixed, want_masked):
            assert torch.allclose(got, ref, atol=1e-6), float((got - ref).abs().max())


def test_validate_lists_the_participant_counts():
    proc = subprocess.run(
        [sys.executable, "-m", "zephon_ray.cli", "validate", ELASTIC, "--no-build"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("P (torchft)"))
    assert line == "P (torchft) dp=1: 1-24; dp=2: 1-12; dp=4: 1-6; dp=8: 1-3"
    padding = next(l for l in proc.stdout.splitlines() if l.startswith("padding"))
    assert "at W = 5: 1 (4%), 7: 4 (17%), 9: 3 (12%)" in padding  # ceil(24/W) x W - 24 rows per step


# ---------------------------------------------------------------------- the ledger of a torchft run
def _ft_ledger_config(tiny_dir, ledger, run_id="ft-ledger"):
    from zephon_ray.stream.loader import LoaderConfig

    return LoaderConfig(recipe=TINY, mode="dataset", dataset_dir=tiny_dir, run_id=run_id, ledger_dir=str(ledger))


def test_an_attempt_applied_after_a_rejection_is_named_by_the_audit(tiny_dir, tmp_path, capsys):
    """A real torchft group (Lighthouse, Manager) trains steps 0..2; at step 1 it reports an error (as a failed
    all-reduce does), so ``should_commit()`` rejects the attempt and torchft serves step 1 again. The loop applies
    the rejected attempt anyway (the bug) and confirms it. The audit names step 1, one line: the rank trained it
    twice, the second time as attempt 1. One group: two groups healing each other made the test's timing depend on
    the machine's load (a heal under load outlasted the process group's timeout)."""
    from zephon_ray.cli import main
    from zephon_ray.formats.ledger import read_ledger
    from zephon_ray.stream.ft import FtSlices

    config = _ft_ledger_config(tiny_dir, tmp_path / "ledger")
    with ft_groups(1) as (m,):
        injected = False
        with FtSlices(config, manager=m) as slices:
            while m.current_step() < 3:
                m.start_quorum()
                step = m.current_step()
                slices.next()
                if step == 1 and not injected:
                    m.report_error(RuntimeError("injected: a failed all-reduce"))
                    injected = True
                m.should_commit()
                slices.commit(step)  # the bug: applied whatever the vote said
            assert (slices.ledger.rejected_attempts, slices.ledger.applied_rejected) == (1, 1)
    records = sorted(
        (r.step, r.rank, r.attempt, r.trained)
        for seg in read_ledger(str(tmp_path / "ledger")).values()
        for part in seg.parts.values()
        for r in part
    )
    assert records == [(0, 0, 0, 1), (1, 0, 1, 2), (2, 0, 0, 1)]
    capsys.readouterr()
    rc = main(["audit", str(tmp_path / "ledger"), "--recipe", TINY, "--dataset", tiny_dir])
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert rc == 1 and lines == [
        "step 1: trained twice: rank 0 of 1 trained it 2 times (its record is attempt 1: an earlier attempt that "
        "torchft rejected was applied too)",
        "audit: 1 finding(s) in steps [0, 3) (W 1)",
    ], lines


def test_a_reader_asked_for_a_step_its_ledger_did_not_reach_stops_and_a_healed_one_continues(tiny_dir, tmp_path):
    """A real Manager trains steps 0 and 1; a new FtSlices on it (a restarted reader that was not healed with the
    state) is asked for step 2 though its ledger is at step 0: one line, before any row. With the first reader's
    state (what torchft's heal carries) it continues the lineage; another run's state is refused, naming it."""
    from zephon_ray.formats.loader_state import LoaderStateError
    from zephon_ray.stream.ft import FtSlices
    from zephon_ray.stream.ledger_recorder import FtLedgerError

    config = _ft_ledger_config(tiny_dir, tmp_path / "ledger")
    with ft_groups(1) as (manager,):
        with FtSlices(config, manager=manager) as first:
            for step in range(2):
                manager.start_quorum()
                assert first.next().step == manager.current_step() == step
                assert manager.should_commit()  # torchft's step moves on here
                first.commit(step)
            state = first.state_dict()
        assert state["next_step"] == 2 and state["ledger"] == first.ledger.head
        manager.start_quorum()
        with FtSlices(config, manager=manager) as restarted:
            with pytest.raises(FtLedgerError) as info:
                restarted.next()
            assert str(info.value) == (
                "FtSlices: asked for step 2, but this reader's ledger is at its next step 0: steps would be skipped "
                "or repeated unseen (a healing group must receive FtSlices.state_dict() through the torchft "
                "Manager's state_dict / load_state_dict)"
            )
            with pytest.raises(
                LoaderStateError, match="belongs to run_id 'ft-ledger', but this loader has run_id 'other'"
            ):
                FtSlices(_ft_ledger_config(tiny_dir, tmp_path / "x", "other"), manager=manager).load_state_dict(state)
            restarted.load_state_dict(state)
            assert restarted.next().step == 2
            assert manager.should_commit()
            restarted.commit(2)
            assert restarted.ledger.head != state["ledger"]
    from zephon_ray.jobs.audit import audit

    report = audit(str(tmp_path / "ledger"))
    assert report.clean and report.next_step == 3 and len(report.lineage) == 3, [f.line for f in report.findings]
