"""StepWindow: the service's window, cursor, commit and bound policy, tested as pure logic (no Ray)."""

from __future__ import annotations

import pytest

from zephon_ray.service.server.window import Entry, Read, StepWindow, resume_step
from zephon_ray.service.wire import MAX_CONSUMER_NAME


def _window(**kw) -> StepWindow:
    kw.setdefault("window", 4)
    kw.setdefault("max_ahead", 100)
    kw.setdefault("retain_behind", 8)
    kw.setdefault("consumer_ttl_s", 10.0)
    kw.setdefault("rows", 16)
    return StepWindow(**kw)


def _produce(w: StepWindow, now: float) -> list[int]:
    """What a producer group does: refresh, then file every wanted step up to produce_until."""
    w.refresh(now)
    filed = []
    for step in range(w.head, w.produce_until):
        w.submitted(step)
        if w.wanted(step) and w.file(step, Entry(containers=[f"ref{step}"], nbytes=10)):
            filed.append(step)
    w.refresh(now)
    return filed


def test_table_follows_the_slowest_cursor_and_stays_bounded():
    w = _window()
    assert _produce(w, 0.0) == [0, 1, 2, 3]
    for step in range(30):
        assert w.read(step, "a", 0, 2, track=True, now=step) in (Read.HIT, Read.WAIT)
        assert w.read(max(step - 2, 0), "a", 1, 2, track=True, now=step) is not Read.REPLAY
        _produce(w, step)
        assert set(w.table) <= set(range(w.keep_from, w.produce_until))
        assert len(w.table) <= w.bound_steps and w.held_bytes == 10 * len(w.table)
    assert w.slowest == 27 and w.keep_from == 27 and w.produce_until == 31
    assert w.read(5, "late", None, None, track=False, now=30) is Read.REPLAY  # evicted: the Replayer serves it


def test_retention_keeps_steps_from_the_newest_commit():
    w = _window(retain_behind=8)
    for step in range(12):
        w.read(step, "job", 0, 1, track=True, now=step)
        _produce(w, step)
        if step == 6:
            w.commit(6, "job")
    assert w.keep_from == 6 and all(s in w.table for s in range(6, 14))
    # A restarted trainer resumes from its commit: every step from there is a hit, not a replay.
    assert all(w.read(s, "job", 0, 2, track=True, now=20) is Read.HIT for s in range(6, 12))
    # But never more than retain_behind behind the cursor: an old commit does not pin the table forever.
    for step in range(12, 40):
        w.read(step, "job", 0, 2, track=True, now=20 + step)
        _produce(w, 20 + step)
    assert w.keep_from == 39 - 8 and len(w.table) <= w.bound_steps


def test_cursor_moves_are_monotonic_and_one_world_per_consumer():
    w = _window()
    w.advance(9, "a", 1, 2, now=0)
    w.advance(5, "a", 1, 2, now=1)  # out of order: ignored
    assert w.cursors[("a", 1, 2)].step == 9 and w.cursors[("a", 1, 2)].seen == 1
    w.advance(3, "a", 0, 4, now=2)  # the job restarted at W=4: its W=2 cursors stop holding the window
    assert list(w.cursors) == [("a", 0, 4)]
    assert w.release("a") == 1 and not w.cursors


def test_expired_cursors_are_deleted():
    w = _window(consumer_ttl_s=5.0)
    w.advance(3, "gone", 0, 1, now=0)
    w.advance(8, "live", 0, 1, now=4)
    w.refresh(now=6)
    assert list(w.cursors) == [("live", 0, 1)] and "gone" not in w.consumed and w.slowest == 8


def test_reads_past_max_ahead_are_rejected_tracked_or_not():
    w = _window(max_ahead=50)
    _produce(w, 0)
    for track in (True, False):
        with pytest.raises(ValueError, match=r"step 1000000 is more than max_ahead=50 steps past the service's head"):
            w.read(10**6, "x", None, None, track=track, now=0)
    assert not w.cursors  # a rejected read moved nothing
    assert w.read(54, "x", None, None, track=False, now=0) is Read.REPLAY
    assert w.read(54, "x", None, None, track=True, now=0) is Read.WAIT


def test_commits_are_per_consumer_and_checked():
    w = _window()
    assert w.commit(0, "a") == 0  # resuming at 0 needs no read
    with pytest.raises(
        ValueError, match=r"commit step 12 of consumer 'a' is ahead of what it was delivered: at most 0"
    ):
        w.commit(12, "a")
    w.read(7, "a", 0, 1, track=True, now=0)
    w.read(30, "b", None, None, track=False, now=0)  # an untracked read consumes nothing
    assert w.commit(8, "a") == 8
    with pytest.raises(ValueError, match="consumer 'b'"):
        w.commit(5, "b")
    assert w.commits == {"a": 8}
    # Asked for is not delivered: a client's commit counts the reads it was delivered (sent with the commit), not
    # the cursor its requests moved (step 20 asked for, failed or still waiting; 9 delivered).
    w.read(20, "a", 0, 1, track=True, now=0)
    with pytest.raises(ValueError, match=r"at most 10 \(one past its highest delivered step 9\)"):
        w.commit(20, "a", read=9)
    assert w.commit(10, "a", read=9, apply=False) == 10 and w.commits == {"a": 8}  # checked, not applied
    with pytest.raises(ValueError, match=r"commit step must be an int in \[0, .*\], got"):
        w.commit(10**12 * -1, "a")


