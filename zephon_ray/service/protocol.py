"""What clients, node readers and the coordinator say to each other, and how the service's actors are named.

Shared by both sides, so the client imports this and never a server class (tests/test_service_client.py).

    client ──read(step, consumer, rank, world, track)──► NodeReader (one per node) ──lease(first, n, lanes, ...)──►
        ◄── (step, generation, lane refs) ─────────────────┘  ◄── LeaseReply: up to n steps of refs ──── Coordinator
    lane refs ──ray.get──► producer's object store (zero-copy on the same node)

- A **cursor move** is ``(consumer, rank, world, step, idle_s)``: rank ``rank`` of ``world`` took ``step``, and was
  last heard ``idle_s`` seconds ago. Node readers batch them onto their leases (:data:`CursorMove`).
- A **lease reply** is ``{"steps": [(step, generation, lanes), ...], "keep_from": k}``: consecutive steps from the
  first one asked for, each with the generation that made it (:data:`REPLAYED` for a replay) and its lane refs
  (``None`` outside the lanes asked for). ``keep_from`` is the oldest step the coordinator still holds.
- Actor names: ``<service>.producer.<instance>.g<G>.<i>``, ``<service>.replayer.<instance>.<i>``,
  ``<service>.reader.<instance>.<node id>``.
- The actor classes clients hold handles of are thin shells in actors.py.
"""

from __future__ import annotations

from typing import Any

CursorMove = tuple[str, int, int, int, float]
"""(consumer, rank, world, step, idle_s)."""
StepLanes = tuple[int, int, list]
"""(step, generation, lanes): lane refs of one step, None where not asked for."""

KEY_STEPS = "steps"
KEY_KEEP_FROM = "keep_from"
REPLAYED = -1
"""The generation of a step served by a Replayer (its shards die with that replayer, not with a producer group)."""

PRODUCER_INFIX = ".producer."
REPLAYER_INFIX = ".replayer."
READER_INFIX = ".reader."
HELPER_INFIXES = (PRODUCER_INFIX, REPLAYER_INFIX, READER_INFIX)


def lease_reply(steps: list[StepLanes], keep_from: int) -> dict[str, Any]:
    return {KEY_STEPS: steps, KEY_KEEP_FROM: keep_from}


def only_lanes(lanes: list[Any], lo: int, hi: int) -> list[Any]:
    """``lanes`` with None outside ``[lo, hi)``: every ref passed on costs its owner a borrower registration."""
    return [ref if lo <= i < hi else None for i, ref in enumerate(lanes)]


def kill_named(name: str, namespace: str, infixes: tuple[str, ...] = HELPER_INFIXES) -> int:
    """Kill the service's helper actors ("<service><infix>...") left by a dead incarnation or a failed start."""
    import ray

    killed = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        actor_name = entry.get("name", "")
        if entry.get("namespace") == namespace and any(actor_name.startswith(name + i) for i in infixes):
            try:
                ray.kill(ray.get_actor(actor_name, namespace=namespace), no_restart=True)
                killed += 1
            except Exception:  # noqa: BLE001 - already gone
                pass
    return killed


READS = "reads"
"""Concurrency group of the coordinator's leases: its own event loop, so control calls never queue behind them."""
CONTROL = "control"
CONTROL_CONCURRENCY = 64
