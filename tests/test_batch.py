"""GlobalBatch: the documented digest, contiguous slices and TorchTitan microbatches."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from zephon_ray import GlobalBatchSource, compute_digest
from zephon_ray.batch import GlobalBatch, RankSlice, padded_rows, slice_bounds, valid_tokens


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


def test_every_world_from_1_to_B_tiles_the_batch_with_the_documented_ranges(batch):
    """For every W in [1, B]: rank r holds rows [floor(r*B/W), floor((r+1)*B/W)) of the batch, computed here from
    the documented formula (not from slice_bounds), and the W slices joined in rank order are the batch."""
    B = batch.num_rows
    for world in range(1, B + 1):
        parts = [batch.slice(rank, world) for rank in range(world)]
        for rank, part in enumerate(parts):
            lo, hi = (rank * B) // world, ((rank + 1) * B) // world
            assert np.array_equal(part.tokens, batch.tokens[lo:hi])
            assert np.array_equal(part.positions, batch.positions[lo:hi])
            assert part.global_valid_tokens == batch.valid_tokens
        assert np.array_equal(np.concatenate([p.tokens for p in parts]), batch.tokens)
        assert np.array_equal(np.concatenate([p.positions for p in parts]), batch.positions)
        assert {p.num_rows for p in parts} <= {B // world, -(-B // world)}


def test_a_world_dividing_B_keeps_the_even_split(batch):
    """When W divides B the split is the one every digest, golden and saved state was made with: B/W rows each."""
    for world in (1, 2, 4, 8, 16):
        assert [batch.slice(r, world).num_rows for r in range(world)] == [batch.num_rows // world] * world
        assert [slice_bounds(16, r, world) for r in range(world)] == [
            (r * 16 // world, (r + 1) * 16 // world) for r in range(world)
        ]


@pytest.mark.parametrize("rank,world", [(3, 3), (2, 2), (-1, 2), (0, 0), (0, 17), (0, True), (0.5, 2)])
def test_bad_slices_are_rejected(batch, rank, world):
    with pytest.raises(ValueError):
        batch.slice(rank, world)


def test_slice_bounds():
    assert slice_bounds(16, 3, 4) == (12, 16)
    assert [slice_bounds(24, r, 5) for r in range(5)] == [(0, 4), (4, 9), (9, 14), (14, 19), (19, 24)]
    with pytest.raises(ValueError, match="a world of 17 ranks exceeds the global batch of 16 rows"):
        slice_bounds(16, 0, 17)


def test_padded_rows():
    assert padded_rows(24, 5) == 5 and padded_rows(24, 5, 2) == 6 and padded_rows(24, 4, 1) == 6
    assert padded_rows(56 * 18 + 16, 56) == 19  # B = 1,024 rows on 56 ranks: 16 ranks of 19, 40 of 18


def test_padding_rows_never_reach_the_loss_and_keep_the_real_rows(batch):
    """A slice padded to equal shapes: the real rows come first and unchanged; every padding label is ignored, so
    a summed cross-entropy over the padded microbatches equals the unpadded one, and the slice's digest (its real
    rows) is unchanged."""
    part = batch.slice(1, 5)  # 3 rows of 16 at W = 5 (floor/ceil: 3 or 4)
    assert part.num_rows == 3
    before = compute_digest(part.tokens, part.positions)
    plain = list(part.microbatches(1))
    padded = list(part.microbatches(2, pad_to=4))
    assert len(plain) == 3 and len(padded) == 2
    tokens = torch.cat([mb[0]["input"] for mb in padded])
    labels = torch.cat([mb[1] for mb in padded])
    assert tokens.shape == (4, batch.tokens.shape[1] - 1)
    assert torch.equal(tokens[:3], torch.cat([mb[0]["input"] for mb in plain]))
    assert torch.equal(labels[:3], torch.cat([mb[1] for mb in plain]))
    assert (labels[3] == -100).all()
    logits = torch.randn(4, tokens.shape[1], 7)
    summed = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 7), (labels % 7).where(labels >= 0, labels).reshape(-1), ignore_index=-100, reduction="sum"
    )
    real = torch.nn.functional.cross_entropy(logits[:3].reshape(-1, 7), (labels[:3] % 7).reshape(-1), reduction="sum")
    assert torch.allclose(summed, real)
    assert compute_digest(part.tokens, part.positions) == before
    with pytest.raises(ValueError, match="pad_to 2 is less than"):
        next(part.microbatches(1, pad_to=2))


def test_valid_tokens_count_the_labels_that_reach_the_loss(batch):
    assert batch.valid_tokens == batch.num_rows * (batch.tokens.shape[1] - 1)  # 'wrap' packing: every label
    tokens = np.array([[5, 6, 9, 9], [9, 1, 2, 3]], dtype=np.int32)
    assert valid_tokens(tokens, pad_token_id=9) == 4 and valid_tokens(tokens, None) == 6


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
    ((_, labels),) = RankSlice(0, 0, 1, tokens, positions, pad_token_id=9).microbatches(1)
    assert labels.tolist() == [[6, -100, -100]]


def test_global_batch_is_frozen(batch):
    assert isinstance(batch, GlobalBatch)
    with pytest.raises(ValueError):
        batch.tokens[0, 0] = 1


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 11, 16])
def test_slice_from_lanes_is_the_global_batch_slice(batch, tiny_recipe, world):
    """``RankSlice.from_lanes`` (the service client and local mode) cuts exactly ``GlobalBatch.slice``'s rows,
    whether a rank reads several lanes (W < L) or part of one (W > L)."""
    from types import SimpleNamespace

    from zephon_ray.batch import lane_span

    per = tiny_recipe.rows_per_lane
    shards = [
        SimpleNamespace(
            tokens=batch.tokens[l * per : (l + 1) * per], positions=batch.positions[l * per : (l + 1) * per]
        )
        for l in range(tiny_recipe.lanes)
    ]
    for rank in range(world):
        span = lane_span(tiny_recipe.lanes, per, rank, world)
        got = RankSlice.from_lanes(batch.step, rank, world, span, [shards[l] for l in span.lanes])
        want = batch.slice(rank, world)
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.positions, want.positions)
        assert not got.tokens.flags.writeable
    with pytest.raises(ValueError, match="expected the shards of lanes"):
        RankSlice.from_lanes(0, 0, 1, lane_span(tiny_recipe.lanes, per, 0, 1), shards[:1])
