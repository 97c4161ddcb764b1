"""Evidence that cannot cancel out: every delivery path against an independent oracle and committed golden digests.

The oracle (tests/oracle.py) imports nothing from zephon_ray: it reads the recipe with tomllib, tokenizes with its
own byte tokenizer or the ``tokenizers`` library, runs Zephon as 2 ranks through Zephon's public API, files
microbatches by ``lane_ids``, assembles lane-major and computes the documented digest itself. The golden digests
(tests/golden/*.json) fix steps 0..169 of every shipped recipe and of the k = 2 test recipe (tests/recipes/k2.toml)
for the zephon version (and, where it matters, the tokenizers and Python versions) they were made with; other
versions fail with the command that regenerates them (``python tests/oracle.py --all``), never skip.

Each path is checked for k = 1 (recipes/tiny.toml) and k = 2 (tests/recipes/k2.toml), always on the rows the path
returns, re-digested by the oracle (a path's own ``.digest`` is checked too, never trusted alone):

- in-process: ``zephon_ray.GlobalBatchSource``;
- the service: ``zephon_ray.DataService`` with 2 producers, slices at W = 2, 3 and 4 joined (and every W from 1 to B
  at one step);
- the materialised dataset: ``zephon_ray.jobs.materialize.materialize`` (2 lane groups) read by
  ``zephon_ray.MaterializedSource`` (rows, joined slices and the manifest's digests);
- the TorchTitan loader ``zephon_ray.torchtitan.ZephonRayDataLoader`` in local, service and dataset mode at W = 2:
  every yielded ``input``/``labels``/``positions`` tensor against the oracle's rows.
"""

from __future__ import annotations

import json

import numpy as np
import oracle
import pytest
from conftest import ROOT, run_ranks

pytestmark = pytest.mark.timeout(600)

STEPS = 6
"""Every delivery path is checked row by row against the oracle's batches of these first steps."""
FAR_STEPS = (21, 157, 169)
"""Far steps, read by random access: past checkpoint intervals and the prose source's first epoch end."""
NS = "zr-oracle"
CASES = {"k1": ROOT / "recipes" / "tiny.toml", "k2": ROOT / "tests" / "recipes" / "k2.toml"}
SHIPPED = sorted((ROOT / "recipes").glob("*.toml"))
CORPUS = ROOT / "data" / "corpus"


# ---------------------------------------------------------------------- the oracle and the goldens
@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """One test recipe: its path, its golden digests and the oracle's batches of steps 0..STEPS-1."""
    path = CASES[request.param]
    golden = oracle.load_golden(path)
    recipe = oracle.read_recipe(path)
    lanes = oracle.lane_microbatches(recipe, STEPS)
    assert recipe.k == int(request.param[1:])
    return {
        "name": request.param,
        "path": path,
        "golden": golden["digests"],
        "recipe": recipe,
        "lanes": lanes,
        "batches": [oracle.assemble(recipe, lanes, s) for s in range(STEPS)],
    }


def test_the_oracle_gives_the_golden_digests(case):
    assert [b.digest for b in case["batches"]] == case["golden"][:STEPS]
    assert len(set(case["golden"])) == oracle.GOLDEN_STEPS


CORPUS_STEPS = 40
"""The corpus recipes (demo, mixture) are checked to this step by default, to the end with ``-m slow``."""


