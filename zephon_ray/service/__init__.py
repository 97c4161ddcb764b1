"""The Ray data service: producer actors precompute step-keyed global-batch shards for any number of consumers.

Public: :class:`DataService` (client), :class:`ServiceConfig`, errors. See coordinator.py for the mechanics.
"""

from zephon_ray.service.client import DataService, StepRefs
from zephon_ray.service.config import ActorResources, ServiceConfig
from zephon_ray.service.errors import FingerprintMismatchError, ServiceError, ServiceNotFoundError

__all__ = ["ActorResources", "DataService", "FingerprintMismatchError", "ServiceConfig", "ServiceError",
           "ServiceNotFoundError", "StepRefs"]
