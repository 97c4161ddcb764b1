"""A global batch: the rows of one training step in canonical order, with a digest anyone can recompute.

Canonical row order is lane-major: lane 0's k microbatches in order, then lane 1's, and so on. Row r is
``tokens[r]`` (seq_len+1 token ids) with ``positions[r]`` (position within its document, reset at every
document start).

The digest (format ``v1``) is the hex sha256 of::

    b"zephon-ray/global-batch/v1\\n"
    + f"{B} {seq_len + 1}\\n".encode()              # rows and row length, ASCII
    + tokens.astype("<i4").tobytes()                 # row-major, little-endian int32
    + positions.astype("<i4").tobytes()

It covers the rows only: not the step number, not the recipe. Two steps that happen to hold the same rows
have the same digest. :func:`compute_digest` is the reference implementation of the formula above; anyone can
recompute it from the rows with their own code.

Usage: ``batch.slice(rank, world)`` is reader r's :class:`RankSlice`, rows ``[floor(r*B/W), floor((r+1)*B/W))``
(:func:`slice_bounds`); ``slice.microbatches(local_batch_size)`` cuts it into trainer microbatches.

Guarantee: concatenating every reader's slice in rank order gives the global batch, for any W in [1, B]; a slice's
arrays are read-only and nothing else writes them. Limits: W > B is refused (a reader would get no rows); a slice
cut from lanes concatenates them (a copy) when the reader's rows span several lanes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon_ray.checks import check_reader

if TYPE_CHECKING:
    import torch

DIGEST_HEADER = b"zephon-ray/global-batch/v1\n"
IGNORE_INDEX = -100


def _rows_sha256(header: bytes, tokens: np.ndarray, positions: np.ndarray) -> str:
    """sha256 of ``header``, ``"<rows> <row length>\n"``, then the tokens and the positions as little-endian int32."""
    if tokens.shape != positions.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} and positions {positions.shape} must be equal 2-D shapes")
    h = hashlib.sha256(header)
    h.update(f"{tokens.shape[0]} {tokens.shape[1]}\n".encode())
    h.update(np.ascontiguousarray(tokens, dtype="<i4").data)
    h.update(np.ascontiguousarray(positions, dtype="<i4").data)
    return h.hexdigest()


def compute_digest(tokens: np.ndarray, positions: np.ndarray) -> str:
    return _rows_sha256(DIGEST_HEADER, tokens, positions)


SLICE_DIGEST_HEADER = b"zephon-ray/ledger-slice/v1\n"
DIGEST_HEX = 32


def slice_digest(tokens: np.ndarray, positions: np.ndarray) -> str:
    """The digest of a rank's rows: sha256 of header, ``"<rows> <row length>\\n"``, the tokens then the positions as
    little-endian int32, truncated to 32 hex digits. The same rows give the same digest whoever computes them (the
    audit recomputes it from the recipe's global batch cut at ``slice_bounds``). sha256 rather than a faster hash:
    it is in every Python, and it costs under a millisecond per seq_len 8192 slice (``benchmarks/bench_ledger.py``)."""
    return _rows_sha256(SLICE_DIGEST_HEADER, tokens, positions)[:DIGEST_HEX]


def slice_bounds(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank r of W reads the contiguous rows ``[floor(r*B/W), floor((r+1)*B/W))`` of a B-row global batch.

    A pure function of (B, W, r) for any ``1 <= W <= B``: the W ranges, in rank order, tile ``[0, B)`` exactly, and
    their sizes differ by at most one row (``floor(B/W)`` or ``ceil(B/W)``). When W divides B every rank has B/W rows,
    the same split as before uneven slices existed, so no digest, golden, materialised run or loader state changes.
    W > B is refused: a rank would get no rows."""
    rank, world = check_reader(rank, world)
    if world > rows:
        raise ValueError(
            f"a world of {world} ranks exceeds the global batch of {rows} rows: a rank would get no rows "
            f"(use at most {rows} readers)"
        )
    return rank * rows // world, (rank + 1) * rows // world


def padded_rows(rows: int, world: int, local_batch_size: int = 1) -> int:
    """Rows every rank holds when slices are padded to equal shapes: ``ceil(B/W)``, rounded up to a multiple of
    ``local_batch_size`` so that every rank cuts the same number of whole microbatches."""
    if world < 1 or local_batch_size < 1:
        raise ValueError(f"world {world} and local_batch_size {local_batch_size} must be >= 1")
    most = -(-rows // world)
    return -(-most // local_batch_size) * local_batch_size


def valid_tokens(tokens: np.ndarray, pad_token_id: int | None) -> int:
    """Labels of these rows that reach the loss: ``row[1:]`` per row, less those equal to the pad id (if any)."""
    labels = tokens[:, 1:]
    if pad_token_id is None:
        return int(labels.size)
    return int(labels.size - np.count_nonzero(labels == pad_token_id))


@dataclass(frozen=True)
class LaneSpan:
    """Where rank r of W finds its rows in a lane-major global batch: lanes ``[first, stop)``, and within their
    concatenation the rows ``[lo, hi)``. When W divides L the span is whole lanes (``lo == 0``, ``hi`` = all)."""

    first: int
    stop: int
    lo: int
    hi: int

    @property
    def lanes(self) -> range:
        return range(self.first, self.stop)


def lane_span(lanes: int, rows_per_lane: int, rank: int, world: int) -> LaneSpan:
    """The lanes holding rank r's rows ``slice_bounds(lanes * rows_per_lane, r, W)`` (validated there)."""
    lo, hi = slice_bounds(lanes * rows_per_lane, rank, world)
    first, last = lo // rows_per_lane, (hi - 1) // rows_per_lane
    return LaneSpan(first, last + 1, lo - first * rows_per_lane, hi - first * rows_per_lane)


@dataclass(frozen=True)
class RankSlice:
    """One rank's rows of a step, as TorchTitan tensors: ``input``/``labels``/``positions`` are [rows, seq_len].

    ``tokens``/``positions`` hold the real rows only (``slice_bounds``); padding rows, when a trainer asks for equal
    shapes, are added by :meth:`microbatches` and never enter a digest. ``global_valid_tokens`` is the number of
    labels of the whole global batch that reach the loss, when the source knows it without another read
    (``zephon_ray.source.fixed_valid_tokens``; a materialised step counts it from the rows it reads anyway), else
    None.

    Immutable while held: ``tokens`` and ``positions`` are made read-only when the slice is built (a write raises),
    and every source hands out arrays that nothing else writes, frees or reuses, through close, prefetch and
    restarts; a zero-copy view keeps its backing array alive, in every mode.
    ``microbatches`` copies the rows into fresh tensors, which belong to the caller.

    ``source_ids`` (only when a loader is asked for them: ``LoaderConfig.source_ids``) is an int16 array shaped like
    ``tokens``: each token's source index in the recipe's order, -1 for pad tokens, derived from the step's
    provenance (:mod:`zephon_ray.provenance`). It never enters a digest."""

    step: int
    rank: int
    world: int
    tokens: np.ndarray
    positions: np.ndarray
    pad_token_id: int | None = None
    global_valid_tokens: int | None = None
    source_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        for rows in (self.tokens, self.positions, self.source_ids):
            if isinstance(rows, np.ndarray):
                rows.setflags(write=False)  # the rows are shared (lane shards, a global batch, peers): never written
        if self.source_ids is not None and np.shape(self.source_ids) != np.shape(self.tokens):
            raise ValueError(
                f"step {self.step}, rank {self.rank} of {self.world}: source_ids of shape "
                f"{np.shape(self.source_ids)} for tokens of shape {np.shape(self.tokens)}"
            )

    @classmethod
    def from_lanes(
        cls,
        step: int,
        rank: int,
        world: int,
        span: LaneSpan,
        shards: list[Any],
        pad_token_id: int | None = None,
        global_valid_tokens: int | None = None,
    ) -> RankSlice:
        """Rank r's slice from the lane shards of ``span.lanes`` (in lane order; each has ``tokens`` and
        ``positions`` arrays). The one place a slice is cut from lanes: the service client and local mode use it,
        and ``GlobalBatch.slice`` cuts the same rows from the assembled batch."""
        if len(shards) != len(span.lanes):
            raise ValueError(
                f"step {step}, rank {rank} of {world}: expected the shards of lanes "
                f"{span.first}..{span.stop - 1}, got {len(shards)} shards"
            )
        if len(shards) == 1:  # one lane (or part of one): a zero-copy view
            tokens, positions = shards[0].tokens[span.lo : span.hi], shards[0].positions[span.lo : span.hi]
        else:  # the rank's rows of its first and last lane, whole lanes between: one copy of exactly its rows
            per = shards[0].tokens.shape[0]
            parts = [(max(span.lo - i * per, 0), min(span.hi - i * per, per)) for i in range(len(shards))]
            tokens = np.concatenate([s.tokens[a:b] for s, (a, b) in zip(shards, parts)])
            positions = np.concatenate([s.positions[a:b] for s, (a, b) in zip(shards, parts)])
        return cls(step, rank, world, tokens, positions, pad_token_id, global_valid_tokens)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def valid_tokens(self) -> int:
        """This rank's labels that reach the loss (padding rows added by :meth:`microbatches` count none)."""
        return valid_tokens(self.tokens, self.pad_token_id)

    @cached_property
    def ledger_digest(self) -> str:
        """The ledger's digest of these rows (:func:`slice_digest`); the prefetch thread computes it before the
        trainer asks for the slice, so the hashing stays off the trainer's path."""
        return slice_digest(self.tokens, self.positions)

    def microbatches(
        self, local_batch_size: int, *, pad_to: int | None = None
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Yield ``({"input", "positions"}, labels)`` of ``local_batch_size`` rows each, in row order.

        ``pad_to``: append rows up to that many (equal shapes on every rank, for torch.compile and CUDA graphs).
        A padding row's labels are all ``IGNORE_INDEX``, so it never reaches a loss that ignores them (TorchTitan's,
        ``cross_entropy(ignore_index=-100)``); its input is token 0 at positions 0..seq_len-1. The padding rows come
        last, so the real rows keep their microbatches.

        With :attr:`source_ids`, the dict also holds ``"source_ids"``: int64 ``[rows, seq_len]`` aligned with
        ``labels`` (the source of each label token, ``row[1:]``), -1 for pad tokens and padding rows, so that
        ``zeros(S).scatter_add(0, ids[ids >= 0], token_loss[ids >= 0])`` sums each source's loss."""
        import torch  # here, not at module level: a node reader imports this module and never needs torch

        rows = self.num_rows if pad_to is None else pad_to
        if rows < self.num_rows:
            raise ValueError(
                f"pad_to {pad_to} is less than this rank's {self.num_rows} rows (step {self.step}, "
                f"rank {self.rank} of {self.world})"
            )
        if local_batch_size < 1 or rows % local_batch_size:
            raise ValueError(
                f"local_batch_size {local_batch_size} does not divide this rank's {rows} rows "
                f"(step {self.step}, rank {self.rank} of {self.world})"
            )
        # astype copies into fresh, writable int64 memory: the stored rows are read-only and shared.
        tokens = torch.from_numpy(self.tokens.astype(np.int64))
        positions = torch.from_numpy(self.positions.astype(np.int64))
        if rows > self.num_rows:
            extra, width = rows - self.num_rows, self.tokens.shape[1]
            tokens = torch.cat([tokens, torch.zeros((extra, width), dtype=torch.int64)])
            positions = torch.cat([positions, torch.arange(width, dtype=torch.int64).repeat(extra, 1)])
        labels = tokens[:, 1:].clone()
        if self.pad_token_id is not None:
            labels[labels == self.pad_token_id] = IGNORE_INDEX
        labels[self.num_rows :] = IGNORE_INDEX
        ids = None
        if self.source_ids is not None:
            ids = torch.full((rows, self.tokens.shape[1] - 1), -1, dtype=torch.int64)
            ids[: self.num_rows] = torch.from_numpy(self.source_ids[:, 1:].astype(np.int64))
        for start in range(0, rows, local_batch_size):
            end = start + local_batch_size
            inputs = {"input": tokens[start:end, :-1], "positions": positions[start:end, :-1]}
            if ids is not None:
                inputs["source_ids"] = ids[start:end]
            yield inputs, labels[start:end]


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """Global batch ``step`` of a recipe; a pure function of (recipe, step).

    ``tokens`` and ``positions`` are read-only int32 arrays of shape [B, seq_len+1]; ``lanes[r]`` is row r's lane.
    """

    step: int
    tokens: np.ndarray
    positions: np.ndarray
    lanes: np.ndarray
    source_tokens: dict[str, int]
    fingerprint: str
    pad_token_id: int | None = None
    _digest: str | None = field(default=None, repr=False)

    @property
    def rows(self) -> np.ndarray:
        return self.tokens

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @cached_property
    def digest(self) -> str:
        return self._digest or compute_digest(self.tokens, self.positions)

    @cached_property
    def valid_tokens(self) -> int:
        """Labels of the whole batch that reach the loss: the denominator of the global mean token loss."""
        return valid_tokens(self.tokens, self.pad_token_id)

    def slice(self, rank: int, world: int) -> RankSlice:
        lo, hi = slice_bounds(self.num_rows, rank, world)
        return RankSlice(
            self.step, rank, world, self.tokens[lo:hi], self.positions[lo:hi], self.pad_token_id, self.valid_tokens
        )

    def source_share(self) -> dict[str, float]:
        total = sum(self.source_tokens.values()) or 1
        return {name: count / total for name, count in self.source_tokens.items()}
