"""A step's rows never change while anyone holds them, in every mode (issue 30's guarantee; ``RankSlice``'s docstring).

A reader group (W = 2 threads) takes step ``HELD`` and keeps its ``StepBatch``, then reads ``DEPTH + 3`` later steps
(the prefetch thread builds slices ahead of it), is closed (threads stopped, Zephon pipelines shut down in the
background, service cursors released, Parquet files dropped), the freed memory is collected and reused by fresh
allocations, and a new group at W = 4 restarts from the group's state and reads the held step again. The held
batches are hashed at hand-out and after each of these: the slice's digest and the microbatch tensors never change,
they are the reference's (``GlobalBatchSource``; its digests are the committed goldens of ``tests/oracle.py``), and a
write into a slice raises. Modes: local (an in-process Zephon lane group per reader, collective Zephon checkpoints
through a directory), service, dataset, and torchft (``FtSlices`` with a real ``Manager``: a step that
``should_commit()`` rejects is served again in fresh tensors even after the trainer wrote into the first ones).
A single-lane slice (``RankSlice.from_lanes``'s zero-copy view) keeps its lane shard alive after the stepper that
made it is closed.
"""

from __future__ import annotations

import gc
import hashlib
import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from conftest import run_readers

from zephon_ray import compute_digest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.toml")
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "tiny.json").read_text())["digests"].items()}
HELD = 2
DEPTH = 2
AHEAD = DEPTH + 3  # steps read after the held one: past everything the prefetch thread had made when it was taken
WORLD, RESTART_WORLD = 2, 4


def _tensor_hash(batch) -> str:
    h = hashlib.sha256()
    for inputs, labels in batch.microbatches:
        for t in (inputs["input"], inputs["positions"], labels):
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _hashes(batch) -> tuple[str, str]:
    """(the slice's digest, a hash of the microbatch tensors)."""
    return compute_digest(batch.slice.tokens, batch.slice.positions), _tensor_hash(batch)


@pytest.fixture(scope="module")
def reference(tiny_recipe):
    """(step, rank, world) -> the reference hashes of that reader's StepBatch, from GlobalBatchSource."""
    from zephon_ray import GlobalBatchSource
    from zephon_ray.stream.loader import StepBatch

    out = {}
    with GlobalBatchSource(tiny_recipe) as source:
        for step in range(HELD + AHEAD + 1):
            batch = source.batch(step)
            assert batch.digest == GOLDEN.get(step, batch.digest)
            for world in (1, WORLD, RESTART_WORLD):
                for rank in range(world):
                    piece = batch.slice(rank, world)
                    rows = tiny_recipe.global_batch_rows // world
                    out[step, rank, world] = _hashes(StepBatch(step, piece, list(piece.microbatches(rows))))
    return out


def _reuse_freed_memory() -> None:
    """Let background closes finish, collect garbage, and hand the freed memory out again, written."""
    deadline = time.monotonic() + 30
    for t in threading.enumerate():
        if t.name == "zephon-ray-close":  # LaneStepper.close(background=True): Zephon shutting down
            t.join(max(0.0, deadline - time.monotonic()))
    gc.collect()
    junk = [np.full((16, 65), -7, dtype=np.int32) for _ in range(4000)]
    junk += [np.full((8, 65), -7, dtype=np.int64) for _ in range(4000)]
    del junk
    gc.collect()


def _readers(config, world: int, body) -> list:
    """``body(loader)`` in ``world`` reader threads (a local-mode checkpoint with W > 1 is collective); results in
    rank order; every loader is closed when its body returns."""
    from zephon_ray.stream.loader import Loader

    loaders = [Loader(config, rank=r, world=world) for r in range(world)]
    results = run_readers(loaders, lambda r, loader: body(loader))
    assert all(r is not None for r in results), "a reader did not finish"
    return results


def _hold_through_close_prefetch_and_restart(make_config, reference) -> None:
    def first_group(loader):
        it = iter(loader)
        for _ in range(HELD):
            next(it)
        state = loader.state_dict()  # at step HELD: the restart point (collective in local mode)
        held = next(it)
        at_handout = _hashes(held)
        with pytest.raises(ValueError, match="read-only"):
            held.slice.tokens[0, 0] = 1
        for _ in range(AHEAD):  # the prefetch thread makes slices of later steps meanwhile
            next(it)
        return held, at_handout, _hashes(held), json.loads(json.dumps(state))

    groups = _readers(make_config(0), WORLD, first_group)
    _reuse_freed_memory()  # every loader is closed now
    states = {json.dumps(g[3], sort_keys=True) for g in groups}
    assert len(states) == 1, "the readers' states differ"
    state = groups[0][3]

    def restarted(loader):
        loader.load_state_dict(state)
        batch = next(iter(loader))
        return batch.step, _hashes(batch)

    again = _readers(make_config(1), RESTART_WORLD, restarted)
    _reuse_freed_memory()
    for rank, (held, at_handout, after_prefetch, _) in enumerate(groups):
        want = reference[HELD, rank, WORLD]
        assert held.step == HELD and held.slice.rank == rank
        assert at_handout == want, f"rank {rank}: the rows handed out are not the reference's"
        assert after_prefetch == want, f"rank {rank}: the held batch changed while later steps were read"
        assert _hashes(held) == want, f"rank {rank}: the held batch changed after close and restart"
        assert not held.slice.tokens.flags.writeable and not held.slice.positions.flags.writeable
    for rank, (step, hashes) in enumerate(again):
        assert step == HELD and hashes == reference[HELD, rank, RESTART_WORLD]


