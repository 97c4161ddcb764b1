"""What both client read paths hand out and share: :class:`StepRefs` (one step's lane refs, fetched into a
``GlobalBatch`` or a ``RankSlice``), and :func:`call`/:func:`unwrap`, which turn Ray's errors into the service's own
(errors.py).

    read path .refs(step, rank, world, track) ──► StepRefs ──.slice(rank, world) / .batch()──► rows

A read path (node_read_path.py, direct_read_path.py) makes the :class:`StepRefs`; ``DataService`` (data_service.py)
retries around it. Guarantee: a lost object (its owner died) surfaces as ``ShardsLostError``, a missing actor as
``ServiceNotFoundError``, a call without a reply in time as ``ReplyTimeoutError``; never a Ray wrapper. Limit: a
``StepRefs`` holds refs, not bytes: fetch it while the service still holds the step (its window, or a replay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    ObjectFetchTimedOutError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    RayTaskError,
)

from zephon_ray.batch import GlobalBatch, RankSlice, lane_span
from zephon_ray.checks import check_int
from zephon_ray.lanes import LaneShard
from zephon_ray.recipe import Recipe
from zephon_ray.service.errors import ReplyTimeoutError, ServiceError, ServiceNotFoundError, ShardsLostError
from zephon_ray.service.wire import unpack
from zephon_ray.source import assemble, fixed_valid_tokens

LOST = (ObjectLostError, OwnerDiedError, ObjectFetchTimedOutError)
"""Ray's errors for an object whose owner or copy is gone."""
FETCH_TIMEOUT_S = 300.0
"""How long fetching a step's shards from the object store may take (a read through ``DataService`` passes what is
left of its own deadline instead)."""


def unwrap(exc: BaseException, service: str) -> BaseException:
    """A Ray error as the clean exception it wraps, or a typed ServiceError with a one-line reason."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and not isinstance(cause, RayTaskError):
            return cause
        return ServiceError(f"service {service}: {str(exc).strip().splitlines()[-1]}")
    if isinstance(exc, LOST):
        return ShardsLostError(f"service {service}: a reply was lost ({type(exc).__name__})")
    if isinstance(exc, (RayActorError, ActorUnavailableError)):
        return ServiceNotFoundError(
            f"service {service} is not running (its coordinator died or was stopped); start it again from its state_dir"
        )
    if isinstance(exc, GetTimeoutError):
        return ReplyTimeoutError(f"service {service}: no reply in time")
    return exc


def call(ref: Any, where: str, *, timeout: float, what: str = "a call") -> Any:
    """The value of a call's reply within ``timeout`` seconds, with Ray's errors as the service's own (a timeout is
    a :class:`ReplyTimeoutError` naming ``what`` and the seconds waited)."""
    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        raise ReplyTimeoutError(f"service {where}: no reply to {what} within {timeout:.0f}s") from None
    except (RayTaskError, RayActorError, ActorUnavailableError, *LOST) as exc:
        raise unwrap(exc, where) from None


def open_containers(refs: list[Any], where: str, timeout_s: float) -> list[Any]:
    """Open containers (wire.py): a lost one (its producer died) is a ShardsLostError."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise ReplyTimeoutError(
            f"service {where}: a step's containers were not fetched within {timeout_s:.0f}s"
        ) from None
    except (*LOST, RayActorError, ActorUnavailableError) as exc:
        raise ShardsLostError(f"service {where}: a step's shards were lost ({type(exc).__name__})") from None


def as_step(step: Any, what: str = "step") -> int:
    """Steps are plain non-negative ints on the wire (numpy integers are accepted and converted)."""
    return check_int(what, step, low=0, numpy_ok=True)


@dataclass(frozen=True)
class StepRefs:
    """One step's lane shards as Ray object refs, owned by the producer (or replayer) that made them.

    ``lanes[l]`` is a ref to the pack that holds lane l's shard (a tuple of the shards of consecutive lanes:
    producer.py, :func:`~zephon_ray.service.server.producer.packs`), ``None`` for lanes outside the (rank, world) it was
    asked for (a rank is handed only the refs it needs). ``generation`` is the producer generation that made it
    (wire.REPLAYED for a replay). Keep the object to keep the shards alive; ``slice`` and ``batch`` only fetch the lanes
    they need.
    """

    step: int
    lanes: list[Any]
    recipe: Recipe
    pad_token_id: int | None
    generation: int = 0

    @property
    def is_refs(self) -> bool:
        return any(isinstance(lane, ray.ObjectRef) for lane in self.lanes)

    def _fetch(self, lanes: range, timeout_s: float) -> list[LaneShard]:
        picked = [self.lanes[lane] for lane in lanes]
        if any(p is None for p in picked):
            raise ValueError(
                f"step {self.step}: these refs were asked for another rank's rows (lanes "
                f"{[i for i, p in enumerate(self.lanes) if p is not None]}); read them with refs() again"
            )
        if not self.is_refs:
            return picked
        unique = list(dict.fromkeys(picked))  # a pack's ref stands for each of its lanes: fetch it once
        try:
            fetched = ray.get(unique, timeout=timeout_s)
        except GetTimeoutError:
            raise ReplyTimeoutError(f"step {self.step}: its shards were not fetched within {timeout_s:.0f}s") from None
        except (*LOST, RayActorError, ActorUnavailableError) as exc:  # the node, owner, producer or replayer died
            raise ShardsLostError(
                f"step {self.step}: its shards were lost ({type(exc).__name__}); read it again to have it made again"
            ) from None
        except RayTaskError as exc:
            raise unwrap(exc, "(replay)") from None
        by_lane = unpack(fetched)
        return [by_lane[lane] for lane in lanes]

    def batch(self, *, timeout_s: float = FETCH_TIMEOUT_S) -> GlobalBatch:
        """The whole global batch, fetched within ``timeout_s`` (else a :class:`ReplyTimeoutError`)."""
        shards = self._fetch(range(self.recipe.lanes), timeout_s)
        return assemble(self.recipe, self.step, dict(zip(range(self.recipe.lanes), shards)))

    def slice(self, rank: int, world: int, *, timeout_s: float = FETCH_TIMEOUT_S) -> RankSlice:
        """Rank ``rank`` of ``world``'s rows, fetched within ``timeout_s`` (else a :class:`ReplyTimeoutError`)."""
        span = lane_span(self.recipe.lanes, self.recipe.rows_per_lane, rank, world)
        return RankSlice.from_lanes(
            self.step,
            rank,
            world,
            span,
            self._fetch(span.lanes, timeout_s),
            self.pad_token_id,
            fixed_valid_tokens(self.recipe),
        )
