"""What clients, node readers and the coordinator say to each other, and how the service's actors are named.

Both sides import it: the client, to send cursor moves and read replies, without importing anything of server/.

    client ──read(step, consumer, rank, world, track)──► NodeReader (one per node) ──lease(first, n, lanes, ...)──►
        ◄── (step, generation, lane refs) ─────────────────┘  ◄── lease Reply: up to n steps of refs ─── Coordinator
    lane refs ──ray.get──► producer's object store (zero-copy on the same node)

- A **cursor move** is a :class:`CursorMove` ``(consumer, rank, world, step, idle_s)``: rank ``rank`` of ``world``
  took ``step``, and was last heard ``idle_s`` seconds ago. Node readers batch them onto their leases.
- A step's shards travel as **containers**: each producer puts its L/M lane shards as *packs* (tuples of the shards of
  consecutive lanes, at most ``ServiceConfig.pack_bytes`` together: server/producer.py) and then one small object
  holding each lane's ref, the ref of the pack that holds it (the container). The coordinator holds only the M container
  refs of a step, so its bookkeeping per step grows with M, not with L; a reader fetches each pack it needs once
  (:func:`unpack`).
- A **lease reply** (coordinator -> node reader, or a direct client) is a :class:`Reply` of
  :class:`StepContainers` ``(step, generation, groups, containers)``: consecutive steps from the first one asked
  for, each with the generation that made it (:data:`REPLAYED` for a replay, one container of all L lanes), the
  number of containers (the M of that generation) and the container refs (``None`` for producers whose lanes
  were not asked for). ``keep_from`` is the oldest step the coordinator still holds.
- A **read reply** (node reader -> client process) is a :class:`Reply` of :class:`StepLanes`
  ``(step, generation, lanes)`` (``None`` for lanes not asked for).
- Moves, replies and their steps are named tuples: a field added with a default (say, a per-step count) changes
  no caller that does not read it, and they pickle across Ray calls as they are.
- Actor names: ``<service>.producer.<instance>.g<G>.<i>``, ``<service>.replayer.<instance>.<i>``,
  ``<service>.reader.<instance>.<node id>``; the concurrency groups of the coordinator: :data:`READS`,
  :data:`CONTROL`.

Limit: the same code version on both sides (nothing here is versioned); the actor classes clients hold handles of
are the shells in actor_shells.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from zephon_ray import checks
from zephon_ray.errors import best_effort

log = logging.getLogger("zephon_ray")


class CursorMove(NamedTuple):
    """Rank ``rank`` of ``world`` of ``consumer`` took ``step``; it was last heard ``idle_s`` seconds before this
    move was sent (the receiver dates the move back by that much)."""

    consumer: str
    rank: int
    world: int
    step: int
    idle_s: float = 0.0


class StepLanes(NamedTuple):
    """One step of a read reply: its lane refs, None where not asked for. Named fields, so that a field added
    later (with a default) changes no caller."""

    step: int
    generation: int
    lanes: list


class StepContainers(NamedTuple):
    """One step of a lease reply: its container refs (one per producer of ``generation``, ``groups`` of them),
    None for producers whose lanes were not asked for."""

    step: int
    generation: int
    groups: int
    containers: list


class Reply(NamedTuple):
    """A lease reply (``steps`` are :class:`StepContainers`) or a read reply (:class:`StepLanes`)."""

    steps: list
    keep_from: int


@dataclass
class HeldStep:
    """The lane refs a node reader or a client process holds of one step (None for lanes none of its ranks asked
    for), with the generation that made them."""

    generation: int
    lanes: list[Any]

    def has(self, lo: int, hi: int) -> bool:
        return all(self.lanes[i] is not None for i in range(lo, hi))


MAX_CONSUMER_NAME = 200
REPLAYED = -1
"""The generation of a step served by a Replayer (its shards die with that replayer, not with a producer group)."""

PRODUCER_INFIX = ".producer."
REPLAYER_INFIX = ".replayer."
READER_INFIX = ".reader."
HELPER_INFIXES = (PRODUCER_INFIX, REPLAYER_INFIX, READER_INFIX)


def check_consumer(consumer: Any) -> str:
    if not isinstance(consumer, str) or not consumer or len(consumer) > MAX_CONSUMER_NAME:
        raise ValueError(
            f"consumer must be a non-empty string of at most {MAX_CONSUMER_NAME} characters, got {consumer!r}"
        )
    return consumer


def check_batch_reader(rank: Any, world: Any, rows: int) -> tuple[int, int]:
    """(rank, world) of a reader of a ``rows``-row global batch (:func:`zephon_ray.checks.check_reader`, at most
    ``rows`` readers: every rank needs a row); ``rank=world=None`` means one reader of the whole batch (0, 1)."""
    if world is None and rank is None:
        return 0, 1
    return checks.check_reader(rank, world, max_world=rows, why_max="the global batch's rows: every rank needs one")


def lease_reply(steps: list, keep_from: int) -> Reply:
    return Reply(steps, int(keep_from))


def only_groups(containers: list[Any], lanes: int, lo: int, hi: int) -> list[Any]:
    """``containers`` (one per lane group of ``lanes // len(containers)`` lanes) with None for the groups that hold
    none of lanes ``[lo, hi)``."""
    per = lanes // len(containers)
    return [ref if g * per < hi and lo < (g + 1) * per else None for g, ref in enumerate(containers)]


def expand(groups: int, values: dict[int, list[Any]], lanes: int) -> list[Any]:
    """Lane refs from resolved containers ``{group: [its lanes' refs]}``; None for lanes of other groups."""
    per = lanes // groups
    out: list[Any] = [None] * lanes
    for g, refs in values.items():
        out[g * per : (g + 1) * per] = refs
    return out


def unpack(fetched: list[Any]) -> dict[int, Any]:
    """The lane shards in fetched packs (tuples of lane shards; a pack fetched twice counts once), by lane."""
    return {shard.lane: shard for pack in fetched for shard in pack}


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
            with best_effort(log, "already gone"):
                ray.kill(ray.get_actor(actor_name, namespace=namespace), no_restart=True)
                killed += 1
    return killed


READS = "reads"
"""Concurrency group of the coordinator's leases: its own event loop, so control calls never queue behind them."""
CONTROL = "control"
CONTROL_CONCURRENCY = 64
