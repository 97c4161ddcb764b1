"""A stateful fault fuzzer of the service's client protocol: random sequences of reads, commits, handles, processes
and kill -9s against a real service, each step checked against a simple model.

A sequence is a list of operations (tuples, :data:`OPS`) run by :func:`run_sequence` against a fresh service; every
failure prints the sequence as a script (``state = ServiceFuzz(); h0 = state.start(); state.read(h0, ...); ...``)
that reproduces it against this module.

Operations: tracked and untracked reads (``slice``, ``batch``) at steps near the consumer's position, in the past, at
random, far past ``max_ahead`` and negative, with good and bad rank/world; commits (valid, ahead of what was
delivered, 10**12, negative); new handles of the same or a new consumer; ``release``; ``status``; kill -9 of the
coordinator, the node reader and a producer; a reader process of its own (and a kill -9 of one mid-run).

Checks:
- safety: every row returned equals the in-process reference (``GlobalBatchSource``), compared as arrays;
- liveness: every valid read returns within ``LIVENESS_S`` (each operation runs in a thread joined with a bound, so
  a hang fails the test instead of hanging it);
- every refusal is one line (``ValueError`` for bad input, never a traceback or a Ray wrapper);
- an accepted commit never passes what the consumer was delivered (plus one), and a commit the handle's own reads
  allow is never refused;
- at the end the service is healthy: no fatal error, and a fresh handle reads a step with the reference rows.

The default suite runs a short seeded budget: the sequences ``random.Random(seed)`` draws for ``FUZZ_SEQUENCES``.
``ZR_FUZZ_MINUTES=30 pytest -m slow tests/test_service_fuzz.py -k long -s`` draws sequences with Hypothesis
(``st.lists`` of the same operations) for that long; Hypothesis shrinks a failing sequence (fewer and simpler
operations) before it reports it, and the counts (sequences, operations, kills, refusals) are printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_ray import DataService, GlobalBatchSource
from zephon_ray.service.wire import READER_INFIX

NS = "zr-fuzz"
STEPS = 40
"""Steps the fuzzer reads: every one lies within ``max_ahead`` of any head, so a read of one is never refused."""
FAR = 10**6
LIVENESS_S = 120.0
"""The bound on one operation: a read may wait for another consumer's cursor to expire (``consumer_ttl_s``) and for
a coordinator restart; anything past this is a hang."""
SERVICE = dict(
    producers=1,
    window=4,
    checkpoint_every=2,
    max_ahead=64,
    consumer_ttl_s=8.0,
    request_timeout_s=60.0,
    reconnect_timeout_s=90.0,
    read_timeout_s=100.0,
)
FUZZ_SEQUENCES = (1,)
"""The seeds of the default suite's sequences (one: the suite's time; the long run draws hundreds)."""
FUZZ_STEPS = 14
ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(1200), pytest.mark.spawns]

READER = r"""
import json, sys
import ray
from zephon_ray import DataService
name, ns, consumer, first, stop, rank, world = sys.argv[1:8]
ray.init(address="auto", log_to_driver=False)
svc = DataService.connect(name, namespace=ns, consumer=consumer)
for step in range(int(first), int(stop)):
    part = svc.slice(step, int(rank), int(world))
    print(json.dumps([step, part.tokens.tolist(), part.positions.tolist()]), flush=True)
