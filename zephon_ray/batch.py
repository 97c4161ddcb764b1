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
have the same digest. :func:`compute_digest` is the reference implementation; ``tests/test_batch.py`` checks it
against the formula above, and ``tests/oracle.py`` recomputes it from the rows with its own code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

DIGEST_HEADER = b"zephon-ray/global-batch/v1\n"
IGNORE_INDEX = -100


def compute_digest(tokens: np.ndarray, positions: np.ndarray) -> str:
    if tokens.shape != positions.shape or tokens.ndim != 2:
        raise ValueError(f"tokens {tokens.shape} and positions {positions.shape} must be equal 2-D shapes")
    h = hashlib.sha256(DIGEST_HEADER)
    h.update(f"{tokens.shape[0]} {tokens.shape[1]}\n".encode())
    h.update(np.ascontiguousarray(tokens, dtype="<i4").data)
    h.update(np.ascontiguousarray(positions, dtype="<i4").data)
    return h.hexdigest()


def slice_bounds(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank r of W reads the contiguous rows [r*B/W, (r+1)*B/W); B % W must be 0."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if rows % world:
        raise ValueError(f"a world of {world} ranks does not divide the global batch of {rows} rows")
    per = rows // world
    return rank * per, (rank + 1) * per


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

    Immutable while held: ``tokens`` and ``positions`` are made read-only when the slice is built (a write raises),
    and every source hands out arrays that nothing else writes, frees or reuses, through close, prefetch and
    restarts; a zero-copy view keeps its backing array alive (``tests/test_stream_immutability.py``, every mode).
    ``microbatches`` copies the rows into fresh tensors, which belong to the caller."""

    step: int
    rank: int
    world: int
    tokens: np.ndarray
    positions: np.ndarray
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for rows in (self.tokens, self.positions):
            if isinstance(rows, np.ndarray):
                rows.setflags(write=False)  # the rows are shared (lane shards, a global batch, peers): never written

    @classmethod
    def from_lanes(cls, step: int, rank: int, world: int, span: LaneSpan, shards: list,
                   pad_token_id: int | None = None) -> "RankSlice":
        """Rank r's slice from the lane shards of ``span.lanes`` (in lane order; each has ``tokens`` and
        ``positions`` arrays). The one place a slice is cut from lanes: the service client and local mode use it,
        and ``GlobalBatch.slice`` cuts the same rows from the assembled batch (``tests/test_batch.py``)."""
        if len(shards) != len(span.lanes):
            raise ValueError(f"step {step}, rank {rank} of {world}: expected the shards of lanes "
                             f"{span.first}..{span.stop - 1}, got {len(shards)} shards")
        if len(shards) == 1:  # one lane (or part of one): a zero-copy view
            tokens, positions = shards[0].tokens[span.lo:span.hi], shards[0].positions[span.lo:span.hi]
        else:
            tokens = np.concatenate([s.tokens for s in shards])[span.lo:span.hi]
            positions = np.concatenate([s.positions for s in shards])[span.lo:span.hi]
            tokens.setflags(write=False)
            positions.setflags(write=False)
        return cls(step, rank, world, tokens, positions, pad_token_id)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def microbatches(self, local_batch_size: int) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Yield ``({"input", "positions"}, labels)`` of ``local_batch_size`` rows each, in row order."""
        import torch  # here, not at module level: a node reader imports this module and never needs torch
        if local_batch_size < 1 or self.num_rows % local_batch_size:
            raise ValueError(
                f"local_batch_size {local_batch_size} does not divide this rank's {self.num_rows} rows "
                f"(step {self.step}, rank {self.rank} of {self.world})"
            )
        # astype copies into fresh, writable int64 memory: the stored rows are read-only and shared.
        tokens = torch.from_numpy(self.tokens.astype(np.int64))
        positions = torch.from_numpy(self.positions.astype(np.int64))
        labels = tokens[:, 1:].clone()
        if self.pad_token_id is not None:
            labels[labels == self.pad_token_id] = IGNORE_INDEX
        for start in range(0, self.num_rows, local_batch_size):
            end = start + local_batch_size
            yield {"input": tokens[start:end, :-1], "positions": positions[start:end, :-1]}, labels[start:end]


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

    def slice(self, rank: int, world: int) -> RankSlice:
        lo, hi = slice_bounds(self.num_rows, rank, world)
        return RankSlice(self.step, rank, world, self.tokens[lo:hi], self.positions[lo:hi], self.pad_token_id)

    def source_share(self) -> dict[str, float]:
        total = sum(self.source_tokens.values()) or 1
        return {name: count / total for name, count in self.source_tokens.items()}
