"""Configuration of the Ray data service, validated when it is built.

Guarantee: a :class:`ServiceConfig` that constructs is runnable: the producers divide the recipe's lanes, the
window and checkpoint interval are positive, and a multi-producer service has a ``run_id`` and exactly one
aggregation point (``aggregate_store`` or ``aggregate_dir``). Anything else is a ``ValueError`` naming the key.
Limit: it cannot check that a ``torch://host:port`` store is reachable or that ``aggregate_dir`` is shared by
every node; that shows at the first collective checkpoint (bounded by ``aggregate_timeout_s``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from zephon_ray.recipe import Recipe

DEFAULT_NAMESPACE = "zephon-ray"
DEFAULT_NAME = "zephon-ray"
HOSTED_STORE = "torch://"
"""``aggregate_store="torch://"`` inside the service means: the coordinator hosts the TCPStore itself."""
_STORE_RE = re.compile(r"^torch://([^:/]+):(\d+)$")


@dataclass(frozen=True)
class ActorResources:
    """Ray resources per actor. Fractional CPUs: a 2-core node must still fit a coordinator, producers,
    trainers and Ray Data tasks (whole CPUs held by actors starve Ray Data; see shared notes)."""

    coordinator_num_cpus: float = 0.05
    producer_num_cpus: float = 0.25
    coordinator_max_concurrency: int = 128
    """Threads of the coordinator: each blocked read (a rank waiting for its step, a prefetch) holds one."""

    def __post_init__(self) -> None:
        for key in ("coordinator_num_cpus", "producer_num_cpus"):
            value = getattr(self, key)
            if not 0 <= value <= 64:
                raise ValueError(f"ServiceConfig: resources.{key} must be in [0, 64], got {value!r}")
        if self.coordinator_max_concurrency < 4:
            raise ValueError("ServiceConfig: resources.coordinator_max_concurrency must be >= 4 "
                             f"(consumers block in it), got {self.coordinator_max_concurrency}")


@dataclass(frozen=True)
class ServiceConfig:
    """Everything that fixes how a service runs. The recipe alone fixes *what* it serves."""

    name: str = DEFAULT_NAME
    namespace: str = DEFAULT_NAMESPACE
    producers: int = 1
    """M producer actors; each is a Zephon rank owning L/M contiguous lanes. M must divide L."""
    window: int = 8
    """At most this many steps are produced ahead of the slowest live consumer (and held in the object store)."""
    state_dir: str | None = None
    """Durable state (fingerprint, merged checkpoints, commits). Required for a service that must survive."""
    checkpoint_every: int = 8
    """K: a merged Zephon checkpoint is written every K steps; serving a past step replays at most K steps."""
    aggregate_store: str | None = None
    """``torch://`` (the coordinator hosts a TCPStore) or ``torch://host:port`` (an existing one)."""
    aggregate_dir: str | None = None
    """A directory every producer can reach, for Zephon's collective checkpoint."""
    run_id: str | None = None
    aggregate_timeout_s: float = 120.0
    consumer_ttl_s: float = 120.0
    """A consumer cursor not heard from for this long stops holding the window back."""
    request_timeout_s: float = 600.0
    """How long one ``batch``/``slice`` may wait for its step before a TimeoutError that says why."""
    start_step: int | None = None
    """Where the live window starts. None: the newest commit in ``state_dir`` (0 when there is none)."""
    resources: ActorResources = field(default_factory=ActorResources)

    def __post_init__(self) -> None:
        for key in ("name", "namespace"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value or "/" in value:
                raise ValueError(f"ServiceConfig: {key} must be a non-empty string without '/', got {value!r}")
        for key in ("producers", "window", "checkpoint_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServiceConfig: {key} must be an integer >= 1, got {value!r}")
        for key in ("aggregate_timeout_s", "consumer_ttl_s", "request_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"ServiceConfig: {key} must be > 0, got {getattr(self, key)!r}")
        if self.start_step is not None and (isinstance(self.start_step, bool) or not isinstance(self.start_step, int)
                                            or self.start_step < 0):
            raise ValueError(f"ServiceConfig: start_step must be an integer >= 0, got {self.start_step!r}")
        if self.aggregate_store is not None and self.aggregate_dir is not None:
            raise ValueError("ServiceConfig: set exactly one of aggregate_store and aggregate_dir, not both")
        if self.aggregate_store is not None and self.aggregate_store != HOSTED_STORE \
                and not _STORE_RE.match(self.aggregate_store):
            raise ValueError(f"ServiceConfig: aggregate_store must be 'torch://' or 'torch://host:port', "
                             f"got {self.aggregate_store!r}")
        self.check_producers(self.producers)

    def check_producers(self, producers: int) -> None:
        """A multi-producer service checkpoints collectively: it needs a run_id and one aggregation point."""
        if producers > 1:
            if not self.run_id:
                raise ValueError(f"ServiceConfig: producers={producers} (> 1) needs a run_id: Zephon's collective "
                                 "checkpoint is keyed by it")
            if (self.aggregate_store is None) == (self.aggregate_dir is None):
                raise ValueError(f"ServiceConfig: producers={producers} (> 1) needs exactly one of aggregate_store "
                                 "and aggregate_dir (or [aggregate] store/dir in the recipe)")

    @classmethod
    def build(cls, recipe: Recipe, **fields) -> "ServiceConfig":
        """Construct for ``recipe``: unset aggregation comes from the recipe's ``[aggregate]`` table *before*
        validation, then the producers are checked against the recipe's lanes."""
        if fields.get("aggregate_store") is None and fields.get("aggregate_dir") is None:
            fields["aggregate_store"], fields["aggregate_dir"] = recipe.aggregate.store, recipe.aggregate.dir
        return cls(**fields).for_recipe(recipe)

    def for_recipe(self, recipe: Recipe) -> "ServiceConfig":
        """This config with the recipe's ``[aggregate]`` table filled in where unset, checked against the recipe."""
        config = self
        if self.aggregate_store is None and self.aggregate_dir is None:
            config = replace(self, aggregate_store=recipe.aggregate.store, aggregate_dir=recipe.aggregate.dir)
        config.check_lanes(recipe, config.producers)
        return config

    def check_lanes(self, recipe: Recipe, producers: int) -> None:
        if recipe.lanes % producers:
            divisors = [d for d in range(1, recipe.lanes + 1) if recipe.lanes % d == 0]
            raise ValueError(f"ServiceConfig: producers={producers} does not divide the recipe's {recipe.lanes} "
                             f"lanes; choose one of {divisors}")
        self.check_producers(producers)
