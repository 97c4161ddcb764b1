"""Mixture schedules keyed by step (issue 29): recipes/phased.toml and recipes derived from recipes/tiny.toml.

What is checked, and against what:
- the recipe: ``[[phases]]`` validation (one line naming the phase and key), the fingerprint chain;
- steps before a boundary are byte-identical with and without the phase (tiny's goldens), and every step of the
  three-phase recipe equals the committed goldens, which the independent oracle (tests/oracle.py, Zephon's public
  API) computes in test_oracle.py;
- no record (Zephon sample id) is drawn twice across a boundary within its source's epoch, while a naive restart at
  the boundary (a fresh recipe with the new weights) does repeat records: the check can fail;
- each phase's per-source token shares follow its weights (a zero weight gives no tokens at all);
- random access and restores on either side of a boundary, and resumes that keep or rewrite the past;
- the Zephon fence for the work-source state (zephon_io).
The local loader at W = 2, 4 and 1 across boundaries runs by default; the service (2 producers) and the materialised
path: test_service_and_materialised_runs_cross_the_boundaries (slow: a private Ray).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY, run_readers

from zephon_ray import GlobalBatchSource, Recipe
from zephon_ray.lanes import LaneStepper, StepStateError
from zephon_ray.recipe import RecipeError
from zephon_ray.source import assemble

PHASED = ROOT / "recipes" / "phased.toml"
GOLDEN = json.loads((ROOT / "tests" / "golden" / "phased.json").read_text())["digests"]
TINY_GOLDEN = json.loads((ROOT / "tests" / "golden" / "tiny.json").read_text())["digests"]
DATA = ROOT / "recipes" / "data" / "tiny"


def phased_text(phases: str, weights: tuple[float, float] = (0.6, 0.4)) -> str:
    """recipes/tiny.toml with absolute source paths, the given source weights and ``phases`` appended."""
    text = TINY.read_text().replace('"data/tiny/', f'"{DATA}/')
    text = text.replace("weight = 0.6", f"weight = {weights[0]}").replace("weight = 0.4", f"weight = {weights[1]}")
    return text + "\n" + phases


def load(tmp_path: Path, text: str, name: str = "r.toml") -> Recipe:
    path = tmp_path / name
    path.write_text(text)
    return Recipe.from_toml(path)


def phase(name: str, start: int, **weights: float) -> str:
    table = ", ".join(f"{k} = {v}" for k, v in weights.items())
    return f'[[phases]]\nname = "{name}"\nstart_step = {start}\nweights = {{ {table} }}\n'


def run(recipe: Recipe, steps: int) -> tuple[list, list[dict[int, list]]]:
    """Batches 0..steps-1 from one LaneStepper, and per step each lane's contributing sample ids."""
    stepper = LaneStepper(recipe)
    stepper.record_contributors = True
    try:
        batches, contributors = [], []
        for step in range(steps):
            batches.append(assemble(recipe, step, stepper.next_step()))
            contributors.append({lane: list(ids) for lane, ids in stepper.contributors.items()})
        return batches, contributors
    finally:
        stepper.close()


# ---------------------------------------------------------------------- the recipe
BAD_PHASES = [
    ("start at 0", phase("a", 0, prose=1.0), "'phases[0].start_step'"),
    ("not increasing", phase("a", 4, prose=1.0) + phase("b", 4, code=1.0), "'phases[1].start_step'"),
    ("unknown source", phase("a", 4, poetry=1.0), "'phases[0].weights.poetry'"),
    ("negative weight", phase("a", 4, prose=-1.0), "'phases[0].weights.prose'"),
    ("all zero", phase("a", 4, prose=0.0), "'phases[0].weights'"),
    ("duplicate name", phase("a", 4, prose=1.0) + phase("a", 6, code=1.0), "'phases[1].name'"),
    ("unknown key", phase("a", 4, prose=1.0).replace("start_step", "start"), "'phases[0].start'"),
]


@pytest.mark.parametrize("what,phases,needle", BAD_PHASES, ids=[b[0] for b in BAD_PHASES])
def test_bad_phases_raise_one_clear_error(tmp_path, what, phases, needle):
    with pytest.raises(RecipeError) as info:
        load(tmp_path, phased_text(phases))
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def test_a_phase_cannot_add_a_source_but_names_the_way(tmp_path):
    """Zephon refuses a checkpoint whose dataset set differs ("Checkpoint dataset_ids do not match"), so the set of
    sources is fixed for the run: a source that joins later is declared with weight 0."""
    with pytest.raises(RecipeError, match="declare it in \\[\\[sources\\]\\] with weight 0"):
        load(tmp_path, phased_text(phase("a", 4, poetry=1.0)))


def test_fingerprint_chain(tmp_path):
    tiny = Recipe.from_toml(TINY)
    phased = Recipe.from_toml(PHASED)
    assert phased.base_fingerprint == tiny.fingerprint == tiny.base_fingerprint  # the past before the first phase
    assert phased.fingerprint != tiny.fingerprint and len(set(phased.schedule_fingerprints)) == 3
    assert [phased.history_fingerprint(t) for t in (0, 1, 2, 3, 4, 5)] == [
        phased.schedule_fingerprints[i] for i in (0, 0, 0, 1, 1, 2)
    ]
    moved = load(
        tmp_path, PHASED.read_text().replace("start_step = 4", "start_step = 5").replace('"data/tiny/', f'"{DATA}/')
    )
    assert moved.schedule_fingerprints[:2] == phased.schedule_fingerprints[:2]
    assert moved.fingerprint != phased.fingerprint


