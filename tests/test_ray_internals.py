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


def test_ray_notices_print_on_stderr_inside_a_session(ray_cluster, capsys):
    """Ray 2.60's driver prints the notices a cluster publishes to it (a task retried, a worker died) on stdout, even
    with ``log_to_driver=False``. Inside ``ray_session`` they go to stderr, so a command's ``--json`` stdout stays
    parseable: a forwarded "Task CoordinatorActor.lease failed ... retried" once came before `zephon-ray bench
    --json`'s JSON. Fails if Ray stops looking ``print_to_stdstream`` up at each notice, or renames it."""
    import time
    import uuid

    import ray
    import ray._private.worker as ray_worker
    from ray._private.utils import publish_error_to_driver

    from zephon_ray.service.client.session import ray_session

    printer = ray_worker.print_to_stdstream
    notice = f"zr-notice-{uuid.uuid4().hex}"
    out = err = ""
    with ray_session(None, private_if_none=True):
        publish_error_to_driver("zr_test", notice, gcs_client=ray_worker.global_worker.gcs_client)
        deadline = time.monotonic() + 30
        while notice not in out + err and time.monotonic() < deadline:
            time.sleep(0.1)
            captured = capsys.readouterr()
            out, err = out + captured.out, err + captured.err
    assert ray.is_initialized()  # the session's own cluster fixture stays up
    assert notice in err, f"the notice did not reach stderr within 30 s; stdout: {out!r}"
    assert notice not in out
    assert ray_worker.print_to_stdstream is printer