@pytest.mark.parametrize(
    "path, steps",
    [
        pytest.param(
            p,
            n,
            id=f"{p.stem}-{n}",
            marks=[pytest.mark.slow] if n == oracle.GOLDEN_STEPS and oracle.reads_corpus(oracle.read_recipe(p)) else [],
        )
        for p in oracle.shipped_recipes()
        for n in (
            (CORPUS_STEPS, oracle.GOLDEN_STEPS)
            if oracle.reads_corpus(oracle.read_recipe(p))
            else (oracle.GOLDEN_STEPS,)
        )
    ],
)
def test_the_oracle_gives_the_golden_digests_of_every_shipped_recipe(path, steps):
    """The committed goldens are the oracle's digests here, all 170 steps; demo and mixture read the corpus
    generated from this Python's stdlib."""
    recipe = oracle.read_recipe(path)
    if oracle.reads_corpus(recipe) and not CORPUS.is_dir():
        pytest.skip(
            f"{path.name} reads {CORPUS}, which is not generated here (run `zephon-ray corpus data/corpus` "
            "or `make demo`)"
        )
    assert oracle.digests(path, steps) == oracle.load_golden(path)["digests"][:steps]


def test_a_golden_of_other_versions_fails_with_the_command_that_regenerates_it(tmp_path, monkeypatch):
    record = {**json.loads(oracle.golden_path(CASES["k1"]).read_text()), "environment": {"zephon": "0.0.1"}}
    monkeypatch.setattr(oracle, "GOLDEN_DIR", tmp_path)
    oracle.golden_path(CASES["k1"]).write_text(json.dumps(record))
    with pytest.raises(oracle.GoldenVersionError, match=r"zephon 0\.0\.1 \(here .*python tests/oracle.py --all"):
        oracle.load_golden(CASES["k1"])


def test_the_session_reference_is_the_golden(reference_digests):
    """tests/conftest.py's ``reference_digests``, which most other test files compare with, is the committed
    golden of the tiny recipe (the oracle's digests), not another path through zephon_ray."""
    assert reference_digests == oracle.load_golden(CASES["k1"])["digests"]


def test_every_shipped_recipe_has_goldens():
    assert {p.stem for p in oracle.shipped_recipes()} == {p.stem for p in oracle.GOLDEN_DIR.glob("*.json")}


def test_the_oracle_sees_a_wrong_microbatch_or_lane_order(case):
    """The checks below have teeth: the k microbatches of a lane swapped inside a step, two lanes swapped, or a
    lane's microbatches taken from the next step each change the digest."""
    recipe = case["recipe"]
    lanes = case["lanes"]
    right = oracle.assemble(recipe, lanes, 0).digest
    assert right == case["golden"][0]
    swapped_lanes = dict(lanes)
    swapped_lanes[0], swapped_lanes[1] = lanes[1], lanes[0]
    assert oracle.assemble(recipe, swapped_lanes, 0).digest != right
    shifted = {lane: mbs[1:] for lane, mbs in lanes.items()}
    assert oracle.assemble(recipe, shifted, 0).digest != right
    if recipe.k > 1:
        assert oracle.assemble(recipe, lanes, 0, order=(1, 0)).digest != right


def check_rows(case, step: int, tokens, positions, what: str) -> None:
    """The rows of ``step`` from a path: equal to the oracle's, and their oracle digest is the golden digest."""
    want = case["batches"][step]
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    assert tokens.shape == want.tokens.shape, f"{what}: step {step}: shape {tokens.shape}"
    assert np.array_equal(tokens, want.tokens), f"{what}: step {step}: tokens differ from the oracle's"
    assert np.array_equal(positions, want.positions), f"{what}: step {step}: positions differ from the oracle's"
    assert oracle.digest(tokens, positions) == case["golden"][step], f"{what}: step {step}"


def check_sources(case, step: int, source_tokens: dict[str, int], what: str) -> None:
    """Tokens per source (what ``show``, the notebook and the plots report) equal Zephon's per-record accounting
    as the oracle sums it."""
    names = tuple(s.name for s in case["recipe"].sources)
    want = dict(zip(names, (int(n) for n in case["batches"][step].source_tokens)))
    assert dict(source_tokens) == want, f"{what}: step {step}: tokens per source {dict(source_tokens)} != {want}"


def joined(parts) -> tuple[np.ndarray, np.ndarray]:
    parts = list(parts)
    return np.concatenate([p.tokens for p in parts]), np.concatenate([p.positions for p in parts])


