"""An independent oracle for zephon-ray's global batches, built from Zephon's public API and the documented contract.

It imports nothing from ``zephon_ray``, so a bug in zephon-ray's recipe parsing, tokenizers, pipeline building, lane
filing, assembly or digest cannot cancel out when a test compares zephon-ray's rows with the oracle's. What it
implements, and where that is written down:

- the recipe: the TOML file read with :mod:`tomllib` here, keys and defaults as in docs/recipes.md
  (``chunk_size`` 64, ``packing`` "wrap", ``repeat`` and every ``[shuffle]`` key true, ``text_field`` "text",
  source ``weight`` 1.0; relative paths resolve against the file);
- the tokenizers: ``"bytes"`` is UTF-8 bytes as ids 0..255, BOS 256, EOS 257, PAD 258; a path is a HF
  ``tokenizer.json`` loaded with the ``tokenizers`` library, BOS/EOS/PAD named by a ``tokenizer_config.json``
  beside it (keys ``bos_token``, ``eos_token``, ``pad_token``) or else ``<|bos|>``, ``<|eos|>``, ``<|pad|>``.
  Zephon's ``tokenize()`` always gets one of these objects: never its per-process ``hash()`` fallback;
- the lanes (DESIGN.md "Step, rows, slices"): L = ``lanes`` Zephon lanes (``canonical_replicas``), contiguous
  mapping; the oracle runs as **2 Zephon ranks** (``world_size=2``), rank g owning lanes [g*L/2, (g+1)*L/2);
  microbatches are filed by ``lane_ids``, never by stream position; step s of lane l is lane l's microbatches
  s*k .. s*k+k-1 in the lane's own order; the global batch is lane-major (lane 0's k microbatches, then lane 1's);
- the digest (README "The digest"): sha256 of ``b"zephon-ray/global-batch/v1\\n"``, then ``f"{B} {seq_len+1}\\n"``,
  then the tokens and then the positions as row-major little-endian int32.

- mixture phases (docs/recipes.md "Mixture schedules"): a ``[[phases]]`` entry starting at step S sets the weights
  (normalised; a source it does not name gets 0) of a new *segment*, drawn by fresh Zephon pipelines whose work
  source continues Zephon's global chunk stream at G_S = one past the highest global chunk that any lane's rows of
  steps < S drew from (Zephon's public ``SampleMeta.contribution_cursors()``). The oracle finds G_S and the stream's
  state there with public calls only: a lane clone (``clone_for_lane``) of the segment's work source draws
  ``next_chunk()`` up to the lane's last contributing chunk, and its ``state_dict()["global_chunk_index"]`` is then
  one past that chunk's global index; the lane whose clone ends furthest holds the stream's state at G_S. Loading that
  state into a new, unbound work source takes the oracle's one private touch: Zephon's ``load_state_dict`` checks the
  lane binding (``_lane``, ``_canon``), which an unbound work source does not have, so the oracle sets it around the
  call.

Limits: recipes with ``pretokenized`` are not supported (that path is checked against raw-text digests elsewhere);
the oracle produces steps 0..n-1 from a fresh start, nothing else.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DIGEST_HEADER = b"zephon-ray/global-batch/v1\n"
RANKS = 2
"""The oracle always runs as this many Zephon ranks (each owning half the lanes)."""


def digest(tokens: np.ndarray, positions: np.ndarray) -> str:
    """The documented digest of rows [B, seq_len+1] (README "The digest")."""
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    assert tokens.ndim == 2 and tokens.shape == positions.shape, (tokens.shape, positions.shape)
    h = hashlib.sha256(DIGEST_HEADER)
    h.update(f"{tokens.shape[0]} {tokens.shape[1]}\n".encode("ascii"))
    h.update(tokens.astype("<i4").tobytes(order="C"))
    h.update(positions.astype("<i4").tobytes(order="C"))
    return h.hexdigest()


# ---------------------------------------------------------------------- tokenizers (picklable, importable)
class OracleByteTokenizer:
    """UTF-8 bytes as ids 0..255; BOS 256, EOS 257, PAD 258 (the documented ``"bytes"`` tokenizer)."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    name_or_path = "oracle-bytes"

    def __call__(self, texts: Any, add_special_tokens: bool = False, **_: Any) -> dict[str, Any]:
        assert not add_special_tokens, "Zephon splices BOS/EOS itself"
        if isinstance(texts, str):
            return {"input_ids": self._encode(texts)}
        return {"input_ids": [self._encode(t) for t in texts]}

    @staticmethod
    def _encode(text: str) -> np.ndarray:
        return np.array(list(text.encode("utf-8", errors="replace")), dtype=np.int64)


