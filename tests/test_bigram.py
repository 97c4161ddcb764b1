"""``examples/bigram.py:global_digest`` over a real 2-rank gloo group, each rank holding its local-mode slice.

* While the group is up, rank 0's gathered digest is the global batch's (the committed golden of
  recipes/elastic.toml, made by tests/oracle.py).
* Ranks at different steps: both ranks refuse, naming the steps (no digest of mixed rows).
* The group torn down in the middle of a step, as Ray Train does it: ``TorchBackend.on_shutdown`` runs
  ``dist.destroy_process_group()`` in every worker from another thread while the training thread is between its
  all-reduce and the digest gather. Both ranks refuse with one line naming the step. Before issue 30's fix rank 0
  returned the digest of its own rows alone (the in-place resize test's wrong step-20 digest), and the slices
  themselves never changed: each rank's rows still hash to the reference after the teardown.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawns  # two processes with a gloo group (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
ELASTIC = str(ROOT / "recipes" / "elastic.toml")
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "elastic.json").read_text())["digests"].items()}
STEP = 2
WORLD = 2


def _rank(rank: int, init: str, aggregate_dir: str, out: str) -> None:
    """One rank: a local-mode loader (its own Zephon lane group), a step's all-reduce, then the digest three ways."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from examples.bigram import global_digest
    from zephon_ray.batch import compute_digest
    from zephon_ray.stream.loader import Loader, LoaderConfig

    def attempt(piece):
        try:
            return {"digest": global_digest(piece)}
        except RuntimeError as exc:
            return {"error": str(exc)}

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    config = LoaderConfig(recipe=ELASTIC, mode="local", run_id="bigram-digest", aggregate_dir=aggregate_dir)
    with Loader(config, rank=rank, world=WORLD) as loader:
        held = {batch.step: batch.slice for _, batch in zip(range(STEP + 2), loader)}
    piece = held[STEP]
    result = {"up": attempt(piece)}
    # rank 1 one step ahead: the gather pairs step STEP with step STEP + 1
    result["skewed"] = attempt(piece if rank == 0 else held[STEP + 1])
    dist.all_reduce(torch.ones(()))  # the loop's loss all-reduce: the group was whole during the step
    teardown = threading.Thread(target=dist.destroy_process_group)  # Ray Train's on_shutdown, another thread
    teardown.start()
    teardown.join()
    result["torn_down"] = attempt(piece)
    result["slice"] = compute_digest(piece.tokens, piece.positions)
    Path(out).write_text(json.dumps(result))


def test_global_digest_refuses_part_of_a_batch(tmp_path):
    from zephon_ray import GlobalBatchSource, Recipe, compute_digest

    with GlobalBatchSource(Recipe.from_toml(ELASTIC)) as source:
        batch = source.batch(STEP)
        expected = [batch.slice(r, WORLD) for r in range(WORLD)]
    assert batch.digest == GOLDEN[STEP]
    ctx = multiprocessing.get_context("spawn")
    outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]
    procs = [
        ctx.Process(target=_rank, args=(r, f"file://{tmp_path}/pg", str(tmp_path / "agg"), str(outs[r])))
        for r in range(WORLD)
    ]
    [p.start() for p in procs]
    [p.join(240) for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a rank failed (see its output above)"
    r0, r1 = (json.loads(o.read_text()) for o in outs)

    assert r0["up"] == {"digest": GOLDEN[STEP]} and r1["up"] == {"digest": None}
    for rank, r in enumerate((r0, r1)):
        assert r["torn_down"] == {
            "error": (
                f"global_digest: step {STEP}, rank {rank} holds a slice of a 2-rank group, but no torch.distributed "
                "process group is up (Ray Train destroys it when it tears the worker group down); no digest is made "
                "from part of the batch"
            )
        }
        # the rows never changed: what the old code digested was rank 0's own 12 rows, not a modified batch
        assert r["slice"] == compute_digest(expected[rank].tokens, expected[rank].positions)

    for r in (r0, r1):
        assert r["skewed"] == {
            "error": (
                f"global_digest: rank {0 if r is r0 else 1} gathered (step, rank, world) "
                f"[({STEP}, 0, 2), ({STEP + 1}, 1, 2)] at step {STEP if r is r0 else STEP + 1}; the ranks are not at "
                "the same step of one group"
            )
        }