# ---------------------------------------------------------------------- in-process
def test_in_process_global_batch_source(case):
    from zephon_ray import GlobalBatchSource, Recipe

    with GlobalBatchSource(Recipe.from_toml(case["path"]), checkpoint_every=2) as source:
        for step in [*range(STEPS), 1]:  # and back: a restore from a checkpoint, then replay
            batch = source.batch(step)
            check_rows(case, step, batch.tokens, batch.positions, "GlobalBatchSource")
            check_sources(case, step, batch.source_tokens, "GlobalBatchSource")
            assert batch.digest == case["golden"][step]
            for world in (2, 4):
                check_rows(
                    case,
                    step,
                    *joined(batch.slice(r, world) for r in range(world)),
                    f"GlobalBatchSource slices W={world}",
                )
        for step in FAR_STEPS:  # random access far ahead, rows re-digested by the oracle's own digest function
            batch = source.batch(step)
            assert oracle.digest(batch.tokens, batch.positions) == batch.digest == case["golden"][step], step


def test_every_world_from_1_to_B_joins_into_the_oracle_batch(case):
    """Any W, a divisor of B or not: rank r's rows [floor(r*B/W), floor((r+1)*B/W)), joined in rank order, are the
    oracle's global batch, and each rank's rows are the oracle's rows at the documented positions."""
    from zephon_ray import GlobalBatchSource, Recipe

    B = case["recipe"].rows
    with GlobalBatchSource(Recipe.from_toml(case["path"])) as source:
        for step in (0, STEPS - 1):
            batch, want = source.batch(step), case["batches"][step]
            for world in range(1, B + 1):
                parts = [batch.slice(r, world) for r in range(world)]
                check_rows(case, step, *joined(parts), f"GlobalBatchSource slices W={world}")
                for r, part in enumerate(parts):
                    lo, hi = r * B // world, (r + 1) * B // world
                    assert np.array_equal(part.tokens, want.tokens[lo:hi]), (step, r, world)


# ---------------------------------------------------------------------- the service
@pytest.fixture(scope="module")
def service(case, ray_cluster, tmp_path_factory):
    from zephon_ray import DataService

    name = f"oracle-{case['name']}"
    # 2 producers with the defaults: run_id = the name, a TCPStore the service hosts
    svc = DataService.start(
        str(case["path"]),
        name=name,
        namespace=NS,
        producers=2,
        window=4,
        checkpoint_every=4,
        consumer="oracle-test",
        state_dir=tmp_path_factory.mktemp(name) / "state",
    )
    try:
        yield svc
    finally:
        svc.stop()


def test_service_two_producers_slices_joined(case, service):
    for step in range(STEPS):
        for world in (2, 3, 4) if step else range(1, case["recipe"].rows + 1):  # step 0: every W up to B
            parts = [service.slice(step, rank, world, track=False) for rank in range(world)]
            check_rows(case, step, *joined(parts), f"DataService slices W={world}")
        batch = service.batch(step)
        check_rows(case, step, batch.tokens, batch.positions, "DataService.batch")
        check_sources(case, step, batch.source_tokens, "DataService.batch")
        assert batch.digest == case["golden"][step]
    assert len(service.status()["producers"]) == 2


# ---------------------------------------------------------------------- the materialised dataset
@pytest.fixture(scope="module")
def materialized(case, ray_cluster, tmp_path_factory):
    from zephon_ray import Recipe
    from zephon_ray.jobs.materialize import materialize

    directory = tmp_path_factory.mktemp(f"mat-{case['name']}") / "run"
    materialize(
        Recipe.from_toml(case["path"]), directory, range(0, STEPS), producers=2, segment_steps=4, progress=False
    )
    return directory


