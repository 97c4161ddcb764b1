"""The shared prefetch thread (``zephon_ray.stream.prefetch``) behind every slice source.

Driven by a small real source: this rank's slices of ``GlobalBatchSource`` (the in-process reference), and by
``LocalSlices`` (an in-process Zephon rank) through the same narrow interface.
"""

from __future__ import annotations

import time

import pytest

from zephon_ray import GlobalBatchSource, compute_digest
from zephon_ray.stream.prefetch import PrefetchedSlices, SliceSource, SourceError


class ReferenceSlices(PrefetchedSlices):
    """Rank r's slices of the in-process reference; ``fail_at`` makes production raise at that step."""

    def __init__(self, recipe, *, rank, world, depth, fail_at=None, delay_s=0.0):
        super().__init__(rank=rank, world=world, depth=depth, name="reference")
        self.recipe, self.fail_at, self.delay_s = recipe, fail_at, delay_s
        self.produced: list[int] = []

    def _produce(self, step, resume, stop):
        with GlobalBatchSource(self.recipe) as source:
            s = step
            while not stop.is_set():
                if s == self.fail_at:
                    raise OSError(f"disk gone at step {s}")
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
    assert isinstance(source, SliceSource) and not source.running
    source.start(2)
    assert source.running
    assert [_digest(source.get(s, timeout=60)) for s in (2, 3)] == [want[2], want[3]]
    source.start(4)  # a jump: restart where asked
    assert [_digest(source.get(s, timeout=60)) for s in (4, 5)] == [want[4], want[5]]
    assert source.state(6, timeout=1) is None  # the reference needs no resume state
    source.close()
    source.close()  # idempotent
    assert not source.running


def test_production_stays_within_depth(tiny_recipe):
    source = ReferenceSlices(tiny_recipe, rank=0, world=1, depth=2)
    source.start(0)
    source.get(0, timeout=60)
    time.sleep(1.0)  # give the thread every chance to run ahead
    # step 0 was taken; at most `depth` more sit in the queue, plus one made and waiting to be put
    assert max(source.produced) <= 0 + 2 + 1, source.produced
    source.close()


def test_a_producer_error_reaches_get_with_its_step_and_cause(tiny_recipe):
    source = ReferenceSlices(tiny_recipe, rank=0, world=2, depth=2, fail_at=1)
    source.start(0)
    source.get(0, timeout=60)
    with pytest.raises(SourceError, match=r"reference source failed at step 1 \(rank 0 of 2\): OSError: disk gone") \
            as info:
        source.get(1, timeout=60)
    assert isinstance(info.value.__cause__, OSError)
    source.close()


def test_wrong_step_and_timeout_are_clear(tiny_recipe):
    source = ReferenceSlices(tiny_recipe, rank=0, world=1, depth=1)
    source.start(3)
    with pytest.raises(SourceError, match="is at step 3, the loader expected step 4"):
        source.get(4, timeout=60)
    slow = ReferenceSlices(tiny_recipe, rank=0, world=1, depth=1, delay_s=5.0)
    slow.start(0)
    with pytest.raises(TimeoutError, match="step 0 not ready within 0 s"):
        slow.get(0, timeout=0.3)
    source.close()
    slow.close()
    assert not source.running and not slow.running


def test_local_slices_through_the_interface(tiny_recipe, reference_digests):
    """LocalSlices (one Zephon rank owning all lanes) behind the same interface: reference rows, and ``state``
    hands out the checkpoint a resume restarts from."""
    from zephon_ray.pipeline import LaneGroup
    from zephon_ray.stream.local import LocalSlices

    source = LocalSlices(tiny_recipe, rank=0, world=1, lane_group=LaneGroup(), depth=2, checkpoint_every=2)
    source.start(0)
    for s in range(3):
        assert _digest(source.get(s, timeout=120)) == reference_digests[s]
        source.advance(s + 1)
    checkpoint = source.state(3, timeout=120)
    assert checkpoint["next_step"] == 2
    source.start(3, checkpoint)  # restore the step-2 checkpoint, replay step 2, serve step 3
    assert _digest(source.get(3, timeout=120)) == reference_digests[3]
    source.close()