# ---------------------------------------------------------------------- the batches
def test_every_step_matches_the_goldens_and_the_past_is_unchanged():
    """Steps 0..5 of recipes/phased.toml (boundaries at 2 and 4) equal the oracle's goldens, and so do far steps
    read by random access (21, 157, 169: restored across both boundaries); steps before the first boundary equal
    recipes/tiny.toml's goldens (the same recipe without phases)."""
    from zephon_ray import GlobalBatchSource

    batches, _ = run(Recipe.from_toml(PHASED), 6)
    assert [b.digest for b in batches] == [GOLDEN[str(s)] for s in range(6)]
    assert [b.digest for b in batches[:2]] == [TINY_GOLDEN["0"], TINY_GOLDEN["1"]]
    assert batches[2].digest != TINY_GOLDEN["2"]
    with GlobalBatchSource(Recipe.from_toml(PHASED)) as source:
        for step in (21, 157, 169):
            assert source.batch(step).digest == GOLDEN[str(step)], step


def test_a_later_phase_changes_no_earlier_step(tmp_path, reference_digests):
    recipe = load(tmp_path, phased_text(phase("late", 7, code=1.0)))
    batches, _ = run(recipe, 9)
    assert [b.digest for b in batches[:7]] == reference_digests[:7]
    assert [b.digest for b in batches[7:]] != reference_digests[7:9]


def distinct_draws(contributors: list[dict[int, list]], lanes: int) -> list[tuple[int, ...]]:
    """Each record once per draw: a record that wrap packing cut across rows shows up in consecutive rows of one
    lane (across steps too), which is one draw."""
    draws = []
    for lane in range(lanes):
        previous = None
        for step in contributors:
            for sample in step[lane]:
                if sample != previous:
                    draws.append(tuple(sample))
                previous = sample
    return draws


def source_sizes(recipe: Recipe) -> dict[int, int]:
    return {i: sum(s.rows for s in src.shards) for i, src in enumerate(recipe.sources)}


