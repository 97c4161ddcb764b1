"""``zephon-ray serve | status | stop | rescale | add-phase | release`` and ``zephon-ray digest --via service``.

``serve`` has one flag per :class:`ServiceConfig` field (``--window``, ``--consumer-ttl-s``, ...; nested
``resources`` fields as ``--resources.producer-num-cpus``), generated from the dataclass so that it cannot drift. ``status`` prints a table of
whatever ``DataService.status()`` reports (known sections first, any others after), or JSON with ``--json``.

Without ``--address`` the ``digest`` command starts a private local Ray (its own temp dir) and shuts it down
again; ``serve``/``status``/``stop`` attach to an existing cluster (``--address``, ``RAY_ADDRESS`` or the one
this process runs in, e.g. a ``ray job submit`` job) and never start one.

Storage settings reach the actors these commands start: ``ray_session`` (service/client/session.py) attaches with
``runtime_env={"env_vars": storage.worker_environment()}`` (endpoints, region, addressing style, account names, retry
settings; never a secret, a profile name or a local path), so a cluster started before the exports still sees the
endpoint. Credentials come from the nodes themselves.

Limits: ``serve`` needs a running cluster (it starts none); errors: the commands raise (a ``ServiceError`` such as "no service of that name", a ``ValueError`` for a bad count,
weight or phase, a ``ConnectionError`` for an unreachable cluster) and ``main`` reports each as one line, exit 2
(errors.py; a worker-side storage failure as one line naming the object and the likely cause).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import typing
import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

from zephon_ray.cli.schedule import SCHEDULE_FROM_HELP, load_recipe
from zephon_ray.docstrings import attribute_docs
from zephon_ray.errors import UserInputError
from zephon_ray.recipe import Recipe
from zephon_ray.service.client.session import ray_session, starts_private_cluster
from zephon_ray.service.config import DEFAULT_NAME, DEFAULT_NAMESPACE, ActorResources, ServiceConfig
from zephon_ray.service.errors import ServiceNotFoundError


def digest_via_service(recipe: Recipe, steps: range, args: argparse.Namespace) -> int:
    """Print ``step <s> <sha256>`` per step, read through the service (started here unless ``--name``)."""
    from zephon_ray.progress import note, step_bar
    from zephon_ray.service.client import DataService

    producers = getattr(args, "producers", 1) or 1
    if not getattr(args, "name", None):  # bad settings fail here, before a Ray cluster is started for nothing
        ServiceConfig.build(recipe, producers=producers)
    # Starting Ray and a service takes tens of seconds before the first line: say so on stderr (stdout unchanged).
    if starts_private_cluster(getattr(args, "address", None), private_if_none=True):
        note("starting a private Ray cluster ...")
    with ray_session(getattr(args, "address", None), private_if_none=True):
        if getattr(args, "name", None):
            svc = DataService.connect(args.name, namespace=args.namespace)
            if svc.recipe.fingerprint != recipe.fingerprint:
                raise UserInputError(
                    f"service {args.name!r} serves recipe fingerprint "
                    f"{svc.recipe.fingerprint[:12]}, not {recipe.describe()}"
                )
            owned, state_dir = False, None
        else:
            note(f"starting the data service ({producers} producer(s)) ...")
            run = f"digest-{uuid.uuid4().hex[:8]}"
            state_dir = tempfile.mkdtemp(prefix=f"zephon-ray-{run}-")
            svc = DataService.start(
                recipe,
                name=run,
                namespace=args.namespace or DEFAULT_NAMESPACE,
                producers=producers,
                state_dir=state_dir,
            )  # run_id, store: defaults
            owned = True
        try:
            with step_bar(len(steps), "digest") as emit:
                for step in steps:
                    # our own service: read tracked so its window follows; someone else's: ad hoc, no cursor
                    emit(f"step {step} {svc.batch(step, track=owned).digest}")
        finally:
            if owned:
                note("stopping the data service ...")
                svc.stop()
                shutil.rmtree(cast(str, state_dir), ignore_errors=True)  # owned: ours, made above
    return 0


# ---------------------------------------------------------------------- serve / status / stop
def cmd_serve(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    recipe = load_recipe(args)
    fields = service_config_fields(args)
    ServiceConfig.build(recipe, **fields)  # every bad setting fails here, in one line, before touching Ray
    with ray_session(args.address, private_if_none=False):
        svc = DataService.start(recipe, **fields)
        status = svc.status()
        print(
            f"serving {recipe.describe()} as {fields['name']!r} in namespace {fields['namespace']!r}: "
            f"{len(status['producers'])} producer{'s' if len(status['producers']) != 1 else ''}, window "
            f"{status['window']['size']}, "
            f"state_dir {status['state_dir']}, starting at step {status['start']['start_step']}",
            flush=True,
        )
        if args.block:
            import time

            try:
                while True:  # until `zephon-ray stop` (the coordinator goes away) or Ctrl-C
                    time.sleep(5)
                    svc.status()
            except ServiceNotFoundError:
                return 0  # stopped (`zephon-ray stop`) while we watched it: a normal end of a blocking serve
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    with ray_session(args.address, private_if_none=False):
        status = DataService.connect(args.name, namespace=args.namespace, timeout_s=args.wait).status()
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True, default=str))
        return 0
    print(format_status(status))
    return 0


STATUS_ORDER = (
    "name",
    "namespace",
    "fingerprint",
    "recipe",
    "state_dir",
    "fatal",
    "generation",
    "restarts",
    "recycles",
    "replaced_without_room",
    "last_restart",
    "producers",
    "window",
    "cursors",
    "throughput",
    "checkpoints",
    "commits",
)
"""Sections printed first, in this order; any other key of ``status()`` follows, so new keys are never hidden."""
_LIST_SHOWN = 8


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        items = [_cell(v) for v in value]
        if len(items) > _LIST_SHOWN:
            items = items[:3] + ["..."] + items[-3:] + [f"({len(value)})"]
        return "[" + " ".join(items) + "]"
    if isinstance(value, dict):
        return "{" + " ".join(f"{k}={_cell(v)}" for k, v in value.items()) + "}"
    return "-" if value is None else str(value)


def window_fill(status: dict[str, Any]) -> str:
    """'ready/size steps ready at or ahead of the slowest live cursor (step s)', from status() alone."""
    window = status.get("window") or {}
    size, held = window.get("size"), window.get("held_steps")
    live = [c.get("step") for c in status.get("cursors") or window.get("cursors") or [] if c.get("live", True)]
    if not isinstance(size, int) or not isinstance(held, list):
        return "-"
    if not live:
        return f"{len(held)} steps held, no live cursor"
    slowest = min(live)
    ready = sum(1 for s in held if s >= slowest)
    return f"{ready}/{size} steps ready at or ahead of the slowest live cursor (step {slowest})"


def format_status(status: dict[str, Any]) -> str:
    """A human table of ``DataService.status()``: scalars on one line, dicts as ``key=value`` pairs, lists of
    dicts (producers, cursors) as aligned tables. Robust to keys it does not know."""
    lines: list[str] = []
    keys = [k for k in STATUS_ORDER if k in status] + sorted(k for k in status if k not in STATUS_ORDER)
    for key in keys:
        value = status[key]
        if key == "window" and isinstance(value, dict):
            lines.append(f"{'fill':<11} {window_fill(status)}")
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            columns = list(dict.fromkeys(c for row in value for c in row))
            cells = [[_cell(row.get(c)) for c in columns] for row in value]
            widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
            lines.append(f"{key:<11} {len(value)}")
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
            lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
        elif isinstance(value, dict):
            lines.append(f"{key:<11} {_cell(value)[1:-1]}")
        elif isinstance(value, list):
            lines.append(f"{key:<11} {len(value)} {_cell(value) if value else ''}".rstrip())
        else:
            lines.append(f"{key:<11} {_cell(value)}")
    return "\n".join(lines)


def cmd_stop(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    with ray_session(args.address, private_if_none=False):
        DataService.connect(args.name, namespace=args.namespace, timeout_s=0).stop()
    print(f"stopped {args.name!r} (namespace {args.namespace!r})")
    return 0


def parse_producers(text: str) -> int:
    """``rescale M``: M as a positive integer, or a ValueError naming it (checked before Ray is touched)."""
    try:
        producers = int(text)
    except ValueError:
        producers = 0
    if producers < 1 or str(producers) != text.strip().lstrip("+"):
        raise ValueError(
            f"rescale: producers must be a positive integer (a divisor of the recipe's lanes), got {text!r}"
        )
    return producers


def cmd_rescale(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    producers = parse_producers(args.producers)  # before Ray is touched
    with ray_session(args.address, private_if_none=False):
        svc = DataService.connect(args.name, namespace=args.namespace, timeout_s=0)
        svc.rescale(producers)  # ValueError (lanes, run_id, aggregation) before any remote change
        status = svc.status()
    print(
        f"rescaled {args.name!r} (namespace {args.namespace!r}) to {len(status['producers'])} producers "
        f"(generation {status['generation']}); batches are unchanged"
    )
    return 0


def parse_weights(items: list[str]) -> dict[str, float]:
    """``--weight SOURCE=W`` (repeated) as ``{source: W}``, or a ValueError naming the item (before Ray)."""
    out: dict[str, float] = {}
    for item in items or []:
        source, sep, value = item.partition("=")
        try:
            weight = float(value) if sep and source.strip() else None
        except ValueError:
            weight = None
        if weight is None:
            raise ValueError(f"add-phase: --weight {item!r} is not SOURCE=WEIGHT (e.g. --weight prose=0.2)")
        out[source.strip()] = weight
    if not out:
        raise ValueError("add-phase: give at least one --weight SOURCE=WEIGHT")
    return out


def cmd_add_phase(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    weights = parse_weights(args.weight)  # before Ray is touched
    with ray_session(args.address, private_if_none=False):
        svc = DataService.connect(args.name, namespace=args.namespace, timeout_s=0)
        result = svc.add_phase(args.phase, args.start_step, weights)  # a refusal: one ValueError naming the reader
    print(
        f"phase {args.phase!r} from step {args.start_step} added to {args.name!r} (namespace {args.namespace!r}) "
        f"in {result['applied_s']:.2f}s: fingerprint {result['fingerprint'][:12]}, steps made again from "
        f"{result['restart_from']}, dropped {len(result.get('dropped_steps', []))} produced steps"
    )
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from zephon_ray.service.client import DataService

    with ray_session(args.address, private_if_none=False):
        svc = DataService.connect(args.name, namespace=args.namespace, consumer=args.consumer, timeout_s=0)
        status = svc.status()
        known = sorted(set(status["cursor_summary"]) | set(status["commits"]["per_consumer"]))
        if args.consumer not in known:
            raise UserInputError(
                f"service {args.name!r} has no consumer {args.consumer!r} (consumers with cursors or "
                f"commits: {', '.join(map(repr, known[:20])) or 'none'})"
            )
        svc.release()
    print(f"released consumer {args.consumer!r} of {args.name!r}: it no longer holds the window back")
    return 0


# ---------------------------------------------------------------------- serve flags from ServiceConfig
NESTED_PREFIX = "resources."
_SERVE_DEST = "cfg__"
"""Prefix of the argparse dest of a generated flag (``cfg__window``, ``cfg__resources__producer_num_cpus``)."""


def _json_object(text: str) -> dict:
    """A ``dict`` field on the command line: a JSON object such as ``'{"head": 0.01}'``."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"head\": 0.01}}', got {text!r}")
    return value


