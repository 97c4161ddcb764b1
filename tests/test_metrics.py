"""The service's Ray metrics, read where an operator reads them: the private cluster's Prometheus endpoint
(each node's metrics agent, ``http://<node>:<MetricsExportPort>/metrics``), never our own counters.

One service (2 producers, tags service/run_id) serves steps to a tracked reader, replays an evicted step, loses a
producer to kill -9 and writes durable checkpoints; every metric of zephon_ray/service/server/metrics.py must then show
up with those tags and plausible values, and the gauges must still be there after the service sat idle for
2.5 of Ray's gauge lifetimes. The batches are checked against the reference digests on the way.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import pytest

from zephon_ray import DataService

pytestmark = pytest.mark.timeout(400)
NAME, RUN_ID = "metrics-svc", "metrics-run"
SAMPLE_RE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\} (?P<value>\S+)$")
LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(ray) -> dict[str, float]:
    """Prometheus text from every node's metrics endpoint -> {series name: value summed over this service's
    series}. Ray prefixes application metrics with ``ray_``."""
    totals: dict[str, float] = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for line in text.splitlines():
            m = SAMPLE_RE.match(line)
            if not m or "zephon_ray_" not in m["name"]:
                continue
            labels = dict(LABEL_RE.findall(m["labels"]))
            if labels.get("service") != NAME or labels.get("run_id") != RUN_ID:
                continue
            if m["name"].endswith("_bucket"):
                continue
            totals[m["name"]] = totals.get(m["name"], 0.0) + float(m["value"])
    return totals


EXPECTED = {  # series -> minimum value once the scenario below ran
    "ray_zephon_ray_steps_produced_total": 8,
    "ray_zephon_ray_tokens_produced_total": 8 * 1024,
    "ray_zephon_ray_window_held_steps": 1,
    "ray_zephon_ray_window_held_bytes": 1,
    "ray_zephon_ray_consumer_wait_seconds_count": 2,  # one per lease (node reader or direct read), not per read
    "ray_zephon_ray_replays_total": 1,
    "ray_zephon_ray_replay_steps_count": 1,
    "ray_zephon_ray_producer_restarts_total": 1,
    "ray_zephon_ray_producer_deaths_total": 1,
    "ray_zephon_ray_checkpoint_write_seconds_count": 1,
}


@pytest.mark.heavy
def test_metrics_on_the_prometheus_endpoint(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    svc = DataService.start(
        tiny_recipe,
        name=NAME,
        namespace="zr-metrics",
        producers=2,
        window=2,
        checkpoint_every=2,
        state_dir=tmp_path / "state",
        aggregate_store="torch://",
        run_id=RUN_ID,
        consumer="trainer",
        retain_behind=0,
    )
    try:
        for step in range(8):
            assert svc.slice(step, 0, 1, track=True).tokens.shape[0] == 16
            if step == 4:  # a producer dies: the group is replaced from the newest durable checkpoint
                pids = [p["pid"] for p in svc.status()["producers"]]
                os.kill(pids[0], signal.SIGKILL)
        assert svc.batch(1).digest == reference_digests[1]  # evicted long ago: served by a replay
        status = svc.status()
        assert status["restarts"] >= 1 and status["replay"]["submitted"] >= 1, status

        deadline = time.monotonic() + 120  # Ray exports every few seconds (RAY_metrics_report_interval_ms)
        while True:
            seen = scrape(ray_cluster)
            short = {k: (seen.get(k), low) for k, low in EXPECTED.items() if seen.get(k, -1) < low}
            if not short and "ray_zephon_ray_window_fill" in seen:
                break
            assert time.monotonic() < deadline, f"metrics missing or too low (seen, expected): {short}"
            time.sleep(2)
        # Idle now (window full, nobody reading): Ray drops a gauge not set for two export intervals, so the
        # gauges must be set again while nothing is produced.
        time.sleep(2.5 * 2 * int(os.environ["RAY_metrics_report_interval_ms"]) / 1000)
        idle = scrape(ray_cluster)
        gauges = ["ray_zephon_ray_window_fill", "ray_zephon_ray_window_held_steps", "ray_zephon_ray_window_held_bytes"]
        assert all(g in idle for g in gauges), f"gauges gone while idle: {sorted(set(gauges) - set(idle))}"
        assert seen["ray_zephon_ray_producer_deaths_total"] <= seen["ray_zephon_ray_producer_restarts_total"]
        assert seen["ray_zephon_ray_checkpoint_write_seconds_sum"] > 0
        print("metrics:", {k: seen[k] for k in sorted(seen)})
    finally:
        svc.stop()


def test_grafana_panel_queries_only_metrics_we_export():
    """service/grafana_panel.json must not drift from metrics.py: every series it queries is one we define."""
    import json
    from pathlib import Path

    from conftest import ROOT

    from zephon_ray.service.server import metrics

    defined = set(re.findall(r'(?:counter|gauge|histogram)\(\s*"(\w+)"', Path(metrics.__file__).read_text()))
    assert defined == set(re.findall(r"zephon_ray_(\w+)", metrics.__doc__)), "metrics.py's table is stale"
    dashboard = json.loads((ROOT / "service" / "grafana_panel.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {
        re.sub(r"_(total|bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"ray_zephon_ray_(\w+)", e)
    }
    assert queried and queried <= defined, queried - defined
    assert defined - {"window_held_steps"} <= queried, f"metrics without a panel: {defined - queried}"
