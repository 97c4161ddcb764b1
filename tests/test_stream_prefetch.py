"""The narrow protocol (``zephon_ray.stream.slice_stream``: reset / next / state / close) and the one prefetch thread
(``zephon_ray.stream.prefetch``) behind every slice stream.

Driven by a small real source: this reader's slices of ``GlobalBatchSource`` (the in-process reference), and by
``LocalSlices`` (an in-process Zephon lane group) through the same protocol.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import one_line
from zephon_ray import GlobalBatchSource, compute_digest
from zephon_ray.stream.prefetch import PrefetchedSlices
from zephon_ray.stream.slice_stream import (
    STATE_CHECKPOINT,
    STATE_NEXT_STEP,
    SliceStream,
    SliceStreamError,
    stream_state,
)


class ReferenceSlices(PrefetchedSlices):
    """Rank r's slices of the in-process reference; ``fail_at`` makes production raise at that step."""

    def __init__(self, recipe, *, rank, world, depth, fail_at=None, delay_s=0.0):
        super().__init__(rank=rank, world=world, depth=depth, name="reference")
        self.recipe, self.fail_at, self.delay_s = recipe, fail_at, delay_s
        self.produced: list[int] = []

    def _produce(self, step, checkpoint, stop):
        with GlobalBatchSource(self.recipe) as source:
            s = step
            while not stop.is_set():
                if s == self.fail_at:
                    raise OSError(f"disk gone at step {s}\n\nDebug source:\n  Generic {{ store: ... }}")  # as obstore
                time.sleep(self.delay_s)
                self.produced.append(s)
                yield source.batch(s).slice(self.rank, self.world)
                s += 1


def _digest(piece):
    return compute_digest(piece.tokens, piece.positions)


def test_consecutive_slices_from_any_start_and_restart(tiny_recipe):
    with GlobalBatchSource(tiny_recipe) as ref:
        want = {s: _digest(ref.batch(s).slice(1, 2)) for s in range(2, 6)}
    source = ReferenceSlices(tiny_recipe, rank=1, world=2, depth=2)
    assert isinstance(source, SliceStream)
    with pytest.raises(SliceStreamError, match="not running: call reset"):
        source.next(timeout=1)
    source.reset(stream_state(2))
    assert [_digest(source.next(timeout=60)) for _ in (2, 3)] == [want[2], want[3]]
    source.reset({STATE_NEXT_STEP: 4, STATE_CHECKPOINT: None})  # a jump: restart where asked
    assert [_digest(source.next(timeout=60)) for _ in (4, 5)] == [want[4], want[5]]
    assert source.state(timeout=1) == {STATE_NEXT_STEP: 6, STATE_CHECKPOINT: None}  # no checkpoint to keep
    source.close()
    source.close()  # idempotent
    with pytest.raises(SliceStreamError, match="not running"):
        source.next(timeout=1)


@pytest.mark.parametrize(
    "state, message",
    [
        ({"next_step": 1}, "lacks key 'checkpoint'"),
        ({"next_step": -1, "checkpoint": None}, "'next_step' must be an int in"),
        ({"next_step": None, "checkpoint": None}, "'next_step' must be an int in"),
        ({"next_step": 1, "checkpoint": "{}"}, "'checkpoint' must be a dict or None"),
        ({"next_step": 1, "checkpoint": None, "step": 1}, "unknown key 'step'"),
        ([1, None], "must be a dict"),
    ],
)
def test_bad_stream_states_and_arguments_fail_early(tiny_recipe, state, message):
    source = ReferenceSlices(tiny_recipe, rank=0, world=1, depth=1)
    with pytest.raises(ValueError, match=message):
        source.reset(state)
    source.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 2, "world": 2, "depth": 1}, r"rank must be an int in \[0, world=2\), got 2"),
        ({"rank": 0, "world": None, "depth": 1}, r"world must be an int in \[1, .*\], got None"),
        ({"rank": 0, "world": 1, "depth": 0}, r"prefetch depth must be an int in \[1, 1024\], got 0"),
    ],
)
def test_bad_reader_arguments_fail_when_built(tiny_recipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReferenceSlices(tiny_recipe, **kwargs)


def test_production_stays_within_depth(tiny_recipe):
    source = ReferenceSlices(tiny_recipe, rank=0, world=1, depth=2)
    source.reset()
    source.next(timeout=60)
    time.sleep(1.0)  # give the thread every chance to run ahead
    # step 0 was taken; at most `depth` more sit in the queue, plus one made and waiting to be put
    assert max(source.produced) <= 0 + 2 + 1, source.produced
    source.close()


def test_a_producer_error_reaches_get_with_its_step_and_cause(tiny_recipe):
    source = ReferenceSlices(tiny_recipe, rank=0, world=2, depth=2, fail_at=1)
    source.reset()
    source.next(timeout=60)
    with pytest.raises(
        SliceStreamError, match=r"reference slice stream failed at step 1 \(rank 0 of 2\): OSError: disk gone"
    ) as info:
        source.next(timeout=60)
    assert isinstance(info.value.__cause__, OSError)
    one_line(info.value, "disk gone at step 1 Debug source: Generic { store: ... }")  # the cause's lines, joined
    source.close()


class SkippingSlices(ReferenceSlices):
    """A broken source that skips a step: ``next`` must notice, not hand out the wrong rows."""

    def _produce(self, step, checkpoint, stop):
        with GlobalBatchSource(self.recipe) as source:
            yield source.batch(step + 1).slice(self.rank, self.world)


def test_wrong_step_and_timeout_are_clear(tiny_recipe):
    source = SkippingSlices(tiny_recipe, rank=0, world=1, depth=1)
    source.reset(stream_state(3))
    with pytest.raises(SliceStreamError, match="is at step 4, the caller expected step 3"):
        source.next(timeout=60)
    slow = ReferenceSlices(tiny_recipe, rank=0, world=1, depth=1, delay_s=5.0)
    slow.reset()
    with pytest.raises(TimeoutError, match="step 0 not ready within 0 s"):
        slow.next(timeout=0.3)
    source.close()
    slow.close()


def test_local_slices_through_the_interface(tiny_recipe, reference_digests):
    """LocalSlices (one Zephon lane group owning all lanes) behind the same protocol: reference rows, and ``state``
    hands out the checkpoint a reset restarts from."""
    from zephon_ray.pipeline import LaneGroup
    from zephon_ray.stream.local import LocalSlices

    source = LocalSlices(tiny_recipe, rank=0, world=1, lane_group=LaneGroup(), depth=2, checkpoint_every=2)
    source.reset()
    for s in range(3):
        assert _digest(source.next(timeout=120)) == reference_digests[s]
    state = source.state(timeout=120)
    assert state[STATE_NEXT_STEP] == 3 and state[STATE_CHECKPOINT]["next_step"] == 2
    source.reset(state)  # restore the step-2 checkpoint, replay step 2, serve step 3
    assert _digest(source.next(timeout=120)) == reference_digests[3]
    bad = {**state, STATE_CHECKPOINT: {**state[STATE_CHECKPOINT], "fingerprint": "0" * 64}}
    with pytest.raises(ValueError, match="step state belongs to recipe fingerprint 000000000000"):
        source.reset(bad)  # refused before any thread starts
    source.close()
