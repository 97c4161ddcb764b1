"""Deliberate skips (``[[skips]]``): after a loss spike, a run resumed from an older state skips the data of a few
steps; training step t >= a reads data step t + (b - a). Checked against the committed goldens of tests/golden/
tiny.json (made by the independent oracle, tests/oracle.py), shifted by the rule:

- the recipe: ``[[skips]]`` validation (one line naming the key) and the mapping;
- one run across modes and W: local W = 2 (steps 0-3, saved at 4), then a resume whose recipe file declares a skip
  at step 4 (training steps 4.. read data 7..), in service mode at W = 3 (steps 4-6, across the skip), in dataset
  mode at W = 5 (steps 7-8) and under torchft (a real Lighthouse; steps 9-10): every step equals the golden of the
  data step it maps to, and the state records the skip, so a resume with the original file keeps it;
- a resume whose file rewrites the recorded skip, or adds one before the resume step, is refused in one line;
- ``zephon-ray audit`` of the run's ledger reports the skip as a note and exits 0; without the skip declared (the
  ledger directory audited against the plain recipe) the same ledger is findings.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY, run_readers
from service_helpers import status_detail

from zephon_ray import Recipe, compute_digest
from zephon_ray.recipe import RecipeError

DATA = ROOT / "recipes" / "data" / "tiny"
GOLDEN = {int(k): v for k, v in json.loads((ROOT / "tests" / "golden" / "tiny.json").read_text())["digests"].items()}
SKIP = '[[skips]]\nname = "spike-1"\nstart_step = 4\nend_step = 7\n'
pytestmark = pytest.mark.timeout(600)


def recipe_file(tmp_path: Path, extra: str = "", name: str = "r.toml") -> Path:
    path = tmp_path / name
    path.write_text(TINY.read_text().replace('"data/tiny/', f'"{DATA}/') + "\n" + extra)
    return path


@pytest.mark.parametrize(
    "extra, needle",
    [
        ('[[skips]]\nname = "a"\nstart_step = 4\nend_step = 4\n', "'skips[0].end_step'"),
        ('[[skips]]\nname = "a"\nstart_step = -1\nend_step = 4\n', "'skips[0].start_step'"),
        (
            '[[skips]]\nname = "a"\nstart_step = 4\nend_step = 6\n[[skips]]\nname = "b"\nstart_step = 4\nend_step = 9\n',
            "'skips[1].start_step'",
        ),
        (
            '[[skips]]\nname = "a"\nstart_step = 4\nend_step = 6\n[[skips]]\nname = "a"\nstart_step = 8\nend_step = 9\n',
            "'skips[1].name'",
        ),
        ('[[skips]]\nname = "a"\nstart = 4\nend_step = 6\n', "'skips[0].start'"),
    ],
)
def test_bad_skips_are_one_line(tmp_path, extra, needle):
    with pytest.raises(RecipeError) as info:
        Recipe.from_toml(recipe_file(tmp_path, extra))
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_the_mapping_and_the_fingerprint(tmp_path):
    """Training step t reads data step t plus every earlier skip's length; a skip changes no data step, so the
    fingerprint (what a service, a materialised run or a state_dir serves) stays the recipe's."""
    two = Recipe.from_toml(recipe_file(tmp_path, SKIP + '[[skips]]\nname = "b"\nstart_step = 10\nend_step = 12\n'))
    assert [two.data_step(t) for t in range(12)] == [0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 15, 16]
    assert [(s.name, first, end) for s, first, end in two.skipped_data()] == [("spike-1", 4, 7), ("b", 13, 15)]
    assert two.fingerprint == Recipe.from_toml(TINY).fingerprint


@pytest.fixture(scope="module")
def sources(ray_cluster, tiny_recipe, tmp_path_factory):
    from zephon_ray import DataService
    from zephon_ray.jobs.materialize import materialize

    work = tmp_path_factory.mktemp("skips")
    materialize(tiny_recipe, work / "materialized", range(0, 16), producers=1, segment_steps=8, progress=False)
    service = DataService.start(str(TINY), name="skips", namespace="zr-skips", state_dir=str(work / "svc"))
    try:
        yield {"dataset_dir": str(work / "materialized"), "work": work, "service": service}
    finally:
        service.stop()


def _config(path: Path, mode: str, sources: dict, tag: str):
    from zephon_ray.stream.loader import LoaderConfig

    kw: dict = {"recipe": str(path), "mode": mode, "run_id": "skips", "ledger_dir": str(sources["work"] / "ledger")}
    if mode == "local":
        kw.update(aggregate_dir=str(sources["work"] / f"agg-{tag}"), checkpoint_every=2)
    elif mode == "service":
        kw.update(service_name="skips", service_namespace="zr-skips")
    else:
        kw.update(dataset_dir=sources["dataset_dir"])
    return LoaderConfig(**kw)


