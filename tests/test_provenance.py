"""Provenance (zephon_ray/provenance.py): every row rebuilt from its pieces by an independent reference.

The reference (``Reference`` below) imports nothing from zephon_ray: it reads the recipe TOML with tomllib, opens
each piece's shard file itself (JSONL lines, Parquet rows), tokenises the record itself (UTF-8 bytes or the
``tokenizers`` library, bracketed by BOS/EOS) and checks that the row's tokens are the document's tokens at the
piece's offset, that a row's pieces tile it from token 0 to its pad tail, and that positions restart at every piece
and at the pad tail. What is checked with it:

- tiny (wrap, JSONL, byte tokenizer) at steps that train a record for the second time (past its source's epoch);
- recipes/phased.toml across both phase boundaries;
- every other packer (first_fit, best_fit, best_fit_wrap) on recipes derived from tiny, with pad tails and pieces
  that start inside their document;
- recipes/mixture.toml (Parquet, BPE tokenizer);
- slices at W = 3 and 5 (B = 16), in-process, from the service (ray_cluster) and from a materialised run;
- the provenance-mode pipeline's rows equal the batch path's (a changed row is refused), and the batch path never
  builds it;
- per-token source ids (LoaderConfig.source_ids) against a brute-force attribution by content, in local mode here
  and in service and dataset mode in test_source_ids_from_the_service_and_a_materialised_run.
"""

from __future__ import annotations

import json
import tomllib
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY

RECIPES = ROOT / "recipes"
PHASED = RECIPES / "phased.toml"
MIXTURE = RECIPES / "mixture.toml"
DATA = RECIPES / "data" / "tiny"


# ---------------------------------------------------------------------- the independent reference
class Reference:
    """A recipe's documents as token lists, read and tokenised without zephon_ray."""

    def __init__(self, recipe_path: Path) -> None:
        raw = tomllib.loads(Path(recipe_path).read_text())
        base = Path(recipe_path).parent
        self.paths = {s["name"]: (base / s["path"]).resolve() for s in raw["sources"]}
        self.text_field = raw.get("text_field", "text")
        spec = raw["tokenizer"]
        if spec == "bytes":
            self.bos, self.eos, self.pad = 256, 257, 258
            self._encode = lambda text: list(text.encode("utf-8", errors="replace"))
        else:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(base / spec))
            config = json.loads((base / spec).with_name("tokenizer_config.json").read_text())
            self.bos, self.eos, self.pad = (tok.token_to_id(config[f"{k}_token"]) for k in ("bos", "eos", "pad"))
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
        self._docs: dict = {}

    def document(self, source: str, shard: str, record: int) -> np.ndarray:
        key = (source, shard, record)
        if key not in self._docs:
            text = self._text(self.paths[source] / shard, record)
            text = text.replace("\r\n", "\n").replace("\r", "\n")  # Zephon's decode_text
            self._docs[key] = np.asarray([self.bos, *self._encode(text), self.eos], dtype=np.int64)
        return self._docs[key]

    def _text(self, path: Path, record: int) -> str:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path, columns=[self.text_field]).column(self.text_field)[record].as_py()
        return json.loads(_lines(str(path))[record])[self.text_field]

    def check_rows(self, tokens: np.ndarray, positions: np.ndarray, rows: list[dict], padded: bool) -> int:
        """Rebuild every row from its pieces (``StepProvenance.to_json()["rows"]``); returns the pieces checked."""
        assert len(rows) == len(tokens)
        checked = 0
        for row_tokens, row_positions, entry in zip(tokens, positions, rows):
            where = f"row {entry['row']}"
            at = 0
            for piece in entry["pieces"]:
                start, end, offset = piece["start"], piece["end"], piece["offset"]
                assert start == at and end > start, (where, piece)
                doc = self.document(piece["source"], piece["shard"], piece["record"])
                assert offset + (end - start) <= len(doc), (where, piece, len(doc))
                assert np.array_equal(row_tokens[start:end], doc[offset : offset + end - start]), (where, piece)
                assert np.array_equal(row_positions[start:end], np.arange(end - start)), (where, piece)
                at, checked = end, checked + 1
            tail = len(row_tokens) - at
            if tail:
                assert padded, (where, "unpacked tokens in a wrap row", at)
                assert (row_tokens[at:] == self.pad).all() and np.array_equal(row_positions[at:], np.arange(tail))
        return checked


