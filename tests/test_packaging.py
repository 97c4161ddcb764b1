"""The wheel carries the recipes and their data: a non-editable install, outside the checkout, runs
``zephon-ray digest tiny`` and the TorchTitan loader on a packaged recipe by bare name, with the reference digests.

To stay cheap the fresh venv gets no copies of the dependencies: it is created without pip, the wheel goes in with
``--no-deps`` (the main venv's pip, ``--python``), and a ``.pth`` file appends the main venv's site-packages
*after* the venv's own, so ``zephon_ray`` comes from the wheel and torch/ray/zephon from the main venv. The test
asserts that ``zephon_ray.__file__`` is not in the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.timeout(600)
# What the wheel is built from: the project files only (a private copy, so no build/ or egg-info lands in the
# checkout that other runs share). The zephon_ray/recipes symlink is kept as a symlink, as in git.
BUILD_INPUTS = ("pyproject.toml", "README.md", "zephon_ray", "recipes")
LOADER_SCRIPT = """
import hashlib, json, zephon_ray
from zephon_ray.torchtitan import ZephonRayDataLoader
loader = ZephonRayDataLoader.Config(recipe="tiny", mode="local").build(
    dp_world_size=1, dp_rank=0, seq_len=64, local_batch_size=16)
steps = iter(loader)
inputs = [next(steps)[0]["input"].numpy() for _ in range(2)]
print(json.dumps({"file": zephon_ray.__file__, "shape": list(inputs[0].shape),
                  "inputs": [hashlib.sha256(x.astype("int64").tobytes()).hexdigest() for x in inputs]}))
loader.close()
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> tuple[Path, Path]:
    """Build the wheel from a copy of the project and install it non-editable into a fresh venv; returns its
    (bin/, site-packages/)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in BUILD_INPUTS:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, src / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(origin, src / name)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"), str(src)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wheels = list((work / "dist").glob("zephon_ray-*.whl"))
    assert len(wheels) == 1, wheels

    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Dependencies from the main venv, searched after the venv's own site-packages (where the wheel goes).
    Path(site, "zz_main_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [*pip, "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheels[0])],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return venv / "bin", Path(site)


@pytest.fixture(scope="module")
def installed(venv) -> Path:
    return venv[0]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}


def test_wheel_holds_the_recipes_and_their_data(venv):
    recipes_dir = venv[1] / "zephon_ray" / "recipes"  # as installed from the wheel: real files, not the symlink
    assert recipes_dir.is_dir() and not recipes_dir.is_symlink()
    shipped = sorted(str(p.relative_to(recipes_dir)) for p in recipes_dir.rglob("*") if p.is_file())
    in_git = sorted(
        str(p.relative_to(ROOT / "recipes"))
        for p in (ROOT / "recipes").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert shipped == in_git
    assert {"tiny.toml", "elastic.toml", "tokenizer/tokenizer.json"} <= set(shipped)


def test_digest_by_bare_name_outside_the_checkout(installed, reference_digests, tmp_path):
    result = subprocess.run(
        [str(installed / "zephon-ray"), "digest", "tiny", "--steps", "0:3"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [f"step {s} {reference_digests[s]}" for s in range(3)]

    result = subprocess.run(
        [str(installed / "zephon-ray"), "digest", "no-such-recipe", "--steps", "0:1"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no-such-recipe" in result.stderr and "elastic, " in result.stderr and "tiny" in result.stderr


def test_loader_on_a_packaged_recipe_outside_the_checkout(installed, tiny_recipe, tmp_path):
    import hashlib
    import json

    from zephon_ray import GlobalBatchSource

    result = subprocess.run(
        [str(installed / "python"), "-c", LOADER_SCRIPT],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not Path(report["file"]).resolve().is_relative_to(ROOT), report
    assert report["shape"] == [16, 64]
    with GlobalBatchSource(tiny_recipe) as source:  # the checkout's reference: inputs are rows[:, :-1]
        expected = [
            hashlib.sha256(source.batch(s).tokens[:, :-1].astype("int64").tobytes()).hexdigest() for s in range(2)
        ]
    assert report["inputs"] == expected
