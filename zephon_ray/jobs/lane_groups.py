"""One Ray Data job shape for work split by lane group: M actors, each one Zephon lane group, all running at once.

``run_lane_groups(Worker, kwargs, groups=M)`` maps ``Worker`` (a callable class whose ``__call__`` takes a batch of
``{"group": [g]}`` rows and yields numpy batches) over one input row per lane group on an
``ActorPoolStrategy(size=M)`` with one task per actor at a time, and returns the stream of its output batches
(numpy), in arrival order. Every lane group runs at once, as a collective Zephon checkpoint or a phase boundary's
exchange of lane positions needs. Used by materialisation (:mod:`zephon_ray.jobs.materialize`) and ``locate``
(:mod:`zephon_ray.jobs.locate`).

Limits: the caller files outputs by their own keys (step, group), never by arrival order; each actor asks for
``cpus_per_actor`` CPUs, so M actors need M x that many free on the cluster before any starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zephon_ray.log_filters import quiet_known_noise


def run_lane_groups(
    worker: type, kwargs: dict[str, Any], *, groups: int, cpus_per_actor: float
) -> Iterable[dict[str, Any]]:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the caller draws one bar of its own
    quiet_known_noise()  # Ray Data's 'Progress bars disabled' line, which the line above causes
    ctx.print_on_execution_start = False
    dataset: ray.data.Dataset = ray.data.from_items([{"group": g} for g in range(groups)], override_num_blocks=groups)
    dataset = dataset.map_batches(
        worker,
        fn_constructor_kwargs=kwargs,
        # One task per actor at a time and exactly M actors: all M lane groups run at once.
        compute=ray.data.ActorPoolStrategy(size=groups, max_tasks_in_flight_per_actor=1),
        batch_size=1,
        num_cpus=cpus_per_actor,
    )
    return dataset.iter_batches(batch_size=None, batch_format="numpy")
