"""Shared fixtures and helpers: the tiny recipe and its golden digests, a private local Ray cluster that the tests
start and stop themselves, the S3 server (``s3``), rank threads (``run_ranks``, ``run_readers``), a bounded poll
(``wait_until``) and the one-line error check (``one_line``). Their own Ray clusters: tests/ray_clusters.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Ray Train's controller polls its worker group every 2 s by default, so each fit() waits a few seconds to see that
# the group started and that it finished. Polling every 0.25 s changes no batch and takes about 6 s off each
# examples/ray_train_quickstart.py run here (38-42 s vs 45-48 s). The private Rays, spawned drivers and subprocesses
# the tests start inherit it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Ray exports application metrics every 10 s by default; tests/test_metrics.py scrapes them, and waits less at 2 s.
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")

# One intra-op thread per process: three pytest workers already share two cores, and torch's OpenMP threads in each
# torchrun rank, DDP rank and in-process model only spin against each other. Alone, the TorchTitan resume and the
# uneven-gradient tests took 29.2 CPU-s and 50 s at torch's default, 21.6 CPU-s and 41 s at 1 (their losses within
# the same tolerances; the command: docs/benchmarks.md, "The test suite"). Ray already gives its workers 1 unless
# told otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A driver's first connection makes Ray prestart idle Python workers, one per logical CPU (8 on a session Ray here).
# Off: workers start when an actor or task needs one, and no idle worker costs CPU meanwhile.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

# No Ray call in a test process ever starts a Ray of its own. Ray's default starts a fresh local one for a call made
# while none is initialised: a rank thread that a timed-out test left behind, calling its service after the test's
# cluster was shut down, started one inside the pytest worker, which then died (the slow set's loader fuzz). Every
# test reaches its cluster through an explicit ray.init; subprocesses keep Ray's default.
import ray._private.auto_init_hook as _ray_auto_init  # after the environment above: Ray reads some of it

_ray_auto_init.enable_auto_connect = False

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
TINY = RECIPES / "tiny.toml"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """`make test` runs three pytest-xdist workers with ``--dist loadgroup``. The tests on a worker's private session
    Ray (they use ``ray_cluster``, or are marked ``session_ray``) are grouped by module, so a module's fixtures (a
    service, a materialised dataset) are built once and the modules spread over the workers; each worker starts
    its session Ray once, when it first needs it. Those that start a Ray or a process tree of their own (marked
    ``spawns``, or ``slow``) run one after another in one group, so at most three Rays are busy at once
    (docs/benchmarks.md, "The test suite")."""
    for item in items:
        if "ray_cluster" in item.fixturenames or item.get_closest_marker("session_ray"):
            item.add_marker(pytest.mark.xdist_group(f"session-ray:{item.module.__name__}"))
        elif any(item.get_closest_marker(m) for m in ("spawns", "slow")):
            item.add_marker(pytest.mark.xdist_group("spawns"))


@pytest.fixture(scope="session")
def tiny_recipe():
    from zephon_ray import Recipe

    return Recipe.from_toml(TINY)


def golden_digests(recipe_path) -> list[str]:
    """The committed golden digests of steps 0..169 of a recipe (tests/golden/, made by the independent oracle
    tests/oracle.py from Zephon's public API; tests/test_oracle.py checks they are the oracle's here)."""
    import oracle

    return oracle.load_golden(recipe_path)["digests"]


@pytest.fixture(scope="session")
def reference_digests():
    """Per-step digests of the tiny recipe, steps 0..169: the committed goldens every test compares with."""
    return golden_digests(TINY)


RAY_START_TIMEOUT = "The current node timed out during startup"
"""Ray's own message when its raylet does not register within a fixed 30 s (ray/_private/node.py, not
configurable): seen once, from a fresh clone on an overloaded afternoon (the suite took 913 s instead of 607-691)."""


def init_ray_retrying_start_timeout(**kwargs) -> None:
    """``ray.init(**kwargs)``; once more if it hit Ray's fixed start-up timeout (:data:`RAY_START_TIMEOUT`), which is
    the machine's load, not the code under test: a worker's session Ray failing to start would fail every test of
    that worker. The processes the failed start left (GCS, raylet, reaper: children of this process started during
    the attempt) are killed first. Any other error is raised."""
    import psutil
    import ray

    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}
    try:
        ray.init(**kwargs)
        return
    except Exception as exc:
        if RAY_START_TIMEOUT not in str(exc):
            raise
    left = [child for child in me.children(recursive=True) if child.pid not in before]
    for child in left:
        child.kill()
    psutil.wait_procs(left, timeout=30)
    ray.shutdown()
    print(f"Ray did not start within its fixed 30 s; killed {len(left)} process(es) it left and starting it again")
    ray.init(**kwargs)


@pytest.fixture(scope="session")
def ray_cluster():
    """A private Ray cluster for this test session; never attaches to a cluster someone else started.

    Logical CPUs are oversubscribed (8 on a 2-core machine) and actors ask for fractions, so a Ray Data or
    Train job cannot starve behind actors holding every CPU (docs/troubleshooting.md, "A hang, not an error").
    """
    import ray

    temp_dir = tempfile.mkdtemp(prefix="zr-ray-", dir="/tmp")
    # Workers import tests/ and examples/ from this checkout. The raylet passes its own environment on to the workers
    # it starts, so PYTHONPATH is set while ray.init starts it, not as a runtime_env: a job with a runtime_env starts
    # every worker through Ray's setup_worker.py and its runtime-env agent: 0.90 CPU-s an actor instead of 0.51
    # (benchmarks/ray_actor_start_cost.py; docs/benchmarks.md, "The test suite").
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + pythonpath if pythonpath else "")
    try:
        init_ray_retrying_start_timeout(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            _temp_dir=temp_dir,
            namespace="zephon-ray-tests",
            log_to_driver=False,
        )
    finally:
        if pythonpath is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = pythonpath
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def run_spawned_driver(target, args: tuple, summary: Path, timeout_s: float, detail=lambda: "") -> dict:
    """Run ``target(*args)`` in a fresh "spawn" process, which has a Ray session of its own (a
    ``ray.cluster_utils.Cluster``, say) apart from the ``ray_cluster`` fixture's, and return the JSON it wrote to
    ``summary``. A driver still running after ``timeout_s`` is terminated and the test fails; ``detail()`` adds
    context to either failure."""
    import json
    import multiprocessing

    driver = multiprocessing.get_context("spawn").Process(target=target, args=args)
    driver.start()
    driver.join(timeout_s)
    if driver.is_alive():
        driver.terminate()
        driver.join(30)
        pytest.fail(f"the driver did not finish within {timeout_s} s{detail()}")
    assert summary.is_file(), f"the driver exited with code {driver.exitcode} and wrote no summary{detail()}"
    return json.loads(summary.read_text())


class RankThreads:
    """``fn(rank)`` for every rank of ``world``, each in a daemon thread, started at once (the readers of one job: a
    local-mode checkpoint with W > 1 is collective, so they must run side by side). :meth:`join` waits for them and
    returns their results in rank order, re-raising the first error; ``errors`` shows the errors so far, for a test
    that watches the ranks while they run."""

    def __init__(self, world: int, fn) -> None:
        import threading

        self.errors: list[BaseException] = []
        self.results: list = [None] * world

        def guarded(rank: int) -> None:
            try:
                self.results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - re-raised by join(), in the test's thread
                self.errors.append(exc)

        self._threads = [
            threading.Thread(target=guarded, args=(r,), daemon=True, name=f"rank-{r}") for r in range(world)
        ]
        for thread in self._threads:
            thread.start()

    def join(self, timeout_s: float = 300, detail=lambda: "") -> list:
        import time

        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.errors:
            raise self.errors[0]
        running = [r for r, thread in enumerate(self._threads) if thread.is_alive()]
        if running:
            pytest.fail(f"rank(s) {running} still running after {timeout_s:.0f} s{detail()}\n{self.stacks()}")
        return self.results

    def stacks(self) -> str:
        """Where every live thread of this process is now (the rank threads and the streams' prefetch threads):
        a hang's failure shows what each rank waits for."""
        import sys
        import threading
        import traceback

        frames = sys._current_frames()
        return "\n".join(
            f"--- thread {thread.name}:\n{''.join(traceback.format_stack(frames[thread.ident]))}"
            for thread in threading.enumerate()
            if thread.ident in frames and thread.name.startswith(("rank-", "zephon-ray"))
        )


def run_ranks(world: int, fn, timeout_s: float = 300, detail=lambda: "") -> list:
    """Run ``fn(rank)`` for every rank of ``world`` in threads at once (:class:`RankThreads`); their results in rank
    order, or the first error re-raised, or a failure naming the ranks still running after ``timeout_s`` (with
    ``detail()``, say the service's status, and every rank's stack)."""
    return RankThreads(world, fn).join(timeout_s, detail)


def run_readers(loaders: list, body, state: dict | None = None, timeout_s: float = 300, detail=lambda: "") -> list:
    """The readers of one job, one loader a rank (rank order), at once (:func:`run_ranks`): each loads ``state`` when
    given (a JSON copy, as a checkpoint gives it back), runs ``body(rank, loader)`` and is closed (on an error too);
    the bodies' results in rank order."""
    import json

    def read(rank: int):
        loader = loaders[rank]
        try:
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            return body(rank, loader)
        finally:
            loader.close()

    return run_ranks(len(loaders), read, timeout_s, detail)


def wait_until(predicate, timeout_s: float, what, interval_s: float = 0.1):
    """Poll ``predicate()`` until it returns something true, and return that; after ``timeout_s`` fail with one line:
    ``what`` (a string, or a callable giving one: the state seen last) was not reached."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            pytest.fail(f"not within {timeout_s:.0f} s: {what() if callable(what) else what}")
        time.sleep(interval_s)


def one_line(exc: BaseException, *needles: str) -> str:
    """The error's message, checked to be one line, free of a traceback, and to contain each of ``needles``."""
    message = str(exc)
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.fixture(scope="module")
def s3():
    """The session's S3 API server (tests/s3_server.py), started; the faults a module's tests left are cleared at
    its end. A module whose session Ray workers must reach it calls ``s3_server.configure_environment()`` when
    collected, before any Ray starts (they inherit the endpoint)."""
    from tests import s3_server

    server = s3_server.server()
    yield server
    server.faults.clear()


def tiny_bucket(s3, prefix: str, recipes=(TINY,)) -> str:
    """A new bucket holding the tiny recipe's data under recipes/data/tiny and ``recipes`` under recipes/ (the
    checkout's layout)."""
    name = s3.new_bucket(prefix)
    s3.upload_tree(RECIPES / "data" / "tiny", name, "recipes/data/tiny")
    for recipe in recipes:
        s3.client().upload_file(str(recipe), name, f"recipes/{Path(recipe).name}")
    return name
