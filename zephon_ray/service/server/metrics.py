"""Ray metrics of the data service (``ray.util.metrics``), exported by every Ray node in Prometheus format.

    zephon_ray_steps_produced            counter    steps the producers finished (filed or skipped past)
    zephon_ray_tokens_produced           counter    their tokens
    zephon_ray_window_fill               gauge      steps ready at or ahead of the slowest live cursor / window
    zephon_ray_window_held_steps         gauge      steps in the table (window plus retained ones behind it)
    zephon_ray_window_held_bytes         gauge      their bytes in the object store
    zephon_ray_consumer_wait_seconds     histogram  how long a lease waited for its first step to be produced
    zephon_ray_replays                   counter    past steps replayed (restore + replay in a Replayer)
    zephon_ray_replay_steps              histogram  steps replayed per replay (<= anchor interval)
    zephon_ray_producer_restarts         counter    producer-group replacements, any cause
    zephon_ray_producer_deaths           counter    of those, the ones caused by a dead producer actor
    zephon_ray_checkpoint_write_seconds  histogram  durable checkpoint writes under state_dir (atomic, fsynced)

Every series carries the tags ``service`` (the service name) and ``run_id`` (``-`` when the service has none).
Ray's Prometheus exporter adds its own suffixes (``_total`` on counters, ``_bucket``/``_sum``/``_count`` on
histograms); ``service/grafana_panel.json`` queries them. The coordinator holds one :class:`ServiceMetrics`
(``NO_METRICS`` is the pool's and the replay scheduling's until it hands them its own).

Guarantee: gauges are set by the coordinator's pump every 1-2 s while the service runs, idle or not
(``GAUGE_REFRESH_S``): Ray 2.60's metrics agent drops a gauge that was not set for two export intervals (Ray's
``open_telemetry_metric_recorder.py``: TTL = 2 × the export interval), so a gauge set only when steps are produced
would vanish from Prometheus whenever the window sits full.

Limits: Ray exports metrics every few seconds (``RAY_metrics_report_interval_ms``, 10 s by default), so a scrape
lags by that much; the consumer wait is measured in the coordinator per lease (a node reader's lease serves the
ranks of its node for up to ``lease_steps`` steps; a direct read is a lease of one step), from its arrival to its
first step being in the table or replayed, so it excludes the ranks' transfer of the shards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

PREFIX = "zephon_ray_"
TAG_KEYS = ("service", "run_id")
WAIT_BOUNDARIES_S = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0]
REPLAY_BOUNDARIES_STEPS: list[float] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
CHECKPOINT_BOUNDARIES_S = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]
GAUGE_REFRESH_S = 1.0
"""The pump sets the gauges (one place, not per produced step) at most this often while busy, and every time it
wakes while idle (2 s). Ray evicts a gauge not set for two export intervals (20 s at Ray's default); at a 1 s
interval, the least Ray allows, an idle gauge may blink out between two sets."""
T = TypeVar("T")


class NoMetrics:
    """The same calls, recording nothing (components used outside a service, unit tests)."""

    def produced(self, steps: int, tokens: int) -> None:
        pass

    def window_gauges(self, window: Any) -> None:
        pass

    def consumer_wait(self, seconds: float) -> None:
        pass

    def replay(self, steps: int) -> None:
        pass

    def producer_restart(self, *, death: bool) -> None:
        pass

    def time_checkpoint(self, write: Callable[..., T], *args: Any) -> T:
        return write(*args)


NO_METRICS = NoMetrics()


class ServiceMetrics(NoMetrics):
    """The service's metrics, created once per coordinator incarnation (Ray aggregates by name and tags)."""

    def __init__(self, service: str, run_id: str | None) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.tags = {"service": service, "run_id": run_id or "-"}

        def counter(name: str, description: str) -> Counter:
            metric = Counter(PREFIX + name, description=description, tag_keys=TAG_KEYS)
            metric.set_default_tags(self.tags)
            return metric

        def gauge(name: str, description: str) -> Gauge:
            metric = Gauge(PREFIX + name, description=description, tag_keys=TAG_KEYS)
            metric.set_default_tags(self.tags)
            return metric

        def histogram(name: str, description: str, boundaries: list[float]) -> Histogram:
            metric = Histogram(PREFIX + name, description=description, boundaries=boundaries, tag_keys=TAG_KEYS)
            metric.set_default_tags(self.tags)
            return metric

        self._steps = counter("steps_produced", "Global-batch steps the producers finished")
        self._tokens = counter("tokens_produced", "Tokens in the steps the producers finished")
        self._fill = gauge("window_fill", "Steps ready at or ahead of the slowest live cursor, over the window size")
        self._held_steps = gauge("window_held_steps", "Steps held in the object store (window + retained)")
        self._held_bytes = gauge("window_held_bytes", "Bytes of the steps held in the object store")
        self._wait = histogram(
            "consumer_wait_seconds", "Time a lease waited for its first step to be produced", WAIT_BOUNDARIES_S
        )
        self._replays = counter("replays", "Past steps served by restore + replay")
        self._replay_steps = histogram("replay_steps", "Steps replayed per replay", REPLAY_BOUNDARIES_STEPS)
        self._restarts = counter("producer_restarts", "Producer-group replacements, any cause")
        self._deaths = counter("producer_deaths", "Producer-group replacements caused by a dead producer actor")
        self._ckpt = histogram(
            "checkpoint_write_seconds", "Durable checkpoint write time under state_dir", CHECKPOINT_BOUNDARIES_S
        )

    @classmethod
    def for_config(cls, config: Any) -> ServiceMetrics:
        return cls(config.name, config.run_id)

    def produced(self, steps: int, tokens: int) -> None:
        self._steps.inc(steps)
        self._tokens.inc(tokens)

    def window_gauges(self, window: Any) -> None:
        """Set the gauges from ``window`` (a StepWindow); call with its lock held."""
        ready = sum(1 for s in window.table if s >= window.slowest)
        self._fill.set(min(1.0, ready / window.window))
        self._held_steps.set(len(window.table))
        self._held_bytes.set(window.held_bytes)

    def consumer_wait(self, seconds: float) -> None:
        self._wait.observe(max(0.0, seconds))

    def replay(self, steps: int) -> None:
        self._replays.inc()
        self._replay_steps.observe(max(0, steps))

    def producer_restart(self, *, death: bool) -> None:
        self._restarts.inc()
        if death:
            self._deaths.inc()

    def time_checkpoint(self, write: Callable[..., T], *args: Any) -> T:
        start = time.perf_counter()
        result = write(*args)
        self._ckpt.observe(time.perf_counter() - start)
        return result