@cache
def _lines(path: str) -> list[str]:
    return [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def check_step(source, recipe_path: Path, step: int, padded: bool = False, rank=None, world=None):
    """``source.provenance(step)`` (a GlobalBatchSource) against the reference; returns the provenance."""
    from zephon_ray.provenance import slice_provenance

    batch = source.batch(step)
    full = source.provenance(step)
    part = slice_provenance(full, rank, world)
    rows = batch.slice(rank, world) if rank is not None else batch
    assert full.batch_digest == batch.digest and full.step == step
    assert Reference(recipe_path).check_rows(rows.tokens, rows.positions, part.to_json()["rows"], padded) >= len(
        part.rows
    )
    return full


def derived(tmp_path: Path, name: str, **changes: str) -> Path:
    """recipes/tiny.toml with absolute source paths and ``changes`` (key = TOML value) applied."""
    text = TINY.read_text().replace('"data/tiny/', f'"{DATA}/')
    for key, value in changes.items():
        line = next((ln for ln in text.splitlines() if ln.startswith(f"{key} =")), None)
        text = text.replace(line, f"{key} = {value}") if line else f"{key} = {value}\n" + text
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------- in-process
def test_tiny_rows_rebuilt_from_their_documents_past_an_epoch():
    """tiny's sources hold 120 records each. Record 32 of prose/shard-00001.jsonl begins at step 108 and begins again
    at step 145: its source's next epoch (a scan of steps 0-146 finds no earlier repeat; found with ProvenanceSource,
    and checked here on the rows of both steps)."""
    from zephon_ray import GlobalBatchSource, Recipe

    with GlobalBatchSource(Recipe.from_toml(TINY)) as source:
        got = {step: check_step(source, TINY, step) for step in (0, 1, 108, 145, 146)}
    key = ("prose", "shard-00001.jsonl", 32)
    for step in (108, 145):
        assert any((p.source, p.shard, p.record, p.offset) == (*key, 0) for row in got[step].rows for p in row), step


def test_phase_boundaries_rows_rebuilt():
    """recipes/phased.toml: steps 1-4 cross the boundaries at 2 (main) and 4 (anneal: prose only)."""
    from zephon_ray import GlobalBatchSource, Recipe

    with GlobalBatchSource(Recipe.from_toml(PHASED)) as source:
        got = {step: check_step(source, PHASED, step) for step in range(1, 6)}
    anneal = {p.source for rows in got[5].rows for p in rows}
    assert anneal == {"prose"}, anneal  # the phase's weights reach the rows (the check can fail)


@pytest.mark.parametrize(
    "packing, changes",
    [
        ("first_fit", {"packing_bins": "4", "seq_len": "1535", "lanes": "4"}),
        ("best_fit", {"packing_bins": "4", "seq_len": "1535", "lanes": "4"}),
        ("best_fit_wrap", {"seq_len": "600", "lanes": "4"}),
    ],
)
def test_every_packer_is_exact(tmp_path, packing, changes):
    """Whole documents with pad tails (first_fit, best_fit) and best_fit_wrap's tails placed inside a row: every
    piece rebuilt, including pieces that start inside their document anywhere in a row."""
    from zephon_ray import GlobalBatchSource, Recipe

    path = derived(tmp_path, packing, packing=f'"{packing}"', **changes)
    with GlobalBatchSource(Recipe.from_toml(path)) as source:
        steps = [check_step(source, path, step, padded=True) for step in range(8 if packing == "best_fit_wrap" else 3)]
    pieces = [p for prov in steps for row in prov.rows for p in row]
    if packing == "best_fit_wrap":
        assert any(p.start > 0 and p.offset > 0 for p in pieces)  # a document's tail after another's piece
    else:
        assert len(pieces) > len(steps) * 8  # rows of several whole documents, and pad tails


def test_mixture_parquet_and_bpe():
    """recipes/mixture.toml: Parquet shards (record = row index in the file) and a BPE tokenizer."""
    from zephon_ray import GlobalBatchSource, Recipe

    if not (ROOT / "data" / "corpus" / "parquet").is_dir():
        pytest.skip("data/corpus is missing: `make data/corpus` (the default suite has it)")
    with GlobalBatchSource(Recipe.from_toml(MIXTURE)) as source:
        check_step(source, MIXTURE, 0)


def test_slices_carry_their_own_rows_at_any_world():
    """At W = 3 and 5 (B = 16) each slice's provenance is its own rows', rebuilt from the reference, and the slices
    tile the step."""
    from zephon_ray import GlobalBatchSource, Recipe
    from zephon_ray.batch import slice_bounds

    with GlobalBatchSource(Recipe.from_toml(TINY)) as source:
        full = source.provenance(9)
        for world in (3, 5):
            parts = [check_step(source, TINY, 9, rank=r, world=world) and full.slice(r, world) for r in range(world)]
            assert [p.first_row for p in parts] == [slice_bounds(16, r, world)[0] for r in range(world)]
            assert sum((p.rows for p in parts), ()) == full.rows


def test_a_row_that_differs_is_refused_and_the_batch_path_never_builds_it():
    from zephon_ray import GlobalBatchSource, Recipe
    from zephon_ray.provenance import PROVENANCE_OP, ProvenanceError, ProvenanceSource

    recipe = Recipe.from_toml(TINY)
    with GlobalBatchSource(recipe) as source:
        batch = source.batch(3)
        assert source._provenance is None and PROVENANCE_OP not in source._stepper._pipeline.explain()
        tokens = batch.tokens.copy()
        tokens[11, 5] += 1
        with ProvenanceSource(recipe) as prov:
            with pytest.raises(ProvenanceError, match="step 3: row 11 "):
                prov.provenance(3, rows=(tokens, batch.positions))
            assert prov.provenance(3, rows=(batch.tokens, batch.positions)).batch_digest == batch.digest


def test_random_access_restores_the_nearest_checkpoint():
    """A step behind the pipeline restores the batch path's nearest checkpoint and replays at most the ring's
    spacing; steps in order reuse the pipeline."""
    from zephon_ray import GlobalBatchSource, Recipe

    with GlobalBatchSource(Recipe.from_toml(TINY), checkpoint_every=8) as source:
        source.batch(40)
        first = source.provenance(35)
        stats = source._provenance.stats
        assert stats["steps_replayed"] <= 3 and stats["restores"] == 1, stats  # from the checkpoint of step 32
        source.provenance(36)
        assert stats["restores"] == 1 and stats["steps_replayed"] <= 3
        source.provenance(33)  # behind the pipeline: restore again, from 32
        assert stats["restores"] == 2 and stats["steps_replayed"] <= 4
        assert source.provenance(35) is first and stats["restores"] == 2  # the newest steps are kept


def test_json_round_trip_names_the_shard_path():
    from zephon_ray import GlobalBatchSource, Recipe

    recipe = Recipe.from_toml(TINY)
    with GlobalBatchSource(recipe) as source:
        doc = source.provenance(2).slice(1, 5).to_json(recipe)
    assert doc["format"] == "zephon-ray/provenance/v1" and doc["rows"][0]["row"] == 3
    for piece in (p for row in doc["rows"] for p in row["pieces"]):
        assert Path(piece["path"]) == DATA / piece["source"] / piece["shard"] and Path(piece["path"]).is_file()


# ---------------------------------------------------------------------- per-token source ids
def brute_force_source(recipe_path: Path, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each token's possible sources by content alone, as a bit mask (bit i: source i of the recipe): every run of
    positions 0, 1, 2, ... (a document piece) is searched in each source's documents (all records, bracketed,
    concatenated); -1 for pad tokens. More than one bit: the piece's tokens occur in several sources (tiny's code
    holds its prose docstrings)."""
    ref = Reference(recipe_path)
    names = list(ref.paths)
    blobs = {}
    for name, path in ref.paths.items():
        docs = []
        for shard in sorted(path.iterdir()):
            for i in range(len(_lines(str(shard)))):
                docs.append(ref.document(name, shard.name, i))
        blobs[name] = b"".join(np.asarray(d, dtype="<i4").tobytes() + b"\xff\xff\xff\xff" for d in docs)
    out = np.full(tokens.shape, -1, dtype=np.int64)
    for r in range(len(tokens)):
        starts = list(np.flatnonzero(positions[r] == 0)) + [len(tokens[r])]
        for a, b in zip(starts, starts[1:]):
            if (tokens[r, a:b] == ref.pad).all():
                continue
            needle = np.asarray(tokens[r, a:b], dtype="<i4").tobytes()
            found = sum(1 << i for i, n in enumerate(names) if needle in blobs[n])
            assert found, f"row {r} tokens {a}:{b} are in no source"
            out[r, a:b] = found
    return out


def test_source_ids_agree_with_a_brute_force_attribution_local_mode(tmp_path):
    """Local mode at W = 2 (tiny) and W = 1 (phased, across its boundaries): every token's id is the source whose
    documents hold it; the microbatches' ids are the labels' (row[1:]); the rows are the goldens'."""
    import oracle

    from zephon_ray.stream.loader import Loader, LoaderConfig

    for path, world, steps in ((TINY, 2, 3), (PHASED, 1, 6)):
        golden = oracle.load_golden(path)["digests"]
        rows = {}
        for rank in range(world):
            config = LoaderConfig(
                recipe=str(path), mode="local", source_ids=True, run_id="ids", aggregate_dir=str(tmp_path)
            )  # W = 2 without checkpoints: no collective call
            with Loader(config, rank=rank, world=world, local_batch_size=4 // world) as loader:
                for batch, _ in zip(loader, range(steps)):
                    piece = batch.slice
                    rows.setdefault(batch.step, []).append(piece)
                    ids = np.concatenate([inputs["source_ids"].numpy() for inputs, _ in batch.microbatches])
                    assert np.array_equal(ids, piece.source_ids[:, 1:])
        _check_source_ids(path, rows, golden)


def _check_source_ids(path: Path, rows: dict, golden=None) -> None:
    from zephon_ray import compute_digest

    decided = 0
    for step, parts in rows.items():
        tokens = np.concatenate([p.tokens for p in parts])
        positions = np.concatenate([p.positions for p in parts])
        ids = np.concatenate([p.source_ids for p in parts])
        if golden is not None:
            assert compute_digest(tokens, positions) == golden[step]
        truth = brute_force_source(path, tokens, positions)
        pad = truth == -1
        assert np.array_equal(ids == -1, pad), f"step {step}: pad tokens"
        assert ((truth[~pad] >> ids[~pad]) & 1).all(), f"step {step}: a token attributed to a source not holding it"
        decided += int(((truth > 0) & ((truth & (truth - 1)) == 0)).sum())  # exactly one source holds the piece
    assert decided > 0.8 * sum(p.tokens.size for parts in rows.values() for p in parts)


# ---------------------------------------------------------------------- the service and a materialised run
@pytest.fixture(scope="module")
def materialised(ray_cluster, tmp_path_factory):
    """tiny's steps 0-147 materialised (checkpoints every 16 steps): past its first epoch (step 145)."""
    from zephon_ray import Recipe
    from zephon_ray.jobs.materialize import materialize

    directory = tmp_path_factory.mktemp("prov") / "mat"
    materialize(Recipe.from_toml(TINY), directory, range(0, 148), segment_steps=16, progress=False)
    return directory


@pytest.fixture(scope="module")
def service(ray_cluster, tmp_path_factory):
    """A tiny DataService whose consumer read steps 0-19, so its producers wrote durable checkpoints (every 8)."""
    from zephon_ray import DataService, Recipe

    state = tmp_path_factory.mktemp("prov") / "state"
    with DataService.start(Recipe.from_toml(TINY), name="prov", state_dir=str(state), checkpoint_every=8) as svc:
        for step in range(0, 20):
            svc.slice(step, 0, 1, track=True)
        yield svc


def test_provenance_from_a_materialised_run_at_uneven_worlds(materialised):
    """Recomputed from the recipe, restored from the directory's checkpoints, checked against the stored rows."""
    from zephon_ray import MaterializedSource, Recipe

    reference = Reference(TINY)
    with MaterializedSource(materialised, recipe=Recipe.from_toml(TINY)) as mat:
        for step, world in ((146, 3), (21, 5)):
            for rank in range(world):
                part = mat.slice(step, rank, world)
                prov = mat.provenance(step, rank, world)
                assert reference.check_rows(part.tokens, part.positions, prov.to_json()["rows"], False)
        assert mat._provenance.stats["steps_replayed"] <= 7  # from the checkpoints of 144 and 16, not from step 0


def test_provenance_from_the_service_at_uneven_worlds(service):
    """Computed in this process from the service's recipe and its nearest durable checkpoint, checked against the
    rows the service serves."""
    from zephon_ray.batch import slice_bounds

    reference = Reference(TINY)
    for step, world in ((13, 3), (17, 5)):
        for rank in range(world):
            part = service.slice(step, rank, world, track=False)
            prov = service.provenance(step, rank, world)
            assert prov.first_row == slice_bounds(16, rank, world)[0]
            assert reference.check_rows(part.tokens, part.positions, prov.to_json()["rows"], False)
    assert service._provenance.stats["steps_replayed"] <= 2 * 7  # from the checkpoints of 8 and 16


def test_source_ids_from_the_service_and_a_materialised_run(service, materialised):
    """Service mode at W = 3 and dataset mode at W = 5 (neither divides B = 16): every token's id agrees with the
    brute-force attribution."""
    from zephon_ray.stream.loader import Loader, LoaderConfig

    for mode, world, extra in (
        ("service", 3, {"service_name": "prov", "run_id": "ids"}),
        ("dataset", 5, {"dataset_dir": str(materialised)}),
    ):
        rows: dict = {}
        for rank in range(world):
            config = LoaderConfig(recipe=str(TINY), mode=mode, source_ids=True, **extra)
            with Loader(config, rank=rank, world=world) as loader:
                loader.load_state_dict(_state_at(loader, 140 if mode == "dataset" else 10))
                for batch, _ in zip(loader, range(2)):
                    rows.setdefault(batch.step, []).append(batch.slice)
        _check_source_ids(TINY, rows)


def _state_at(loader, step: int) -> dict:
    """A loader state at ``step`` for this loader's run (a resume point)."""
    from zephon_ray.formats.loader_state import make_state

    return make_state(run_id=loader.config.run_id, fingerprint=loader.recipe.fingerprint, next_step=step, zephon=None)


def test_source_ids_follow_a_deliberate_skip_local_mode(tmp_path):
    """With ``[[skips]]`` (training steps 2.. read data steps 5..), a local-mode reader's source ids are those of the
    data step it reads (``slice.step``), not of the training step: equal to the in-process provenance of that data
    step, and the rows are the data step's."""
    from zephon_ray import GlobalBatchSource, Recipe
    from zephon_ray.stream.loader import Loader, LoaderConfig

    path = derived(tmp_path, "skipping")
    path.write_text(path.read_text() + '\n[[skips]]\nname = "spike-1"\nstart_step = 2\nend_step = 5\n')
    config = LoaderConfig(recipe=str(path), mode="local", source_ids=True, run_id="ids-skip")
    seen = []
    with (
        Loader(config, rank=0, world=1, local_batch_size=4) as loader,
        GlobalBatchSource(Recipe.from_toml(TINY)) as source,
    ):
        for batch, _ in zip(loader, range(5)):
            piece = batch.slice
            seen.append((batch.step, piece.step))
            assert np.array_equal(piece.tokens, source.batch(piece.step).tokens)
            assert np.array_equal(piece.source_ids, source.provenance(piece.step).source_ids())
    assert seen == [(0, 0), (1, 1), (2, 5), (3, 6), (4, 7)]
