"""Configuration of the Ray data service, validated when it is built, with no I/O.

Guarantee: a :class:`ServiceConfig` that constructs is runnable: the producers divide the recipe's lanes (checked
by :meth:`ServiceConfig.build` / :meth:`ServiceConfig.for_recipe`), the window, lease length and checkpoint
interval are positive integers, every ``*_timeout_s`` is a finite number > 0, ``resources`` is an
:class:`ActorResources` (a dict of its fields is converted, an unknown key is an error), and a multi-producer
service has a ``run_id`` and exactly one aggregation point (``aggregate_store`` or ``aggregate_dir``). Anything else
is a ``ValueError`` naming the key.
Limit: it reads no file and touches no Ray. A ``materialized_dir`` is checked (it exists, belongs to the recipe,
holds its end checkpoint) by ``DataService.start`` before Ray or ``state_dir`` is touched
(:func:`zephon_ray.service.server.launch.check_materialized_dir`); a ``torch://host:port`` store or a shared
``aggregate_dir`` shows at the first collective checkpoint (bounded by ``aggregate_timeout_s``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from zephon_ray.checks import check_int
from zephon_ray.recipe import Recipe

DEFAULT_NAMESPACE = "zephon-ray"
DEFAULT_NAME = "zephon-ray"
HOSTED_STORE = "torch://"
"""``aggregate_store="torch://"`` inside the service means: the coordinator hosts the TCPStore itself."""
_STORE_RE = re.compile(r"^torch://([^:/]+):(\d+)$")
READ_PATHS = ("node", "direct")
"""How a client reads: ``node`` (one node reader per node leases steps for every rank there), ``direct`` (one
coordinator call per read, the pre-lease path; kept for comparison in benchmarks/bench_service_load.py)."""
TIMEOUT_KEYS = (
    "aggregate_timeout_s",
    "consumer_ttl_s",
    "request_timeout_s",
    "progress_timeout_s",
    "reconnect_timeout_s",
    "read_timeout_s",
)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ActorResources:
    """Ray resources per actor. Fractional CPUs: a 2-core node must still fit a coordinator, producers,
    trainers and Ray Data tasks (whole CPUs held by actors starve Ray Data: docs/troubleshooting.md, "A hang, not
    an error")."""

    coordinator_num_cpus: float = 0.05
    """CPUs Ray reserves for the coordinator (it mostly waits)."""
    producer_num_cpus: float = 0.25
    """CPUs Ray reserves for each producer (its Zephon pipeline's work is real CPU)."""
    replayer_num_cpus: float = 0.5
    """The Replayer restores and replays past steps: real CPU, never the coordinator's."""
    coordinator_max_concurrency: int = 2048
    """Calls the (async) coordinator runs at once. A waiting read holds no thread, only a slot here."""
    coordinator_resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources (e.g. ``{"head": 0.01}``) that pin the coordinator to a node; same for the others."""
    producer_resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources for each producer (see ``coordinator_resources``)."""
    replayer_resources: dict[str, float] = field(default_factory=dict)
    """Extra Ray resources for each replayer (see ``coordinator_resources``)."""

    def __post_init__(self) -> None:
        for key in ("coordinator_resources", "producer_resources", "replayer_resources"):
            value = getattr(self, key)
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and _is_number(v) and v >= 0 for k, v in value.items()
            ):
                raise ValueError(
                    f"ServiceConfig: resources.{key} must map resource names to amounts >= 0, got {value!r}"
                )
        for key in ("coordinator_num_cpus", "producer_num_cpus", "replayer_num_cpus"):
            value = getattr(self, key)
            if not _is_number(value) or not 0 <= value <= 64:
                raise ValueError(f"ServiceConfig: resources.{key} must be a number in [0, 64], got {value!r}")
        check_int(
            "ServiceConfig: resources.coordinator_max_concurrency",
            self.coordinator_max_concurrency,
            low=4,
            high=100_000,
            why="waiting reads occupy it",
        )

    @classmethod
    def coerce(cls, value: object) -> ActorResources:
        """``value`` as ActorResources: itself, or a dict of its fields (an unknown key is a ValueError)."""
        if isinstance(value, ActorResources):
            return value
        if isinstance(value, Mapping):
            known = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise ValueError(f"ServiceConfig: resources has unknown key(s) {unknown}; known: {known}")
            return cls(**value)
        raise ValueError(
            f"ServiceConfig: resources must be an ActorResources or a dict of its fields, "
            f"got {type(value).__name__} {value!r}"
        )