class OracleJsonTokenizer:
    """A HF ``tokenizer.json`` through the ``tokenizers`` library; special tokens from ``tokenizer_config.json``."""

    def __init__(self, path: str | Path) -> None:
        self.name_or_path = str(path)
        self._tok: Any = None
        names = {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"}
        config = Path(path).parent / "tokenizer_config.json"
        if config.is_file():
            data = json.loads(config.read_text())
            for role in names:
                value = data.get(f"{role}_token")
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    names[role] = value
        ids = {role: self._tokenizer().token_to_id(token) for role, token in names.items()}
        assert None not in ids.values(), f"{path}: special tokens {names} not all in the vocabulary"
        self.bos_token_id, self.eos_token_id, self.pad_token_id = ids["bos"], ids["eos"], ids["pad"]

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.name_or_path)
        return self._tok

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tok": None}  # the Rust object does not pickle; rebuilt from the file

    def __call__(self, texts: Any, add_special_tokens: bool = False, **_: Any) -> dict[str, Any]:
        assert not add_special_tokens, "Zephon splices BOS/EOS itself"
        if isinstance(texts, str):
            return {
                "input_ids": np.asarray(self._tokenizer().encode(texts, add_special_tokens=False).ids, dtype=np.int64)
            }
        encodings = self._tokenizer().encode_batch(list(texts), add_special_tokens=False)
        return {"input_ids": [np.asarray(e.ids, dtype=np.int64) for e in encodings]}


# ---------------------------------------------------------------------- the recipe, read with tomllib
@dataclass(frozen=True)
class OracleSource:
    name: str
    path: Path
    weight: float
    format: str | None


@dataclass(frozen=True)
class OracleRecipe:
    path: Path
    seed: int
    lanes: int
    k: int
    m: int
    seq_len: int
    tokenizer: str
    """``"bytes"`` or an absolute path to a tokenizer.json."""
    sources: tuple[OracleSource, ...]
    text_field: str = "text"
    chunk_size: int = 64
    packing: str = "wrap"
    packing_bins: int | None = None
    repeat: bool = True
    flush_every_k_chunks: int | None = None
    shuffle: dict[str, bool] = field(default_factory=dict)
    phases: tuple[tuple[int, tuple[float, ...]], ...] = ()
    """``(start_step, weights in source order)`` per ``[[phases]]`` entry."""

    def segments(self, steps: int) -> list[tuple[int, int, tuple[float, ...]]]:
        """``(first step, end step, raw weights)`` of every segment that steps 0..steps-1 touch."""
        starts = [(0, tuple(s.weight for s in self.sources))] + list(self.phases)
        out = []
        for i, (start, weights) in enumerate(starts):
            end = starts[i + 1][0] if i + 1 < len(starts) else steps
            if start < steps:
                out.append((start, min(end, steps), weights))
        return out

    @property
    def rows(self) -> int:
        """B = L * k * m."""
        return self.lanes * self.k * self.m


