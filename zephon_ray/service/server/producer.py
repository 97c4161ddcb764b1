"""A producer: one Ray actor that is one Zephon rank owning L/M contiguous lanes of the recipe.

    ProducerPool ──produce(s) / skip / checkpoint──► Producer ──ray.put──► packs of lane shards + container
                 ◄── shard_meta(s) + the container's ref ──┘

Guarantee: ``produce(s)`` puts this rank's lane shards of step s into the object store of its own node, as :func:`packs`
(consecutive lanes up to ``ServiceConfig.pack_bytes`` to an object), bit-identical to the same lanes of
``GlobalBatchSource(recipe).batch(s)``, and returns one small value: :func:`shard_meta` plus the ref of a container
holding each lane's ref, the ref of its pack (:data:`KEY_CONTAINER`; the coordinator's bookkeeping per step then grows
with the producers, not the lanes). The producer is the **owner** of its shards and the container, whatever their size
(``ray.put``, not return values: Ray inlines return values under 100 KiB into the caller, which would make the
coordinator own them). The coordinator only borrows the refs and passes them on; it never holds a shard's bytes. A
producer that dies takes its shards with it: the coordinator drops that generation's steps and the next group makes them
again. A failure in ``__init__`` (missing data, a bad tokenizer, an identity mismatch on this node) does not kill the
actor: ``info()`` reports it with the node, so the coordinator can report one configuration error instead of restarting
the group again and again.

The producer also holds its own refs of the last ``hold_steps`` steps it made (``held``): Ray 2.60 leaves one
entry behind in the owner's in-process memory store for every object whose last reference is dropped by a borrower
rather than by the owner (benchmarks/ray_memstore_leak.py): 5 entries per step of ``tiny`` in each producer
before. Holding the refs past every borrower makes the owner drop them last; it keeps those shards in the object
store for ``hold_steps`` steps (pool.py sizes it above what the coordinator and the node readers hold).
Limits: calls must come in step order (the actor is sequential and checks it); a producer cannot go back, the
coordinator replaces the whole group instead (see coordinator.py).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
from typing import Any

from zephon_ray.identity import verify_on_node
from zephon_ray.lanes import LaneShard, LaneStepper, first_step
from zephon_ray.pipeline import LaneGroup
from zephon_ray.recipe import Recipe
from zephon_ray.service.errors import describe

log = logging.getLogger("zephon_ray.service")


KEY_STEP = "step"
KEY_NBYTES = "nbytes"
KEY_TOKENS = "tokens"
KEY_CONTAINER = "container"


def shard_nbytes(shard: LaneShard) -> int:
    return int(shard.tokens.nbytes + shard.positions.nbytes + shard.source_tokens.nbytes)


def shard_meta(step: int, shards: list[LaneShard]) -> dict[str, int]:
    """The small value returned beside a step's shards: what the coordinator needs without their bytes."""
    return {
        KEY_STEP: step,
        KEY_NBYTES: sum(shard_nbytes(s) for s in shards),
        KEY_TOKENS: sum(int(s.tokens.size) for s in shards),
    }


def packs(shards: list[LaneShard], limit: int) -> list[tuple[LaneShard, ...]]:
    """``shards`` (consecutive lanes, in order, all of one shape) cut into runs of ``d`` lanes each: the largest
    divisor ``d`` of their count whose runs hold at most ``limit`` bytes (1 if none does). Equal runs that divide
    the group start at multiples of ``d``, so a node whose ranks read an aligned share of the lanes (8 ranks of a
    W = 64 job over 64 lanes: 8 lanes) fetches whole packs of its own lanes only. Why packs:
    ``ServiceConfig.pack_bytes``."""
    n = len(shards)
    largest = max((shard_nbytes(s) for s in shards), default=0)
    per = max((d for d in range(1, n + 1) if n % d == 0 and d * largest <= limit), default=1)
    return [tuple(shards[i : i + per]) for i in range(0, n, per)]


def put_shards(step: int, shards: list[LaneShard], pack_bytes: int, held: OwnedRefs | None = None) -> dict[str, Any]:
    """Put ``shards`` into this process's object store (this worker owns them) as :func:`packs`, then one small
    container object holding each lane's ref (the ref of the pack that holds it, so a pack's ref appears once per
    lane in it), and return their meta with the container's ref (wire.py: "containers"). ``held`` keeps this
    process's own refs for a while (:class:`OwnedRefs`)."""
    import ray

    lanes = [ref for run in packs(shards, pack_bytes) for ref in [ray.put(run)] * len(run)]
    container = ray.put(lanes)
    if held is not None:
        held.add(container, lanes)
    return {**shard_meta(step, shards), KEY_CONTAINER: container}


