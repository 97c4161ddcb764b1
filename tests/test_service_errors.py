"""One-line error messages (service/errors.py ``describe``): what a user sees when a producer, a replayer or the
pump fails, with the traceback left to the log."""

from __future__ import annotations

import pytest
import ray

from zephon_ray.service.errors import describe


def test_an_exception_whose_message_holds_a_traceback_becomes_its_last_line():
    message = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    f()\n'
        "OSError: s3://bucket/key: Not Found"
    )
    assert describe(OSError(message)) == "OSError: s3://bucket/key: Not Found"


def test_a_multi_line_message_is_one_line():
    got = describe(ValueError("recipe recipes/x.toml:\n  key 'lanes' must divide\n  rows_per_step 56"))
    assert "\n" not in got and got.startswith("ValueError: recipe recipes/x.toml:") and "rows_per_step 56" in got


def test_notes_follow_the_message_instead_of_replacing_it():
    """``add_note`` lines come after the message in Python's formatted lines: taking the last line gave the last
    note alone ("while reading shard 3"), and the message naming the key was lost."""
    error = KeyError("lane 7 of step 12")
    error.add_note("while reading shard 3\nof source prose")
    error.add_note("attempt 2 of 5")
    got = describe(error)
    assert got == "KeyError: 'lane 7 of step 12' (while reading shard 3 of source prose; attempt 2 of 5)"
    try:
        compile("x = (", "recipe.py", "exec")
    except SyntaxError as syntax:
        syntax.add_note("in recipe.py")
        assert describe(syntax) == "SyntaxError: '(' was never closed (in recipe.py)"  # not its source lines


def test_a_ray_task_error_is_its_cause_without_the_remote_traceback(ray_cluster):
    @ray.remote
    def fails():
        raise KeyError("lane 7 of step 12")

    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(fails.remote())
    assert 'File "' in str(info.value)  # Ray's own message carries the remote frames, over several lines
    got = describe(info.value)
    assert "\n" not in got and 'File "' not in got and "lane 7 of step 12" in got, got


def test_reply_within_keeps_a_calls_own_timeout_apart_from_its_bound():
    """asyncio.TimeoutError is TimeoutError since Python 3.11: a bound built on asyncio.wait_for would take a call's
    own TimeoutError (the coordinator's "not produced within ... the live window is ...") for its own expiry and
    replace the message (seen: "did not answer a lease within 31s" after a 1 s wait)."""
    import asyncio

    from zephon_ray.service.errors import NoReply, reply_within

    async def answers_timeout():
        raise TimeoutError("step 50 was not produced within 1s: the live window is [0, 4)")

    async def never():
        await asyncio.sleep(3600)

    with pytest.raises(TimeoutError, match="live window"):
        asyncio.run(reply_within(answers_timeout(), 5))
    with pytest.raises(NoReply, match="no reply within 0.05s"):
        asyncio.run(reply_within(never(), 0.05))
    assert asyncio.run(reply_within(asyncio.sleep(0, result=7), 1)) == 7