def read_recipe(path: str | Path, *, root: str | Path | None = None) -> OracleRecipe:
    """Parse a recipe TOML. ``root`` replaces the recipe's directory as the base of relative paths."""
    path = Path(path).resolve()
    with path.open("rb") as fh:
        raw = tomllib.load(fh)
    if "pretokenized" in raw:
        raise NotImplementedError(f"{path}: the oracle reads raw-text recipes only")
    base = Path(root).resolve() if root is not None else path.parent

    def resolve(value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else (base / p).resolve()

    shuffle = {"shards": True, "within_shard": True, "reshuffle_on_repeat": True, **raw.get("shuffle", {})}
    tokenizer = raw["tokenizer"]
    return OracleRecipe(
        path=path,
        seed=raw["seed"],
        lanes=raw["lanes"],
        k=raw["microbatches_per_lane"],
        m=raw["rows_per_microbatch"],
        seq_len=raw["seq_len"],
        tokenizer=tokenizer if tokenizer == "bytes" else str(resolve(tokenizer)),
        sources=tuple(
            OracleSource(s["name"], resolve(s["path"]), float(s.get("weight", 1.0)), s.get("format"))
            for s in raw["sources"]
        ),
        text_field=raw.get("text_field", "text"),
        chunk_size=raw.get("chunk_size", 64),
        packing=raw.get("packing", "wrap"),
        packing_bins=raw.get("packing_bins"),
        repeat=raw.get("repeat", True),
        flush_every_k_chunks=raw.get("flush_every_k_chunks"),
        shuffle=shuffle,
        phases=tuple(
            (p["start_step"], tuple(float(p["weights"].get(s["name"], 0.0)) for s in raw["sources"]))
            for p in raw.get("phases", [])
        ),
    )


def make_tokenizer(spec: str) -> OracleByteTokenizer | OracleJsonTokenizer:
    return OracleByteTokenizer() if spec == "bytes" else OracleJsonTokenizer(spec)


# ---------------------------------------------------------------------- Zephon, public API only
def work_source(
    recipe: OracleRecipe, weights: tuple[float, ...] | None = None, state: dict[str, Any] | None = None
) -> Any:
    """An unbound StaticMixtureWorkSource: the recipe's own (no arguments), or the global chunk stream at ``state``
    drawing with ``weights`` (normalised here; zero allowed) from there on."""
    from zephon import Dataset, MixtureSpec, StaticMixtureWorkSource

    datasets = [
        Dataset.from_path(s.name, str(s.path), **({"fmt": s.format} if s.format else {})) for s in recipe.sources
    ]
    work = StaticMixtureWorkSource(
        datasets,
        MixtureSpec({s.name: (s.weight if state is None else 1.0) for s in recipe.sources}),
        chunk_size=recipe.chunk_size,
        seed=recipe.seed,
        shuffle_shards=recipe.shuffle["shards"],
        shuffle_within_shard=recipe.shuffle["within_shard"],
        reshuffle_on_repeat=recipe.shuffle["reshuffle_on_repeat"],
        exhausted_policy="repeat" if recipe.repeat else None,
    )
    if state is not None:
        if weights is not None:
            total = sum(weights)
            state = {**state, "weights": {s.name: w / total for s, w in zip(recipe.sources, weights)}}
        work._lane, work._canon = state["lane_id"], state["canonical_replicas"]  # the one private touch (see top)
        try:
            work.load_state_dict(state)
        finally:
            work._lane, work._canon = None, None
    return work


def stream_state_after(work: Any, lanes: int, last_chunk: dict[int, int]) -> dict[str, Any]:
    """The global chunk stream's state one past the furthest chunk ``last_chunk[l]`` (lane l's own chunk number) of
    any lane, from public calls: each lane's clone draws up to its chunk and reports its global position."""
    best: dict[str, Any] | None = None
    for lane, last in sorted(last_chunk.items()):
        clone = work.clone_for_lane(lane, lanes)
        for _ in range(last + 1):
            assert clone.next_chunk() is not None
        state = clone.state_dict()
        if best is None or state["global_chunk_index"] > best["global_chunk_index"]:
            best = state
    assert best is not None
    return best


def rank_pipeline(recipe: OracleRecipe, rank: int, *, aggregate_dir: str, run_id: str, work: Any = None) -> Any:
    """Zephon rank ``rank`` of :data:`RANKS`, owning lanes [rank*L/2, (rank+1)*L/2) (contiguous mapping), drawing
    from ``work`` (default: the recipe's own work source)."""
    from zephon import Pipeline

    if work is None:
        work = work_source(recipe)
    tokenizer = make_tokenizer(recipe.tokenizer)
    pipeline = (
        Pipeline(work)
        .decode_text()
        .tokenize(tokenizer=tokenizer, field=recipe.text_field, return_tensors="np")
        .pack_flat(
            max_length=recipe.seq_len + 1,
            algorithm=recipe.packing,
            num_bins=recipe.packing_bins,
            pad_token_id=tokenizer.pad_token_id,
        )
        .batch(recipe.m)
    )
    options: dict[str, Any] = dict(
        canonical_replicas=recipe.lanes,
        mapping_strategy="contiguous",
        world_size=RANKS,
        global_rank=rank,
        dp_degree=RANKS,
        dp_group_id=rank,
        run_id=run_id,
        aggregate_dir=aggregate_dir,
        runner="threads",  # a performance knob only (Zephon: execution parameters never change data order)
    )
    if recipe.flush_every_k_chunks is not None:
        options["flush_every_k_chunks"] = recipe.flush_every_k_chunks
    return pipeline.options(**options)


Microbatch = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(tokens [m, seq_len+1], positions [m, seq_len+1], tokens per source [number of sources], recipe order)."""


def lane_microbatches(recipe: OracleRecipe, steps: int) -> dict[int, list[Microbatch]]:
    """``{lane: [microbatch 0, 1, ..., steps*k - 1]}`` from 2 ranks, one set of pipelines per mixture segment. Tokens
    per source are Zephon's per-record ``meta.component_token_counts`` (component id = the source's index in the
    mixture)."""
    out: dict[int, list[Microbatch]] = {lane: [] for lane in range(recipe.lanes)}
    work = None
    for i, (start, end, _weights) in enumerate(recipe.segments(steps)):
        part, last_chunk = _segment_microbatches(recipe, end - start, work)
        for lane, mbs in part.items():
            out[lane].extend(mbs)
        if i + 1 < len(recipe.segments(steps)):
            state = stream_state_after(work if work is not None else work_source(recipe), recipe.lanes, last_chunk)
            work = work_source(recipe, recipe.segments(steps)[i + 1][2], state)
    return out


def _segment_microbatches(
    recipe: OracleRecipe, steps: int, work: Any
) -> tuple[dict[int, list[Microbatch]], dict[int, int]]:
    """One segment from fresh pipelines: each lane's microbatches, and the highest chunk number of the lane that
    they drew from (Zephon's ``contribution_cursors``)."""
    assert recipe.lanes % RANKS == 0, f"{recipe.path}: {recipe.lanes} lanes do not split over {RANKS} ranks"
    per_rank = recipe.lanes // RANKS
    want = steps * recipe.k
    out: dict[int, list[Microbatch]] = {}
    last_chunk: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="zr-oracle-") as agg:
        run_id = f"oracle-{uuid.uuid4().hex[:8]}"
        for rank in range(RANKS):
            owned = range(rank * per_rank, (rank + 1) * per_rank)
            filed: dict[int, list[Microbatch]] = {lane: [] for lane in owned}
            stream = iter(
                rank_pipeline(
                    recipe,
                    rank,
                    aggregate_dir=agg,
                    run_id=run_id,
                    work=None if work is None else _copy_work(recipe, work),
                )
            )
            try:
                while any(len(v) < want for v in filed.values()):
                    mb = next(stream)
                    lanes = {int(x) for x in np.asarray(mb.lane_ids).ravel()}
                    assert len(lanes) == 1, f"a Zephon microbatch mixes lanes {sorted(lanes)}"
                    lane = lanes.pop()
                    assert lane in filed, f"rank {rank} of {RANKS} emitted lane {lane}, not one of {list(owned)}"
                    tokens = np.stack([np.asarray(r.payload["input_ids"]) for r in mb.records])
                    positions = np.stack([np.asarray(r.payload["positions"]) for r in mb.records])
                    assert tokens.shape == (recipe.m, recipe.seq_len + 1), tokens.shape
                    per_source = np.zeros(len(recipe.sources), dtype=np.int64)
                    for r in mb.records:
                        for component, count in (r.meta.component_token_counts or {}).items():
                            per_source[int(component)] += int(count)
                    if len(filed[lane]) < want:
                        last_chunk[lane] = max(
                            [last_chunk.get(lane, -1)]
                            + [int(c.chunk_id) for r in mb.records for c in r.meta.contribution_cursors()]
                        )
                    filed[lane].append((tokens, positions, per_source))
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
            out.update({lane: mbs[:want] for lane, mbs in filed.items()})
    return out, last_chunk


