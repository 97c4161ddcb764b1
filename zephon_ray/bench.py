"""``zephon-ray bench``: how fast this node produces a recipe's global batches. Needs no source checkout.

    zephon-ray bench RECIPE [--steps N] [--warmup W] [--via local|service|both] [--producers M] [--rounds R]

A reader takes global batches in step order, as a trainer does, and each read is timed: ``local`` reads
``GlobalBatchSource(recipe).batch(s)`` in this process; ``service`` reads ``DataService.batch(s, track=True)``
from a service with M producers that the command starts on the cluster (``--address``, ``RAY_ADDRESS``, or a
private local Ray when neither is set) and stops again, or from a running one (``--name``). The first ``W`` steps
(pipeline start, first shards) are timed apart as ``first_steps_s`` and left out of the rates.

Reported per path: tokens/s and steps/s over the timed steps, and the step latency (one read) p50 and p99.
``--via both`` alternates the two paths in rounds (local, service, service, local, ...), each round reading the
next N steps, and reports service/local as the median of the per-round ratios: both sides read the same steps of
the same recipe, one whole global batch at a time, so the ratio compares like with like. One bias remains, and it
favours the service: its producers keep working up to ``window`` (8) steps ahead while the local side is timed, so
each service round may start with up to 8 steps ready; keep N well above 8 (the default is 32).
Guarantee: the digest of the last step read is printed with the numbers, so a run can be checked against
``zephon-ray digest``: the reads are of the real batches.

Limits: one reader on one node, the producer side only (no training step); a loaded machine gives a lower bound.
p99 of fewer than 100 steps is the largest latency seen. Numbers are for comparing on one machine, not absolutes.
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from zephon_ray.checks import check_int
from zephon_ray.errors import UserInputError
from zephon_ray.recipe import Recipe

VIAS = ("local", "service", "both")
BENCH_NAMESPACE = "zephon-ray-bench"


@dataclass
class PathResult:
    """One path's numbers over all its timed steps."""

    via: str
    steps: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list, repr=False)
    first_steps_s: float = 0.0
    last_step: int | None = None
    last_digest: str | None = None

    def summary(self, tokens_per_step: int) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {
            "via": self.via,
            "steps": self.steps,
            "tokens_per_s": self.steps * tokens_per_step / self.seconds if self.seconds else None,
            "steps_per_s": self.steps / self.seconds if self.seconds else None,
            "step_latency_p50_ms": _percentile(lat, 50) * 1e3 if lat else None,
            "step_latency_p99_ms": _percentile(lat, 99) * 1e3 if lat else None,
            "first_steps_s": self.first_steps_s,
            "last_step": self.last_step,
            "last_digest": self.last_digest,
        }


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


class _Reader:
    """Reads steps in order from one path and times each read."""

    def __init__(self, via: str, read: Callable[[int], Any]) -> None:
        self.result = PathResult(via)
        self._read = read
        self._next = 0

    def warm(self, steps: int) -> None:
        t0 = time.perf_counter()
        for _ in range(steps):
            self._take()
        self.result.first_steps_s = time.perf_counter() - t0

    def round(self, steps: int) -> float:
        """Read and time the next ``steps`` steps; returns their rate in steps/s."""
        t_round = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            self._take()
            dt = time.perf_counter() - t0
            self.result.latencies_s.append(dt)
            t_round += dt
        self.result.steps += steps
        self.result.seconds += t_round
        return steps / t_round if t_round else math.inf

    def _take(self) -> None:
        step = self._next
        batch = self._read(step)
        self.result.last_step, self.result.last_digest = step, batch.digest  # the digest is part of the work
        self._next += 1


@contextmanager
def _local_reader(recipe: Recipe) -> Iterator[_Reader]:
    from zephon_ray.source import GlobalBatchSource

    with GlobalBatchSource(recipe) as source:
        yield _Reader("local", source.batch)


@contextmanager
def _service_reader(
    recipe: Recipe, *, producers: int, name: str | None, namespace: str, address: str | None
) -> Iterator[_Reader]:
    from zephon_ray.service.client import DataService
    from zephon_ray.service.client.session import ray_session

    with ray_session(address, private_if_none=True):
        if name is not None:
            svc = DataService.connect(name, namespace=namespace, consumer=f"bench-{uuid.uuid4().hex[:8]}")
            if svc.recipe.fingerprint != recipe.fingerprint:
                raise UserInputError(
                    f"--name {name}: the service serves recipe fingerprint "
                    f"{svc.recipe.fingerprint[:12]}, not {recipe.describe()}"
                )
            started = False
        else:
            run = f"bench-{uuid.uuid4().hex[:8]}"
            extra: dict[str, Any] = {"aggregate_store": "torch://", "run_id": run} if producers > 1 else {}
            svc = DataService.start(recipe, name=run, namespace=namespace, producers=producers, consumer=run, **extra)
            started = True
        try:
            yield _Reader("service", lambda step: svc.batch(step, track=True))
        finally:
            if started:
                svc.stop()
            else:
                svc.release()