def test_local_mode_held_batch(reference, tmp_path):
    from zephon_ray.stream.loader import LoaderConfig

    def config(phase: int):
        return LoaderConfig(
            recipe=TINY,
            mode="local",
            run_id="held",
            aggregate_dir=str(tmp_path / f"agg{phase}"),
            prefetch=DEPTH,
            checkpoint_every=HELD,
        )

    _hold_through_close_prefetch_and_restart(config, reference)


@pytest.fixture(scope="module")
def remote_sources(ray_cluster, tiny_recipe, tmp_path_factory):
    """A running service and a materialised directory of the tiny recipe, on the session's private Ray."""
    from zephon_ray import DataService
    from zephon_ray.jobs.materialize import materialize

    work = tmp_path_factory.mktemp("held")
    materialize(
        tiny_recipe, work / "materialized", range(0, HELD + AHEAD + 2), producers=1, segment_steps=8, progress=False
    )
    service = DataService.start(
        TINY, name="held-batches", namespace="zr-held-batches", producers=1, state_dir=str(work / "svc")
    )
    try:
        yield {"service": service, "dataset_dir": str(work / "materialized")}
    finally:
        service.stop()


@pytest.mark.heavy
def test_service_mode_held_batch(reference, remote_sources):
    from zephon_ray.stream.loader import LoaderConfig

    _hold_through_close_prefetch_and_restart(
        lambda phase: LoaderConfig(
            recipe=TINY,
            mode="service",
            service_name="held-batches",
            service_namespace="zr-held-batches",
            run_id="held",
            prefetch=DEPTH,
        ),
        reference,
    )


def test_dataset_mode_held_batch(reference, remote_sources):
    from zephon_ray.stream.loader import LoaderConfig

    _hold_through_close_prefetch_and_restart(
        lambda phase: LoaderConfig(
            recipe=TINY, mode="dataset", dataset_dir=remote_sources["dataset_dir"], prefetch=DEPTH
        ),
        reference,
    )


def test_torchft_held_batch_and_a_rejected_step_served_again(reference, remote_sources):
    """One replica group (a real Lighthouse, TCPStore and Manager over gloo) reads through FtSlices."""
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    from zephon_ray.stream.ft import FtSlices
    from zephon_ray.stream.loader import LoaderConfig

    config = LoaderConfig(recipe=TINY, mode="dataset", dataset_dir=remote_sources["dataset_dir"], prefetch=DEPTH)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=1,
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        replica_id="held",
        lighthouse_addr=lighthouse.address(),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        use_async_quorum=False,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
    )
    try:
        slices = FtSlices(config, manager=manager)
        held = None
        while held is None:
            manager.start_quorum()
            batch = slices.next()
            if batch.step < HELD:
                assert manager.should_commit()
                continue
            held, at_handout = batch, _hashes(batch)
        assert at_handout == reference[HELD, 0, 1]
        # The trainer writes into its tensors, then the step is rejected: served again, the rows are the same.
        ((inputs, labels),) = held.microbatches
        inputs["input"].zero_()
        labels.fill_(-100)
        manager.start_quorum()
        again = slices.next()
        assert slices.served_again == 1 and again.step == HELD
        assert _hashes(again) == reference[HELD, 0, 1], "the step served again is not the rows of the step"
        assert manager.should_commit()
        for _ in range(AHEAD):
            manager.start_quorum()
            slices.next()
            assert manager.should_commit()
        slices.close()
        restarted = FtSlices(config, manager=manager)  # a restarted trainer, at the group's current step
        manager.start_quorum()
        assert restarted.next().step == HELD + 1 + AHEAD
        restarted.close()
        _reuse_freed_memory()
        assert _hashes(again) == reference[HELD, 0, 1]
        assert compute_digest(held.slice.tokens, held.slice.positions) == reference[HELD, 0, 1][0]
        assert not torch.equal(held.microbatches[0][0]["input"], again.microbatches[0][0]["input"])
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def test_a_single_lane_view_keeps_its_shard_alive(tiny_recipe, reference):
    """W = 2L: every rank reads half a lane, a zero-copy view of the lane shard (``RankSlice.from_lanes``)."""
    from zephon_ray import GlobalBatchSource
    from zephon_ray.batch import RankSlice, lane_span
    from zephon_ray.lanes import LaneStepper

    world = 2 * tiny_recipe.lanes
    stepper = LaneStepper(tiny_recipe)
    for _ in range(HELD):
        stepper.next_step()
    shards = stepper.next_step()
    pieces = []
    for rank in range(world):
        span = lane_span(tiny_recipe.lanes, tiny_recipe.rows_per_lane, rank, world)
        pieces.append(RankSlice.from_lanes(HELD, rank, world, span, [shards[lane] for lane in span.lanes]))
    assert all(np.shares_memory(p.tokens, shards[r // 2].tokens) for r, p in enumerate(pieces))  # really views
    with pytest.raises(ValueError, match="read-only"):
        shards[0].tokens[0, 0] = 1
    for _ in range(AHEAD):
        stepper.next_step()
    stepper.close()
    del shards, stepper
    _reuse_freed_memory()
    with GlobalBatchSource(tiny_recipe) as source:
        batch = source.batch(HELD)
    want = [batch.slice(r, world) for r in range(world)]
    for p, w in zip(pieces, want):
        assert compute_digest(p.tokens, p.positions) == compute_digest(w.tokens, w.positions)
        assert not p.tokens.flags.writeable
