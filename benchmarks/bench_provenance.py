"""What provenance and ``locate`` cost: one step's provenance in-process and through the service, and a locate scan.

    python benchmarks/bench_provenance.py [--recipe tiny] [--rounds 3] [--parts inprocess,service,locate]
                                          [--locate-steps 10000] [--groups 1,2]

- ``inprocess``: a batch-path step (``LaneStepper.next_step``) against a provenance-mode step
  (``ProvenanceStepper.next_step`` plus the pieces), steps 1..64 in order, alternating which goes first per round;
  then ``GlobalBatchSource.provenance(s)`` of a step behind both pipelines (steps 100..199 produced, 20 random steps
  asked): one restore of the nearest checkpoint (every 8 steps) and at most 7 steps of replay, and the check against
  the batch's rows.
- ``service``: a DataService (1 producer, checkpoint every 8, a private Ray) whose consumer read steps 0..99;
  ``DataService.provenance(s)`` of 20 random steps behind (restore of the nearest durable checkpoint under state_dir,
  read of the step's rows from the service, the check), then steps 60..79 in order.
- ``locate``: ``locate`` over ``--locate-steps`` steps with each ``--groups`` count (the Ray Data job, fractional CPUs:
  0.5 per lane-group actor), and the in-process scan (``scan_all``) of the same range; the record is one the first
  step holds. Its rate gives the extrapolation to 100,000 steps: one lane group, and 8 lane groups on a cluster with a
  core free for each (ideal split: the groups share nothing but phase boundaries).

Prints a table and one JSON line (prefixed ``RESULT``). Rows are checked where they are read (the provenance's own
check against the batch's rows), so a wrong row fails the benchmark.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

PARTS = ("inprocess", "service", "locate")


def median_ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 2)


def steps_in_order(recipe, stepper_class, steps: int) -> list[float]:
    stepper = stepper_class(recipe)
    times = []
    try:
        stepper.next_step()  # step 0: the pipeline's start
        for _ in range(steps):
            t0 = time.perf_counter()
            stepper.next_step()
            times.append(time.perf_counter() - t0)
    finally:
        stepper.close()
    return times


def inprocess(recipe, rounds: int) -> dict:
    from zephon_ray import GlobalBatchSource
    from zephon_ray.lanes import LaneStepper
    from zephon_ray.provenance import ProvenanceStepper

    batch, prov = [], []
    for r in range(rounds):
        order = [(LaneStepper, batch), (ProvenanceStepper, prov)]
        for cls, out in order if r % 2 == 0 else order[::-1]:
            out.extend(steps_in_order(recipe, cls, 64))
    rng = random.Random(7)
    behind = []
    with GlobalBatchSource(recipe, checkpoint_every=8) as source:
        source.batch(199)
        source.provenance(199)
        for step in rng.sample(range(100, 199), 20):
            t0 = time.perf_counter()
            source.provenance(step)
            behind.append(time.perf_counter() - t0)
    return {
        "batch_step_ms": median_ms(batch),
        "provenance_step_ms": median_ms(prov),
        "ratio": round(statistics.median(prov) / statistics.median(batch), 2),
        "behind_p50_ms": median_ms(behind),
        "behind_max_ms": round(1e3 * max(behind), 1),
    }


def service(recipe) -> dict:
    import ray

    try:
        return _service(recipe)
    finally:
        ray.shutdown()  # the private Ray ray_init=True started: locate starts its own


def _service(recipe) -> dict:
    from zephon_ray import DataService

    rng = random.Random(11)
    with (
        tempfile.TemporaryDirectory() as state,
        DataService.start(recipe, name="bench-prov", state_dir=state, checkpoint_every=8, ray_init=True) as svc,
    ):
        for step in range(100):
            svc.slice(step, 0, 1, track=True)
        t0 = time.perf_counter()
        svc.provenance(50)
        first = time.perf_counter() - t0
        behind = []
        for step in rng.sample(range(0, 99), 20):
            t0 = time.perf_counter()
            svc.provenance(step)
            behind.append(time.perf_counter() - t0)
        ordered = []
        for step in range(60, 80):
            t0 = time.perf_counter()
            svc.provenance(step)
            ordered.append(time.perf_counter() - t0)
        stats = dict(svc._provenance.stats)
    return {
        "first_call_s": round(first, 2),
        "behind_p50_ms": median_ms(behind),
        "behind_max_ms": round(1e3 * max(behind), 1),
        "in_order_p50_ms": median_ms(ordered),
        **stats,
    }


def locate_part(recipe, steps: int, groups: list[int]) -> dict:
    import ray

    from zephon_ray import GlobalBatchSource
    from zephon_ray.jobs.locate import RecordRef, locate, scan_all

    with GlobalBatchSource(recipe) as source:
        first = source.provenance(0).rows[0][0]
    target = RecordRef(first.source, first.shard, first.record)
    out: dict = {"steps": steps, "record": [target.source, target.shard, target.record]}
    t0 = time.perf_counter()
    hits = scan_all(recipe, target, range(0, steps))
    out["inprocess_s"] = round(time.perf_counter() - t0, 1)
    out["hits"] = len(hits)
    print(f"locate, in-process scan: {out}", flush=True)  # before Ray starts: kept if Ray does not
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=8)
    try:
        for m in groups:
            t0 = time.perf_counter()
            found = locate(recipe, target, range(0, steps), groups=m, progress=False)
            took = time.perf_counter() - t0
            assert found == hits, f"locate with {m} groups found other hits than the in-process scan"
            out[f"groups_{m}_s"] = round(took, 1)
    finally:
        ray.shutdown()
    rate = steps / out["inprocess_s"]
    out["steps_per_s_one_group"] = round(rate, 1)
    out["extrapolated_100k_one_group_min"] = round(100_000 / rate / 60, 1)
    out["extrapolated_100k_8_groups_min"] = round(100_000 / rate / 8 / 60, 1)
    return out


def main() -> None:
    from zephon_ray import Recipe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--locate-steps", type=int, default=10_000)
    parser.add_argument("--groups", default="1,2")
    args = parser.parse_args()
    recipe = Recipe.from_toml(args.recipe)
    parts = args.parts.split(",")
    result: dict = {"recipe": args.recipe, "tokens_per_step": recipe.global_batch_rows * recipe.row_length}
    if "inprocess" in parts:
        result["inprocess"] = inprocess(recipe, args.rounds)
        print("in-process:", result["inprocess"], flush=True)
    if "service" in parts:
        result["service"] = service(recipe)
        print("service:   ", result["service"], flush=True)
    if "locate" in parts:
        result["locate"] = locate_part(recipe, args.locate_steps, [int(g) for g in args.groups.split(",")])
        print("locate:    ", result["locate"], flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