def run_bench(
    recipe: Recipe,
    *,
    steps: int,
    warmup: int,
    via: str,
    rounds: int,
    producers: int = 1,
    name: str | None = None,
    namespace: str = BENCH_NAMESPACE,
    address: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure and return the report (see the module docstring); ``progress`` gets one line per round."""
    for flag, value, low in (
        ("--steps", steps, 1),
        ("--warmup", warmup, 0),
        ("--rounds", rounds, 1),
        ("--producers", producers, 1),
    ):
        check_int(flag, value, low=low, error=UserInputError)
    if via not in VIAS:
        raise UserInputError(f"--via must be one of {', '.join(VIAS)}, got {via!r}")
    if recipe.lanes % producers:
        raise UserInputError(f"--producers {producers} does not divide the recipe's {recipe.lanes} lanes")
    paths = ("local", "service") if via == "both" else (via,)
    say = progress or (lambda line: None)
    ratios: list[float] = []
    with _readers(recipe, paths, producers=producers, name=name, namespace=namespace, address=address) as readers:
        for reader in readers.values():
            reader.warm(warmup)
        for r in range(rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))  # A B, B A, A B, ...
            rates = {p: readers[p].round(steps) for p in order}
            line = "  ".join(f"{p} {rates[p] * recipe.tokens_per_step / 1e6:.3f} M tok/s" for p in paths)
            if len(paths) == 2:
                ratios.append(rates["service"] / rates["local"])
                line += f"  service/local {ratios[-1]:.3f}"
            say(f"round {r}: {line}")
        report: dict[str, Any] = {
            "recipe": str(recipe.path) if recipe.path else None,
            "fingerprint": recipe.fingerprint,
            "tokens_per_step": recipe.tokens_per_step,
            "steps_per_round": steps,
            "rounds": rounds,
            "warmup": warmup,
            "producers": producers if "service" in paths else None,
            "paths": {p: readers[p].result.summary(recipe.tokens_per_step) for p in paths},
        }
    if ratios:
        report["ratio_service_over_local"] = statistics.median(ratios)
        report["round_ratios"] = ratios
    return report


@contextmanager
def _readers(recipe: Recipe, paths: tuple[str, ...], **service_kw: Any) -> Iterator[dict[str, _Reader]]:
    readers: dict[str, _Reader] = {}
    with (
        _maybe(_local_reader(recipe) if "local" in paths else None) as local,
        _maybe(_service_reader(recipe, **service_kw) if "service" in paths else None) as service,
    ):
        if local is not None:
            readers["local"] = local
        if service is not None:
            readers["service"] = service
        yield readers


@contextmanager
def _maybe(cm: Any) -> Iterator[Any]:
    if cm is None:
        yield None
    else:
        with cm as value:
            yield value


def format_report(report: dict[str, Any]) -> list[str]:
    lines = [
        f"recipe      {report['recipe']} (fingerprint {report['fingerprint'][:12]}), "
        f"{report['tokens_per_step']} tokens/step, {report['rounds']} x {report['steps_per_round']} steps timed "
        f"after {report['warmup']} warm-up"
    ]
    for p, s in report["paths"].items():
        lines.append(
            f"{p:<8}    {s['tokens_per_s'] / 1e6:.3f} M tokens/s, {s['steps_per_s']:.2f} steps/s, step latency "
            f"p50 {s['step_latency_p50_ms']:.1f} ms p99 {s['step_latency_p99_ms']:.1f} ms; first steps "
            f"{s['first_steps_s']:.2f} s; step {s['last_step']} digest {s['last_digest']}"
        )
    if "ratio_service_over_local" in report:
        lines.append(
            f"ratio       service/local {report['ratio_service_over_local']:.3f} (median of "
            f"{len(report['round_ratios'])} alternating rounds)"
        )
    return lines


__all__ = ["PathResult", "VIAS", "format_report", "run_bench"]
