"""DataService as a notebook uses it: ``ray_init`` starts a private Ray, and ``with`` stops what it started.

Runs in a subprocess, because the rest of the suite shares one Ray per session and ``ray_init`` only acts in a
process that has none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

SCRIPT = textwrap.dedent("""
    import ray
    from zephon_ray import DataService, GlobalBatchSource, Recipe

    assert not ray.is_initialized()
    recipe = Recipe.from_toml("tiny")
    with GlobalBatchSource(recipe) as local:
        expected = [local.batch(s).digest for s in range(3)]
    try:
        with DataService.start(recipe, name="ctx-demo", namespace="zr-ctx", ray_init=True) as svc:
            assert [svc.batch(s).digest for s in range(3)] == expected
            raise KeyError("a failing notebook cell")
    except KeyError:
        pass
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith("ctx-demo")], names   # coordinator and producers are gone
    print("CLEAN", flush=True)
    ray.shutdown()
""")


def _run(code: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=base)


@pytest.mark.heavy
@pytest.mark.spawns
def test_ray_init_and_context_manager_stop_what_they_started():
    result = _run(SCRIPT)
    assert "CLEAN" in result.stdout, result.stderr[-3000:]


CONNECT_AND_READ = textwrap.dedent("""
    import sys
    import ray
    from zephon_ray import DataService

    ray.init(address=sys.argv[1], namespace="zr-import", log_to_driver=False)
    svc = DataService.connect("import-probe", namespace="zr-import", consumer="probe")
    digests = [svc.batch(s).digest for s in range(3)] + [svc.slice(1, 1, 4).tokens.shape[0]]
    svc.release()
    server = sorted(m for m in sys.modules if m == "zephon_ray.service.server"
                    or m.startswith("zephon_ray.service.server.") or m == "zephon_ray.service.ray_internals")
    print("DIGESTS", *digests)
    print("SERVER", *server)
    ray.shutdown()
    for call in (lambda: svc.batch(0), lambda: svc.slice(0, 0, 2, track=True), svc.status, svc.release):
        try:
            call()
        except Exception as exc:
            print("AFTER", type(exc).__name__, str(exc).replace(" ", "_"))
    print("RAY", ray.is_initialized())
