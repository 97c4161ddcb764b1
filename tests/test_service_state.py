"""Durable service state: checkpoint retention (newest N + anchors), the in-memory index, per-consumer commits.

No Ray. Checkpoint files here are one real merged LaneStepper state re-labelled at other step boundaries: the
tests are about which files are kept, not about restoring them (test_service_faults.py restores real ones).
"""

from __future__ import annotations

import copy
import json
import os

import pytest

from zephon_ray.formats.service_state import (
    CHECKPOINT_RE,
    COMMITS_FILE,
    MAX_CONSUMERS,
    FingerprintMismatchError,
    ServiceState,
    checkpoint_index,
)
from zephon_ray.lanes import KEY_NEXT_STEP, LaneStepper
from zephon_ray.storage import write_json


@pytest.fixture(scope="module")
def real_state(tiny_recipe):
    stepper = LaneStepper(tiny_recipe)
    try:
        stepper.next_step()
        return stepper.checkpoint()
    finally:
        stepper.close()


def _at(state, recipe, step):
    out = copy.deepcopy(state)
    out[KEY_NEXT_STEP] = step
    emitted = out["zephon"]["lane_emitted"]
    for lane in emitted:
        emitted[lane] = step * recipe.microbatches_per_lane
    return out


def test_add_phase_records_the_phase_and_drops_later_checkpoints(tiny_recipe, real_state, tmp_path):
    """A phase a running service accepted (Coordinator.add_phase) deletes the checkpoints after its start (made
    under the old schedule) and is recorded in service.json: the state_dir then opens with the recipe the service
    started from (it gets the phase) or with the phase written in, and refuses another schedule."""
    state = ServiceState.open(tiny_recipe, tmp_path)
    for step in (2, 4, 6):
        state.write_checkpoint(_at(real_state, tiny_recipe, step))
    added = tiny_recipe.with_phase("anneal", 4, {"prose": 1.0})
    assert state.add_phase(added, "anneal") == [6]
    assert state.checkpoint_steps() == [2, 4] and sorted(checkpoint_index(tmp_path)) == [2, 4]
    for recipe in (tiny_recipe, added):
        reopened = ServiceState.open(recipe, tmp_path)
        assert reopened.recipe.fingerprint == added.fingerprint
        assert reopened.read_checkpoint(4)[KEY_NEXT_STEP] == 4
    with pytest.raises(FingerprintMismatchError, match="belongs to recipe fingerprint"):
        ServiceState.open(tiny_recipe.with_phase("anneal", 5, {"prose": 1.0}), tmp_path)


def test_a_checkpoint_pruned_between_its_choice_and_its_read_is_replaced_by_an_older_one(
    tiny_recipe, real_state, tmp_path
):
    """A replay picks the newest checkpoint <= its step on the coordinator's executor while the pump writes new ones,
    whose prune can delete it before the read (the heavy recycle test in test_service_faults.py failed 2 runs of 2
    with 'checkpoint missing' that way). ``read_nearest`` then reads the next one <= the step; a checkpoint missing
    without a prune stays an error naming the file."""
    state = ServiceState.open(tiny_recipe, tmp_path, keep_checkpoints=2, anchor_every=8)
    for step in (4, 8, 12, 16, 20):
        state.write_checkpoint(_at(real_state, tiny_recipe, step))
    assert state.checkpoint_steps() == [8, 16, 20]
    read = state.read_checkpoint
    chosen = []

    def pruned_before_its_read(step):
        chosen.append(step)
        if len(chosen) == 1:  # the pump writes two checkpoints meanwhile: 20 is no longer among the newest 2
            for later in (24, 28):
                state.write_checkpoint(_at(real_state, tiny_recipe, later))
        return read(step)

    state.read_checkpoint = pruned_before_its_read
    ckpt, got = state.read_nearest(21)
    assert chosen == [20, 16] and ckpt == 16 and got[KEY_NEXT_STEP] == 16
    assert state.read_nearest(3) == (0, None)  # no checkpoint <= 3: a fresh pipeline
    os.remove(tmp_path / "checkpoints" / "step-000000000016.json")  # gone without a prune: an error, not a retry
    state.read_checkpoint = read
    with pytest.raises(ValueError, match="step-000000000016.json: checkpoint missing"):
        state.read_nearest(17)


def test_retention_keeps_newest_and_anchors(tiny_recipe, real_state, tmp_path):
    state = ServiceState.open(tiny_recipe, tmp_path, keep_checkpoints=3, anchor_every=32)
    k = 4
    for step in range(k, 1000 + 1, k):
        state.write_checkpoint(_at(real_state, tiny_recipe, step))
    kept = state.checkpoint_steps()
    anchors = list(range(32, 1000 + 1, 32))
    assert kept == sorted(set(anchors) | {992, 996, 1000})
    on_disk = sorted(int(CHECKPOINT_RE.match(p.name).group(1)) for p in (tmp_path / "checkpoints").iterdir())
    assert on_disk == kept  # the index matches the directory
    # nearest <= s: a recent step replays at most K, an old one at most anchor_every.
    assert state.nearest_checkpoint(999) == 996 and state.nearest_checkpoint(900) == 896
    assert state.nearest_checkpoint(31) is None
    # A reopened state builds the same index from one listing.
    again = ServiceState.open(tiny_recipe, tmp_path, keep_checkpoints=3, anchor_every=32)
    assert again.checkpoint_steps() == kept and again.nearest_checkpoint(999) == 996


