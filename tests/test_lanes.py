"""LaneStepper and LaneGroup: lane filing, step-boundary checkpoints, fail-loud state, pipeline restarts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import RECIPES, TINY, golden_digests, run_ranks

from zephon_ray import GlobalBatchSource, Recipe
from zephon_ray.lanes import KEY_FINGERPRINT, KEY_NEXT_STEP, KEY_VERSION, LaneStepper, StepStateError
from zephon_ray.pipeline import LaneGroup
from zephon_ray.source import assemble


def test_lane_group_validation():
    with pytest.raises(ValueError, match="run_id"):
        LaneGroup(count=2, index=0, aggregate_dir="/tmp/x")
    with pytest.raises(ValueError, match="exactly one of aggregate_store and aggregate_dir"):
        LaneGroup(count=2, index=0, run_id="r")
    with pytest.raises(ValueError, match="exactly one"):
        LaneGroup(count=2, index=0, run_id="r", aggregate_dir="/tmp/x", aggregate_store="torch://")
    with pytest.raises(ValueError, match=r"index 2 is not in \[0, 2\)"):
        LaneGroup(count=2, index=2, run_id="r", aggregate_dir="/tmp/x")
    assert LaneGroup(count=4, index=1, run_id="r", aggregate_dir="/tmp/x").owned_lanes(8) == (2, 3)
    with pytest.raises(ValueError, match="3 lane groups do not divide 8 lanes"):
        LaneGroup(count=3, index=0, run_id="r", aggregate_dir="/tmp/x").owned_lanes(8)


def test_a_lane_group_produces_its_lanes_rows(tiny_recipe, tmp_path):
    """Rank 1 of 4 alone (no collective checkpoint) yields exactly lanes 2-3 of every global batch."""
    group = LaneGroup(count=4, index=1, run_id="lanes-test", aggregate_dir=str(tmp_path))
    stepper = LaneStepper(tiny_recipe, group)
    with GlobalBatchSource(tiny_recipe) as source:
        try:
            for step in range(4):
                shards = stepper.next_step()
                assert sorted(shards) == [2, 3]
                rows = np.concatenate([shards[2].tokens, shards[3].tokens])
                assert np.array_equal(rows, source.batch(step).slice(1, 4).tokens)
        finally:
            stepper.close()


def test_state_is_json_safe_and_versioned(tiny_recipe):
    stepper = LaneStepper(tiny_recipe)
    try:
        stepper.next_step()
        state = stepper.checkpoint()
    finally:
        stepper.close()
    assert json.loads(json.dumps(state)) == state
    assert state[KEY_VERSION] == 1 and state[KEY_NEXT_STEP] == 1 and state[KEY_FINGERPRINT] == tiny_recipe.fingerprint


def test_restore_refuses_other_recipes_versions_and_non_boundaries(tiny_recipe, tmp_path):
    stepper = LaneStepper(tiny_recipe)
    try:
        stepper.next_step()
        state = stepper.checkpoint()
        other = Recipe.from_toml(_variant(tmp_path, "seed = 1234", "seed = 4321"))
        with pytest.raises(StepStateError, match="fingerprint"):
            LaneStepper(other).restore(state)
        with pytest.raises(StepStateError, match="version"):
            stepper.restore({**state, KEY_VERSION: 99})
        with pytest.raises(StepStateError, match="not at a step boundary"):
            stepper.restore({**state, KEY_NEXT_STEP: 2})
    finally:
        stepper.close()


def test_checkpoint_refuses_when_next_step_is_buffered(tiny_recipe):
    stepper = LaneStepper(tiny_recipe)
    try:
        stepper.next_step()
        stepper._pending[0].append(object())  # as if lane 0 had already delivered a microbatch of step 1
        with pytest.raises(StepStateError, match="already buffered"):
            stepper.checkpoint()
    finally:
        stepper.close()


@pytest.mark.parametrize(
    ("recipe_name", "steps", "restart_every", "restarts"),
    [pytest.param("tiny", 170, 3, 56, marks=pytest.mark.heavy), ("phased", 6, 1, 4)],
)
def test_restarts_change_no_row(recipe_name, steps, restart_every, restarts):
    """The pipeline restarted from its own checkpoint every few steps (what bounds Zephon's buffers over a long run)
    gives the goldens' rows at every step: over 170 steps of tiny, and inside each segment of phased.toml (restarts
    before steps 1, 3, 5 and 6; a phase's first step starts a fresh pipeline instead)."""
    path = RECIPES / f"{recipe_name}.toml"
    recipe, golden = Recipe.from_toml(path), golden_digests(path)
    stepper = LaneStepper(recipe)
    stepper.restart_every = restart_every
    try:
        digests = [assemble(recipe, step, stepper.next_step()).digest for step in range(steps)]
    finally:
        stepper.close()
    assert digests == golden[:steps]
    assert stepper.restarts == restarts


def test_lane_groups_restart_at_their_collective_checkpoints(tiny_recipe, tmp_path, reference_digests):
    """Two lane groups (as two producers, which keep every lane's position) checkpoint together every 2 steps and
    restart at the first checkpoint 3 steps after the last restart (steps 4, 8, ...): every step still equals the
    goldens, and both agree on each state. Of the 12 checkpoints' lane exchanges only the last is left behind."""

    def group(index: int) -> tuple[list, list]:
        stepper = LaneStepper(
            tiny_recipe, LaneGroup(count=2, index=index, run_id="restarts", aggregate_dir=str(tmp_path))
        )
        stepper.restart_every = 3
        stepper.keep_positions = True
        shards, states = [], []
        try:
            for step in range(24):
                shards.append(stepper.next_step())
                if step % 2 == 1:
                    states.append(stepper.checkpoint())
            assert stepper.restarts == 6
            return shards, states
        finally:
            stepper.close()

    (first, first_states), (second, second_states) = run_ranks(2, group, timeout_s=120)
    assert first_states == second_states
    digests = [assemble(tiny_recipe, step, {**first[step], **second[step]}).digest for step in range(24)]
    assert digests == reference_digests[:24]
    assert [path.parent.name for path in sorted(tmp_path.rglob("zephon-ray-lanes/**/group-*.json"))] == [
        f"checkpoint-{tiny_recipe.fingerprint[:16]}-{tiny_recipe.fingerprint[:16]}-24"
    ] * 2


def _variant(tmp_path, old, new):
    text = TINY.read_text().replace(old, new).replace('path = "', f'path = "{TINY.parent}/')
    path = tmp_path / "variant.toml"
    path.write_text(text)
    return path