_FLAG_TYPES: dict[type, Callable[[str], Any]] = {int: int, float: float, str: str, dict: _json_object}


def _flag_type(hint: Any) -> Any:
    """The argparse ``type`` for a field type such as ``int``, ``float | None``, ``str | None`` or ``dict``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if len(args) == 1 else typing.get_origin(hint) or hint
    if base not in _FLAG_TYPES and base is not bool:
        raise TypeError(f"ServiceConfig field type {hint!r} has no CLI mapping; extend _FLAG_TYPES")
    return base


def _config_flags(cls: type, prefix: str = "") -> Iterator[tuple[str, str, Any, Any, str]]:
    """(flag, dest, type, default, help) per field of ``cls``; nested dataclasses become ``--<field>.<sub>``."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _config_flags(cast(type, hint), prefix=f"{prefix}{f.name}.")
            continue
        kind = _flag_type(hint)
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = _SERVE_DEST + (prefix + f.name).replace(".", "__")
        doc = " ".join(docs.get(f.name, f"ServiceConfig.{prefix}{f.name}").split())
        doc = doc.replace("``", "").replace("%", "%%")  # plain text for a terminal; argparse formats with %
        yield flag, dest, kind, default, f"{doc} (default: {default})"


def add_service_config_flags(p: argparse.ArgumentParser) -> None:
    for flag, dest, kind, default, help_ in _config_flags(ServiceConfig):
        if kind is bool:
            p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            metavar = "JSON" if kind is dict else dest.rsplit("__", 1)[-1].upper()
            p.add_argument(flag, dest=dest, type=_FLAG_TYPES[kind], default=default, metavar=metavar, help=help_)


