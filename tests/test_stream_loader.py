"""The framework-free loader core (``zephon_ray.stream.loader.Loader``) over all three sources, with the mode AND the
reader count W changing at every resume, and its bad-input refusals.

One run of 10 steps of recipes/tiny.toml (L = 8 lanes, B = 16 rows), resumed five times from a JSON round trip of
the loader state: local W=2 -> service W=3 -> dataset W=5 (padded to equal shapes) -> service W=1 -> local W=4 ->
dataset W=2 (local -> service -> dataset and back; 3 and 5 do not divide B, so those readers hold 5 or 6 and 3 or 4
rows). Every step's global batch, joined from the readers' slices in rank order, must equal
the committed golden digests of tests/golden/tiny.json (made by the independent oracle, tests/oracle.py), and
every reader's state must be identical at every resume.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_readers

from zephon_ray import compute_digest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny.toml")
STEPS = 10
# (mode, W, steps this segment trains)
SCHEDULE = (
    ("local", 2, 2),
    ("service", 3, 2),
    ("dataset", 5, 2),
    ("service", 1, 1),
    ("local", 4, 2),
    ("dataset", 2, 1),
)
PADDED = {("dataset", 5)}  # segments that pad every reader's slice to ceil(16/W) rows
STATE_KEYS = {"version", "run_id", "fingerprint", "next_step", "zephon", "replayed_steps", "ledger", "run_schedule"}


@pytest.fixture(scope="module")
def sources(ray_cluster, tiny_recipe, tmp_path_factory):
    """A running service and a materialised directory of the tiny recipe (both on the session's private Ray)."""
    from zephon_ray import DataService
    from zephon_ray.jobs.materialize import materialize

    work = tmp_path_factory.mktemp("stream-loader")
    materialize(tiny_recipe, work / "materialized", range(0, STEPS), producers=1, segment_steps=8, progress=False)
    service = DataService.start(
        TINY, name="stream-loader", namespace="zr-stream-loader", producers=1, state_dir=str(work / "svc")
    )
    try:
        yield {"service": service, "dataset_dir": str(work / "materialized"), "work": work}
    finally:
        service.stop()


def _config(mode: str, sources: dict, segment: int, pad: bool = False):
    from zephon_ray.stream.loader import LoaderConfig

    kw: dict = {"recipe": TINY, "mode": mode, "run_id": "modes", "pad_slices": pad}
    if mode == "local":
        kw.update(aggregate_dir=str(sources["work"] / f"aggregate-{segment}"), checkpoint_every=1)
    elif mode == "service":
        kw.update(service_name="stream-loader", service_namespace="zr-stream-loader")
    else:
        kw.update(dataset_dir=sources["dataset_dir"])
    return LoaderConfig(**kw)


def _segment(config, world: int, state: dict | None, steps: int) -> tuple[list, list[dict]]:
    """W readers (threads: a local-mode checkpoint with W > 1 is collective) load ``state``, take ``steps`` steps
    each, then take their states; returns the per-step slices in rank order and the states."""
    from zephon_ray.stream.loader import Loader

    lbs = 16 // world if 16 % world == 0 else 0  # 0: one microbatch of the reader's rows (5 or 6 at W=3)
    loaders = [Loader(config, rank=r, world=world, local_batch_size=lbs) for r in range(world)]

    def read(r: int, loader) -> tuple[list, dict]:
        it, slices = iter(loader), []
        for _ in range(steps):
            batch = next(it)
            rows = torch.cat([labels for _, labels in batch.microbatches])
            # Padded to the same rows on every reader; the padding rows' labels are all ignored.
            assert rows.shape[0] == (-(-16 // world) if config.pad_slices else batch.slice.num_rows)
            assert (rows[batch.slice.num_rows :] == -100).all()
            assert batch.global_valid_tokens == 16 * 64  # 'wrap' packing: every label of the 16 rows
            slices.append(batch.slice)
        return slices, loader.state_dict()

    slices, states = zip(*run_readers(loaders, read, state))
    return [list(step) for step in zip(*slices)], list(states)


# Proves stream/loader.py: the same rows in every mode, with mode and W changing at every resume.
def test_modes_and_w_change_at_every_resume(sources, reference_digests):
    state = None
    seen: list[tuple[int, str, int]] = []
    for segment, (mode, world, steps) in enumerate(SCHEDULE):
        per_step, states = _segment(_config(mode, sources, segment, (mode, world) in PADDED), world, state, steps)
        for parts in per_step:
            step = parts[0].step
            digest = compute_digest(
                np.concatenate([p.tokens for p in parts]), np.concatenate([p.positions for p in parts])
            )
            assert digest == reference_digests[step], f"step {step} ({mode}, W={world}) differs from the golden"
            seen.append((step, mode, world))
        assert all(s == states[0] for s in states), f"{mode} W={world}: the readers' states differ"
        state = states[0]
        assert set(state) == STATE_KEYS and state["next_step"] == seen[-1][0] + 1
        # zephon: the merged Zephon checkpoint in local mode (taken every step here), "" otherwise
        assert (state["zephon"] != "") == (mode == "local"), (mode, state["zephon"][:40])
    assert [s for s, _, _ in seen] == list(range(STEPS))
    # local W=4 resumed at step 7 from a service state (no Zephon checkpoint): it replayed steps 0..6, and says so
    assert state["replayed_steps"] == 7


# ---------------------------------------------------------------------- bad input: one line naming what is wrong
def _loader(**kw):
    from zephon_ray.stream.loader import Loader, LoaderConfig

    return Loader(LoaderConfig(recipe=TINY, mode="local"), **{"rank": 0, "world": 1, **kw})


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"world": None}, r"world must be an int in \[1, 10\*\*12\], got None"),
        ({"world": 0}, r"world must be an int in \[1, 10\*\*12\], got 0"),
        ({"rank": 1, "world": 1}, r"rank must be an int in \[0, world=1\), got 1"),
        ({"rank": "0"}, r"rank must be an int in \[0, world=1\), got '0'"),
        ({"local_batch_size": 2.5}, r"local_batch_size must be an int in \[0, .*\], got 2.5"),
        ({"world": 17, "rank": 0}, "a data-parallel degree of 17 does not fit the recipe's global batch of 16 rows"),
        ({"world": 3}, "local mode needs the data-parallel degree to divide the recipe's 8 lanes, got 3"),
        ({"world": 3, "local_batch_size": 2}, "local_batch_size 2 does not divide every reader's share"),
    ],
)
def test_bad_reader_numbers_are_one_line(kw, message):
    with pytest.raises(ValueError, match=message) as info:
        _loader(**kw)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("next_step"), "loader state lacks key 'next_step'"),
        (lambda s: s.pop("zephon"), "loader state lacks key 'zephon'"),
        (lambda s: s.pop("version"), "loader state lacks key 'version'"),
        (lambda s: s.update(extra=1), "loader state has unknown key 'extra'"),
        (lambda s: s.update(next_step="3"), r"key 'next_step' must be an int in \[0, 10\*\*12\], got '3'"),
        (
            lambda s: s.update(zephon='{"version": 1}'),
            r"the Zephon checkpoint's 'next_step' must be an int in \[0, .*\], got None",
        ),
        (lambda s: s.update(zephon='{"next_step": 9}'), "the Zephon checkpoint is at step 9, after 'next_step' 3"),
        (lambda s: s.update(zephon="[1]"), "key 'zephon' must hold a JSON object"),
        (lambda s: s.update(zephon=None), "key 'zephon' must be a JSON string"),
    ],
)
# Proves formats/loader_state.py: a missing, extra or bad key is one line naming the key.
def test_bad_loader_states_are_one_line_naming_the_key(change, message):
    from zephon_ray.formats.loader_state import LoaderStateError

    with _loader() as loader:
        state = {**loader.state_dict(), "next_step": 3}
        change(state)
        with pytest.raises(LoaderStateError, match=message) as info:
            loader.load_state_dict(state)
        assert "\n" not in str(info.value)
        assert loader.next_step == 0  # nothing half-loaded


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"mode": "ray"}, "'mode' must be one of"),
        ({"recipe": ""}, "'recipe' .* is required"),
        ({"prefetch": 0}, r"'prefetch' must be an int in \[1, 1024\], got 0"),
        ({"checkpoint_every": None}, "'checkpoint_every' must be an int in"),
        ({"mode": "local", "dataset_dir": "/x"}, "only used by it"),
    ],
)
def test_bad_loader_config_fails_when_built(kw, message):
    from zephon_ray.stream.loader import LoaderConfig

    with pytest.raises(ValueError, match=message):
        LoaderConfig(**{"recipe": TINY, **kw})
