"""GlobalBatchSource: global batch s is a pure function of (recipe, s), for every access order and process."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import numpy as np
import oracle
import pytest
from conftest import TINY
from zephon import Pipeline
from zephon.io import Dataset
from zephon.work import MixtureSpec, StaticMixtureWorkSource

from zephon_ray import GlobalBatchSource
from zephon_ray.source import unpacked_state

STEPS = 6


def plain_zephon_rank(recipe, rank: int, world: int, tmp_path):
    """An independent Zephon rank r of W, built straight from Zephon's API (not through zephon_ray.pipeline), with
    the oracle's byte tokenizer (tests/oracle.py), not ours."""
    work = StaticMixtureWorkSource(
        [Dataset.from_path(s.name, str(s.path)) for s in recipe.sources],
        MixtureSpec({s.name: s.weight for s in recipe.sources}),
        chunk_size=recipe.chunk_size,
        seed=recipe.seed,
        shuffle_shards=True,
        shuffle_within_shard=True,
        exhausted_policy="repeat",
    )
    pipeline = (
        Pipeline(work)
        .decode_text()
        .tokenize(tokenizer=oracle.OracleByteTokenizer(), field="text", return_tensors="np", add_attention_mask=False)
        .pack_flat(max_length=recipe.seq_len + 1, algorithm="wrap", pad_token_id=258)
        .batch(recipe.rows_per_microbatch)
    )
    return pipeline.options(
        canonical_replicas=recipe.lanes,
        world_size=world,
        global_rank=rank,
        dp_degree=world,
        dp_group_id=rank,
        flush_every_k_chunks=recipe.flush_every_k_chunks,
        runner="threads",
        aggregate_dir=str(tmp_path / "agg"),
        run_id="plain-zephon-check",
    )


def row_multiset(tokens: np.ndarray) -> collections.Counter:
    return collections.Counter(row.tobytes() for row in np.asarray(tokens, dtype=np.int32))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_slices_match_independent_plain_zephon_ranks(tiny_recipe, world, tmp_path):
    recipe = tiny_recipe
    per_step = recipe.microbatches_per_lane * recipe.lanes // world  # microbatches a rank yields per step
    with GlobalBatchSource(recipe) as source:
        batches = [source.batch(s) for s in range(STEPS)]
    for rank in range(world):
        stream = iter(plain_zephon_rank(recipe, rank, world, tmp_path))
        try:
            for step in range(STEPS):
                mbs = [next(stream) for _ in range(per_step)]
                rows = np.stack([rec.payload["input_ids"] for mb in mbs for rec in mb.records])
                ours = batches[step].slice(rank, world)
                assert row_multiset(rows) == row_multiset(ours.tokens), f"step {step} rank {rank}/{world}"
                assert ours.num_rows == recipe.global_batch_rows // world
        finally:
            stream.close()


def test_fresh_runs_agree_and_steps_differ(tiny_recipe, reference_digests):
    with GlobalBatchSource(tiny_recipe) as source:
        assert [source.batch(s).digest for s in range(24)] == reference_digests[:24]
    assert len(set(reference_digests)) == len(reference_digests)


@pytest.mark.parametrize("resume_at", [1, 5, 13])
def test_restore_from_ring_then_continue(tiny_recipe, reference_digests, resume_at):
    with GlobalBatchSource(tiny_recipe, checkpoint_every=1) as first:
        for s in range(resume_at + 3):
            first.batch(s)
        state = unpacked_state(first._checkpoints[resume_at])
    with GlobalBatchSource(tiny_recipe) as second:
        second._stepper.restore(state)
        assert second.position == resume_at
        got = [second.batch(s).digest for s in range(resume_at, 20)]
    assert got == reference_digests[resume_at:20]


