"""``status()``: the report of one service, assembled from the coordinator's parts without waiting on any of them.

    Coordinator.status() ──► build(coordinator) ──► dict ──► DataService.status(), ``zephon-ray status`` (a table,
                                                              zephon_ray/cli/service.py), the notebook

Sections: identity (name, namespace, fingerprint, recipe, state_dir), ``coordinator`` (pid, node, restarted,
uptime), ``producers`` and ``replayers`` (pids, nodes, worker ids, lanes), ``generation``/``restarts``/``recycles``/
``replaced_without_room``/``last_restart`` (why and when)/``retired_generations``, ``aggregate``, ``window`` (bounds, held steps and bytes vs
their bound), ``cursors`` (at most ``MAX_STATUS_CURSORS``, slowest first) and ``cursor_summary`` (per consumer),
``reads`` (leases, leased steps, cursor moves and reports, node readers), ``throughput``, ``checkpoints``,
``commits``, ``start``, ``replay``, ``materialized``. ``window.shard_owners`` counts who owns the containers of the
newest held step (one per producer; each holds the refs of its lane shards), read from Ray's owner addresses:
producers (and retired producers), never the coordinator.

Guarantee: building it takes the window lock once, for a copy of the window's counters, and makes no remote call
and no ``ray.get`` (it runs on the coordinator's event loop: producer infos are those the pump thread resolved,
replayer infos arrive by callback), so it answers while reads wait (benchmarks/bench_service_load.py measures its
p99 under 2 x 256 lock-step ranks).
Limit: cursors are as reported by node readers, up to ``lease_steps`` steps behind the ranks (node_reader.py).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from zephon_ray import storage
from zephon_ray.recipe import Recipe
from zephon_ray.service.ray_internals import owner_worker_id


def global_batch_nbytes(recipe: Recipe) -> int:
    """Bytes of one step's lane shards (int32 tokens + int32 positions + per-source counts)."""
    return recipe.lanes * (2 * recipe.rows_per_lane * recipe.row_length * 4 + len(recipe.sources) * 8)


def shard_owners(refs: list[Any], pool: Any, coordinator_worker: str) -> dict[str, int]:
    """How many of ``refs`` each kind of process owns, from Ray's owner addresses."""
    producers = {w for gen in [pool.gen, *pool.retired] for w in [(i or {}).get("worker_id") for i in gen.infos]}
    out = {"producers": 0, "coordinator": 0, "other": 0}
    for ref in refs:
        owner = owner_worker_id(ref)
        kind = "producers" if owner in producers else "coordinator" if owner == coordinator_worker else "other"
        out[kind] += 1
    return out


def build(c: Any) -> dict[str, Any]:
    """The status of coordinator ``c`` (coordinator.py)."""
    config, recipe, pool = c.config, c.recipe, c.pool  # producer infos: as the pump last resolved them
    with c._lock:
        now = time.monotonic()
        w = c.window.status(now)
        counters = dict(c.counters)
        lease_nodes = dict(c.lease_nodes)
        newest = c.window.table[max(c.window.table)].containers if c.window.table else []
    cursors = w.pop("cursors")
    summary = w.pop("cursor_summary")
    commits = w.pop("commits")
    gb = global_batch_nbytes(recipe)
    gen = pool.gen
    ckpts = c.state.checkpoint_steps()
    first, last = counters.pop("first_produced"), counters.pop("last_produced")
    elapsed = (last or now) - (first or now)
    w.update(
        {
            "floor": w["replay_below"],
            "next_step": pool.next_step,
            "inflight_steps": pool.inflight_steps(),
            "bound_bytes": w["bound_steps"] * gb,
            "global_batch_bytes": gb,
            "shard_owners": shard_owners(newest, pool, ray.get_runtime_context().get_worker_id()),
        }
    )
    return {
        "name": config.name,
        "namespace": config.namespace,
        "fingerprint": recipe.fingerprint,
        "recipe": str(recipe.path) if recipe.path else None,
        "state_dir": str(c.state.root),
        "fatal": c._fatal,
        "coordinator": {
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "worker_id": ray.get_runtime_context().get_worker_id(),
            "restarted": c.start_info["restarted"],
            "uptime_s": round(now - c._t0, 3),
        },
        "producers": pool.describe(),
        "replayers": c.replay.infos(),
        "generation": gen.number,
        "restarts": pool.restarts,
        "recycles": pool.recycles,
        "replaced_without_room": pool.replaced_without_room,
        "last_restart": pool.last_restart,
        "hung_replacements": pool.hung_replacements,
        "retired_generations": [g.number for g in pool.retired],
        "aggregate": {"store": pool.store_address, "dir": config.aggregate_dir, "run_id": gen.run_id},
        "window": w,
        "cursors": cursors,
        "cursor_summary": summary,
        "reads": {
            "read_path": config.read_path,
            "lease_steps": config.lease_steps,
            "leases": counters["leases"],
            "leased_steps": counters["leased_steps"],
            "lease_waits": counters["lease_waits"],
            "lease_seconds": round(counters["lease_seconds"], 6),
            "cursor_moves": counters["moves"],
            "bad_moves": counters["bad_moves"],
            "reports": counters["reports"],
            "node_readers": len(c.readers),
            "leases_by_node": lease_nodes,
        },
        "throughput": {
            "produced_steps": counters["produced_steps"],
            "produced_tokens": counters["produced_tokens"],
            "tokens_per_s": counters["produced_tokens"] / elapsed if elapsed > 0 else None,
        },
        "checkpoints": {
            "every": config.checkpoint_every,
            "count": len(ckpts),
            "latest": ckpts[-1] if ckpts else None,
            "steps": ckpts[-16:],
            "keep": config.keep_checkpoints,
            "anchor_every": config.anchor_every,
            "unwritten": pool.unwritten_checkpoints(),
        },
        "commits": {
            "latest": c.recent_commits[-1] if c.recent_commits else None,
            "latest_durable_step": c.state.latest_commit(),
            "per_consumer": commits,
        },
        "start": dict(c.start_info),
        "storage": {"retry_budget_s": storage.retry_budget_s(), **storage.RETRY_STATS},
        "replay": dict(c.replay.stats),
        "materialized": {
            "dir": config.materialized_dir,
            "first_step": c.replay.prefix.start,
            "end_step": c.replay.prefix.stop,
        }
        if config.materialized_dir
        else None,
    }
