"""zephon_ray.stream.geometry: how any W in [1, B] cuts a step, padded or not, and the trainer checks."""

from __future__ import annotations

import pytest

from zephon_ray.stream.geometry import TrainerMismatchError, check_geometry, check_global_batch_setting


def shape(recipe, world, lbs=0, *, pad=False, gbs=None):
    return check_geometry(
        recipe, global_batch_size=gbs, local_batch_size=lbs, dp_world_size=world, seq_len=None, pad=pad
    )


def test_every_world_up_to_B_is_served_and_padding_makes_equal_shapes(tiny_recipe):
    B = tiny_recipe.global_batch_rows
    for world in range(1, B + 1):
        plain = shape(tiny_recipe, world)
        rows = [plain.rows(r) for r in range(world)]
        assert sum(rows) == B and max(rows) - min(rows) <= 1
        assert [plain.microbatches(r) for r in range(world)] == [1] * world  # lbs 0: one microbatch of its rows
        padded = shape(tiny_recipe, world, pad=True)
        assert padded.padded_to == -(-B // world)
        assert padded.padding_rows == padded.padded_to * world - B
        assert padded.trainer_batch == B + padded.padding_rows
        if B % world == 0:
            assert padded.padding_rows == 0 and plain.padded_to is None


def test_local_batch_size_must_cut_every_rank_or_slices_are_padded(tiny_recipe):
    # B = 16 at W = 3: 5 or 6 rows. Only 1 divides both; padding to 6 rows lets local_batch_size 2 or 3 cut them.
    assert shape(tiny_recipe, 3, 1).microbatches(0) == 5 and shape(tiny_recipe, 3, 1).microbatches(2) == 6
    with pytest.raises(TrainerMismatchError, match="local_batch_size 2 does not divide every reader's share"):
        shape(tiny_recipe, 3, 2)
    padded = shape(tiny_recipe, 3, 2, pad=True)
    assert padded.padded_to == 6 and [padded.microbatches(r) for r in range(3)] == [3, 3, 3]
    assert shape(tiny_recipe, 3, 4, pad=True).padded_to == 8  # ceil(16/3) = 6, rounded up to a multiple of 4


def test_a_trainer_with_a_fixed_accumulation_needs_padding_at_an_uneven_world(tiny_recipe):
    with pytest.raises(TrainerMismatchError, match="pad slices to equal shapes"):
        shape(tiny_recipe, 3, 1, gbs=16)
    # Padded: the trainer's global batch is W x padded rows (B real rows + the padding), and the error says so.
    with pytest.raises(TrainerMismatchError, match=r"set training.global_batch_size = 18 = 16 rows \+ 2 padding"):
        shape(tiny_recipe, 3, 1, pad=True, gbs=16)
    assert shape(tiny_recipe, 3, 1, pad=True, gbs=18).microbatches(0) == 6
    assert shape(tiny_recipe, 3, 6, pad=True, gbs=-1).microbatches(0) == 1  # -1: local_batch_size x dp = 18
    # At a W dividing B nothing changes: the trainer's batch is B, padded or not.
    assert shape(tiny_recipe, 4, 2, pad=True, gbs=16).padding_rows == 0
    with pytest.raises(TrainerMismatchError, match="set training.global_batch_size = 16"):
        shape(tiny_recipe, 4, 2, gbs=32)


@pytest.mark.parametrize("world", [0, 17, 1000])
def test_a_world_without_rows_for_every_reader_is_refused(tiny_recipe, world):
    with pytest.raises(TrainerMismatchError, match=f"a data-parallel degree of {world} does not fit"):
        shape(tiny_recipe, world)


def test_the_config_time_check_accepts_B_padded_or_derived(tiny_recipe):
    for ok in (16, 18, 64, -1):
        check_global_batch_setting(tiny_recipe, ok)
    with pytest.raises(TrainerMismatchError, match="training.global_batch_size 8 is smaller"):
        check_global_batch_setting(tiny_recipe, 8)
