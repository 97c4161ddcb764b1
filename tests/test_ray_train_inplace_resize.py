"""In-place elastic resize inside ONE Ray Train ``fit()`` keeps every global batch identical, and a restart in the
middle of a step never logs a wrong digest.

The loop is ``examples/bigram.py`` reading ``ray.train.get_dataset_shard`` (``ZephonDataConfig.configure`` runs
again for the W=4 group). A private simulated multi-node cluster (``ray.cluster_utils.Cluster``) starts with a
2-CPU head node, so that only the minimum of ``ScalingConfig(num_workers=(2, 4))`` fits (1 CPU per worker).

The resize is triggered by a condition, not by racing Ray Train's monitor: both W=2 ranks hold step ``HOLD``
(``train_helpers.HoldForRestart``: after the all-reduce and the optimizer step, before the digest gather) and the
driver adds a second 2-CPU node only once they hold. Ray Train's elastic policy notices the node
(``elastic_resize_monitor_interval_s``), destroys the process group in every worker, and restarts the group at W=4
from the latest registered checkpoint (step HOLD - 1: checkpoints every 2 steps), all within the same ``fit()``.
So the schedule is fixed: steps 0 .. HOLD-1 at W=2, then HOLD-1 .. STEPS-1 at W=4 (step HOLD-1 replayed). The
held step's digest is gathered from the destroyed group: issue 30's failure, where ``global_digest`` returned rank
0's rows alone as the global digest; it must refuse instead, so no W=2 record of step HOLD exists. Every record,
replays included, carries the in-process reference digest of its step (recipes/elastic.toml: 12 lanes, B = 24
rows, so W = 2 and W = 4 both divide), and every rank's slice, digested at the end of every step and again after
the teardown, is the reference slice. The only time bound is the hold's (``HOLD_TIMEOUT_S``, far above the ~25 s
Ray Train takes here to act on a new node).

The driver runs in a spawned process of its own: a pytest process can hold only one Ray connection, and the
session ``ray_cluster`` fixture may already own it when the slow tests run together.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import golden_digests, run_spawned_driver
from zephon_ray import GlobalBatchSource, Recipe, compute_digest

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "elastic.json").read_text())["digests"].items()}
STEPS = 16
HOLD = 11  # odd: the restart resumes from the checkpoint at HOLD - 1 and replays that step
HOLD_TIMEOUT_S = 300.0
MIN_W, MAX_W = 2, 4
MONITOR_S = 5.0  # Ray's default resize check is every 60 s: far too slow for a test
DRIVER_TIMEOUT_S = 480


def _drive(work: str, log: str, summary: str) -> None:
    """The driver (in a spawned process): start the cluster, fit() elastically, add a node once the W=2 ranks hold
    step HOLD."""
    import ray
    from train_helpers import HoldForRestart, fit_bigram

    from tests.ray_clusters import checkout_pythonpath, local_cluster
    from zephon_ray.integrations.ray_train import ZephonDataset

    info: dict = {}
    try:
        with local_cluster("zr-inplace-", {"num_cpus": MIN_W}) as (cluster, temp_dir):
            info["temp_dir"] = temp_dir
            ray.init(
                address=cluster.address,
                namespace="zr-inplace-resize",
                log_to_driver=False,
                runtime_env={"env_vars": {"PYTHONPATH": checkout_pythonpath()}},
            )

            def train() -> None:
                try:
                    result = fit_bigram(
                        ZephonDataset(ELASTIC),
                        workers=(MIN_W, MAX_W),
                        name="inplace",
                        storage_path=str(Path(work) / "ray-results"),
                        log_path=log,
                        steps=STEPS,
                        run_id="inplace",
                        cpu_per_worker=1.0,
                        elastic_resize_monitor_interval_s=MONITOR_S,
                        before_digest=HoldForRestart(HOLD, MIN_W, work, HOLD_TIMEOUT_S),
                    )
                    info["error"] = None if result.error is None else repr(result.error)
                except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
                    info["error"] = repr(exc)
                info["fit_end"] = time.time()

            # fit() runs in a thread: Cluster.add_node() installs signal handlers, so it must run in the main thread.
            trainer = threading.Thread(target=train, daemon=True)
            info["fit_start"] = time.time()
            trainer.start()
            holding = [Path(work, f"holding.r{r}") for r in range(MIN_W)]
            while trainer.is_alive() and not all(p.exists() for p in holding):
                time.sleep(0.2)
            if trainer.is_alive():
                info["hold_seen"] = time.time()
                cluster.add_node(num_cpus=MAX_W - MIN_W, temp_dir=temp_dir)
                info["node_added"] = time.time()
            trainer.join()
    except BaseException as exc:  # noqa: BLE001 - the driver reports everything to the test
        info.setdefault("error", repr(exc))
    finally:
        Path(summary).write_text(json.dumps(info))


def _slices(work: Path) -> list[dict]:
    path = work / "slices.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_inplace_upsize_in_one_fit_keeps_global_batches(tmp_path):
    from examples.torchtitan_ray_train import read_log

    with GlobalBatchSource(Recipe.from_toml(ELASTIC)) as source:
        batches = [source.batch(s) for s in range(STEPS)]
        digests = [b.digest for b in batches]
        slice_digests = {
            (s, r, w): compute_digest(part.tokens, part.positions)
            for s, b in enumerate(batches)
            for w in (MIN_W, MAX_W)
            for r in range(w)
            for part in [b.slice(r, w)]
        }
    assert digests == golden_digests(ELASTIC)[:STEPS]  # the in-process reference is the oracle's
    assert all(digests[s] == GOLDEN[s] for s in GOLDEN if s < STEPS)  # the reference is the oracle's

    log, summary = str(tmp_path / "steps.jsonl"), tmp_path / "summary.json"
    info = run_spawned_driver(
        _drive,
        (str(tmp_path), log, str(summary)),
        summary,
        DRIVER_TIMEOUT_S,
        detail=lambda: f"; records: {read_log(log)}",
    )
    records = read_log(log)
    assert info.get("error") is None, info["error"]
    assert "node_added" in info, f"training ended before the ranks held step {HOLD}: {records}"

    # The global batch of every step, replays included, is the in-process reference; the held step's digest,
    # gathered from a destroyed process group, was refused rather than logged.
    for r in records:
        assert r["digest"] == digests[r["step"]], r

    # The schedule is fixed by the hold: steps 0..HOLD-1 at W=2, then (after the node joined) a new W=4 group
    # resuming from the checkpoint at HOLD-1, all in this one fit().
    steps_worlds = [(r["step"], r["world"]) for r in records]
    assert steps_worlds == [(s, MIN_W) for s in range(HOLD)] + [(s, MAX_W) for s in range(HOLD - 1, STEPS)], (
        steps_worlds
    )
    assert records[HOLD]["time"] > info["node_added"] > info["hold_seen"]
    assert records[HOLD - 1]["pid"] != records[HOLD]["pid"]  # rank 0 was restarted

    # Every rank's slice at the end of every step, and after the teardown, is the reference slice.
    audit = _slices(tmp_path)
    for a in audit:
        assert a["digest"] == slice_digests[(a["step"], a["rank"], a["world"])], a
    held = {(a["rank"], a["phase"]) for a in audit if a["step"] == HOLD and a["world"] == MIN_W}
    assert {(r, "end") for r in range(MIN_W)} <= held, sorted(held)
    trained = {(a["step"], a["rank"], a["world"]) for a in audit if a["phase"] == "end"}
    assert trained >= {(s, r, MIN_W) for s in range(HOLD + 1) for r in range(MIN_W)} | {
        (s, r, MAX_W) for s in range(HOLD - 1, STEPS) for r in range(MAX_W)
    }
