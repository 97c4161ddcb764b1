"""The Ray data service: producer actors precompute step-keyed global-batch shards for any number of consumers.

Public: :class:`DataService` (client), :class:`ServiceConfig`, errors. See coordinator.py for the mechanics.
"""

from zephon_ray.service.config import ActorResources, ServiceConfig
from zephon_ray.service.errors import FingerprintMismatchError, ServiceError, ServiceNotFoundError, ShardsLostError

__all__ = ["ActorResources", "DataService", "FingerprintMismatchError", "ServiceConfig", "ServiceError",
           "ServiceNotFoundError", "ShardsLostError", "StepRefs"]


def __getattr__(name: str):
    # The client pulls in Ray; importing zephon_ray.formats.service_state (offline `zephon-ray inspect`) must not.
    if name in ("DataService", "StepRefs"):
        from zephon_ray.service import client

        return getattr(client, name)
    raise AttributeError(name)
