"""Where a local-mode run's collective Zephon checkpoints meet: a TCPStore (``torch://``) or a shared directory.

Resolution order, first match wins:

1. ``ZEPHON_RAY_AGGREGATE_DIR`` in the environment (:data:`ENV_AGGREGATE_DIR`): selects directory aggregation
   from the launch command, overriding a configured ``aggregate_store`` (the examples default to ``torch://``).
2. The loader Config's ``aggregate_store`` / ``aggregate_dir``.
3. The recipe's optional ``[aggregate]`` table (``store = "torch://"`` or ``dir = "..."``).

``torch://`` names the c10d TCPStore at ``MASTER_ADDR:MASTER_PORT`` (torchrun's agent store, or the store that Ray
Train's rank 0 hosts; it gets a new port after every worker-group restart, so it is resolved again at every
build). ``torch://host:port`` names one explicitly. Zephon is only a client: the store must already be running.
"""

from __future__ import annotations

import os
import socket
import tomllib

from zephon_ray import storage

ENV_AGGREGATE_DIR = "ZEPHON_RAY_AGGREGATE_DIR"
"""Set to a shared directory to aggregate local-mode Zephon checkpoints there instead of through a TCPStore."""

TORCH_SCHEME = "torch://"


def recipe_aggregate(recipe_path: str) -> tuple[str | None, str | None]:
    """The recipe's ``[aggregate]`` table, read cheaply (no dataset scan). Paths resolve against the recipe."""
    try:
        table = tomllib.loads(storage.read_bytes(recipe_path, limit=1 << 20).decode()).get("aggregate", {})
    except (OSError, ValueError, tomllib.TOMLDecodeError):
        return None, None  # the recipe itself is validated (with a precise error) when the loader is built
    if not isinstance(table, dict):
        return None, None
    store = table.get("store")
    agg_dir = table.get("dir")
    if isinstance(agg_dir, str):  # a path relative to the recipe, an absolute one, or a URI (s3://...)
        agg_dir = storage.location(agg_dir, base=storage.location(recipe_path).parent.uri).uri
    return (store if isinstance(store, str) else None), (agg_dir if isinstance(agg_dir, str) else None)


def resolve(store: str | None, agg_dir: str | None, recipe_path: str) -> tuple[str | None, str | None, str]:
    """Return ``(aggregate_store, aggregate_dir, origin)`` after applying the resolution order above."""
    env_dir = os.environ.get(ENV_AGGREGATE_DIR)
    if env_dir:
        return None, env_dir, f"${ENV_AGGREGATE_DIR}"
    if store is not None or agg_dir is not None:
        return store, agg_dir, "loader config"
    r_store, r_dir = recipe_aggregate(recipe_path) if recipe_path else (None, None)
    return r_store, r_dir, "recipe [aggregate]"


def store_address(store: str) -> tuple[str, int]:
    """``torch://`` -> (MASTER_ADDR, MASTER_PORT); ``torch://host:port`` -> (host, port). ValueError otherwise."""
    if not store.startswith(TORCH_SCHEME):
        raise ValueError(f"aggregate_store {store!r}: only '{TORCH_SCHEME}' or '{TORCH_SCHEME}host:port' is supported")
    rest = store[len(TORCH_SCHEME) :]
    if not rest:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError(
                "aggregate_store 'torch://' names the TCPStore at MASTER_ADDR:MASTER_PORT, but they are not set "
                "(launch with torchrun or Ray Train, or name the store as torch://host:port)"
            )
    else:
        host, _, port = rest.rpartition(":")
        if not host or not port:
            raise ValueError(f"aggregate_store {store!r}: expected torch://host:port")
    try:
        return host, int(port)
    except ValueError:
        raise ValueError(f"aggregate_store {store!r}: port {port!r} is not a number") from None


def check_store_reachable(store: str, timeout_s: float = 5.0) -> None:
    """Raise ValueError unless something accepts TCP connections at the store's address."""
    host, port = store_address(store)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ValueError(
            f"aggregate_store {store!r}: no TCPStore is reachable at {host}:{port} ({exc.strerror or exc}); "
            "Zephon only connects to a running store"
        ) from None