@pytest.mark.parametrize("boundaries", [(2, 5)], ids=["two"])
def test_no_record_repeats_across_the_boundary(tmp_path, boundaries):
    """Counted per source by Zephon sample id over a window shorter than each source's epoch (asserted), so every
    record may be drawn at most once. A naive switch (a fresh run with the new weights from the boundary on) repeats
    records in the same window: the check can fail."""
    phases = "".join(phase(f"p{i}", start, prose=0.5, code=0.5) for i, start in enumerate(boundaries))
    recipe = load(tmp_path, phased_text(phases))
    steps = boundaries[-1] + 3
    _, contributors = run(recipe, steps)
    draws = distinct_draws(contributors, recipe.lanes)
    sizes = source_sizes(recipe)
    for source, size in sizes.items():
        mine = [d for d in draws if d[0] == source]
        assert len(mine) < size, f"window too long for source {source}: {len(mine)} draws of {size} records"
        assert len(set(mine)) == len(mine), f"source {source}: a record drawn twice"
    assert {d[0] for d in draws[-len(draws) // 3 :]} == {0, 1}

    # The naive switch: steps before the boundary from the unphased recipe, then a fresh run of the new weights.
    fresh = load(tmp_path, phased_text("", weights=(0.5, 0.5)), "fresh.toml")
    _, before = run(load(tmp_path, phased_text(""), "base.toml"), boundaries[0])
    _, after = run(fresh, steps - boundaries[0])
    naive = distinct_draws(before + after, recipe.lanes)
    assert len(set(naive)) < len(naive)


def test_each_phase_follows_its_weights(tmp_path):
    recipe = load(tmp_path, phased_text(phase("code", 6, prose=0.1, code=0.9) + phase("prose", 12, prose=1.0)))
    batches, _ = run(recipe, 18)

    def share(lo: int, hi: int) -> float:
        prose = sum(b.source_tokens["prose"] for b in batches[lo:hi])
        return prose / sum(sum(b.source_tokens.values()) for b in batches[lo:hi])

    # Whole chunks of 8 records are drawn by weight, and records differ in length: shares converge loosely.
    assert 0.45 < share(0, 6) < 0.85
    assert share(7, 12) < 0.3  # the first step after a boundary may still finish records cut by packing
    assert all(b.source_tokens["code"] == 0 for b in batches[13:])  # weight 0: nothing at all


def test_a_source_joins_later_with_weight_zero(tmp_path):
    recipe = load(tmp_path, phased_text(phase("join", 3, prose=0.5, code=0.5), weights=(1.0, 0.0)))
    batches, _ = run(recipe, 6)
    assert all(b.source_tokens["code"] == 0 for b in batches[:3])
    assert sum(b.source_tokens["code"] for b in batches[3:]) > 0


# Proves lanes.py: across a phase boundary step s stays a pure function of (recipe, s), in any order, through restores.
@pytest.mark.heavy
def test_random_access_and_restores_across_the_boundary():
    recipe = Recipe.from_toml(PHASED)
    stepper = LaneStepper(recipe)
    states, want = {}, []
    for step in range(7):
        states[step] = stepper.checkpoint() if stepper.position else None
        want.append(assemble(recipe, step, stepper.next_step()).digest)
    stepper.close()
    assert want[:6] == [GOLDEN[str(s)] for s in range(6)]
    for at in (1, 4, 5):  # before both boundaries, at the second one (2 and 4), after both
        resumed = LaneStepper(recipe)
        resumed.restore(json.loads(json.dumps(states[at])))
        assert [assemble(recipe, s, resumed.next_step()).digest for s in range(at, 7)] == want[at:], at
        resumed.close()
    with GlobalBatchSource(recipe, checkpoint_every=2, anchor_every=2, cache_steps=1) as source:
        for step in (5, 3):  # step 3 behind: a restore at 2 (in 'main'), then a replay
            assert source.batch(step).digest == want[step], step


@pytest.mark.heavy
def test_resume_refuses_a_rewritten_past(tmp_path):
    """A state at next_step t accepts a recipe whose phases starting before t are unchanged, whatever it does from t
    on; a rewritten, added or removed earlier phase is one line naming the phase and the step."""
    text = PHASED.read_text().replace('"data/tiny/', f'"{DATA}/')
    recipe = load(tmp_path, text)
    stepper = LaneStepper(recipe)
    for _ in range(3):
        stepper.next_step()
    state = stepper.checkpoint()  # next_step 3: 'main' (start 2) is the past, 'anneal' (start 4) the future
    stepper.close()

    rewritten = load(tmp_path, text.replace("prose = 0.2, code = 0.8", "prose = 0.3, code = 0.7"), "a.toml")
    added = load(tmp_path, text.replace("start_step = 2", "start_step = 1"), "b.toml")
    removed = load(tmp_path, text.split("[[phases]]")[0], "c.toml")
    for other, needle in (
        (rewritten, "phase 'main' (start_step 2) differs"),
        (added, "phase 'main'"),
        (removed, "phase 'main' (start_step 2) produced steps before step 3"),
    ):
        with pytest.raises(StepStateError) as info:
            LaneStepper(other).restore(state)
        message = str(info.value)
        assert needle in message and "step 3" in message and "\n" not in message, message

    future = load(
        tmp_path, text.replace("start_step = 4", "start_step = 5").replace("prose = 1.0 }", "code = 1.0 }"), "d.toml"
    )
    resumed = LaneStepper(future)
    resumed.restore(state)
    batches = [assemble(future, s, resumed.next_step()) for s in range(3, 6)]
    resumed.close()
    fresh, _ = run(future, 6)
    assert [b.digest for b in batches] == [b.digest for b in fresh[3:6]]
    assert batches[1].digest != GOLDEN["4"]  # step 4 is still in 'main' under this recipe, not in 'anneal'
    assert batches[2].source_tokens["prose"] == 0  # the new future phase


def test_zephon_state_format_fence():
    """Fails loudly, naming the key or attribute, when a Zephon release changes what the phases rely on."""
    from zephon.work import StaticMixtureWorkSource

    from zephon_ray import zephon_io
    from zephon_ray.pipeline import build_work_source

    for name in zephon_io.FENCED_WORK_SOURCE_ATTRS:
        assert name in ("_lane", "_canon") or hasattr(StaticMixtureWorkSource, name), name
    recipe = Recipe.from_toml(PHASED)
    work = build_work_source(recipe)
    assert work._lane is None and work._canon is None  # the unbound binding load_work_source_state sets and clears
    state = work.state_dict()
    for key in zephon_io.WORK_SOURCE_STATE_KEYS:
        assert key in state, f"Zephon's work-source state lost key {key!r}"
    stream = zephon_io.ChunkStream(work, recipe.lanes)
    stream.advance(13)
    at = stream.state()
    assert at["global_chunk_index"] == 13 and state["global_chunk_index"] == 0
    broken = {k: v for k, v in at.items() if k != "cursor_states"}
    with pytest.raises(zephon_io.ZephonStateError, match="no key 'cursor_states'"):
        zephon_io.load_work_source_state(build_work_source(recipe), broken)


def test_chunk_stream_routes_and_walks_like_a_walk_from_the_start():
    """ChunkStream.global_index, computed per block, equals counting each lane's chunks one global chunk at a time
    (Zephon's routing, queried chunk by chunk), from a block-aligned start and from a mid-block one; a stream
    advanced in hops reaches the state of one walk from the start."""
    from zephon_ray import zephon_io
    from zephon_ray.pipeline import build_work_source

    recipe = Recipe.from_toml(PHASED)
    lanes = recipe.lanes
    router = build_work_source(recipe).clone_for_lane(0, lanes)
    for start in (0, 5, 3 * lanes):
        seen: dict[int, list[int]] = {lane: [] for lane in range(lanes)}
        for g in range(start, start + 40 * lanes):
            seen[router._lane_for_chunk(g)].append(g)
        stream = zephon_io.ChunkStream(build_work_source(recipe), lanes)
        for n in (0, 1, 7, 30):
            want = {lane: seen[lane][n] for lane in range(lanes)}
            assert stream.global_index(start, {lane: n for lane in range(lanes)}) == want, (start, n)

    hops = zephon_io.ChunkStream(build_work_source(recipe), lanes)
    for index in (3, 3, 17, 18, 60):
        hops.advance(index)
    once = zephon_io.ChunkStream(build_work_source(recipe), lanes)
    once.advance(60)
    assert hops.state() == once.state() and hops.index == 60
    with pytest.raises(ValueError, match="global chunk 59 is before the stream's position 60"):
        hops.advance(59)


def test_a_boundary_walks_a_bounded_distance_whatever_the_phase_length(tmp_path, monkeypatch):
    """The stepper's chunk stream follows its rows, so the boundary walks fewer than STREAM_LAG global chunks
    although the phase before it spans many times that, and a state restored mid-phase carries the stream's position
    (``segment.stream``) so that the resumed stepper does not walk from the phase's start either. The batches equal a
    stepper that never follows (STREAM_LAG larger than the phase: the whole phase walked at the boundary)."""
    from zephon_ray import lanes as lanes_module

    text = phased_text(phase("late", 30, prose=0.2, code=0.8)).replace("chunk_size = 8", "chunk_size = 1")
    assert "chunk_size = 1" in text
    recipe = load(tmp_path, text)

    def steps(lag: int, restore_at: int | None = None) -> tuple[list[str], int, int]:
        monkeypatch.setattr(lanes_module, "STREAM_LAG", lag)
        stepper = LaneStepper(recipe)
        digests = []
        try:
            for step in range(34):
                if step == restore_at:
                    state = json.loads(json.dumps(stepper.checkpoint()))
                    assert state["segment"]["stream"]["index"] > 0
                    stepper.close()
                    stepper = LaneStepper(recipe)
                    stepper.restore(state)
                digests.append(assemble(recipe, step, stepper.next_step()).digest)
            return digests, stepper.boundary_walk, stepper._segment_state["global_chunk_index"]
        finally:
            stepper.close()

    whole, whole_walk, boundary = steps(10**9)
    assert whole_walk == boundary > 40  # without following, the boundary walks the whole phase
    followed, walk, _ = steps(4)
    assert followed == whole and walk < 4
    resumed, walk, _ = steps(4, restore_at=20)
    assert resumed == whole and walk < 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_service_and_materialised_runs_cross_the_boundaries(ray_cluster, tmp_path):
    """The three-phase recipe's goldens through the service (2 producers, which exchange their lanes' last chunks
    through the service's TCPStore; slices at W = 2 and W = 4, and step 1 again after step 5: a replay from a
    durable checkpoint) and a materialised directory (2 lane groups)."""
    from zephon_ray import DataService, MaterializedSource
    from zephon_ray.jobs.materialize import materialize

    recipe = Recipe.from_toml(PHASED)
    want = [GOLDEN[str(s)] for s in range(6)]
    service = DataService.start(
        recipe,
        name="zr-phases",
        namespace="zr-phases",
        producers=2,
        state_dir=str(tmp_path / "state"),
        checkpoint_every=2,
        run_id="zr-phases",
        aggregate_store="torch://",
    )
    try:
        import numpy as np

        from zephon_ray.batch import compute_digest

        for step in list(range(len(want))) + [1, 3]:
            world = 2 if step % 2 == 0 else 4
            tokens = np.concatenate([service.slice(step, r, world, track=True).tokens for r in range(world)])
            positions = np.concatenate([service.slice(step, r, world, track=True).positions for r in range(world)])
            assert compute_digest(tokens, positions) == want[step], step
    finally:
        service.stop()
    out = tmp_path / "materialised"
    materialize(recipe, out, range(len(want)), producers=2, segment_steps=3, progress=False)
    with MaterializedSource(out, recipe=recipe) as source:
        assert [source.digest(s) for s in range(len(want))] == want
        assert [source.batch(s).digest for s in range(len(want))] == want


ADD_PHASE_OPTS = dict(name="zr-add-phase", namespace="zr-add-phase", checkpoint_every=2, read_path="direct")


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_a_phase_added_to_a_running_service(ray_cluster, tmp_path):
    """A service started from tiny (no phases; 2 producers, which then record every lane's position in their
    checkpoints) has consumer 'trainer' read steps 0-1 while its producers run ahead, then is given recipes/
    phased.toml's two phases at steps 2 and 4 without a restart: the steps produced ahead are dropped, and steps
    2-7 equal the phased goldens (the in-process run of the recipe with those phases, which the oracle checks in
    test_oracle.py). A phase at or before a step the consumer read is refused naming the consumer and step, an
    invalid one naming the key. The phases are recorded in state_dir: opened with tiny.toml (what a restarted
    coordinator does) or with phased.toml it runs under them; a restarted service serves them:
    test_a_service_restarted_after_add_phase_keeps_it (slow)."""
    from zephon_ray import DataService
    from zephon_ray.formats.service_state import ServiceState, check_state_dir, inspect

    tiny, phased = Recipe.from_toml(TINY), Recipe.from_toml(PHASED)
    assert (
        tiny.with_phase("main", 2, {"prose": 0.2, "code": 0.8}).with_phase("anneal", 4, {"prose": 1.0}).fingerprint
        == phased.fingerprint
    )
    state_dir = str(tmp_path / "state")
    service = DataService.start(
        tiny, producers=2, run_id="zr-add-phase", aggregate_store="torch://", state_dir=state_dir, **ADD_PHASE_OPTS
    )
    trainer = DataService.connect("zr-add-phase", namespace="zr-add-phase", consumer="trainer", read_path="direct")
    try:
        assert [trainer.batch(s, track=True).digest for s in (0, 1)] == [GOLDEN["0"], GOLDEN["1"]]
        deadline = time.monotonic() + 60
        while max(service.status()["window"]["held_steps"], default=0) < 4:  # producers ran ahead of step 1
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(ValueError, match="consumer 'trainer' has read step 1; a phase must start after"):
            service.add_phase("main", 1, {"prose": 0.2, "code": 0.8})
        with pytest.raises(ValueError, match="phases\\[0\\].weights.poetry"):
            service.add_phase("main", 2, {"poetry": 1.0})
        main = service.add_phase("main", 2, {"prose": 0.2, "code": 0.8})
        assert main["dropped_steps"] and min(main["dropped_steps"]) >= 2 and main["restart_from"] <= 2
        anneal = service.add_phase("anneal", 4, {"prose": 1.0})
        assert anneal["fingerprint"] == phased.fingerprint
        assert [trainer.batch(s, track=True).digest for s in range(2, 8)] == [GOLDEN[str(s)] for s in range(2, 8)]
        with pytest.raises(ValueError, match="consumer 'trainer' has read step 7"):
            service.add_phase("late", 6, {"code": 1.0})
        trainer.commit(8)
    finally:
        service.stop()
    assert [(p["name"], p["start_step"], p["added"]) for p in inspect(state_dir)["schedule"]] == [
        ("sources", 0, False),
        ("main", 2, True),
        ("anneal", 4, True),
    ]
    assert ServiceState.open(tiny, state_dir).recipe.fingerprint == phased.fingerprint
    assert check_state_dir(phased, state_dir) is phased


@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_a_replay_in_flight_when_a_phase_is_added_is_served_and_later_ones_follow_the_phase(ray_cluster, tmp_path):
    """An untracked read ahead of the live window is replayed (no cursor moves the producers there). A phase added
    (at a later step: a replayed step counts as leased) while that replay is in flight retires the replayer
    without failing the replay: the read gets the rows of tiny's golden. A replay asked after the phase follows it,
    at a fresh replayer (the in-process source of the phased recipe). The replayer cannot start until the phase is
    recorded: an actor holds all but 1 of the free CPUs, and the replayer asks for 2."""
    import ray

    from zephon_ray import DataService

    class Placeholder:  # defined here: Ray ships it by value (test modules are not importable in workers)
        def ready(self) -> bool:
            return True

    tiny = Recipe.from_toml(TINY)
    late = ("late", 12, {"code": 1.0})
    service = DataService.start(
        tiny,
        producers=1,
        window=4,
        state_dir=str(tmp_path / "state"),
        resources={"replayer_num_cpus": 2.0},
        name="zr-phase-replay",
        namespace="zr-phase-replay",
        checkpoint_every=2,
        read_path="direct",
    )
    trainer = DataService.connect("zr-phase-replay", namespace="zr-phase-replay", consumer="trainer")
    gate = None
    try:
        assert [trainer.batch(s, track=True).digest for s in (0, 1)] == [TINY_GOLDEN["0"], TINY_GOLDEN["1"]]
        gate = ray.remote(num_cpus=ray.available_resources()["CPU"] - 1.0)(Placeholder).remote()
        ray.get(gate.ready.remote(), timeout=60)
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(digest=trainer.batch(10).digest), daemon=True)
        reader.start()  # step 10 lies ahead of the live window: replayed
        deadline = time.monotonic() + 60
        while service.status()["replay"]["submitted"] < 1:
            assert time.monotonic() < deadline, "the read of step 10 never reached the replayer"
            time.sleep(0.1)
        service.add_phase(*late)
        ray.kill(gate)  # the retired replayer starts now and finishes the replay of step 10
        gate = None
        reader.join(120)
        assert got.get("digest") == TINY_GOLDEN["10"], "the replay in flight when the phase was added failed"
        with GlobalBatchSource(tiny.with_phase(*late)) as source:
            assert trainer.batch(14).digest == source.batch(14).digest  # replayed under the phase
        replay = service.status()["replay"]
        assert replay["submitted"] == 2 and replay["retired"] == 1, replay
    finally:
        if gate is not None:
            ray.kill(gate)
        service.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_service_restarted_after_add_phase_keeps_it(ray_cluster, tmp_path):
    """After add_phase, a coordinator killed with SIGKILL (Ray restarts it with the recipe it was started with),
    a service restarted on the state_dir from that recipe, and one started from the recipe file with the phases
    written in all serve the new schedule (the phased goldens), past steps too."""
    import os
    import signal

    from zephon_ray import DataService

    tiny, phased = Recipe.from_toml(TINY), Recipe.from_toml(PHASED)
    state_dir = str(tmp_path / "state")
    service = DataService.start(tiny, producers=1, state_dir=state_dir, reconnect_timeout_s=120, **ADD_PHASE_OPTS)
    try:
        service.add_phase("main", 2, {"prose": 0.2, "code": 0.8})
        service.add_phase("anneal", 4, {"prose": 1.0})
        assert [service.batch(s, track=True).digest for s in range(3)] == [GOLDEN[str(s)] for s in range(3)]
        old_pid = service.status()["coordinator"]["pid"]
        os.kill(old_pid, signal.SIGKILL)
        assert [service.batch(s, track=True).digest for s in range(3, 6)] == [GOLDEN[str(s)] for s in range(3, 6)]
        status = service.status()
        assert status["coordinator"]["pid"] != old_pid and status["fingerprint"] == phased.fingerprint
        service.commit(6)
    finally:
        service.stop()
    for recipe in (tiny, phased):
        service = DataService.start(recipe, producers=1, state_dir=state_dir, **ADD_PHASE_OPTS)
        try:
            assert service.recipe.fingerprint == phased.fingerprint
            assert [service.batch(s).digest for s in (6, 7, 3)] == [GOLDEN[str(s)] for s in (6, 7, 3)]
        finally:
            service.stop()


def _local_readers(
    config, world: int, state: dict | None, steps: int, add: tuple | None = None
) -> tuple[list[str], dict]:
    """W readers (threads: local-mode checkpoints are collective) load ``state``, each add phase ``add`` (name,
    start, weights) when given, and read ``steps`` steps; returns each step's digest of the joined slices and the
    (identical) states they take afterwards."""
    import numpy as np

    from zephon_ray.batch import compute_digest
    from zephon_ray.stream.loader import Loader

    lbs = 16 // world if 16 % world == 0 else 0  # 0: one microbatch of the reader's rows
    loaders = [Loader(config, rank=r, world=world, local_batch_size=lbs) for r in range(world)]

    def read(r: int, loader) -> tuple[list, dict]:
        if add is not None:
            loader.add_phase(*add)
        it = iter(loader)
        return [next(it).slice for _ in range(steps)], loader.state_dict()

    slices, states = zip(*run_readers(loaders, read, state))
    assert all(s == states[0] for s in states)
    digests = [
        compute_digest(np.concatenate([p.tokens for p in parts]), np.concatenate([p.positions for p in parts]))
        for parts in zip(*slices)
    ]
    return digests, json.loads(json.dumps(states[0]))


def test_local_loader_crosses_the_boundaries_at_every_w(tmp_path):
    """The trainer-side loader in local mode (each rank runs Zephon for its own lanes; TorchTitan's and Ray Train's
    in-process path): W = 2 for steps 0..2 (across the boundary at 2), a saved state in the 'main' phase, W = 4 for
    steps 3..4 (across the boundary at 4), then W = 1 for step 5. Every step equals the goldens. The ranks exchange
    their lanes' last chunks through the aggregate directory at the boundaries and checkpoints."""
    from zephon_ray.stream.loader import LoaderConfig

    def config(segment: int) -> LoaderConfig:
        return LoaderConfig(
            recipe=str(PHASED),
            mode="local",
            run_id="phases",
            checkpoint_every=1,
            aggregate_dir=str(tmp_path / f"agg-{segment}"),
        )

    digests, state = _local_readers(config(0), 2, None, 3)
    assert state["next_step"] == 3
    assert len(list((tmp_path / "agg-0").rglob("boundary-*/group-*.json"))) == 2  # the exchange at step 2
    assert sorted(json.loads(state["zephon"])["segment"]["last_chunk"]) == [str(lane) for lane in range(8)]
    more, state = _local_readers(config(1), 4, state, 2)
    last, state = _local_readers(config(2), 1, state, 1)
    assert digests + more + last == [GOLDEN[str(s)] for s in range(6)]
    assert state["next_step"] == 6


def test_a_new_w_crosses_a_boundary_the_old_w_crossed_in_the_same_aggregate_dir(tmp_path):
    """Local-mode ranks at W = 4 ran past the boundary at step 4 (loaders read ahead of the trainer) and left their
    lanes' last chunks for it in the aggregate directory; the run resumes at W = 2 from the state saved at step 4, in
    the same directory, as a restarted job does. Group 0 of 2 holds other lanes than group 0 of 4, so the W = 2
    exchange must not read the W = 4 values: every step equals the goldens. A soak's W = 2 ranks, separate processes,
    failed at such a boundary when one read the other's W = 4 value before its peer wrote ("global chunk 296 is
    before the stream's position 302"); threads here rarely race that way, so tests/test_lane_exchange.py checks the
    exchange itself, deterministically."""
    from zephon_ray.stream.loader import LoaderConfig

    agg = tmp_path / "agg"
    config = LoaderConfig(
        recipe=str(PHASED), mode="local", run_id="rescale", checkpoint_every=1, aggregate_dir=str(agg)
    )
    _local_readers(config, 4, None, 6)  # W = 4 crosses the boundary at 4, then stops
    assert len(list(agg.rglob("boundary-*-4/group-*.json"))) == 4
    first, state = _local_readers(config, 4, None, 4)  # the same run from the start, its state saved at step 4
    assert state["next_step"] == 4
    rest, state = _local_readers(config, 2, state, 4)  # W = 2 from there, across the boundary at 4
    assert first + rest == [GOLDEN[str(s)] for s in range(8)]
    assert state["next_step"] == 8


def test_loader_resume_keeps_the_past_and_accepts_a_new_future(tmp_path):
    """The trainer-side loader state (local mode, W = 1) saved at step 3: a recipe that moves and rewrites the future
    phase 'anneal' resumes (and gives that recipe's steps), one that rewrites the past phase 'main' is one line naming
    it and the step."""
    from zephon_ray.formats.loader_state import LoaderStateError
    from zephon_ray.stream.loader import LoaderConfig

    text = PHASED.read_text().replace('"data/tiny/', f'"{DATA}/')
    (tmp_path / "phased.toml").write_text(text)
    (tmp_path / "future.toml").write_text(
        text.replace("start_step = 4", "start_step = 5").replace("prose = 1.0 }", "code = 1.0 }")
    )
    (tmp_path / "past.toml").write_text(text.replace("prose = 0.2, code = 0.8", "prose = 0.3, code = 0.7"))

    def config(name: str) -> LoaderConfig:
        return LoaderConfig(recipe=str(tmp_path / name), mode="local", run_id="resume", checkpoint_every=1)

    _, state = _local_readers(config("phased.toml"), 1, None, 3)
    resumed, _ = _local_readers(config("future.toml"), 1, state, 3)
    fresh, _ = run(Recipe.from_toml(tmp_path / "future.toml"), 6)
    assert resumed == [b.digest for b in fresh[3:]]
    assert resumed[:1] == [GOLDEN["3"]] and resumed[1] != GOLDEN["4"]
    with pytest.raises(LoaderStateError) as info:
        _local_readers(config("past.toml"), 1, state, 1)
    message = str(info.value)
    assert "phase 'main' (start_step 2) differs" in message and "step 3" in message and "\n" not in message, message


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_a_run_time_phase_travels_with_the_loader_state(ray_cluster, tmp_path, capsys):
    """Issue 44: a service started from tiny.toml takes recipes/phased.toml's two phases (steps 2 and 4) at run time,
    before anyone reads. Service-mode readers given tiny.toml itself (W = 2) read steps 0-1 and save at step 2: the
    state records both phases, which lie in its future. Resumes from that state with tiny.toml unchanged serve the
    run's schedule, steps 2-5 equal to the phased goldens (the oracle's, test_oracle.py): in local mode at W = 4, in
    dataset mode at W = 3 over a fresh materialisation of the run's schedule, and from a service started afresh on a
    new state_dir (the readers add the phases to it). A directory materialised from tiny.toml alone, and a recipe file
    whose phase contradicts the recorded one, are each refused in one line. ``zephon-ray inspect`` prints the recorded
    phases, and ``zephon-ray digest --schedule-from`` gives the run's digests. The ledger segments record the run's
    schedule (the service's phases included), and the local resume's lineage audits clean."""
    from zephon_ray import DataService
    from zephon_ray.cli import main
    from zephon_ray.formats.loader_state import LoaderStateError, added_phases
    from zephon_ray.formats.materialized import MaterializedError
    from zephon_ray.jobs.materialize import materialize
    from zephon_ray.stream.loader import Loader, LoaderConfig

    tiny = Recipe.from_toml(TINY)
    want = [GOLDEN[str(s)] for s in range(2, 6)]
    first = DataService.start(tiny, name="zr-run-phase", namespace="zr-run-phase", state_dir=str(tmp_path / "svc"))
    try:
        first.add_phase("main", 2, {"prose": 0.2, "code": 0.8})
        first.add_phase("anneal", 4, {"prose": 1.0})
        service = LoaderConfig(
            recipe=str(TINY),
            mode="service",
            run_id="run-phase",
            service_name="zr-run-phase",
            service_namespace="zr-run-phase",
            ledger_dir=str(tmp_path / "ledger"),
        )
        digests, state = _local_readers(service, 2, None, 2)
    finally:
        first.stop()
    assert digests == [GOLDEN["0"], GOLDEN["1"]] and state["next_step"] == 2
    assert [(p["name"], p["start_step"]) for p in added_phases(state)] == [("main", 2), ("anneal", 4)]

    local = LoaderConfig(
        recipe=str(TINY),
        mode="local",
        run_id="run-phase",
        checkpoint_every=1,
        aggregate_dir=str(tmp_path / "agg"),
        ledger_dir=str(tmp_path / "ledger"),
    )
    local_digests, local_state = _local_readers(local, 4, state, 4)
    assert local_digests == want
    # The ledger records the run's schedule: the service's segment (steps 0-1) the sources' weights alone, the local
    # resume's (2-5) both phases, as phased.toml's own fingerprint chain; the audit checks that the second continues
    # the first, and the rows against the run's schedule, from the state alone.
    from zephon_ray.formats.ledger import parse_schedule, read_ledger

    chain = Recipe.from_toml(PHASED).schedule_fingerprints
    recorded = {s.first_step: parse_schedule(s.schedule) for s in read_ledger(str(tmp_path / "ledger")).values()}
    assert recorded == {
        0: (2, [(0, "sources", chain[0])]),
        2: (6, [(0, "sources", chain[0]), (2, "main", chain[1]), (4, "anneal", chain[2])]),
    }
    (tmp_path / "local.json").write_text(json.dumps(local_state))
    capsys.readouterr()
    assert (
        main(["audit", str(tmp_path / "local.json"), "--ledger", str(tmp_path / "ledger"), "--recipe", str(TINY)]) == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        "audit: clean: steps [0, 6) each trained exactly once in a lineage of 2 segment(s) (W 2 -> 4); 20 slice "
        "digests matched the recipe's global batches"
    ]

    plain, run_dir = tmp_path / "plain", tmp_path / "run"
    materialize(tiny, plain, range(0, 6), progress=False)
    with pytest.raises(MaterializedError) as info:
        _local_readers(
            LoaderConfig(recipe=str(TINY), mode="dataset", run_id="run-phase", dataset_dir=str(plain)), 3, state, 1
        )
    assert "phase(s) 'main' from step 2, 'anneal' from step 4" in str(info.value) and "\n" not in str(info.value)
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(state))
    assert (
        main(
            [
                "materialize",
                str(TINY),
                "--steps",
                "0:6",
                "--out",
                str(run_dir),
                "--schedule-from",
                str(state_file),
                "--quiet",
                "--address",
                ray_cluster.get_runtime_context().gcs_address,
            ]
        )
        == 0
    )
    dataset = LoaderConfig(recipe=str(TINY), mode="dataset", run_id="run-phase", dataset_dir=str(run_dir))
    assert _local_readers(dataset, 3, state, 4)[0] == want
    with Loader(dataset, rank=0, world=1) as fixed, pytest.raises(ValueError, match="schedule is fixed"):
        fixed.add_phase("late", 20, {"code": 1.0})  # a materialised directory's schedule cannot change

    fresh = DataService.start(tiny, name="zr-run-phase", namespace="zr-run-phase", state_dir=str(tmp_path / "new"))
    try:
        digests, resumed = _local_readers(service, 5, state, 4)
        assert fresh.refresh_recipe().fingerprint == Recipe.from_toml(PHASED).fingerprint  # the readers added them
    finally:
        fresh.stop()
    assert digests == want and added_phases(resumed) == added_phases(state)

    (tmp_path / "other.toml").write_text(phased_text(phase("anneal", 4, code=1.0)))
    with pytest.raises(LoaderStateError) as info:
        _local_readers(LoaderConfig(recipe=str(tmp_path / "other.toml"), mode="local", run_id="run-phase"), 1, state, 1)
    message = str(info.value)
    assert "recorded phase 'anneal' from step 4 with weights {prose 1, code 0}" in message, message
    assert "has phase 'anneal' from step 4 with weights {prose 0, code 1}" in message and "\n" not in message

    capsys.readouterr()
    assert main(["inspect", str(state_file)]) == 0
    out = capsys.readouterr().out
    assert "phase       main: from step 2 (prose 0.2, code 0.8)  [decided while running]" in out, out
    assert main(["digest", str(TINY), "--steps", "2:6", "--schedule-from", str(state_file)]) == 0
    assert capsys.readouterr().out.split() == [w for s, d in zip(range(2, 6), want) for w in ("step", str(s), d)]


