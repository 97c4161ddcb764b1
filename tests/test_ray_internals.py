"""The Ray fence: every private Ray name the package uses sits in zephon_ray/service/ray_internals.py, whose
behaviour tests/test_service.py::test_ray_internals_fence checks. This scans every other module's syntax tree
(lazy imports inside functions included) for a private name: a module or attribute path of ``ray`` with a part
that starts with ``_``, ``ray.experimental``, ``ray.core.generated``, or a ``_``-keyword to a ``ray.*`` call."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zephon_ray"
FENCE = PACKAGE / "service" / "ray_internals.py"


def _private(path: str) -> bool:
    parts = path.split(".")
    return parts[0] == "ray" and (
        any(p.startswith("_") for p in parts[1:])
        or parts[1:2] == ["experimental"]
        or parts[1:3] == ["core", "generated"]
    )


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_ray_uses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _private(node.module) or (
                node.module.split(".")[0] == "ray" and any(_private(f"{node.module}.{a.name}") for a in node.names)
            ):
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute):
            path = _dotted(node)
            if path and _private(path):
                found.append(f"{node.lineno}: {path}")
        elif isinstance(node, ast.Call):
            func = _dotted(node.func) or ""
            if func.split(".")[0] == "ray":
                found += [
                    f"{node.lineno}: {func}({k.arg}=...)" for k in node.keywords if k.arg and k.arg.startswith("_")
                ]
    return found


def test_no_private_ray_name_outside_the_fence():
    leaks = {
        str(p.relative_to(PACKAGE)): uses
        for p in sorted(PACKAGE.rglob("*.py"))
        if p != FENCE
        for uses in [private_ray_uses(p.read_text())]
        if uses
    }
    assert not leaks, f"private Ray names outside service/ray_internals.py: {leaks}"


def test_the_scan_sees_each_kind_of_private_use():
    source = """
import ray._private.worker
from ray._raylet import ObjectRef
from ray import _private
import ray.experimental
def f():
    from ray.core.generated import common_pb2
    ray.init(address="local", _temp_dir="/tmp/x")
    return ray._private.worker.global_worker
"""
    assert len(private_ray_uses(source)) >= 7, private_ray_uses(source)
    assert private_ray_uses("import ray\nray.init(address='auto')\nray.util.get_node_ip_address()\n") == []
    assert private_ray_uses(FENCE.read_text())  # the fence itself holds what the scan looks for