@dataclass(frozen=True)
class ServiceConfig:
    """Everything that fixes how a service runs. The recipe alone fixes *what* it serves."""

    name: str = DEFAULT_NAME
    """The coordinator actor's name: what clients, loaders and the CLI's ``--name`` find the service by."""
    namespace: str = DEFAULT_NAMESPACE
    """The Ray namespace of the service's actors."""
    producers: int = 1
    """M producer actors; each is a Zephon rank owning L/M contiguous lanes. M must divide L."""
    window: int = 8
    """At most this many steps are produced ahead of the slowest live consumer (and held in the object store).
    At hundreds of nodes and more, a larger window with ``lease_steps`` at half of it (32 and 16) cuts the
    coordinator's calls per node and step about tenfold (docs/scaling.md, "Many node readers")."""
    state_dir: str | None = None
    """Durable state (fingerprint, merged checkpoints, commits). Required for a service that must survive."""
    checkpoint_every: int = 8
    """K: a merged Zephon checkpoint is written every K steps; serving a past step replays at most K steps."""
    aggregate_store: str | None = None
    """``torch://`` (the coordinator hosts a TCPStore) or ``torch://host:port`` (an existing one)."""
    aggregate_dir: str | None = None
    """A directory every producer can reach, for Zephon's collective checkpoint."""
    run_id: str | None = None
    """Names the run in the producers' collective Zephon checkpoints (None: the service's name)."""
    aggregate_timeout_s: float = 120.0
    """How long a collective checkpoint waits for every producer before it fails naming the ones missing. The pool
    sends it once every producer has finished its earlier steps, so this bounds the collective alone."""
    consumer_ttl_s: float = 120.0
    """A consumer cursor not heard from for this long stops holding the window back."""
    request_timeout_s: float = 600.0
    """How long one ``batch``/``slice`` may wait for its step before a TimeoutError that says why."""
    start_step: int | None = None
    """Where the live window starts. None: the consumers' newest commits in ``state_dir`` (0 when there are none)."""
    max_ahead: int = 512
    """A read (tracked or not) more than this many steps past the producers' head is rejected with a ValueError."""
    retain_behind: int = 32
    """The table keeps each live consumer's steps from its newest commit, but at most this many behind its cursor:
    a trainer resuming from its last checkpoint reads hits. Held bytes <= (window + retain_behind) batches."""
    keep_checkpoints: int = 4
    """Newest durable checkpoints kept in ``state_dir`` (besides the anchors)."""
    anchor_every: int | None = None
    """Checkpoints at multiples of this step are kept for good (None: 16 x checkpoint_every; 0: keep all).
    Replaying an old step costs at most this many steps."""
    progress_timeout_s: float = 300.0
    """A producer group with calls in flight and no finished call for this long is replaced (hung, not dead)."""
    replayers: int = 1
    """Replayer actors serving past steps (each a world-size-1 Zephon pipeline over all lanes)."""
    coordinator_max_restarts: int = -1
    """Ray restarts a dead coordinator this many times (-1: always); it reopens ``state_dir`` and clients retry."""
    reconnect_timeout_s: float = 300.0
    """How long a client keeps retrying a read while the coordinator restarts or lost shards are replayed."""
    read_timeout_s: float = 900.0
    """The longest one client call waits: a read (``slice``, ``batch``, a loader's next step) with its retries, a
    ``commit``, ``add_phase`` or ``rescale``. Past it, one line names the step or call, what it waited for and how
    long (``ReadTimeoutError``). It covers a coordinator restart and a storage outage within their budgets."""
    materialized_dir: str | None = None
    """A directory written by ``zephon-ray materialize`` for this recipe, covering steps [A, N). The service reads
    those steps from it (in its Replayer actors) and starts its producers at N from the directory's checkpoint
    of step N. It must be readable from the coordinator's and the replayers' nodes. Its manifest is read when the
    service starts: steps appended later are served from the directory after a restart."""
    lease_steps: int = 4
    """n: a node reader leases the refs of up to n consecutive produced steps in one coordinator call, and reports
    its ranks' cursor moves with it; the coordinator sees O(nodes x steps / n) calls, not one per rank-step.
    Cursors on the coordinator lag by up to a process's run of steps plus n (status(); client/node_read_path.py);
    commits carry exact ones."""
    pack_bytes: int = 1 << 20
    """A producer (or replayer) puts its lanes' shards as packs: equal runs of consecutive lanes, each one object of
    at most this many bytes (the largest run that divides its lanes; a lane of more is a pack of its own). A step
    of small lanes then costs it one put, and a reader one fetch, instead of one per lane
    (benchmarks/bench_producer_put.py, bench_service.py). A reader of part of a pack fetches all of it: at most
    this many bytes more per pack it touches a step. 0: one object per lane."""
    read_path: str = "node"
    """The default read path of clients: ``node`` (a node reader per node shares leases among its ranks) or
    ``direct`` (one coordinator call per read). ``DataService.connect(read_path=...)`` overrides it."""
    producer_recycle_steps: int = 50_000
    """A producer group that has made this many steps is replaced by a fresh one of the same size at the next step
    boundary, as a rescale to the same M replaces it (a collective checkpoint, then new actors from it; the old
    group's steps stay readable; without room in the cluster for both groups the old one is killed instead, and the
    steps of it still held are made again, ``status()["replaced_without_room"]``): no batch changes. Why: a producer process grows slowly over a long
    run, and where that memory goes is not found (docs/limits.md, "A long run"); a process that lives at most this
    many steps keeps at most that many steps of it (a 120,000-step soak: each producer at most 9.7 MB above its RSS
    at step 10,000, docs/benchmarks.md "With producer groups recycled"). The replayers that started are replaced with
    it: fresh ones start on the next replay, and the old ones are killed once their replays in flight are done. 0:
    never."""
    storage_retry_s: float | None = None
    """How long the coordinator, producers and replayers keep retrying a transient object-store fault (an outage,
    503 SlowDown, a timeout, a cut response) before it is fatal. None: the environment's
    ``ZEPHON_RAY_STORAGE_RETRY_S``, else 600 s (zephon_ray/storage/retries.py)."""
    resources: ActorResources = field(default_factory=ActorResources)
    """Ray resources per actor (``--resources.<field>`` on the command line)."""

    def __post_init__(self) -> None:
        for key in ("name", "namespace"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value or "/" in value:
                raise ValueError(f"ServiceConfig: {key} must be a non-empty string without '/', got {value!r}")
        for key in ("producers", "window", "checkpoint_every"):
            check_int(f"ServiceConfig: {key}", getattr(self, key), low=1)
        for key in TIMEOUT_KEYS:
            value = getattr(self, key)
            if not _is_number(value) or not value > 0:
                raise ValueError(f"ServiceConfig: {key} must be a number of seconds > 0, got {value!r}")
        object.__setattr__(self, "resources", ActorResources.coerce(self.resources))
        if self.storage_retry_s is not None and (
            not _is_number(self.storage_retry_s) or not 0 <= self.storage_retry_s <= 7 * 24 * 3600
        ):
            raise ValueError(
                f"ServiceConfig: storage_retry_s must be None or a number of seconds in [0, 604800], "
                f"got {self.storage_retry_s!r}"
            )
        if self.read_path not in READ_PATHS:
            raise ValueError(f"ServiceConfig: read_path must be one of {list(READ_PATHS)}, got {self.read_path!r}")
        for key, low, high in (
            ("max_ahead", 1, 1_000_000),
            ("retain_behind", 0, 100_000),
            ("keep_checkpoints", 1, 10_000),
            ("replayers", 1, 64),
            ("lease_steps", 1, 1024),
            ("pack_bytes", 0, 1 << 30),
            ("coordinator_max_restarts", -1, 1_000_000),
            ("producer_recycle_steps", 0, 10**12),
        ):
            check_int(f"ServiceConfig: {key}", getattr(self, key), low=low, high=high)
        if self.anchor_every is None:
            object.__setattr__(self, "anchor_every", 16 * self.checkpoint_every)
        if (
            isinstance(self.anchor_every, bool)
            or not isinstance(self.anchor_every, int)
            or self.anchor_every < 0
            or self.anchor_every % self.checkpoint_every
        ):
            raise ValueError(
                f"ServiceConfig: anchor_every must be 0 or a positive multiple of checkpoint_every="
                f"{self.checkpoint_every}, got {self.anchor_every!r}"
            )
        if self.start_step is not None:
            check_int("ServiceConfig: start_step", self.start_step, low=0)
        if self.materialized_dir is not None and (
            not isinstance(self.materialized_dir, str) or not self.materialized_dir
        ):
            raise ValueError(
                f"ServiceConfig: materialized_dir must be a non-empty path string, got {self.materialized_dir!r}"
            )
        if self.aggregate_store is not None and self.aggregate_dir is not None:
            raise ValueError("ServiceConfig: set exactly one of aggregate_store and aggregate_dir, not both")
        if (
            self.aggregate_store is not None
            and self.aggregate_store != HOSTED_STORE
            and not _STORE_RE.match(self.aggregate_store)
        ):
            raise ValueError(
                f"ServiceConfig: aggregate_store must be 'torch://' or 'torch://host:port', "
                f"got {self.aggregate_store!r}"
            )
        self.check_producers(self.producers)

    def check_producers(self, producers: int) -> None:
        """A multi-producer service checkpoints collectively: it needs a run_id and one aggregation point."""
        if producers > 1:
            if not self.run_id:
                raise ValueError(
                    f"ServiceConfig: producers={producers} (> 1) needs a run_id: Zephon's collective "
                    "checkpoint is keyed by it"
                )
            if (self.aggregate_store is None) == (self.aggregate_dir is None):
                raise ValueError(
                    f"ServiceConfig: producers={producers} (> 1) needs exactly one of aggregate_store "
                    "and aggregate_dir (or [aggregate] store/dir in the recipe)"
                )

    @classmethod
    def build(cls, recipe: Recipe, **fields: Any) -> ServiceConfig:
        """Construct for ``recipe`` with the defaults a service needs to run any number of producers, applied
        *before* validation: an unset ``run_id`` is the service's name; unset aggregation comes from the recipe's
        ``[aggregate]`` table, else it is the TCPStore the coordinator hosts (``torch://``, created only once
        more than one producer runs). Explicit values win; a store and a dir together are still refused here.
        Then the producers are checked against the recipe's lanes
        (tests/test_service_config.py::test_build_defaults_run_id_and_hosted_store)."""
        fields.setdefault("name", DEFAULT_NAME)
        if not fields.get("run_id"):
            fields["run_id"] = fields["name"]
        if fields.get("aggregate_store") is None and fields.get("aggregate_dir") is None:
            fields["aggregate_store"], fields["aggregate_dir"] = recipe.aggregate.store, recipe.aggregate.dir
            if recipe.aggregate.store is None and recipe.aggregate.dir is None:
                fields["aggregate_store"] = HOSTED_STORE
        return cls(**fields).for_recipe(recipe)

    def for_recipe(self, recipe: Recipe) -> ServiceConfig:
        """This config with the recipe's ``[aggregate]`` table filled in where unset, checked against the recipe.
        No I/O: ``materialized_dir`` is checked by ``DataService.start`` (see the module docstring)."""
        config = self
        if self.aggregate_store is None and self.aggregate_dir is None:
            config = replace(self, aggregate_store=recipe.aggregate.store, aggregate_dir=recipe.aggregate.dir)
        config.check_lanes(recipe, config.producers)
        return config

    def check_lanes(self, recipe: Recipe, producers: int) -> None:
        if recipe.lanes % producers:
            divisors = [d for d in range(1, recipe.lanes + 1) if recipe.lanes % d == 0]
            raise ValueError(
                f"ServiceConfig: producers={producers} does not divide the recipe's {recipe.lanes} "
                f"lanes; choose one of {divisors}"
            )
        self.check_producers(producers)
