"""All-gather of small JSON values between the lane groups of one run, over the channel their Zephon checkpoints
already use (``LaneGroup.aggregate_store``: a c10d TCPStore; or ``aggregate_dir``: a shared directory or URI).

Used at mixture-phase boundaries and checkpoints (:mod:`zephon_ray.lanes`, "Phases"), where every group needs every
lane's last contributing chunk. Guarantee: ``gather(group, key, value)`` returns every group's value for ``key``, in
group order, or raises :class:`ExchangeError` naming the key and the groups missing after
``group.aggregate_timeout_s``. Values are kept per lane-group count (group g of G owns other lanes at another G), and
keys must name values that are a pure function of the run and that count (the phases' are), so a key left over from
an earlier attempt (a restart replaying the same boundary) holds the same value and is harmless, and one left by a
run at another count (a resume at another W) is never read.
``forget(group, key)`` deletes the group's own value once every group has read it (a checkpoint's values, from the
next checkpoint on), so a long run does not leave one key or file per group and checkpoint behind. Limits: every
group must call it with the same key (the lane groups of a run step in lock-step, as their collective Zephon
checkpoints require); the directory channel polls every 20 ms.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from datetime import timedelta
from typing import Any

from zephon_ray import storage
from zephon_ray.errors import best_effort
from zephon_ray.pipeline import LaneGroup

log = logging.getLogger(__name__)

PREFIX = "zephon-ray-lanes"
POLL_S = 0.02


class ExchangeError(RuntimeError):
    """A lane group's value did not arrive in time; the message names the key and the groups."""


def gather(group: LaneGroup, key: str, value: Any) -> list[Any]:
    if group.count == 1:
        return [value]
    name = _name(group, key)
    if group.aggregate_store is not None:
        return _gather_store(group, name, value)
    return _gather_dir(group, name, value)


def forget(group: LaneGroup, key: str) -> None:
    """Delete this group's value for ``key``. Call it only once every group has read that key: a lane group forgets its
    last checkpoint's key after its next collective Zephon checkpoint, which no group finishes before every group has
    finished the last one. Best effort: a value that outlives a failure is harmless (the module docstring)."""
    if group.count == 1:
        return
    name = _name(group, key)
    with best_effort(log, "a lane exchange value left behind is harmless; the next checkpoint goes on"):
        if group.aggregate_store is not None:
            _connect(group).delete_key(f"{name}/{group.index}")
        else:
            base = storage.location(group.aggregate_dir or "").join(name)
            storage.delete(base.join(f"group-{group.index}.json"))
            if not base.remote:
                with contextlib.suppress(OSError):  # not empty yet: the last group to forget removes it
                    os.rmdir(base.path)


def _name(group: LaneGroup, key: str) -> str:
    # Group g of G holds other lanes at another G: a run resumed at another lane-group count (a new W in local mode)
    # must not read the values its earlier count left under the same key (tests/test_lane_exchange.py).
    return f"{PREFIX}/{group.run_id}/{group.count}-groups/{key}"


def _connect(group: LaneGroup) -> Any:
    from torch.distributed import TCPStore

    host, port = _store_address(group.aggregate_store or "")
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=group.aggregate_timeout_s))


def _store_address(spec: str) -> tuple[str, int]:
    rest = spec[len("torch://") :] if spec.startswith("torch://") else spec
    if not rest:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    host, _, port = rest.rpartition(":")
    return host, int(port)


def _gather_store(group: LaneGroup, name: str, value: Any) -> list[Any]:
    store = _connect(group)
    store.set(f"{name}/{group.index}", json.dumps(value))
    out = []
    for index in range(group.count):
        try:
            out.append(json.loads(store.get(f"{name}/{index}")))
        except Exception as exc:  # noqa: BLE001 - c10d raises its own timeout types
            raise ExchangeError(
                f"lane group {index} of {group.count} sent no '{name}' within "
                f"{group.aggregate_timeout_s:g} s ({type(exc).__name__})"
            ) from None
    return out


def _gather_dir(group: LaneGroup, name: str, value: Any) -> list[Any]:
    base = storage.location(group.aggregate_dir or "").join(name)
    storage.write_json(base.join(f"group-{group.index}.json"), value, compact=True)
    deadline = time.monotonic() + group.aggregate_timeout_s
    out: dict[int, Any] = {}
    while True:
        for index in range(group.count):
            if index not in out and storage.exists(base.join(f"group-{index}.json")):
                raw = storage.read_bytes(base.join(f"group-{index}.json"), limit=1 << 20)
                if raw:  # az:// shows a new blob empty until its upload commits (storage.operations)
                    out[index] = json.loads(raw)
        if len(out) == group.count:
            return [out[i] for i in range(group.count)]
        if time.monotonic() > deadline:
            missing = sorted(set(range(group.count)) - set(out))
            raise ExchangeError(
                f"lane groups {missing} of {group.count} wrote no '{name}' under "
                f"{group.aggregate_dir} within {group.aggregate_timeout_s:g} s"
            )
        time.sleep(POLL_S)