@pytest.mark.heavy
def test_reverse_and_interleaved_random_access(tiny_recipe, reference_digests):
    with GlobalBatchSource(
        tiny_recipe, checkpoint_every=2, recent_checkpoints=3, anchor_every=4, cache_steps=1
    ) as source:
        for s in reversed(range(10)):
            assert source.batch(s).digest == reference_digests[s], s
        for s in [7, 2, 9, 2, 15, 0, 11, 3, 3, 20, 1, 23]:
            assert source.batch(s).digest == reference_digests[s], s


def test_far_ahead_then_back(tiny_recipe, reference_digests):
    with GlobalBatchSource(tiny_recipe, checkpoint_every=4, recent_checkpoints=2, anchor_every=8) as source:
        assert source.batch(23).digest == reference_digests[23]
        assert source.batch(0).digest == reference_digests[0]
        assert source.batch(17).digest == reference_digests[17]


def test_batch_contents_and_composition(tiny_recipe):
    with GlobalBatchSource(tiny_recipe) as source:
        batch = source.batch(3)
    recipe = tiny_recipe
    assert batch.tokens.shape == (recipe.global_batch_rows, recipe.row_length)
    assert batch.tokens.dtype == np.int32 and not batch.tokens.flags.writeable
    assert list(batch.lanes) == [lane for lane in range(recipe.lanes) for _ in range(recipe.rows_per_lane)]
    assert sum(batch.source_tokens.values()) == batch.tokens.size
    assert set(batch.source_tokens) == {"prose", "code"} and all(v > 0 for v in batch.source_tokens.values())
    # positions restart at 0 at every document start inside a packed row
    assert (batch.positions[:, 1:] - batch.positions[:, :-1] <= 1).all()


def test_checkpoint_ring_is_bounded(tiny_recipe):
    with GlobalBatchSource(tiny_recipe, checkpoint_every=2, recent_checkpoints=3, anchor_every=8) as source:
        source.batch(23)
        assert sorted(source._checkpoints) == [0, 8, 16, 18, 20, 22, 24]


def test_kept_checkpoints_cost_kilobytes_not_their_decoded_size(tiny_recipe, reference_digests):
    """Kept checkpoints are held packed: 24 more anchors add about 0.3 MB to what the source keeps (the bound is
    50 KB each), where decoded states took 4.0 MB at these early steps (about 500 KB each by step 5,000:
    benchmarks/bench_source_memory.py), and a step behind is still restored from them."""
    import tracemalloc

    with GlobalBatchSource(tiny_recipe, checkpoint_every=8, recent_checkpoints=1, anchor_every=8) as source:
        source.batch(16)  # the pipeline's buffers fill before tracing starts
        tracemalloc.start(1)
        try:
            before = tracemalloc.take_snapshot()
            source.batch(16 + 8 * 24)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        assert len(source._checkpoints) >= 24 + 3
        kept = sum(
            stat.size_diff
            for stat in after.compare_to(before, "filename")
            if stat.traceback[0].filename.endswith(("json/decoder.py", "zephon_ray/source.py"))
        )
        assert kept < 24 * 50_000, f"{kept / 2**20:.1f} MB kept for 24 anchors"
        assert [source.batch(s).digest for s in (5, 13)] == [reference_digests[5], reference_digests[13]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"checkpoint_every": 0},
        {"anchor_every": 12, "checkpoint_every": 8},
        {"cache_steps": -1},
        {"recent_checkpoints": 1.5},
    ],
)
def test_rejects_bad_settings(tiny_recipe, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GlobalBatchSource(tiny_recipe, **kwargs)


def test_rejects_bad_steps(tiny_recipe):
    with GlobalBatchSource(tiny_recipe) as source:
        for bad in (-1, 1.5, "3", True):
            with pytest.raises(ValueError, match="step"):
                source.batch(bad)


def test_two_processes_with_different_hash_seeds_agree(reference_digests):
    outputs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-m", "zephon_ray.cli", "digest", str(TINY), "--steps", "0:8"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
        outputs.append(out)
    assert outputs[0] == outputs[1]
    assert outputs[0].splitlines() == [f"step {s} {d}" for s, d in enumerate(reference_digests[:8])]