def _main_file(tmp_path: Path) -> Path:
    """tiny.toml with phased.toml's first phase ('main' from step 2) written in: 'anneal' (step 4) is added while
    running, so the run's schedule is phased.toml's, whose goldens the independent oracle computes."""
    path = tmp_path / "main.toml"
    path.write_text(phased_text(phase("main", 2, prose=0.2, code=0.8)))
    return path


def test_a_phase_added_in_local_mode_on_every_reader(tmp_path):
    """Issue 44: local-mode readers (W = 2, a collective checkpoint every 2 steps) each call add_phase('anneal', 4)
    before reading; steps 0-5 equal phased.toml's goldens, and the state saved at step 6 records the phase. A resume
    at W = 4 with the recipe file unchanged gives steps 6-7 of the goldens. A phase that starts too early (the
    producer may have made it, or no checkpoint lies between: the readers could not check that they agree) is one
    line."""
    from zephon_ray.formats.loader_state import added_phases
    from zephon_ray.stream.loader import Loader, LoaderConfig

    recipe = _main_file(tmp_path)

    def config(segment: int) -> LoaderConfig:
        return LoaderConfig(
            recipe=str(recipe),
            mode="local",
            run_id="local-phase",
            checkpoint_every=2,
            aggregate_dir=str(tmp_path / f"agg-{segment}"),
        )

    early = Loader(config(9), rank=0, world=2)
    with pytest.raises(ValueError) as info:
        early.add_phase("anneal", 3, {"prose": 1.0})
    message = str(info.value)
    assert "too early" in message and "checkpoint of step 4" in message and "\n" not in message, message

    digests, state = _local_readers(config(0), 2, None, 6, add=("anneal", 4, {"prose": 1.0}))
    assert digests == [GOLDEN[str(s)] for s in range(6)]
    assert [(p["name"], p["start_step"]) for p in added_phases(state)] == [("anneal", 4)]
    assert _local_readers(config(1), 4, state, 2)[0] == [GOLDEN["6"], GOLDEN["7"]]


