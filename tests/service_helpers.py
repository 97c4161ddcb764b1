"""The service tests' shared helpers: one namespace, a start with the tests' defaults, and lookups by name."""

from __future__ import annotations

import json
import time

from zephon_ray import DataService

NS = "zr-tests"


def start_service(recipe, tmp_path, name, **kw):
    """``DataService.start`` with a small window and checkpoint interval, its state_dir under ``tmp_path``."""
    kw.setdefault("window", 4)
    kw.setdefault("checkpoint_every", 4)
    if kw.get("producers", 1) > 1:
        if "aggregate_dir" not in kw:
            kw.setdefault("aggregate_store", "torch://")
        kw.setdefault("run_id", name)
    return DataService.start(recipe, name=name, namespace=NS, state_dir=kw.pop("state_dir", tmp_path / name), **kw)


def replayer_actors(name):
    """The live Replayer actors of service ``name``, from Ray's table of named actors."""
    import ray

    from zephon_ray.service.wire import REPLAYER_INFIX

    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NS and a["name"].startswith(name + REPLAYER_INFIX)
    ]


def live_pids(svc, timeout=60.0):
    """The service's status and its producers' pids, once every producer has reported one."""
    deadline = time.monotonic() + timeout
    while True:
        status = svc.status()
        pids = [p["pid"] for p in status["producers"]]
        if all(pids):
            return status, pids
        assert time.monotonic() < deadline, f"producers never reported their pids: {status['producers']}"
        time.sleep(0.2)


def status_detail(
    svc,
    keys=(
        "fatal",
        "generation",
        "restarts",
        "last_restart",
        "hung_replacements",
        "producers",
        "window",
        "cursors",
        "reads",
        "replay",
        "replayers",
    ),
):
    """A ``detail`` for a hang's failure (conftest.run_readers): the service's status, as far as it answers, and the
    cluster's free resources (an actor that cannot be placed waits for them)."""

    def detail() -> str:
        import ray

        try:
            status = svc.status()
        except Exception as exc:  # noqa: BLE001 - the failure being reported matters more than this one
            return f"\nservice status: not read: {type(exc).__name__}: {exc}"
        return (
            "\nservice status: "
            + json.dumps({k: status.get(k) for k in keys}, default=str)
            + f"\nfree resources: {ray.available_resources()}"
        )

    return detail
