"""GlobalBatch: the documented digest, contiguous slices and TorchTitan microbatches."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from zephon_ray import GlobalBatchSource, compute_digest
from zephon_ray.batch import GlobalBatch, RankSlice, slice_bounds


@pytest.fixture(scope="module")
def batch(tiny_recipe):
    with GlobalBatchSource(tiny_recipe) as source:
        return source.batch(2)


def test_digest_is_the_documented_sha256(batch):
    rows, length = batch.tokens.shape
    expected = hashlib.sha256(
        b"zephon-ray/global-batch/v1\n"
        + f"{rows} {length}\n".encode()
        + batch.tokens.astype("<i4").tobytes()
        + batch.positions.astype("<i4").tobytes()
    ).hexdigest()
    assert batch.digest == expected == compute_digest(batch.tokens, batch.positions)


def test_digest_sees_every_token_and_the_row_order(batch):
    tokens = batch.tokens.copy()
    tokens[-1, -1] += 1
    assert compute_digest(tokens, batch.positions) != batch.digest
    assert compute_digest(batch.tokens[::-1], batch.positions[::-1]) != batch.digest


def test_slices_are_contiguous_and_cover_the_batch(batch):
    for world in (1, 2, 4, 8, 16):
        parts = [batch.slice(rank, world) for rank in range(world)]
        assert np.array_equal(np.concatenate([p.tokens for p in parts]), batch.tokens)
        assert {p.num_rows for p in parts} == {batch.num_rows // world}


@pytest.mark.parametrize("rank,world", [(0, 3), (0, 5), (2, 2), (-1, 2), (0, 0)])
def test_bad_slices_are_rejected(batch, rank, world):
    with pytest.raises(ValueError):
        batch.slice(rank, world)


def test_slice_bounds():
    assert slice_bounds(16, 3, 4) == (12, 16)
    with pytest.raises(ValueError, match="does not divide the global batch of 16 rows"):
        slice_bounds(16, 0, 3)


def test_microbatches_are_torchtitan_shaped(batch, tiny_recipe):
    part = batch.slice(1, 2)
    micro = list(part.microbatches(2))
    assert len(micro) == part.num_rows // 2
    inputs, labels = micro[0]
    assert set(inputs) == {"input", "positions"}
    assert inputs["input"].dtype == torch.long and inputs["input"].shape == (2, tiny_recipe.seq_len)
    assert labels.shape == (2, tiny_recipe.seq_len)
    row = torch.from_numpy(part.tokens[0].astype(np.int64))
    assert torch.equal(inputs["input"][0], row[:-1]) and torch.equal(labels[0], row[1:])
    with pytest.raises(ValueError, match="local_batch_size 3 does not divide"):
        next(part.microbatches(3))


def test_padding_is_masked_in_labels():
    tokens = np.array([[5, 6, 9, 9]], dtype=np.int32)
    positions = np.array([[0, 1, 0, 0]], dtype=np.int32)
    (_, labels), = RankSlice(0, 0, 1, tokens, positions, pad_token_id=9).microbatches(1)
    assert labels.tolist() == [[6, -100, -100]]


def test_global_batch_is_frozen(batch):
    assert isinstance(batch, GlobalBatch)
    with pytest.raises(ValueError):
        batch.tokens[0, 0] = 1


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_slice_from_lanes_is_the_global_batch_slice(batch, tiny_recipe, world):
    """``RankSlice.from_lanes`` (the service client and local mode) cuts exactly ``GlobalBatch.slice``'s rows,
    whether a rank reads several lanes (W < L) or part of one (W > L)."""
    from types import SimpleNamespace

    from zephon_ray.batch import lane_span

    per = tiny_recipe.rows_per_lane
    shards = [SimpleNamespace(tokens=batch.tokens[l * per:(l + 1) * per],
                              positions=batch.positions[l * per:(l + 1) * per]) for l in range(tiny_recipe.lanes)]
    for rank in range(world):
        span = lane_span(tiny_recipe.lanes, per, rank, world)
        got = RankSlice.from_lanes(batch.step, rank, world, span, [shards[l] for l in span.lanes])
        want = batch.slice(rank, world)
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.positions, want.positions)
        assert not got.tokens.flags.writeable
    with pytest.raises(ValueError, match="expected the shards of lanes"):
        RankSlice.from_lanes(0, 0, 1, lane_span(tiny_recipe.lanes, per, 0, 1), shards[:1])