""")


def test_connect_and_reads_import_no_server_class(ray_cluster, tiny_recipe, reference_digests, tmp_path):
    """A fresh process attached to the cluster connects and reads (whole batches and a slice) and has imported
    nothing of zephon_ray/service/server/ (the modules that run inside the actors), nor the Ray fence: the client
    needs only client/ and the shared config, errors, wire, actor_shells and lease_cache. After ``ray.shutdown()``
    its reads, status and release fail in one line instead of starting a local Ray."""
    from zephon_ray import DataService

    svc = DataService.start(tiny_recipe, name="import-probe", namespace="zr-import", state_dir=tmp_path / "s")
    try:
        address = ray_cluster.get_runtime_context().gcs_address
        result = subprocess.run(
            [sys.executable, "-c", CONNECT_AND_READ, address],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        )
        lines = {ln.split(" ", 1)[0]: ln.split()[1:] for ln in result.stdout.splitlines() if " " in ln or ln}
        assert "DIGESTS" in lines, result.stderr[-3000:]
        assert lines["DIGESTS"] == reference_digests[:3] + [str(tiny_recipe.global_batch_rows // 4)]
        assert lines.get("SERVER", []) == [], lines["SERVER"]
        # After ray.shutdown() each call fails in one line; none starts a local Ray of its own.
        after = [ln.split()[1:] for ln in result.stdout.splitlines() if ln.startswith("AFTER ")]
        assert len(after) == 4 and all(kind == "ServiceError" for kind, _ in after), after
        assert all("Ray_is_not_initialised_in_this_process" in message for _, message in after), after
        assert lines["RAY"] == ["False"]
    finally:
        svc.stop()


def test_connect_to_a_missing_name_fails_at_once(ray_cluster, monkeypatch):
    import time

    import pytest

    from zephon_ray import DataService
    from zephon_ray.service.errors import ServiceNotFoundError

    slept = []
    with monkeypatch.context() as patch:
        patch.setattr(time, "sleep", lambda s: slept.append(s))  # a wait would sleep between lookups
        with pytest.raises(ServiceNotFoundError) as info:
            DataService.connect("nope", namespace="zr-none")
    assert not slept
    assert str(info.value) == (
        "no service named 'nope' in namespace 'zr-none'; start it, or wait for one that is "
        "starting (connect(timeout_s=...); `zephon-ray status --wait SECONDS`)"
    )
    with pytest.raises(ServiceNotFoundError, match="after waiting 0.3s"):
        DataService.connect("nope", namespace="zr-none", timeout_s=0.3)  # asked to wait: it polls, then says so
    for bad in ("60", -1, float("nan"), True):
        with pytest.raises(ValueError, match="connect: timeout_s must be a number of seconds >= 0"):
            DataService.connect("nope", namespace="zr-none", timeout_s=bad)


def test_start_takes_a_config_and_overrides_of_its_fields(tiny_recipe, tmp_path, monkeypatch):
    """``start(recipe, config, **overrides)``: a built ServiceConfig, keyword overrides of its fields (replacing the
    config's), or both; an unknown keyword is one TypeError naming it, before anything starts. No Ray here: the
    launch is replaced by a recorder."""
    import types

    from zephon_ray import DataService, ServiceConfig
    from zephon_ray.service.client import data_service
    from zephon_ray.service.server import launch

    launched = []
    monkeypatch.setattr(data_service, "_ensure_ray", lambda ray_init=None: None)
    monkeypatch.setattr(launch, "launch", lambda recipe, config: launched.append(config) or "coordinator")
    monkeypatch.setattr(
        DataService,
        "_from_coordinator",
        classmethod(lambda cls, handle, **kw: types.SimpleNamespace(handle=handle, **kw)),
    )
    config = ServiceConfig.build(tiny_recipe, name="built", window=4, state_dir=str(tmp_path / "a"))

    DataService.start(tiny_recipe, config)
    assert launched[-1] == config
    DataService.start(tiny_recipe, config, window=6, state_dir=tmp_path / "b")
    assert (launched[-1].name, launched[-1].window, launched[-1].state_dir) == ("built", 6, str(tmp_path / "b"))
    got = DataService.start(tiny_recipe, name="kw", producers=2, consumer="me")
    assert (launched[-1].name, launched[-1].producers, launched[-1].run_id) == ("kw", 2, "kw")
    assert (got.handle, got.consumer, got._started_here) == ("coordinator", "me", True)

    count = len(launched)
    with pytest.raises(
        TypeError,
        match=r"^DataService.start: unknown option 'windwo' \(did you mean 'window'\?\); "
        r"options are consumer, ray_init and the fields of ServiceConfig: ",
    ):
        DataService.start(tiny_recipe, windwo=4)
    with pytest.raises(TypeError, match="unknown option 'flavour';"):
        DataService.start(tiny_recipe, config, flavour="x")
    with pytest.raises(TypeError, match="config must be a ServiceConfig, got dict"):
        DataService.start(tiny_recipe, {"window": 4})
    assert len(launched) == count


def test_a_handle_is_not_constructed_directly():
    from zephon_ray import DataService

    with pytest.raises(TypeError, match=r"^DataService is not constructed directly: DataService.start\(recipe, "):
        DataService("coordinator", name="x", namespace="y")


SERVICE = ROOT / "zephon_ray" / "service"
LAZY_SERVER_IMPORTS = {
    ("client/data_service.py", "start"),
    ("client/data_service.py", "stop"),
    ("actor_shells.py", "__init__"),
}
"""Where a client-side or shared module may import server/: DataService.start and stop (they launch and stop the
actors) and the shells' constructors (they run inside the actor's process)."""


def test_the_client_side_imports_server_only_where_it_starts_or_stops_the_actors():
    """The seam in the tree: client/ and the shared modules of service/ import nothing of server/ except inside the
    functions of LAZY_SERVER_IMPORTS (the subprocess test above checks what a connecting process really loads)."""
    import ast

    files = sorted(SERVICE.glob("client/*.py")) + sorted(SERVICE.glob("*.py"))
    found = []
    for path in files:
        rel = str(path.relative_to(SERVICE))

        def visit(node, rel, function=None):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, rel, child.name)
                    continue
                if isinstance(child, ast.ImportFrom) and child.module:
                    names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
                elif isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    names = []
                if (
                    any(n.startswith("zephon_ray.service.server") for n in names)
                    and (rel, function) not in LAZY_SERVER_IMPORTS
                ):
                    found.append(f"{rel}:{child.lineno} in {function or 'the module'}")
                visit(child, rel, function)

        visit(ast.parse(path.read_text()), rel)
    assert not found, found