def test_a_commit_counts_its_own_reads_after_a_release():
    """Rank 1 of a job closes its loader first (a release of the whole consumer, later than rank 0's moves):
    rank 0's moves sent with its commit are ignored as cursors, yet its commit one past them is accepted."""
    w = _window()
    w.advance(3, "job", 0, 2, now=1)
    w.release("job", now=2)
    assert not w.advance(3, "job", 0, 2, now=3, seen=1) and "job" not in w.consumed  # heard before the release
    with pytest.raises(ValueError, match=r"at most 0 \(it was delivered nothing yet\)"):
        w.commit(4, "job")
    assert w.commit(4, "job", read=3) == 4
    with pytest.raises(ValueError, match=r"at most 4 \(one past its highest delivered step 3\)"):
        w.commit(5, "job", read=3)


@pytest.mark.parametrize(
    "rank, world, words",
    [
        (2, 2, r"rank must be an int in \[0, world=2\), got 2"),
        (
            0,
            17,
            r"world must be an int in \[1, 16\] \(the global batch's rows"
            r": every rank needs one\), got 17",
        ),
        (-1, 4, "rank must be an int in .*, got -1"),
        (0, 32, "world must be an int in .*, got 32"),
        (0, True, "world must be an int in .* got True"),
    ],
)
def test_rank_and_world_are_validated(rank, world, words):
    with pytest.raises(ValueError, match=words):
        _window().advance(0, "a", rank, world, now=0)


def test_consumer_name_and_step_validated():
    w = _window()
    with pytest.raises(ValueError, match="consumer must be"):
        w.advance(0, "x" * (MAX_CONSUMER_NAME + 1), 0, 1, now=0)
    with pytest.raises(ValueError, match=r"step must be an int in \[0, .*\], got -1"):
        w.read(-1, "a", None, None, track=False, now=0)


def test_untracked_reads_never_move_the_window():
    w = _window()
    _produce(w, 0)
    for step in range(4):
        assert w.read(step, "notebook", None, None, track=False, now=0) is Read.HIT
    assert not w.cursors and w.produce_until == 4
    assert w.read(6, "notebook", None, None, track=False, now=0) is Read.REPLAY


def test_lost_step_is_replayed_afterwards():
    w = _window()
    _produce(w, 0)
    assert w.invalidate(2) is not None and 2 not in w.table and w.held_bytes == 30
    w.replay_below = 3
    assert w.read(2, "a", None, None, track=False, now=0) is Read.REPLAY


def test_wait_ends_only_where_producers_will_deliver():
    """WAIT is only answered for steps the producers will file: in flight, or inside the moving window."""
    w = _window()
    w.read(0, "a", 0, 1, track=True, now=0)
    w.refresh(0)
    assert w.read(2, "a", 0, 1, track=False, now=0) is Read.WAIT
    assert w.read(9, "a", 0, 1, track=False, now=0) is Read.REPLAY  # nobody's cursor heads there
    assert w.read(9, "a", 0, 1, track=True, now=0) is Read.WAIT  # now this cursor moves the producers


def test_steps_handed_to_a_replaced_group_are_not_waited_for():
    """A group was handed steps 0-13 (a cursor at 10), then killed; its replacement starts at checkpoint 2 while the
    cursor fell back to 3 (another world size): step 12 is neither on its way nor in the live window, so an untracked
    read of it is replayed instead of waiting for ever (the regression in tests/test_service_fuzz.py)."""
    w = _window()
    w.read(10, "a", 0, 16, track=True, now=0)
    w.refresh(0)
    for step in range(w.produce_until):
        w.submitted(step)
    assert w.read(12, "b", None, None, track=False, now=0) is Read.WAIT  # on its way
    w.drop_generation(0)
    w.launched(2)
    w.read(3, "a", 0, 2, track=True, now=1)
    w.refresh(1)
    assert (w.produce_until, w.head, w.submitted_until) == (7, 14, 2)
    assert w.read(12, "b", None, None, track=False, now=1) is Read.REPLAY


def test_resume_step_ignores_long_gone_consumers():
    assert resume_step({}, 100) == 0
    assert resume_step({"a": 40, "b": 36}, 100) == 36
    assert resume_step({"a": 5000, "old": 12}, 100) == 5000


def test_bad_window_config():
    with pytest.raises(ValueError, match="window"):
        StepWindow(window=0)
    with pytest.raises(ValueError, match="retain_behind"):
        StepWindow(window=2, retain_behind=-1)