def _copy_work(recipe: OracleRecipe, work: Any) -> Any:
    """A second unbound work source in ``work``'s state (each rank's pipeline clones its own)."""
    state = work.state_dict()
    state["lane_id"], state["canonical_replicas"] = 0, 1  # an unbound source's state: any binding loads it
    return work_source(recipe, None, state)


@dataclass(frozen=True)
class OracleBatch:
    step: int
    tokens: np.ndarray
    positions: np.ndarray
    source_tokens: np.ndarray
    """Tokens per source, recipe order."""

    def source_share(self, names: tuple[str, ...]) -> dict[str, float]:
        total = int(self.source_tokens.sum()) or 1
        return {name: int(n) / total for name, n in zip(names, self.source_tokens)}

    @property
    def digest(self) -> str:
        return digest(self.tokens, self.positions)

    def slice(self, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank r of W: rows [r*B/W, (r+1)*B/W)."""
        rows = self.tokens.shape[0]
        assert rows % world == 0
        lo, hi = rank * rows // world, (rank + 1) * rows // world
        return self.tokens[lo:hi], self.positions[lo:hi]


def assemble(
    recipe: OracleRecipe, lanes: dict[int, list[Microbatch]], step: int, order: tuple[int, ...] | None = None
) -> OracleBatch:
    """Step s: lane-major over lanes 0..L-1, each lane's microbatches s*k .. s*k+k-1 (``order`` permutes those k;
    for tests that show a wrong order is caught)."""
    k = recipe.k
    order = order or tuple(range(k))
    parts = [lanes[lane][step * k + i] for lane in range(recipe.lanes) for i in order]
    return OracleBatch(
        step,
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        np.sum([p[2] for p in parts], axis=0),
    )


def global_batches(recipe: OracleRecipe, steps: int) -> list[OracleBatch]:
    lanes = lane_microbatches(recipe, steps)
    return [assemble(recipe, lanes, s) for s in range(steps)]


def digests(path: str | Path, steps: int, *, root: str | Path | None = None) -> list[str]:
    return [b.digest for b in global_batches(read_recipe(path, root=root), steps)]


def environment(recipe: OracleRecipe, *, corpus: bool) -> dict[str, str]:
    """The versions a golden digest belongs to: zephon's always; the tokenizers library's for a tokenizer.json;
    Python's for a recipe that reads the corpus generated from the local stdlib (``zephon-ray corpus``)."""
    import platform
    from importlib.metadata import version

    env = {"zephon": version("zephon")}
    if recipe.tokenizer != "bytes":
        env["tokenizers"] = version("tokenizers")
    if corpus:
        env["python"] = platform.python_version()
    return env