def _segment(
    config, world: int, state: dict | None, steps: int, detail=lambda: ""
) -> tuple[list[tuple[int, str]], dict]:
    """W readers load ``state``, read ``steps`` steps (confirming each) and save: (training step, digest of the joined
    slices) per step, and the state. ``detail()`` goes with a failure of ranks still running at the deadline."""
    from zephon_ray.stream.loader import Loader

    loaders = [Loader(config, rank=r, world=world) for r in range(world)]

    def read(r: int, loader) -> tuple[list, dict]:
        it, got = iter(loader), []
        for _ in range(steps):
            batch = next(it)
            got.append(batch)
            loader.commit(batch.step)
        return got, loader.state_dict()

    got, states = zip(*run_readers(loaders, read, state, detail=detail))
    assert all(s == states[0] for s in states)
    out = []
    for parts in zip(*got):
        out.append(
            (
                parts[0].step,
                compute_digest(
                    np.concatenate([p.slice.tokens for p in parts]), np.concatenate([p.slice.positions for p in parts])
                ),
            )
        )
    return out, json.loads(json.dumps(states[0]))


@pytest.mark.heavy
def test_a_skip_across_modes_and_w_and_its_audit(sources, tmp_path, capsys):
    from zephon_ray.cli import main
    from zephon_ray.formats.loader_state import LoaderStateError, run_schedule

    plain, skipped = recipe_file(tmp_path, name="plain.toml"), recipe_file(tmp_path, SKIP, name="skip.toml")
    want = {t: GOLDEN[Recipe.from_toml(skipped).data_step(t)] for t in range(12)}

    steps, state = _segment(_config(plain, "local", sources, "a"), 2, None, 4)
    assert steps == [(t, GOLDEN[t]) for t in range(4)]
    # the spike workflow: roll back to the state at step 4, declare the skip in the recipe file, resume at W = 3
    steps, state = _segment(_config(skipped, "service", sources, "b"), 3, state, 3)
    assert steps == [(t, want[t]) for t in (4, 5, 6)] and want[4] == GOLDEN[7]
    assert run_schedule(state)["skips"] == [{"name": "spike-1", "start_step": 4, "end_step": 7}]
    steps, state = _segment(_config(plain, "dataset", sources, "c"), 5, state, 2)  # the state carries the skip
    assert steps == [(t, want[t]) for t in (7, 8)]
    with open(tmp_path / "state.json", "w") as f:
        json.dump(state, f)

    rewritten = recipe_file(tmp_path, SKIP.replace("end_step = 7", "end_step = 8"), name="rewritten.toml")
    with pytest.raises(LoaderStateError) as info:
        _segment(_config(rewritten, "local", sources, "d"), 1, state, 1)
    assert "recorded skip 'spike-1'" in str(info.value) and "\n" not in str(info.value), str(info.value)
    late = recipe_file(tmp_path, SKIP + '[[skips]]\nname = "late"\nstart_step = 8\nend_step = 9\n', name="late.toml")
    with pytest.raises(LoaderStateError) as info:
        _segment(_config(late, "local", sources, "e"), 1, state, 1)
    assert "skip 'late' starts at step 8, before step 9" in str(info.value), str(info.value)

    capsys.readouterr()
    assert (
        main(
            ["audit", str(tmp_path / "state.json"), "--ledger", str(sources["work"] / "ledger"), "--recipe", str(plain)]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert (
        "note: step 4: data steps 4..6 skipped by schedule entry 'spike-1' (training step 4 on reads data step 7 "
        "on)" in out
    ), out
    assert out[-1].startswith("audit: clean: steps [0, 9) each trained exactly once"), out
    # Undeclared: the same ledger against the plain recipe, without the run's schedule, is findings.
    assert main(["audit", str(sources["work"] / "ledger"), "--recipe", str(plain)]) == 1
    assert "other rows" in capsys.readouterr().out


def test_a_skip_under_torchft(sources, tmp_path):
    """A real torchft group (Lighthouse, Manager) over the materialised run with the skip declared: committed steps
    0-5 read data steps 0-3, then 7-8, and the state names the skip."""
    from test_ft import ft_groups

    from zephon_ray.formats.loader_state import run_schedule
    from zephon_ray.stream.ft import FtSlices

    skipped = recipe_file(tmp_path, SKIP, name="skip.toml")
    data = Recipe.from_toml(skipped).data_step
    got = []
    config = replace(_config(skipped, "dataset", sources, "ft"), ledger_dir=str(tmp_path / "ledger"))
    with ft_groups(1) as (manager,), FtSlices(config, manager=manager) as slices:
        while manager.current_step() < 6:
            manager.start_quorum()
            step = manager.current_step()
            batch = slices.next()
            assert batch.step == step
            got.append((batch.step, compute_digest(batch.slice.tokens, batch.slice.positions)))
            assert manager.should_commit()
        state = slices.state_dict()
    assert got == [(t, GOLDEN[data(t)]) for t in range(6)] and data(4) == 7
    assert run_schedule(state)["skips"] == [{"name": "spike-1", "start_step": 4, "end_step": 7}]


@pytest.mark.parametrize("mode, world", [("local", 2), ("service", 3)])
def test_a_skip_met_while_reading(sources, tmp_path, mode, world):
    """A skip the recipe declares ahead of the readers: at training step 4 the data jumps from step 3 to 7 in the
    middle of the stream (local mode restarts its Zephon lane groups from their newest checkpoint and replays)."""
    skipped = recipe_file(tmp_path, SKIP, name="skip.toml")
    data = Recipe.from_toml(skipped).data_step
    config = replace(_config(skipped, mode, sources, f"mid-{mode}"), ledger_dir=None)
    steps, state = _segment(
        config, world, None, 7, status_detail(sources["service"]) if mode == "service" else lambda: ""
    )
    assert steps == [(t, GOLDEN[data(t)]) for t in range(7)]
    assert state["next_step"] == 7