@pytest.mark.timeout(300)
def test_a_reader_that_misses_a_local_phase_stops_every_reader_in_one_line(tmp_path):
    """Only reader 0 of 2 adds the phase: at the next collective checkpoint (step 2) the readers' schedules differ,
    so they never meet there and both stop with one line, once the checkpoint channel's timeout passes. Neither was
    served a step of the phase, or any step after the checkpoint."""
    from zephon_ray.stream.loader import Loader, LoaderConfig

    config = LoaderConfig(
        recipe=str(_main_file(tmp_path)),
        mode="local",
        run_id="missed-phase",
        checkpoint_every=2,
        aggregate_dir=str(tmp_path / "agg"),
        aggregate_timeout_s=8,
    )
    loaders = [Loader(config, rank=r, world=2, local_batch_size=8) for r in range(2)]
    got: dict[int, list[int]] = {0: [], 1: []}
    errors: dict[int, str] = {}

    def read(r: int, loader) -> None:
        try:
            if r == 0:
                loader.add_phase("anneal", 4, {"prose": 1.0})
            it = iter(loader)
            for _ in range(6):
                got[r].append(next(it).slice.step)
        except Exception as exc:  # noqa: BLE001 - the expected stop, checked below
            errors[r] = str(exc)

    run_readers(loaders, read, timeout_s=240)
    assert got == {0: [0, 1], 1: [0, 1]}, got
    for r in (0, 1):
        assert "did not all arrive with this schedule" in errors[r] and "\n" not in errors[r], errors
