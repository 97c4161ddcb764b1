"""The actor classes a client holds handles of: thin shells whose methods delegate to the implementation in server/.

    CoordinatorActor  -> server.coordinator.Coordinator   (ray.remote with concurrency groups READS and CONTROL)
    NodeReaderActor   -> server.node_reader.NodeReader

Ray loads an actor's class to build a handle to it (``ray.get_actor``, or a handle arriving in a reply), so these
classes are what a client that connected to the coordinator and got its node reader has imported.

Guarantee: a shell imports its implementation inside ``__init__``, so the server modules load in the actor's
process only, never in a client's. Limit: a method added to an implementation is reachable only once the shell
forwards it.
"""

from __future__ import annotations

from typing import Any

import ray

from zephon_ray.service.wire import CONTROL, READS, CursorMove


class CoordinatorActor:
    """The coordinator's RPC surface (see server/coordinator.py for what each call does). Wrap with
    ``ray.remote(concurrency_groups={READS: n, CONTROL: CONTROL_CONCURRENCY})``."""

    def __init__(self, recipe: Any, config: Any) -> None:
        from zephon_ray.service.server.coordinator import Coordinator

        self._impl = Coordinator(recipe, config, reader_class=NodeReaderActor)

    # Task events off for the hot calls (one per lease or report): Ray records several per call and ships them to
    # the GCS, CPU in this process and in the caller's for calls nobody inspects (docs/scaling.md).
    @ray.method(concurrency_group=READS, enable_task_events=False)
    async def lease(self, *args: Any, **kwargs: Any) -> Any:
        return await self._impl.lease(*args, **kwargs)

    @ray.method(concurrency_group=CONTROL)
    async def ready(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await self._impl.ready(*args, **kwargs)

    @ray.method(concurrency_group=CONTROL)
    async def recipe_and_config(self) -> tuple[Any, Any]:
        return self._impl.recipe, self._impl.config

    @ray.method(concurrency_group=CONTROL)
    async def pid(self) -> int:
        import os

        return os.getpid()

    @ray.method(concurrency_group=CONTROL)
    async def node_reader(self, node_id: str) -> Any:
        return await self._impl.node_reader(node_id)

    @ray.method(concurrency_group=CONTROL, enable_task_events=False)
    async def advance(self, moves: list[CursorMove]) -> None:
        return await self._impl.advance(moves)

    @ray.method(concurrency_group=CONTROL)
    async def commit(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await self._impl.commit(*args, **kwargs)

    @ray.method(concurrency_group=CONTROL)
    async def release(self, consumer: str) -> int:
        return await self._impl.release(consumer)

    @ray.method(concurrency_group=CONTROL)
    async def invalidate(self, step: int, generation: int) -> bool:
        return await self._impl.invalidate(step, generation)

    @ray.method(concurrency_group=CONTROL)
    async def rescale(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await self._impl.rescale(*args, **kwargs)

    @ray.method(concurrency_group=CONTROL)
    async def add_phase(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await self._impl.add_phase(*args, **kwargs)

    @ray.method(concurrency_group=CONTROL)
    async def status(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await self._impl.status(*args, **kwargs)

    @ray.method(concurrency_group=CONTROL)
    async def stop(self) -> None:
        return await self._impl.stop()


class NodeReaderActor:
    """A node reader's RPC surface (see server/node_reader.py). One event loop: its calls are short and node-local."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from zephon_ray.service.server.node_reader import NodeReader

        self._impl = NodeReader(*args, **kwargs)

    @ray.method(enable_task_events=False)  # one call per process per run of steps: see CoordinatorActor.lease
    async def read(self, *args: Any, **kwargs: Any) -> Any:
        return await self._impl.read(*args, **kwargs)

    @ray.method(enable_task_events=False)
    async def advance(self, moves: list[CursorMove]) -> None:
        return await self._impl.advance(moves)

    @ray.method(enable_task_events=False)
    async def demand(self, epoch: int, timeout_s: float = 60.0) -> int:
        return await self._impl.demand(epoch, timeout_s)

    async def invalidate(self, step: int, generation: int) -> bool:
        return await self._impl.invalidate(step, generation)

    async def release(self, consumer: str) -> int:
        return await self._impl.release(consumer)

    async def info(self) -> dict[str, Any]:
        return await self._impl.info()

    async def memory(self) -> dict[str, Any]:
        return await self._impl.memory()
