"""Provenance: which pieces of which documents every row of a step holds.

    ProvenanceSource(recipe).provenance(step, rows=(tokens, positions))  ->  StepProvenance
        .rows[r]          the pieces of row r: Piece(source, shard, record, start, end, offset)
        .slice(rank, W)   rows [floor(r*B/W), floor((r+1)*B/W)): a slice's own rows
        .source_ids()     [rows, seq_len+1] int16: each token's source index (-1: pad token)

A piece is one contiguous span ``[start, end)`` of a row holding tokens ``[offset, offset + end - start)`` of one
document: record ``record`` (0-based index of the record in the file) of shard ``shard`` (the shard's name as
``Recipe.sources[i].shards`` and the fingerprint list it, relative to the source's path) of source ``source``. Offset
0 is the document's BOS: Zephon's ``tokenize`` brackets every document with BOS and EOS, so both belong to the
document's pieces. A row's pieces cover it from token 0 up to its padding tail (none with ``wrap``).

What Zephon gives, and what it does not (zephon 0.2.0):

- Every record carries a sample id ``(dataset id, shard id, index in shard)``: the recipe's source order, Zephon's
  shard-id order (``Source.shards``) and the record's index in the file.
- ``pack_flat`` keeps, for each packed row, its contributors (``SampleMeta.contribution_cursors()``: one sample id per
  segment, in segment order), ``positions`` that restart at 0 at every segment, the pad tail's length
  (``SampleMeta.padding_length``) and per-source token counts. It drops the per-token sample ids and, for every
  segment but a ``wrap`` row's first, where in its document the segment starts (``best_fit_wrap`` places a
  document's tail anywhere in a row).
- ``pack_flat`` slices and concatenates every payload field that is as long as the token field exactly as it does
  the tokens (and pads it with 0).

How the pieces are exact for every packer (``wrap``, ``best_fit_wrap``, ``first_fit``, ``best_fit``): a
*provenance-mode pipeline* of the same recipe adds four aligned fields to every tokenised record just before
``pack_flat`` (the record's dataset id, shard id and index, and ``0..n-1``, each token's offset in its document), so
the packer carries each token's identity and offset through whatever it does. The fields are ignored by the row
assembly, so the rows are the recipe's; :meth:`ProvenanceSource.provenance` checks that they equal the rows the
caller was served (tokens and positions, exactly) and raises :class:`ProvenanceError` otherwise. Every row is also
cross-checked against Zephon's own metadata: its segments (``positions`` resets, less the pad tail) must be the
pieces, one per contributor, with the contributors' sample ids. No cost on the batch path: nothing here runs unless
provenance is asked for.

Cost: a step's provenance replays the provenance-mode pipeline from the nearest checkpoint at or before it (a batch
path's own Zephon state restores into it: the pipeline state does not depend on the added fields) and is cheap when
steps are asked in order; each step costs about what producing it costs (``benchmarks/bench_provenance.py``).

Limits: recipes whose shards Zephon lists remotely are read the same way; the text of a piece is decoded from the
row's tokens (``zephon-ray show --docs``), never re-read from the shard. A pretokenised recipe names the records of
its token-id copies, which keep the raw shards' record order (``zephon_ray.jobs.pretokenize``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from zephon_ray.batch import compute_digest, slice_bounds
from zephon_ray.checks import check_int
from zephon_ray.lanes import LaneShard, LaneStepper
from zephon_ray.pipeline import LaneGroup
from zephon_ray.pretokenized_manifest import TOKEN_FIELD
from zephon_ray.recipe import Recipe

PROVENANCE_OP = "zephon_ray_provenance"
"""The name of the operator a provenance-mode pipeline adds before ``pack_flat``."""
FIELD_SOURCE, FIELD_SHARD, FIELD_RECORD, FIELD_OFFSET = (
    "zr_prov_source",
    "zr_prov_shard",
    "zr_prov_record",
    "zr_prov_offset",
)
FIELDS = (FIELD_SOURCE, FIELD_SHARD, FIELD_RECORD, FIELD_OFFSET)
"""The per-token fields the provenance op adds; they travel through ``pack_flat`` with the tokens."""
PAD_SOURCE_ID = -1
"""The source id of a pad token and of a padding row (:func:`rows_source_ids`, ``RankSlice.source_ids``)."""
SOURCE_ID_DTYPE = np.int16
JSON_FORMAT = "zephon-ray/provenance/v1"


class ProvenanceError(RuntimeError):
    """The provenance-mode pipeline disagrees with the rows served, or with Zephon's own metadata; the message
    names the step, the row and what differs."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens ``[start, end)`` of a row are tokens ``[offset, offset + end - start)`` of record ``record`` of shard
    ``shard`` of source ``source`` (see the module docstring)."""

    source: str
    shard: str
    record: int
    start: int
    end: int
    offset: int

    @property
    def length(self) -> int:
        return self.end - self.start

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "shard": self.shard,
            "record": self.record,
            "start": self.start,
            "end": self.end,
            "offset": self.offset,
        }


@dataclass(frozen=True)
class StepProvenance:
    """The pieces of rows ``[first_row, first_row + len(rows))`` of global batch ``step``; ``batch_digest`` is the
    digest of the whole global batch they were computed with."""

    step: int
    rows: tuple[tuple[Piece, ...], ...]
    sources: tuple[str, ...]
    row_length: int
    batch_digest: str
    first_row: int = 0
    global_rows: int = field(default=0)
    """B, the rows of the whole global batch (0: ``len(rows)``)."""

    def __post_init__(self) -> None:
        if not self.global_rows:
            object.__setattr__(self, "global_rows", len(self.rows))

    def slice(self, rank: int, world: int) -> StepProvenance:
        """Rank ``rank`` of ``world``'s rows, ``[floor(r*B/W), floor((r+1)*B/W))``, as ``GlobalBatch.slice`` cuts
        them (only from a whole step's provenance)."""
        if self.first_row or len(self.rows) != self.global_rows:
            raise ValueError(
                f"step {self.step}: slice() cuts a whole step's provenance, not rows "
                f"{self.first_row}..{self.first_row + len(self.rows) - 1}"
            )
        lo, hi = slice_bounds(self.global_rows, rank, world)
        return StepProvenance(
            self.step,
            self.rows[lo:hi],
            self.sources,
            self.row_length,
            self.batch_digest,
            first_row=lo,
            global_rows=self.global_rows,
        )

    def source_ids(self) -> np.ndarray:
        """``[rows, seq_len+1]`` int16: each token's source index in the recipe's order, -1 for pad tokens."""
        return rows_source_ids(self.rows, self.sources, self.row_length)

    def to_json(self, recipe: Recipe | None = None) -> dict[str, Any]:
        """JSON-safe: ``{"format", "step", "batch_digest", "rows": [{"row", "pieces": [...]}]}``; with ``recipe``,
        every piece also has ``path``, its shard's full path or URI."""
        where = shard_paths(recipe) if recipe is not None else {}
        rows = []
        for i, pieces in enumerate(self.rows):
            out = []
            for piece in pieces:
                item = piece.to_json()
                if where:
                    item["path"] = where[(piece.source, piece.shard)]
                out.append(item)
            rows.append({"row": self.first_row + i, "pieces": out})
        return {"format": JSON_FORMAT, "step": self.step, "batch_digest": self.batch_digest, "rows": rows}


def rows_source_ids(rows: Sequence[Sequence[Piece]], sources: Sequence[str], row_length: int) -> np.ndarray:
    """``[len(rows), row_length]`` int16 source indices (``sources`` order) of every token; -1 where no piece is."""
    index = {name: i for i, name in enumerate(sources)}
    out = np.full((len(rows), row_length), PAD_SOURCE_ID, dtype=SOURCE_ID_DTYPE)
    for r, pieces in enumerate(rows):
        for piece in pieces:
            out[r, piece.start : piece.end] = index[piece.source]
    return out


def shard_paths(recipe: Recipe) -> dict[tuple[str, str], str]:
    """``{(source, shard name): the shard's full path or URI}``."""
    from zephon_ray import storage

    return {(s.name, x.name): storage.location(s.path).join(x.name).uri for s in recipe.sources for x in s.shards}


# ---------------------------------------------------------------------- the provenance-mode pipeline
def _tag(elems: list[Any]) -> list[Any]:
    """The provenance op (one call per batch of tokenised records): each record's sample id and each token's offset
    in the record, as fields as long as its tokens, which ``pack_flat`` slices with them."""
    for elem in elems:
        payload = dict(elem.payload)
        n = len(payload[TOKEN_FIELD])
        dataset, shard, record = (int(x) for x in elem.meta.sample_id)
        payload[FIELD_SOURCE] = np.full(n, dataset, dtype=np.int32)
        payload[FIELD_SHARD] = np.full(n, shard, dtype=np.int32)
        payload[FIELD_RECORD] = np.full(n, record, dtype=np.int64)
        payload[FIELD_OFFSET] = np.arange(n, dtype=np.int64)
        elem.payload = payload
    return elems


def _validation_samples() -> list[Any]:
    """Zephon's op validator feeds ``{'text', 'value'}`` payloads unless given records shaped like ours."""
    from zephon.types import SampleMeta, SampleRecord

    return [
        SampleRecord(
            meta=SampleMeta(sample_id=(0, 0, i), lane_id=i % 2, chunk_id=0, chunk_offset=i),
            payload={TOKEN_FIELD: np.arange(3 + i, dtype=np.int64)},
        )
        for i in range(4)
    ]


def add_provenance_fields(pipeline: Any) -> Any:
    """The ``before_packing`` hook of a provenance-mode pipeline (:func:`zephon_ray.pipeline.build_pipeline`): a
    stateless 1:1 operator, so chunk routing, packing and checkpoints are the batch path's."""
    return pipeline.add_op(
        PROVENANCE_OP, process_many=_tag, preserves_cursor_order=True, validation_samples=_validation_samples
    )


class ProvenanceStepper(LaneStepper):
    """A :class:`LaneStepper` over the provenance-mode pipeline: the same shards, and after each step
    ``pieces[lane]``, the pieces of each of the lane's rows of that step (in row order). Restores the batch path's
    states, and its own restore into the batch path (the added operator is stateless)."""

    before_packing = staticmethod(add_provenance_fields)

    def __init__(self, recipe: Recipe, group: LaneGroup = LaneGroup()) -> None:
        self._names = (recipe.source_names, tuple(tuple(x.name for x in s.shards) for s in recipe.sources))
        self.pieces: dict[int, list[tuple[Piece, ...]]] = {}
        self.collect_from = 0
        """Build ``pieces`` for the steps from this one on (those before it are replayed up to a wanted step)."""
        super().__init__(recipe, group)

    def _shard(self, lane: int, microbatches: list[Any]) -> LaneShard:
        shard = super()._shard(lane, microbatches)
        if self.position >= self.collect_from:
            records = [rec for mb in microbatches for rec in mb.records]
            self.pieces[lane] = [self._row_pieces(rec, lane, i) for i, rec in enumerate(records)]
        return shard

    def _row_pieces(self, record: Any, lane: int, row: int) -> tuple[Piece, ...]:
        payload, length = record.payload, self.recipe.row_length
        where = f"step {self.position}, lane {lane}, row {row}"
        positions = np.asarray(payload["positions"])
        pad = record.meta.padding_length or 0
        real = length - pad
        if pad and not np.array_equal(positions[real:], np.arange(pad)):
            raise ProvenanceError(f"{where}: the {pad} pad positions are not one trailing segment")
        cols = [np.asarray(payload[name]) for name in FIELDS]
        starts = np.flatnonzero(positions[:real] == 0)
        if real and (not len(starts) or starts[0] != 0):
            raise ProvenanceError(f"{where}: the row does not start a segment at token 0")
        bounds = list(starts) + [real]
        contributors = [tuple(int(x) for x in c.sample_id) for c in record.meta.contribution_cursors()]
        if len(contributors) != len(starts):
            raise ProvenanceError(f"{where}: {len(starts)} segments but Zephon names {len(contributors)} contributors")
        sources, shards = self._names
        pieces = []
        for (a, b), sample in zip(zip(bounds, bounds[1:]), contributors):
            ids = tuple(int(col[a]) for col in cols[:3])
            offset = int(cols[3][a])
            if (
                ids != sample
                or any((col[a:b] != col[a]).any() for col in cols[:3])
                or not np.array_equal(cols[3][a:b], np.arange(offset, offset + b - a))
            ):
                raise ProvenanceError(
                    f"{where}: tokens {a}..{b - 1} are not one span of one document (sample "
                    f"{ids}, Zephon's contributor {sample})"
                )
            pieces.append(Piece(sources[ids[0]], shards[ids[0]][ids[1]], ids[2], int(a), int(b), offset))
        return tuple(pieces)


# ---------------------------------------------------------------------- random access
CheckpointLookup = Callable[[int], "tuple[int, dict[str, Any]] | None"]
"""``step -> (checkpoint step, LaneStepper state)`` of the newest checkpoint at or before ``step``, or None."""


class ProvenanceSource:
    """The provenance of any step of ``recipe``: a pure function of (recipe, step).

    ``checkpoints`` finds the newest batch-path state at or before a step (a GlobalBatchSource's ring, a service's
    ``state_dir``, a materialised directory's checkpoints); without it a step is replayed from step 0. Steps asked in
    order reuse the pipeline (``reuse_within`` steps ahead at most before a nearer checkpoint is preferred)."""

    def __init__(
        self,
        recipe: Recipe,
        *,
        checkpoints: CheckpointLookup | None = None,
        reuse_within: int = 64,
        cache_steps: int = 4,
    ) -> None:
        self.recipe = recipe
        self._checkpoints = checkpoints
        self._reuse_within = check_int("reuse_within", reuse_within, low=0)
        self._cache_steps = check_int("cache_steps", cache_steps, low=1)
        self._stepper: ProvenanceStepper | None = None
        # The newest steps' (tokens, positions, provenance): the W ranks of one step cost one replay, not W.
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray, StepProvenance]] = OrderedDict()
        self.stats = {"restores": 0, "steps_replayed": 0}

    def _stepper_for(self, step: int) -> ProvenanceStepper:
        stepper = self._stepper
        if stepper is not None and stepper.position <= step <= stepper.position + self._reuse_within:
            return stepper
        nearest = self._checkpoints(step) if self._checkpoints is not None else None
        if stepper is not None and stepper.position <= step and (nearest is None or nearest[0] <= stepper.position):
            return stepper
        if stepper is not None:
            stepper.close(background=True)
        stepper = self._stepper = ProvenanceStepper(self.recipe)
        if nearest is not None and nearest[0] > 0:
            stepper.restore(nearest[1])
        self.stats["restores"] += 1
        return stepper

    def provenance(
        self, step: int, *, rows: tuple[np.ndarray, np.ndarray] | None = None, first_row: int = 0
    ) -> StepProvenance:
        """Step ``step``'s provenance. ``rows``: the ``(tokens, positions)`` the caller was served for rows
        ``[first_row, first_row + len(tokens))`` of that step; the provenance-mode rows must equal them exactly, or a
        :class:`ProvenanceError` names the first row that differs."""
        step = check_int("step", step, low=0, numpy_ok=True)
        cached = self._cache.get(step)
        if cached is None:
            cached = self._cache[step] = self._compute(step)
            while len(self._cache) > self._cache_steps:
                self._cache.popitem(last=False)
        tokens, positions, provenance = cached
        if rows is not None:
            check_rows(step, tokens, positions, rows, first_row)
        return provenance

    def _compute(self, step: int) -> tuple[np.ndarray, np.ndarray, StepProvenance]:
        stepper = self._stepper_for(step)
        stepper.collect_from = step
        while stepper.position < step:
            stepper.next_step()
            self.stats["steps_replayed"] += 1
        shards = stepper.next_step()
        recipe = self.recipe
        tokens = np.concatenate([shards[lane].tokens for lane in range(recipe.lanes)])
        positions = np.concatenate([shards[lane].positions for lane in range(recipe.lanes)])
        pieces = tuple(row for lane in range(recipe.lanes) for row in stepper.pieces[lane])
        return (
            tokens,
            positions,
            StepProvenance(step, pieces, recipe.source_names, recipe.row_length, compute_digest(tokens, positions)),
        )

    def close(self) -> None:
        if self._stepper is not None:
            self._stepper.close(background=True)
            self._stepper = None

    def __enter__(self) -> ProvenanceSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_rows(
    step: int, tokens: np.ndarray, positions: np.ndarray, served: tuple[np.ndarray, np.ndarray], first_row: int = 0
) -> None:
    """Raise :class:`ProvenanceError` unless ``served`` (tokens, positions) equals rows ``[first_row, ...)`` of
    ``tokens``/``positions`` exactly."""
    want_tokens, want_positions = (np.asarray(a) for a in served)
    end = first_row + len(want_tokens)
    if want_tokens.shape != want_positions.shape or end > len(tokens) or want_tokens.shape[1:] != tokens.shape[1:]:
        raise ProvenanceError(
            f"step {step}: served rows of shape {want_tokens.shape} at row {first_row} do not fit "
            f"the global batch of shape {tokens.shape}"
        )
    differs = np.flatnonzero(
        (tokens[first_row:end] != want_tokens).any(axis=1) | (positions[first_row:end] != want_positions).any(axis=1)
    )
    if len(differs):
        raise ProvenanceError(
            f"step {step}: row {first_row + int(differs[0])} of the provenance-mode pipeline differs "
            f"from the row served ({len(differs)} row(s) differ); the provenance would describe "
            "other documents"
        )


def slice_provenance(full: StepProvenance, rank: int | None, world: int | None) -> StepProvenance:
    """``full`` itself, or rank ``rank`` of ``world``'s part of it (both or neither given)."""
    if (rank is None) != (world is None):
        raise ValueError(f"give both rank and world, or neither (got rank {rank!r}, world {world!r})")
    return full if rank is None else full.slice(rank, cast(int, world))