def test_materialized_dataset(case, materialized):
    from zephon_ray import MaterializedSource, Recipe

    with MaterializedSource(materialized, recipe=Recipe.from_toml(case["path"])) as source:
        assert list(source.steps) == list(range(STEPS))
        for step in range(STEPS):
            assert source.digest(step) == case["golden"][step]  # the manifest's digest
            batch = source.batch(step)
            check_rows(case, step, batch.tokens, batch.positions, "MaterializedSource.batch")
            check_sources(case, step, batch.source_tokens, "MaterializedSource.batch")
            for world in (2, 3, 4):
                check_rows(
                    case,
                    step,
                    *joined(source.slice(step, r, world) for r in range(world)),
                    f"MaterializedSource slices W={world}",
                )


# ---------------------------------------------------------------------- the TorchTitan loader
LOADER_WORLD = 2
LOCAL_BATCH = 2


def loader_rows(loaders, steps: int, per_step: int):
    """Pull ``steps`` steps of ``per_step`` microbatches from every rank (one thread per rank, as ranks run side by
    side) and return, per step, the ranks' yielded (input, labels, positions) rows joined in rank order."""

    def pull(i: int) -> list[tuple]:
        it, rows = iter(loaders[i]), []
        for _ in range(steps):
            got = [next(it) for _ in range(per_step)]
            rows.append(
                tuple(
                    np.concatenate([x.numpy() for x in column])
                    for column in zip(*[(inp["input"], labels, inp["positions"]) for inp, labels in got])
                )
            )
        return rows

    per_rank = run_ranks(len(loaders), pull)
    assert all(len(r) == steps for r in per_rank), "a rank did not finish its steps"
    return [
        tuple(np.concatenate([per_rank[i][s][c] for i in range(len(loaders))]) for c in range(3)) for s in range(steps)
    ]


# service and dataset ask for their fixtures at run time, so they declare the session Ray here (conftest.py)
@pytest.mark.parametrize(
    "mode",
    [
        "local",
        pytest.param("service", marks=pytest.mark.session_ray),
        pytest.param("dataset", marks=pytest.mark.session_ray),
    ],
)
def test_torchtitan_loader(case, mode, request, tmp_path):
    """Rank r of W=2 yields ``input = row[:-1]``, ``labels = row[1:]``, ``positions = positions[:-1]`` of its
    rows, in order: joined over the ranks, exactly the oracle's global batch (every column the loader yields)."""
    from zephon_ray.torchtitan import ZephonRayDataLoader

    recipe = case["recipe"]
    kw = {"recipe": str(case["path"]), "mode": mode, "run_id": f"oracle-loader-{case['name']}-{mode}"}
    if mode == "local":
        kw["aggregate_dir"] = str(tmp_path / "aggregate")
    elif mode == "service":
        service = request.getfixturevalue("service")
        kw.update(service_name=service.name, service_namespace=service.namespace)
    else:
        kw["dataset_dir"] = str(request.getfixturevalue("materialized"))
    cfg = ZephonRayDataLoader.Config(**kw)
    loaders = [
        cfg.build(dp_world_size=LOADER_WORLD, dp_rank=r, seq_len=recipe.seq_len, local_batch_size=LOCAL_BATCH)
        for r in range(LOADER_WORLD)
    ]
    try:
        steps = loader_rows(loaders, STEPS, per_step=recipe.rows // LOADER_WORLD // LOCAL_BATCH)
    finally:
        for loader in loaders:
            loader.close()
    for step, (inputs, labels, positions) in enumerate(steps):
        want = case["batches"][step]
        what = f"ZephonRayDataLoader mode={mode} W={LOADER_WORLD}: step {step}"
        assert np.array_equal(inputs, want.tokens[:, :-1]), f"{what}: input differs from the oracle's rows"
        assert np.array_equal(labels, want.tokens[:, 1:]), f"{what}: labels differ from the oracle's rows"
        assert np.array_equal(positions, want.positions[:, :-1]), f"{what}: positions differ from the oracle's rows"