"""


@dataclass
class Counts:
    sequences: int = 0
    operations: int = 0
    reads: int = 0
    refusals: int = 0
    kills: dict = field(default_factory=dict)
    commits: int = 0
    processes: int = 0

    def line(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


class _Reference:
    """The in-process rows of steps [0, STEPS), made once per test session."""

    batches: dict | None = None

    @classmethod
    def get(cls, recipe) -> dict:
        if cls.batches is None:
            with GlobalBatchSource(recipe) as source:
                cls.batches = {s: source.batch(s) for s in range(STEPS)}
        return cls.batches


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text.strip() and "Traceback" not in text, f"a multi-line refusal: {type(exc).__name__}: {text}"
    return text


def _bounded(what: str, fn, bound: float = LIVENESS_S):
    """Run ``fn`` in a thread; a call still running after ``bound`` is a hang (the thread is left behind)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            box["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True, name=f"fuzz-{what}")
    thread.start()
    thread.join(bound)
    if thread.is_alive():
        pytest.fail(f"hang: {what} did not return within {bound:.0f}s")
    box["seconds"] = time.monotonic() - t0
    return box


WHERES = ["near", "near", "near", "near", "past", "random", "random", "far", "negative"]
KINDS = ["slice", "slice", "batch"]
READERS = ["0/1", "0/1", "0/2", "1/2", "2/4", "3/4", "1/3", "2/3", "0/16", "bad:4/4", "bad:0/17", "bad:-1/2"]
COMMITS = ["own", "own", "ahead", "huge", "negative"]
NAMES = ["trainer", "notebook", "eval"]
TARGETS = ["coordinator", "node reader", "producer"]
OPS = {
    # name: (weight, takes a handle, {argument: choices (a list) or an inclusive int range (a tuple)})
    "read": (6, True, {"where": WHERES, "offset": (0, 60), "kind": KINDS, "track": [True, False], "reader": READERS}),
    "commit": (2, True, {"how": COMMITS}),
    "new_handle": (1, True, {"same": [True, False], "name": NAMES}),
    "release": (1, True, {}),
    "status": (1, True, {}),
    "kill": (1, False, {"what": TARGETS}),
    "reader_process": (
        1,
        False,
        {
            "consumer": ["trainer", "worker"],
            "first": (0, 20),
            "count": (1, 4),
            "world": [1, 2],
            "kill_after": [None, None, 1],
        },
    ),
}
"""The operations of a sequence. An operation is ``(name, handle index, {argument: value})``; the handle index is
taken modulo the handles open at that point (``start``'s and each ``new_handle``'s)."""


class ServiceFuzz:
    """One sequence: a fresh service (:meth:`start`), then operations, then :meth:`teardown` (which checks that the
    service is healthy). The model of what the service must do lives in the operations' checks."""

    recipe = None
    workdir: Path = Path("/tmp")
    counts = Counts()
    number = 0

    def __init__(self) -> None:
        self.svc: DataService | None = None
        self.reference = _Reference.get(self.recipe)
        self.delivered: dict[str, int] = {}  # consumer -> highest step a tracked read of it delivered
        self.commits: dict[str, int] = {}
        self.own: dict[int, dict] = {}  # handle id -> {(rank, world): highest tracked step} (the client's own moves)
        self.position: dict[str, int] = {}  # consumer -> where its "near" reads go
        self.procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ set-up and teardown
    def start(self):
        ServiceFuzz.number += 1
        name = f"fz{os.getpid()}x{ServiceFuzz.number}"
        self.counts.sequences += 1
        self.svc = DataService.start(
            self.recipe, name=name, namespace=NS, consumer="trainer", state_dir=self.workdir / name, **SERVICE
        )
        self.name = name
        return self._track(self.svc)

    def teardown(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        if self.svc is not None:
            try:
                self._healthy()
            finally:
                self.svc.stop()

    def _healthy(self) -> None:
        box = _bounded("the final status", self.svc.status)
        assert "error" not in box, f"status failed at the end: {box.get('error')!r}"
        assert not box["value"].get("fatal"), box["value"].get("fatal")
        fresh = DataService.connect(self.name, namespace=NS, consumer="final-check")
        box = _bounded("the final read", lambda: fresh.slice(3, 0, 1, track=False))
        assert "error" not in box, f"a fresh handle could not read at the end: {box.get('error')!r}"
        self._check_rows(box["value"], 3, 0, 1)

    # ------------------------------------------------------------------ helpers
    def _track(self, handle: DataService) -> DataService:
        self.own[id(handle)] = {}
        self.position.setdefault(handle.consumer, 0)
        return handle

    def _check_rows(self, got, step: int, rank: int | None, world: int | None) -> None:
        want = self.reference[step] if world is None else self.reference[step].slice(rank, world)
        np.testing.assert_array_equal(np.asarray(got.tokens), want.tokens, err_msg=f"step {step} rows differ")
        np.testing.assert_array_equal(np.asarray(got.positions), want.positions, err_msg=f"step {step} positions")

    def _step(self, consumer: str, where: str, offset: int) -> int:
        if where == "near":
            return min(STEPS - 1, self.position[consumer] + offset % 3)
        if where == "past":
            return max(0, self.position[consumer] - 1 - offset % 8)
        if where == "far":
            return FAR + offset
        if where == "negative":
            return -1 - offset % 3
        return offset % STEPS

    # ------------------------------------------------------------------ operations
    def new_handle(self, handle, same, name):
        consumer = handle.consumer if same else name
        box = _bounded("connect", lambda: DataService.connect(self.name, namespace=NS, consumer=consumer))
        assert "error" not in box, f"connect failed: {box.get('error')!r}"
        self.counts.operations += 1
        return self._track(box["value"])

    def read(self, handle, where, offset, kind, track, reader):
        self.counts.operations += 1
        self.counts.reads += 1
        step = self._step(handle.consumer, where, offset)
        bad = reader.startswith("bad:")
        rank, world = (int(x) for x in reader.removeprefix("bad:").split("/"))
        if kind == "batch":
            call = lambda: handle.batch(step, track=track)  # noqa: E731
            rank = world = None
            bad = False
        else:
            call = lambda: handle.slice(step, rank, world, track=track)  # noqa: E731
        box = _bounded(f"{kind}({step}, {reader}, track={track})", call)
        refused = bad or where in ("far", "negative")
        if refused:
            assert "error" in box, f"{kind} of step {step} as {reader} was served; it must be refused"
            error = box["error"]
            assert isinstance(error, ValueError), f"a refusal must be a ValueError: {type(error).__name__}: {error}"
            _one_line(error)
            self.counts.refusals += 1
            return
        assert "error" not in box, (
            f"{kind} of step {step} as {reader} failed: {type(box['error']).__name__}: {box['error']}"
        )
        self._check_rows(box["value"], step, rank, world)
        if track:
            c = handle.consumer
            self.delivered[c] = max(self.delivered.get(c, -1), step)
            own = self.own[id(handle)]
            key = (0, 1) if world is None else (rank, world)
            if any(w != key[1] for _, w in own):
                own.clear()  # the client keeps one world per consumer, as the service does
            own[key] = max(own.get(key, -1), step)
            self.position[c] = max(self.position[c], step)

    def commit(self, handle, how):
        self.counts.operations += 1
        own = self.own[id(handle)]
        c = handle.consumer
        mine = max(own.values(), default=None)
        step = {
            "own": (mine if mine is not None else self.delivered.get(c, -1)) + 1,
            "ahead": self.delivered.get(c, -1) + 5,
            "huge": 10**12,
            "negative": -1,
        }[how]
        box = _bounded(f"commit({step})", lambda: handle.commit(step))
        allowed = max(self.delivered.get(c, -1) + 1, self.commits.get(c, 0))
        if "error" in box:
            error = box["error"]
            assert isinstance(error, ValueError), f"commit({step}) failed: {type(error).__name__}: {error}"
            _one_line(error)
            self.counts.refusals += 1
            assert not (mine is not None and 0 <= step <= max(mine + 1, self.commits.get(c, 0))), (
                f"commit({step}) of {c!r} was refused although this handle read up to step {mine}: {error}"
            )
            return
        assert 0 <= step <= allowed, f"commit({step}) of {c!r} was accepted past what it was delivered ({allowed})"
        self.commits[c] = step
        self.counts.commits += 1

    def release(self, handle):
        self.counts.operations += 1
        box = _bounded("release", handle.release)
        assert "error" not in box, f"release failed: {box.get('error')!r}"
        self.own[id(handle)].clear()  # the client forgets its own moves with its cursors

    def status(self, handle):
        self.counts.operations += 1
        box = _bounded("status", handle.status)
        assert "error" not in box, f"status failed: {box.get('error')!r}"
        assert not box["value"].get("fatal"), box["value"]["fatal"]

    def kill(self, what):
        self.counts.operations += 1
        import ray

        box = _bounded("status before a kill", self.svc.status)
        if "error" in box:  # restarting from an earlier kill: one line, and nothing to kill now
            _one_line(box["error"])
            return
        status = box["value"]
        if what == "coordinator":
            pid = status["coordinator"]["pid"]
        elif what == "producer":
            pid = next((p["pid"] for p in status["producers"] if p["pid"]), None)
        else:
            readers = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == NS and a["name"].startswith(self.name + READER_INFIX)
            ]
            pid = None
            if readers:
                try:
                    pid = ray.get(ray.get_actor(readers[0], namespace=NS).info.remote(), timeout=30)["pid"]
                except Exception:  # noqa: BLE001 - it is restarting already: nothing to kill now
                    pid = None
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.counts.kills[what] = self.counts.kills.get(what, 0) + 1

    def reader_process(self, consumer, first, count, world, kill_after):
        """A reader of its own (a trainer rank in another process): its rows are checked here; with ``kill_after``
        it is killed -9 after its first step (its cursor then holds the window until it expires)."""
        self.counts.operations += 1
        self.counts.processes += 1
        import ray

        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                READER,
                self.name,
                NS,
                consumer,
                str(first),
                str(min(STEPS, first + count)),
                str(world - 1),
                str(world),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.procs.append(proc)
        lines = []

        def run() -> None:
            for line in proc.stdout:
                lines.append(json.loads(line))
                if kill_after is not None and len(lines) >= kill_after:
                    proc.kill()
                    break
            proc.wait()

        box = _bounded("a reader process", run, LIVENESS_S + 60)
        assert "error" not in box, box.get("error")
        for step, tokens, positions in lines:
            want = self.reference[step].slice(world - 1, world)
            assert np.array_equal(np.array(tokens), want.tokens) and np.array_equal(
                np.array(positions), want.positions
            ), step
        if kill_after is None:
            assert proc.returncode == 0, f"the reader process failed: {proc.stderr.read()[-2000:]}"
            assert len(lines) == min(STEPS, first + count) - first
            self.delivered[consumer] = max(self.delivered.get(consumer, -1), lines[-1][0])
        else:  # it may have asked for (moved its cursor to) the step after the last one it printed
            self.counts.kills["reader process"] = self.counts.kills.get("reader process", 0) + 1
            asked = lines[-1][0] + 1 if lines else first
            self.delivered[consumer] = max(self.delivered.get(consumer, -1), asked)
        self.procs.remove(proc)


def run_sequence(recipe, workdir: Path, ops: list) -> None:
    """Run ``ops`` against a fresh service; on a failure, print the sequence as a script and re-raise."""
    ServiceFuzz.recipe, ServiceFuzz.workdir = recipe, workdir
    machine = ServiceFuzz()
    script = ["state = ServiceFuzz()", "h0 = state.start()"]
    try:
        handles = [machine.start()]
        for name, index, args in ops:
            takes_handle = OPS[name][1]
            h = index % len(handles)
            shown = ", ".join([f"h{h}"] * takes_handle + [f"{k}={v!r}" for k, v in args.items()])
            call = f"state.{name}({shown})"
            script.append(f"h{len(handles)} = {call}" if name == "new_handle" else call)
            got = getattr(machine, name)(*([handles[h]] if takes_handle else []), **args)
            if name == "new_handle":
                handles.append(got)
        script.append("state.teardown()")
        machine.teardown()
    except BaseException:
        print("the failing sequence, as a script (tests/test_service_fuzz.py):\n" + "\n".join(script))
        raise


def seeded_ops(seed: int, steps: int) -> list:
    """``steps`` operations drawn by ``random.Random(seed)`` with :data:`OPS`' weights."""
    import random

    rng = random.Random(seed)
    names = list(OPS)
    out = []
    for _ in range(steps):
        name = rng.choices(names, weights=[OPS[n][0] for n in names])[0]
        args = {k: rng.randint(*v) if isinstance(v, tuple) else rng.choice(v) for k, v in OPS[name][2].items()}
        out.append((name, rng.randrange(8), args))
    return out


def _op_strategy():
    """Hypothesis's operations: the same names and arguments; ``status`` first, so its simplest sequence is cheap."""

    def one(name):
        fields = {k: st.integers(*v) if isinstance(v, tuple) else st.sampled_from(v) for k, v in OPS[name][2].items()}
        return st.tuples(st.just(name), st.integers(0, 7), st.fixed_dictionaries(fields))

    order = ["status"] + [n for n in OPS if n != "status"]
    return st.one_of(*[one(n) for n in order for _ in range(OPS[n][0])])


def test_fuzz_service_short_seeded(ray_cluster, tiny_recipe, tmp_path):
    ServiceFuzz.counts = Counts()
    for seed in FUZZ_SEQUENCES:
        print(f"seed {seed}")
        run_sequence(tiny_recipe, tmp_path, seeded_ops(seed, FUZZ_STEPS))
    counts = ServiceFuzz.counts
    print("service fuzz:", counts.line())
    assert counts.sequences == len(FUZZ_SEQUENCES) and counts.reads > 0


@pytest.mark.slow
@pytest.mark.timeout(int(float(os.environ.get("ZR_FUZZ_MINUTES", "30")) * 60) + 1800)  # a round may end late
def test_fuzz_service_long(ray_cluster, tiny_recipe, tmp_path):
    """``ZR_FUZZ_MINUTES`` (default 30) of Hypothesis's sequences of 5-40 operations, in rounds of 10; a failure is
    shrunk, then reported. The counts are printed and written to ``$ZR_FUZZ_SUMMARY`` when set."""
    minutes = float(os.environ.get("ZR_FUZZ_MINUTES", "30"))
    ServiceFuzz.counts = Counts()

    @settings(max_examples=10, database=None, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
    @given(ops=st.lists(_op_strategy(), min_size=5, max_size=40))
    def sequence(ops):
        run_sequence(tiny_recipe, tmp_path, ops)

    t0 = time.monotonic()
    while time.monotonic() - t0 < minutes * 60:
        sequence()
    line = ServiceFuzz.counts.line()
    print(f"service fuzz, {minutes:g} min:", line)
    if os.environ.get("ZR_FUZZ_SUMMARY"):
        Path(os.environ["ZR_FUZZ_SUMMARY"]).write_text(line + "\n")


# ---------------------------------------------------------------------------------------------- named regressions
def _service(recipe, tmp_path, name, **overrides):
    return DataService.start(
        recipe, name=name, namespace=NS, consumer="trainer", state_dir=tmp_path / name, **{**SERVICE, **overrides}
    )


def _kill_coordinator(svc, wait_for_restart: bool = False) -> None:
    """kill -9 the coordinator's process; with ``wait_for_restart``, return once Ray has seen it die and begun
    restarting the actor."""
    from ray._private import state as ray_state

    pid = svc.status()["coordinator"]["pid"]
    if not wait_for_restart:
        os.kill(pid, signal.SIGKILL)
        return
    actor = next(a for a, info in ray_state.actors().items() if info["Pid"] == pid and info["State"] == "ALIVE")
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: ray_state.actors(actor_id=actor)["NumRestarts"] >= 1,
        60,
        lambda: f"Ray restarting the killed coordinator: {ray_state.actors(actor_id=actor)['State']}",
    )


@pytest.mark.heavy
def test_regression_a_refused_far_read_then_a_coordinator_restart(ray_cluster, tiny_recipe, tmp_path):
    """Issue 38's sequence: reads 0-4, a read of 10**6 (refused), step 5, commit 6, kill -9 of the coordinator, then
    steps 6-15. The refused read's cursor move stayed in the client's unsent moves (put back when its call failed)
    and every later move of the rank was merged into it by max, so the restarted coordinator refused them all and
    never learnt the cursor: the read of the step past the window waited forever."""
    reference = _Reference.get(tiny_recipe)
    svc = _service(tiny_recipe, tmp_path, "far-then-kill", window=8, max_ahead=512)
    try:
        for step in range(5):
            assert np.array_equal(svc.slice(step, 0, 1, track=True).tokens, reference[step].tokens)
        with pytest.raises(ValueError, match="max_ahead"):
            svc.slice(10**6, 0, 1, track=True)
        svc.slice(5, 0, 1, track=True)
        svc.commit(6)
        _kill_coordinator(svc)
        for step in range(6, 16):
            box = _bounded(f"slice({step})", lambda step=step: svc.slice(step, 0, 1, track=True), 60)
            assert "error" not in box, box.get("error")
            assert np.array_equal(box["value"].tokens, reference[step].tokens), step
        assert svc.status()["reads"]["bad_moves"] <= 1  # the refused move is never sent again
    finally:
        svc.stop()


@pytest.mark.heavy
def test_regression_a_waiting_lease_keeps_no_other_consumer_alive(ray_cluster, tiny_recipe, tmp_path):
    """Found by the fuzzer (seed 13): consumer ``eval`` reads step 2 and moves to step 3 (``advance``: the move waits in
    the process to go with its next call), then ``trainer`` reads step 31, far past the window. The trainer's call
    carried eval's move to the node reader and its lease to the coordinator, which refreshed every move of a waiting
    lease each second: eval's cursor never expired and held the window at step 3 until the read timed out. Now the
    read waits one TTL."""
    reference = _Reference.get(tiny_recipe)
    svc = _service(tiny_recipe, tmp_path, "silent-consumer")
    try:
        evaluator = DataService.connect("silent-consumer", namespace=NS, consumer="eval")
        evaluator.slice(2, 3, 4, track=True)
        evaluator.advance(3, rank=3, world=4)
        box = _bounded("batch(31)", lambda: svc.batch(31, track=True), 60)
        assert "error" not in box, box.get("error")
        assert np.array_equal(box["value"].tokens, reference[31].tokens)
        assert box["seconds"] < SERVICE["consumer_ttl_s"] + 20, box["seconds"]  # one TTL, not request_timeout_s
    finally:
        svc.stop()


@pytest.mark.heavy
def test_regression_ranks_far_past_their_commit_after_a_restart(ray_cluster, tiny_recipe, tmp_path):
    """A trainer more than ``max_ahead`` steps past its last commit when the coordinator restarts: the new incarnation
    starts at the commit, and refused the trainer's next read as past ``max_ahead`` (a ValueError that ends a
    training job). Now the limit counts from where the old incarnation got (its newest durable checkpoint), and the
    producers restore from there instead of stepping through the gap. (Limit: ranks more than ``max_ahead`` past
    that checkpoint are still refused; checkpoints made during a storage outage are durable only after it.)"""
    reference = _Reference.get(tiny_recipe)
    svc = _service(tiny_recipe, tmp_path, "far-past-commit", max_ahead=8)
    try:
        for step in range(30):
            svc.slice(step, 0, 1, track=True)
        svc.commit(2)
        deadline = time.monotonic() + 60  # the old incarnation's checkpoints of these steps are durable
        while svc.status()["checkpoints"]["unwritten"] or svc.status()["checkpoints"]["latest"] < 28:
            assert time.monotonic() < deadline, svc.status()["checkpoints"]
            time.sleep(0.2)
        _kill_coordinator(svc, wait_for_restart=True)  # the process's cached steps are dropped by the failed reads
        for step in range(30, 34):
            box = _bounded(f"slice({step})", lambda step=step: svc.slice(step, 0, 1, track=True), 60)
            assert "error" not in box, box.get("error")
            assert np.array_equal(box["value"].tokens, reference[step].tokens), step
        start = svc.status()["start"]
        assert start["restarted"] and start["start_step"] == 2
    finally:
        svc.stop()


@pytest.mark.heavy
def test_regression_an_untracked_read_past_the_window_after_a_producer_kill(ray_cluster, tiny_recipe, tmp_path):
    """Found by the long fuzz run: a consumer reads step 14, so producers make steps up to 17; a producer is killed
    -9 (its steps leave the table) and the consumer's rank at another world size reads step 3, so the live window
    shrinks to [3, 7). An untracked read of step 14 then waited for producers that no longer would make it (the
    service took "submitted once" for "on its way") until its 60 s timeout. Now it is replayed."""
    reference = _Reference.get(tiny_recipe)
    svc = _service(tiny_recipe, tmp_path, "untracked-after-kill")
    try:
        svc.slice(14, 0, 16, track=True)
        wait_until(lambda: 17 in svc.status()["window"]["held_steps"], 60, lambda: "producers making step 17")
        pid = next(p["pid"] for p in svc.status()["producers"] if p["pid"])
        os.kill(pid, signal.SIGKILL)
        svc.slice(3, 0, 2, track=True)
        box = _bounded("slice(14, 3, 4, track=False)", lambda: svc.slice(14, 3, 4, track=False), 45)
        assert "error" not in box, box.get("error")
        want = reference[14].slice(3, 4)
        assert np.array_equal(box["value"].tokens, want.tokens) and np.array_equal(
            box["value"].positions, want.positions
        )
    finally:
        svc.stop()
