"""The object store's used bytes and object count on every node, from Ray's memory summary, for the benchmarks.

    from ray_plasma import plasma_usage   # benchmarks/ is on sys.path when a benchmark runs as a script
    plasma_usage()                        # {"mib": used MiB, "objects": n}, summed over the cluster's nodes

It reads ``ray._private.internal_api.memory_summary`` (a private Ray name, so it lives here, outside the package's
Ray fence) and parses its "Plasma memory usage" lines. Limit: a Ray whose summary no longer has such a line makes
it raise instead of reporting zeros.
"""

from __future__ import annotations

import re

_PLASMA_RE = re.compile(r"Plasma memory usage (\d+) MiB, (\d+) objects")


def plasma_usage() -> dict[str, int]:
    """``{"mib": used MiB, "objects": n}`` summed over the cluster's nodes (Ray's memory summary, stats only)."""
    import ray
    from ray._private.internal_api import memory_summary

    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    found = _PLASMA_RE.findall(text)
    if not found:
        raise RuntimeError(f"Ray's memory summary has no 'Plasma memory usage' line (Ray moved it?): {text[:300]!r}")
    return {"mib": sum(int(m) for m, _ in found), "objects": sum(int(n) for _, n in found)}
