"""``zephon_ray.stream.service``: the service-mode slice stream's cursor reports and its commit at a save."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from service_helpers import NS, start_service

from zephon_ray import GlobalBatchSource


def assert_source_rows(recipe, taken) -> None:
    """The slices taken, steps 0.., are the in-process source's rows (one reader)."""
    with GlobalBatchSource(recipe) as source:
        for step, part in enumerate(taken):
            np.testing.assert_array_equal(part.tokens, source.batch(step).slice(0, 1).tokens)


@pytest.mark.heavy
def test_a_save_during_the_prefetch_threads_cursor_report_commits_what_the_trainer_took(
    ray_cluster, tiny_recipe, tmp_path
):
    """The prefetch thread reports the trainer's last step while the trainer saves. The save waits for that report,
    so its commit counts every step taken. Before the fix it found the report marked as sent but not yet recorded,
    and the service refused the commit ("ahead of what it was delivered"): found by a 60,000-step run of
    benchmarks/bench_memory_growth.py, at step 1,800."""
    from zephon_ray.stream.service import ServiceSlices

    svc = start_service(tiny_recipe, tmp_path, "stream-cursor")
    stream = ServiceSlices(tiny_recipe, rank=0, world=1, name="stream-cursor", namespace=NS, run_id="cursor", depth=2)
    trainer = threading.current_thread()
    inside = threading.Event()
    report = stream.service.advance

    def slow_report(step, **kw):  # the prefetch thread's report of step 2 takes a second
        if step >= 2 and threading.current_thread() is not trainer:
            inside.set()
            time.sleep(1.0)
        report(step, **kw)

    stream.service.advance = slow_report
    try:
        stream.reset()
        taken = [stream.next(timeout=60) for _ in range(3)]
        assert inside.wait(30), "the prefetch thread never reported step 2"
        assert stream.state(timeout=60)["next_step"] == 3  # raised ValueError (commit refused) before the fix
        assert svc.status()["commits"]["per_consumer"]["cursor"] == 3
        assert_source_rows(tiny_recipe, taken)
    finally:
        stream.close()
        svc.stop()


@pytest.mark.heavy
def test_a_save_and_close_do_not_wait_for_a_read_ahead(ray_cluster, tiny_recipe, tmp_path):
    """A read-ahead may wait as long as the slowest rank of the job holds the window back. The trainer's save (its
    commit) and ``close()`` do not wait for it. Before the fix they took the lock the read held: in a scratch run
    (W = 2, rank 1 silent after step 0, window 4) rank 0's save waited 10 s for its read-ahead of step 4. Here the
    read-ahead of step 3 is held until the end, and the save and close must finish meanwhile."""
    from zephon_ray.stream.service import ServiceSlices

    svc = start_service(tiny_recipe, tmp_path, "stream-held")
    stream = ServiceSlices(tiny_recipe, rank=0, world=1, name="stream-held", namespace=NS, run_id="held", depth=2)
    held, inside = threading.Event(), threading.Event()
    read = stream.service.slice

    def held_back(step, *args, **kw):
        if step >= 3:
            inside.set()
            held.wait(120)
        return read(step, *args, **kw)

    stream.service.slice = held_back
    try:
        stream.reset()
        taken = [stream.next(timeout=60) for _ in range(3)]
        assert inside.wait(30), "the prefetch thread never read ahead to step 3"
        done: dict = {}
        saver = threading.Thread(target=lambda: done.update(state=stream.state(timeout=60)), daemon=True)
        saver.start()
        saver.join(30)
        assert done.get("state") == {"next_step": 3, "checkpoint": None}, "the save waited for the read-ahead"
        assert svc.status()["commits"]["per_consumer"]["held"] == 3
        closer = threading.Thread(target=stream.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() waited for the read-ahead"
        assert inside.is_set() and not held.is_set()  # the read-ahead was still held all along
        assert_source_rows(tiny_recipe, taken)
    finally:
        held.set()
        stream.close()
        svc.stop()