def service_config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServiceConfig``/``DataService.start`` keyword arguments given by the generated ``serve`` flags."""
    fields: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if not key.startswith(_SERVE_DEST):
            continue
        path = key[len(_SERVE_DEST) :].split("__")
        if len(path) == 1:
            fields[path[0]] = value
        else:
            nested.setdefault(path[0], {})[path[1]] = value
    for name, values in nested.items():
        fields[name] = {"resources": ActorResources}[name](**values)
    return fields


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=DEFAULT_NAME, help="service (coordinator actor) name")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Ray namespace of the service")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or the running cluster)")


def add_service_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the data service (a named, detached coordinator) on a Ray cluster")
    p.add_argument("recipe")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or the running cluster)")
    add_service_config_flags(p)  # --name, --namespace, --producers, --window, --state-dir, ... (every field)
    p.add_argument("--block", action="store_true", help="stay in the foreground until the service is stopped")
    p.add_argument("--schedule-from", metavar="STATE", help=SCHEDULE_FROM_HELP)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="report a running service")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the service to appear")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("stop", help="stop a running service (its state_dir stays)")
    _common(p)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("rescale", help="change the number of producer actors (must divide the lanes)")
    p.add_argument("producers", help="new producer count M (a divisor of the recipe's lanes)")
    _common(p)
    p.set_defaults(func=cmd_rescale)

    p = sub.add_parser(
        "add-phase",
        help="add a mixture phase to a running service (from a step no consumer "
        "has read yet; durable in its state_dir)",
    )
    p.add_argument("phase", help="the phase's name (unique in the schedule)")
    p.add_argument("--start-step", type=int, required=True, help="the first step of the phase")
    p.add_argument(
        "--weight",
        action="append",
        metavar="SOURCE=W",
        help="a source's weight from that step on (repeat; unnamed sources get 0)",
    )
    _common(p)
    p.set_defaults(func=cmd_add_phase)

    p = sub.add_parser("release", help="drop a consumer's cursors so it no longer holds the window back")
    p.add_argument("consumer", help="the consumer id, as `status` lists it")
    _common(p)
    p.set_defaults(func=cmd_release)
