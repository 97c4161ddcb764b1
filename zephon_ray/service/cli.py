"""``zephon-ray serve | status | stop`` and ``zephon-ray digest --via service``.

Without ``--address`` the ``digest`` command starts a private local Ray (its own temp dir) and shuts it down
again; ``serve``/``status``/``stop`` attach to an existing cluster (``--address``, ``RAY_ADDRESS`` or the one
this process runs in, e.g. a ``ray job submit`` job) and never start one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator

from zephon_ray.recipe import Recipe
from zephon_ray.service.config import DEFAULT_NAME, DEFAULT_NAMESPACE, HOSTED_STORE, ServiceConfig
from zephon_ray.service.errors import ServiceError


@contextlib.contextmanager
def ray_session(address: str | None, *, private_if_none: bool) -> Iterator[None]:
    """Attach to ``address`` (or the ambient cluster), or start a private local Ray when asked to."""
    import ray

    if ray.is_initialized():
        yield
        return
    temp_dir = None
    quiet = {"log_to_driver": False, "logging_level": "ERROR"}
    if address is None and private_if_none and not os.environ.get("RAY_ADDRESS"):
        temp_dir = tempfile.mkdtemp(prefix="zephon-ray-local-", dir="/tmp")
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 _temp_dir=temp_dir, **quiet)
    else:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", **quiet)
    try:
        yield
    finally:
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _fail(message: str) -> int:
    print(f"zephon-ray: error: {message}", file=sys.stderr)
    return 2


def digest_via_service(recipe: Recipe, steps: range, args: argparse.Namespace) -> int:
    """Print ``step <s> <sha256>`` per step, read through the service (started here unless ``--name``)."""
    from zephon_ray.service.client import DataService

    producers = getattr(args, "producers", 1) or 1
    if not getattr(args, "name", None):  # bad settings fail here, before a Ray cluster is started for nothing
        ServiceConfig(producers=producers, run_id="check", aggregate_store=HOSTED_STORE).for_recipe(recipe)
    try:
        with ray_session(getattr(args, "address", None), private_if_none=True):
            if getattr(args, "name", None):
                svc = DataService.connect(args.name, namespace=args.namespace)
                if svc.recipe.fingerprint != recipe.fingerprint:
                    return _fail(f"service {args.name!r} serves recipe fingerprint {svc.recipe.fingerprint[:12]}, "
                                 f"not {recipe.describe()}")
                owned, state_dir = False, None
            else:
                run = f"digest-{uuid.uuid4().hex[:8]}"
                state_dir = tempfile.mkdtemp(prefix=f"zephon-ray-{run}-")
                aggregate = {}
                if producers > 1 and recipe.aggregate.store is None and recipe.aggregate.dir is None:
                    aggregate = {"aggregate_store": HOSTED_STORE}
                svc = DataService.start(recipe, name=run, namespace=args.namespace or DEFAULT_NAMESPACE,
                                        producers=producers, state_dir=state_dir, run_id=run, **aggregate)
                owned = True
            try:
                for step in steps:
                    print(f"step {step} {svc.batch(step).digest}", flush=True)
            finally:
                if owned:
                    svc.stop()
                    shutil.rmtree(state_dir, ignore_errors=True)
    except (ServiceError, ConnectionError) as exc:
        return _fail(str(exc))
    return 0


# ---------------------------------------------------------------------- serve / status / stop
def cmd_serve(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    recipe = Recipe.from_toml(args.recipe)
    try:
        with ray_session(args.address, private_if_none=False):
            svc = DataService.start(
                recipe, name=args.name, namespace=args.namespace, producers=args.producers, window=args.window,
                state_dir=args.state_dir, checkpoint_every=args.checkpoint_every,
                aggregate_store=args.aggregate_store, aggregate_dir=args.aggregate_dir, run_id=args.run_id,
            )
            status = svc.status()
            print(f"serving {recipe.describe()} as {args.name!r} in namespace {args.namespace!r}: "
                  f"{len(status['producers'])} producers, window {status['window']['size']}, "
                  f"state_dir {status['state_dir']}, starting at step {status['start']['start_step']}", flush=True)
            if args.block:
                import time

                while True:  # until `zephon-ray stop` (the coordinator goes away) or Ctrl-C
                    time.sleep(5)
                    svc.status()
    except (ServiceError, ConnectionError) as exc:
        if args.block and "not running" in str(exc):
            return 0
        return _fail(str(exc))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    try:
        with ray_session(args.address, private_if_none=False):
            status = DataService.connect(args.name, namespace=args.namespace, timeout_s=args.wait).status()
    except (ServiceError, ConnectionError) as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True, default=str))
        return 0
    w, t, c = status["window"], status["throughput"], status["checkpoints"]
    print(f"service     {status['name']} (namespace {status['namespace']})  recipe {status['fingerprint'][:12]}")
    print(f"producers   {len(status['producers'])} (generation {status['generation']}, restarts {status['restarts']})"
          + "".join(f"\n  #{p['index']} pid {p['pid']} lanes {p['lanes']}" for p in status["producers"]))
    print(f"window      {w['size']} steps from {w['low']}; next {w['next_step']}; held {w['held_steps']} "
          f"{w['held_bytes']} B (peak {w['peak_held_bytes']}, bound {w['bound_bytes']})")
    for cur in status["cursors"]:
        print(f"cursor      {cur['consumer']} rank {cur['rank']}/{cur['world']} at {cur['step']} "
              f"(idle {cur['idle_s']}s{'' if cur['live'] else ', expired'})")
    rate = f"{t['tokens_per_s']:.0f} tokens/s" if t["tokens_per_s"] else "n/a"
    print(f"throughput  {t['produced_steps']} steps, {rate}")
    print(f"durable     {c['count']} checkpoints every {c['every']} (latest {c['latest']}); "
          f"latest commit {status['commits']['latest_durable_step']}; state_dir {status['state_dir']}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    try:
        with ray_session(args.address, private_if_none=False):
            DataService.connect(args.name, namespace=args.namespace, timeout_s=0).stop()
    except (ServiceError, ConnectionError) as exc:
        return _fail(str(exc))
    print(f"stopped {args.name!r} (namespace {args.namespace!r})")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=DEFAULT_NAME, help="service (coordinator actor) name")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Ray namespace of the service")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or the running cluster)")


def add_service_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the data service (a named, detached coordinator) on a Ray cluster")
    p.add_argument("recipe")
    _common(p)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--state-dir", default=None, help="durable state; reuse it to resume after a restart")
    p.add_argument("--checkpoint-every", type=int, default=8)
    p.add_argument("--aggregate-store", default=None, help="torch:// (hosted by the service) or torch://host:port")
    p.add_argument("--aggregate-dir", default=None)
    p.add_argument("--run-id", default=None)
    p.add_argument("--block", action="store_true", help="stay in the foreground until the service is stopped")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="report a running service")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the service to appear")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("stop", help="stop a running service (its state_dir stays)")
    _common(p)
    p.set_defaults(func=cmd_stop)