def test_a_pinned_checkpoint_outlives_pruning(tiny_recipe, real_state, tmp_path):
    """A materialised prefix's end (imported pinned by the coordinator) stays: replays past it start there."""
    state = ServiceState.open(tiny_recipe, tmp_path, keep_checkpoints=2, anchor_every=32)
    state.write_checkpoint(_at(real_state, tiny_recipe, 12), pin=True)
    for step in range(16, 200 + 1, 4):
        state.write_checkpoint(_at(real_state, tiny_recipe, step))
    assert state.checkpoint_steps() == [12, 32, 64, 96, 128, 160, 192, 196, 200]
    assert state.nearest_checkpoint(20) == 12


def test_nearest_checkpoint_does_not_list_the_directory(tiny_recipe, real_state, tmp_path, monkeypatch):
    state = ServiceState.open(tiny_recipe, tmp_path, anchor_every=0)
    for step in (8, 16, 24):
        state.write_checkpoint(_at(real_state, tiny_recipe, step))
    calls = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda *a: calls.append(a) or real_listdir(*a))
    for step in range(100):
        state.nearest_checkpoint(step)
        state.has_checkpoint(step)
    assert not calls and state.checkpoint_steps() == [8, 16, 24]  # anchor_every=0 keeps everything


def test_commits_newest_per_consumer_and_bounded(tiny_recipe, tmp_path):
    state = ServiceState.open(tiny_recipe, tmp_path)
    state.add_commit(10, "a")
    state.add_commit(4, "b")
    state.add_commit(12, "a")
    assert state.consumer_commits() == {"a": 12, "b": 4} and state.latest_commit() == 12
    for i in range(MAX_CONSUMERS + 20):
        state.add_commit(i, f"c{i}")
    commits = state.consumer_commits()
    assert (
        len(commits) == MAX_CONSUMERS and "a" not in commits and commits[f"c{MAX_CONSUMERS + 19}"] == MAX_CONSUMERS + 19
    )
    assert (tmp_path / COMMITS_FILE).stat().st_size < 64 * 1024


def test_commits_written_before_per_consumer_format_still_read(tiny_recipe, tmp_path):
    state = ServiceState.open(tiny_recipe, tmp_path)
    write_json(
        tmp_path / COMMITS_FILE,
        {
            "format": "zephon-ray/service-state/v1",
            "commits": [
                {"step": 3, "consumer": "x", "time": 1.0},
                {"step": 9, "consumer": "y", "time": 2.0},
                {"step": 5, "consumer": "x", "time": 3.0},
            ],
        },
    )
    assert state.consumer_commits() == {"x": 5, "y": 9}
    state.add_commit(6, "x")
    assert json.loads((tmp_path / COMMITS_FILE).read_text())["latest"]["x"]["step"] == 6


@pytest.mark.parametrize(
    "entry, needle",
    [
        (
            {"step": "seven", "consumer": "x", "time": 1.0},
            "commits[1] is malformed: 'step' must be an int in [0, 10**12], got 'seven'",
        ),
        ({"step": 3, "time": 1.0}, "commits[1] is malformed ('consumer' must be a non-empty string"),
        ("not a table", "commits[1] is malformed (a str, not a table)"),
    ],
)
def test_a_malformed_commit_entry_is_one_line(tiny_recipe, tmp_path, capsys, entry, needle):
    """`zephon-ray inspect` (and a restarting coordinator) name the file and the entry; nothing is rewritten."""
    from zephon_ray.cli import main
    from zephon_ray.formats.service_state import ServiceStateError, inspect

    state = ServiceState.open(tiny_recipe, tmp_path)
    state.add_commit(2, "good")
    path = tmp_path / COMMITS_FILE
    payload = json.loads(path.read_text())
    payload["commits"].append(entry)
    payload.pop("latest")
    path.write_text(json.dumps(payload))
    before = path.read_bytes()
    with pytest.raises(ServiceStateError, match=re_escape(f"{path}: {needle}")):
        inspect(tmp_path)
    with pytest.raises(ServiceStateError, match=re_escape(needle)):
        ServiceState.open(tiny_recipe, tmp_path).consumer_commits()
    with pytest.raises(SystemExit) as exc:
        main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and needle in err and str(path) in err, err
    assert path.read_bytes() == before


def test_inspect_reads_a_state_dir_and_old_checkpoint_names(tiny_recipe, real_state, tmp_path, capsys):
    from zephon_ray.cli import main
    from zephon_ray.storage import write_json as write

    state = ServiceState.open(tiny_recipe, tmp_path)
    state.write_checkpoint(_at(real_state, tiny_recipe, 16))
    write(tmp_path / "checkpoints" / "step-00000008.json", _at(real_state, tiny_recipe, 8))  # an older, 8-digit name
    state.add_commit(12, "trainer")
    again = ServiceState.open(tiny_recipe, tmp_path)
    assert again.checkpoint_steps() == [8, 16] and again.read_checkpoint(8)[KEY_NEXT_STEP] == 8
    assert set(os.listdir(tmp_path / "checkpoints")) == {"step-00000008.json", "step-000000000016.json"}
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checkpoints"]["steps"] == [8, 16] and report["commits"]["by_consumer"] == {"trainer": 12}
    assert report["fingerprint"] == tiny_recipe.fingerprint


def re_escape(text):
    import re

    return re.escape(text)
