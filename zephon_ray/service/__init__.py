"""The Ray data service: producer actors precompute step-keyed global-batch shards for any number of consumers.

Public: :class:`DataService` (client), :class:`ServiceConfig`, :class:`ActorResources`, errors. The parts: client.py
(DataService, the handle) with its read paths node_reads.py and direct_reads.py (and reads.py, what they share),
lease_cache.py (the lease cache of the node reader and the client), node.py (a node reader per node),
coordinator.py (glue), window.py, pool.py, producer.py, replay.py, replayer.py, status.py, launch.py, protocol.py,
config.py, metrics.py; session.py (attach to a Ray cluster). The commands are zephon_ray/cli/service.py.
"""

from zephon_ray.service.config import ActorResources, ServiceConfig
from zephon_ray.service.errors import (
    FingerprintMismatchError, ReplyTimeoutError, ServiceError, ServiceNotFoundError, ShardsLostError)

__all__ = ["ActorResources", "DataService", "FingerprintMismatchError", "ReplyTimeoutError", "ServiceConfig",
           "ServiceError", "ServiceNotFoundError", "ShardsLostError", "StepRefs"]


def __getattr__(name: str):
    # The client pulls in Ray; importing zephon_ray.formats.service_state (offline `zephon-ray inspect`) must not.
    if name in ("DataService", "StepRefs"):
        from zephon_ray.service import client

        return getattr(client, name)
    raise AttributeError(name)
