"""DataService as a notebook uses it: ``ray_init`` starts a private Ray, and ``with`` stops what it started.

Runs in a subprocess, because the rest of the suite shares one Ray per session and ``ray_init`` only acts in a
process that has none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=base)


def test_ray_init_and_context_manager_stop_what_they_started():
    result = _run(SCRIPT)
    assert "CLEAN" in result.stdout, result.stderr[-3000:]