class OwnedRefs:
    """The owner's refs of the last ``steps`` puts, so that the owner, not a borrower, drops them last (see the
    module docstring: Ray 2.60 leaks a memory-store entry per object otherwise). Released container first, then its
    lanes: each is then freed by the owner's own release."""

    def __init__(self, steps: int) -> None:
        self.steps = max(0, int(steps))
        self._held: collections.deque[tuple[Any, list[Any]]] = collections.deque()

    def add(self, container: Any, lanes: list[Any]) -> None:
        if not self.steps:
            return
        self._held.append((container, lanes))
        while len(self._held) > self.steps:
            old_container, old_lanes = self._held.popleft()
            del old_container  # first, so that each lane is then freed by the release of its own last ref here
            del old_lanes

    def __len__(self) -> int:
        return len(self._held)


def worker_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_worker_id()
    except Exception:  # noqa: BLE001 - outside Ray
        return None


def node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray
        return None


def node_name() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return socket.gethostname()


class Producer:
    """Plain class; the coordinator wraps it with ``ray.remote`` and fractional CPUs."""

    def __init__(
        self,
        recipe: Recipe,
        group: LaneGroup,
        state: dict[str, Any] | None = None,
        *,
        storage_retry_s: float | None = None,
        hold_steps: int = 0,
        pack_bytes: int = 0,
    ) -> None:
        from zephon_ray import storage

        self.held = OwnedRefs(hold_steps)
        self.pack_bytes = pack_bytes
        self.lanes = group.owned_lanes(recipe.lanes)
        self.init_error: str | None = None
        if storage_retry_s is not None:
            storage.set_retry_budget(storage_retry_s)

        def start() -> LaneStepper:
            verify_on_node(recipe, where=f"producer for lanes {list(self.lanes)}")
            stepper = LaneStepper(recipe, group)
            stepper.keep_positions = True  # a running service may be given a phase (Coordinator.add_phase)
            try:
                if state is not None:
                    stepper.restore(state)
            except BaseException:
                stepper.close()
                raise
            return stepper

        self._start = start
        self._stepper: LaneStepper | None = None
        self._stepped = False  # no step made yet: Zephon may still be opening its storage (_next_step)
        try:
            # A storage outage while starting (a replacement group during an outage) is waited out, within the
            # storage budget; a permanent problem is reported once (info()).
            self._stepper = storage.retry(start, f"producer for lanes {list(self.lanes)}")
        except Exception as exc:
            log.warning("start failed", exc_info=True)  # the trace stays in the log; the message is one line
            last = describe(exc)
            self.init_error = f"producer for lanes {list(self.lanes)} on node {node_name()} failed to start: {last}"

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node": node_name(),
            "node_id": node_id(),
            "worker_id": worker_id(),
            "lanes": list(self.lanes),
            "position": None if self._stepper is None else self._stepper.position,
            "error": self.init_error,
        }

    def _expect(self, step: int) -> LaneStepper:
        if self.init_error or self._stepper is None:
            raise RuntimeError(self.init_error or f"producer for lanes {self.lanes} has no pipeline")
        if step != self._stepper.position:
            raise RuntimeError(f"producer for lanes {self.lanes} is at step {self._stepper.position}, asked for {step}")
        return self._stepper

    def produce(self, step: int) -> dict[str, Any]:
        """:func:`shard_meta` of the owned lanes' shards of ``step`` and their container (:func:`put_shards`)."""
        shards = self._next_step(step)
        return put_shards(step, [shards[lane] for lane in self.lanes], self.pack_bytes, self.held)

    def skip(self, step: int) -> int:
        """Advance past a step that nobody needs stored (already held, or behind every consumer)."""
        self._next_step(step)
        return step

    def _next_step(self, step: int) -> dict[int, LaneShard]:
        """The stepper's next step, which must be ``step``. The first one is waited out as the start is
        (:func:`zephon_ray.lanes.first_step`: Zephon opens its storage there), instead of failing the call and so
        restarting the whole group (tests/test_storage_faults.py)."""
        stepper = self._expect(step)
        if self._stepped:
            return stepper.next_step()
        self._stepper = None
        try:
            self._stepper, shards = first_step(
                self._start, f"producer for lanes {list(self.lanes)} at step {step}", built=stepper
            )
        except Exception as exc:  # every later call says why, as a start that failed does
            self.init_error = f"producer for lanes {list(self.lanes)} lost its pipeline: {describe(exc)}"
            raise
        self._stepped = True
        return shards

    def checkpoint(self, step: int) -> dict[str, Any]:
        """The merged state at the boundary before ``step``. Collective with M > 1: every producer of the group
        must be called at the same step; each receives the same merged state (measured)."""
        return self._expect(step).checkpoint()

    def memory(self) -> dict[str, Any]:
        """This process's pid and core-worker memory store (entries, bytes), and the steps it holds refs of."""
        from zephon_ray.service.ray_internals import memory_store

        return {"pid": os.getpid(), "held_steps": len(self.held), **memory_store()}

    def close(self) -> None:
        if self._stepper is not None:
            self._stepper.close(background=True)