# ---------------------------------------------------------------------- golden digests (tests/golden/<name>.json)
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
GOLDEN_STEPS = 170
"""Steps 0..169: past every checkpoint interval the tests use, past the first epoch end of the tiny recipes' prose
source (about 80 KB of text at 0.6 x 1,024 tokens per step), and at far steps such as 157."""
REGENERATE = "python tests/oracle.py --all"
SHIPPED_RECIPES = ("recipes/*.toml", "tests/recipes/k2.toml", "tests/recipes/cp.toml")
CORPUS_MARK = "data/corpus"
"""A recipe whose sources live under this path reads the corpus generated from the local stdlib."""


def reads_corpus(recipe: OracleRecipe) -> bool:
    return any(CORPUS_MARK in s.path.as_posix() for s in recipe.sources)


def golden_path(recipe_path: str | Path) -> Path:
    return GOLDEN_DIR / f"{Path(recipe_path).stem}.json"


def write_golden(recipe_path: str | Path, steps: int = GOLDEN_STEPS) -> Path:
    """Compute the oracle's digests of steps 0..steps-1 and write them with the versions they belong to."""
    recipe = read_recipe(recipe_path)
    repo = GOLDEN_DIR.parent.parent
    record = {
        "recipe": recipe.path.relative_to(repo).as_posix(),
        "made_by": REGENERATE,
        "environment": environment(recipe, corpus=reads_corpus(recipe)),
        "digests": {str(s): d for s, d in enumerate(digests(recipe.path, steps))},
    }
    out = golden_path(recipe_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out


class GoldenVersionError(AssertionError):
    """The goldens were made with other versions of the libraries that fix the rows (a failure, never a skip)."""


def load_golden(recipe_path: str | Path) -> dict[str, Any]:
    """The golden record with ``digests`` as a list by step. Versions that differ from the golden's fail with the
    one command that regenerates them: a golden that silently stops being checked is no evidence."""
    record = json.loads(golden_path(recipe_path).read_text())
    recipe = read_recipe(recipe_path)
    here = environment(recipe, corpus=reads_corpus(recipe))
    differ = {k: (v, here.get(k)) for k, v in record["environment"].items() if here.get(k) != v}
    if differ:
        raise GoldenVersionError(
            "golden digests of "
            + record["recipe"]
            + " belong to "
            + ", ".join(f"{k} {v[0]} (here {v[1]})" for k, v in differ.items())
            + f"; check the change of rows is intended, then regenerate them with `{REGENERATE}`"
        )
    record["digests"] = [record["digests"][str(s)] for s in range(len(record["digests"]))]
    return record


def shipped_recipes() -> list[Path]:
    repo = GOLDEN_DIR.parent.parent
    return sorted(p for pattern in SHIPPED_RECIPES for p in repo.glob(pattern))


if __name__ == "__main__":  # regenerate: python tests/oracle.py --all | RECIPE [RECIPE ...]
    import sys

    for arg in shipped_recipes() if sys.argv[1:] == ["--all"] else sys.argv[1:]:
        print(write_golden(arg))
