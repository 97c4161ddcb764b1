"""The third delivery path: global batches read back from a materialised directory with pyarrow.

A directory written by ``zephon-ray materialize`` (:mod:`zephon_ray.jobs.materialize`)::

    DIR/manifest.json                         the commit point, replaced atomically, written last
    DIR/segments/steps-<a>-<b>.parquet        steps a..b-1, ONE ROW GROUP PER STEP, rows in canonical order
    DIR/checkpoints/step-<b>.json             Zephon state at the boundary before step b (resume / extend)

Parquet columns: ``step`` (int64), ``lane`` (int16), ``row`` (int32, index in the global batch), ``tokens`` and
``positions`` (fixed_size_list<int32>[seq_len+1]). The manifest holds the recipe fingerprint, the geometry, every
segment's size and sha256, and the digest and per-source token counts of every step.

Guarantee: ``MaterializedSource(DIR).batch(s)`` has the same rows, order and digest as
``GlobalBatchSource(recipe).batch(s)`` and the data service (tests/test_materialized.py), and every read is
checked against the manifest's digest, so a corrupted row group is an error, never a wrong batch. A step is one
row-group read: O(1) in the number of steps (benchmarks/bench_materialize.py measures p50/p99).

Limits: only steps in ``[first_step, end_step)`` exist; others raise :class:`MaterializedError`. Opening checks
that every segment exists with its recorded size (a truncated or missing file is named); it does not hash the
segments (:meth:`MaterializedSource.verify` does, reading every byte).
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zephon_ray.batch import GlobalBatch, RankSlice, compute_digest

MANIFEST_FORMAT = "zephon-ray/materialized/v1"
MANIFEST_NAME = "manifest.json"
SEGMENTS_DIR = "segments"
CHECKPOINTS_DIR = "checkpoints"
COLUMNS = ("step", "lane", "row", "tokens", "positions")
MAX_STEP = 10**12
"""Steps are bounded so that a typo cannot ask for years of work."""

# Manifest keys
KEY_FORMAT = "format"
KEY_FINGERPRINT = "fingerprint"
KEY_GEOMETRY = "geometry"
KEY_FIRST = "first_step"
KEY_END = "end_step"
KEY_SEGMENT_STEPS = "segment_steps"
KEY_SEGMENTS = "segments"
KEY_DIGESTS = "digests"
KEY_SOURCE_TOKENS = "source_tokens"
KEY_CHECKPOINTS = "checkpoints"


class MaterializedError(ValueError):
    """A materialised directory that cannot be used as asked; the message names the file, key or step."""


def segment_name(first: int, end: int) -> str:
    return f"{SEGMENTS_DIR}/steps-{first:012d}-{end:012d}.parquet"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINTS_DIR}/step-{step:012d}.json"


def read_manifest(directory: Path) -> dict[str, Any]:
    """The parsed, structurally checked manifest, or one clear :class:`MaterializedError`."""
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise MaterializedError(f"materialised directory not found: {directory}")
    if not path.is_file():
        raise MaterializedError(f"{path}: manifest missing (not a materialised directory, or no step committed yet)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MaterializedError(f"{path}: corrupt manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get(KEY_FORMAT) != MANIFEST_FORMAT:
        got = manifest.get(KEY_FORMAT) if isinstance(manifest, dict) else type(manifest).__name__
        raise MaterializedError(f"{path}: manifest format {got!r} is not {MANIFEST_FORMAT!r}")
    try:
        first, end = int(manifest[KEY_FIRST]), int(manifest[KEY_END])
        geometry = manifest[KEY_GEOMETRY]
        rows, width = int(geometry["rows"]), int(geometry["row_length"])
        digests, source_tokens = manifest[KEY_DIGESTS], manifest[KEY_SOURCE_TOKENS]
        segments = manifest[KEY_SEGMENTS]
        covered = first
        for seg in segments:
            if int(seg["first_step"]) != covered or int(seg["end_step"]) <= covered:
                raise ValueError(f"segment {seg.get('file')} does not continue at step {covered}")
            covered = int(seg["end_step"])
            str(seg["file"]), int(seg["bytes"]), str(seg["sha256"])
        if covered != end or len(digests) != end - first or len(source_tokens) != end - first:
            raise ValueError(f"segments, digests and source_tokens do not all cover steps {first}..{end - 1}")
        if rows < 1 or width < 2 or not isinstance(manifest[KEY_FINGERPRINT], str):
            raise ValueError("bad geometry or fingerprint")
        dict(manifest[KEY_CHECKPOINTS])
    except (KeyError, TypeError, ValueError) as exc:
        raise MaterializedError(f"{path}: corrupt manifest ({type(exc).__name__}: {exc})") from None
    return manifest


def load_checkpoint(path: Path, recipe: Any, step: int) -> dict[str, Any]:
    """The Zephon state in ``path``: it must exist, parse, belong to ``recipe`` and sit at the boundary before
    ``step``; else one :class:`MaterializedError` naming the file."""
    from zephon_ray.lanes import KEY_NEXT_STEP, StepStateError, check_step_state

    try:
        state = json.loads(path.read_text())
        check_step_state(state, recipe)
    except FileNotFoundError:
        raise MaterializedError(f"{path}: checkpoint missing (the manifest records it for step {step})") from None
    except (ValueError, StepStateError, KeyError, TypeError, AttributeError) as exc:
        raise MaterializedError(f"{path}: unusable checkpoint ({exc})") from None
    if int(state[KEY_NEXT_STEP]) != step:
        raise MaterializedError(f"{path}: checkpoint is for step {state[KEY_NEXT_STEP]}, not {step}")
    return state


@dataclass(frozen=True)
class _Segment:
    file: Path
    first: int
    end: int
    bytes: int
    sha256: str


class MaterializedSource:
    """Random access to a materialised run: ``batch(s)``, ``slice(s, rank, world)``, ``digest(s)``.

    ``recipe`` (optional) must have the manifest's fingerprint; pass it wherever a run's identity matters (the
    loader and the CLI do). ``cache_files`` bounds the open Parquet footers kept.
    """

    def __init__(self, directory: str | Path, *, recipe: Any = None, cache_files: int = 8) -> None:
        self.directory = Path(directory).resolve()
        manifest = read_manifest(self.directory)
        self.fingerprint: str = manifest[KEY_FINGERPRINT]
        if recipe is not None and recipe.fingerprint != self.fingerprint:
            raise MaterializedError(
                f"{self.directory / MANIFEST_NAME}: materialised from recipe fingerprint {self.fingerprint[:12]}, "
                f"not {recipe.describe()}"
            )
        geometry = manifest[KEY_GEOMETRY]
        self.rows = int(geometry["rows"])
        self.row_length = int(geometry["row_length"])
        self.lanes = int(geometry["lanes"])
        self.source_names: tuple[str, ...] = tuple(geometry["sources"])
        self.pad_token_id: int | None = geometry.get("pad_token_id")
        self.first_step = int(manifest[KEY_FIRST])
        self.end_step = int(manifest[KEY_END])
        self._digests: list[str] = list(manifest[KEY_DIGESTS])
        self._source_tokens: list[list[int]] = list(manifest[KEY_SOURCE_TOKENS])
        self.checkpoints: dict[int, dict[str, Any]] = {int(k): v for k, v in manifest[KEY_CHECKPOINTS].items()}
        self._segments = [
            _Segment(self.directory / s["file"], int(s["first_step"]), int(s["end_step"]), int(s["bytes"]),
                     str(s["sha256"]))
            for s in manifest[KEY_SEGMENTS]
        ]
        self._starts = [s.first for s in self._segments]
        for seg in self._segments:
            if not seg.file.is_file():
                raise MaterializedError(f"{seg.file}: segment missing (steps {seg.first}..{seg.end - 1})")
            size = seg.file.stat().st_size
            if size != seg.bytes:
                raise MaterializedError(
                    f"{seg.file}: {size} bytes, the manifest records {seg.bytes} (truncated or rewritten; steps "
                    f"{seg.first}..{seg.end - 1})"
                )
        self._files: OrderedDict[Path, Any] = OrderedDict()
        self._cache_files = max(1, int(cache_files))
        self._lanes_column = np.repeat(np.arange(self.lanes, dtype=np.int16), self.rows // self.lanes)
        self._lanes_column.setflags(write=False)

    @property
    def steps(self) -> range:
        return range(self.first_step, self.end_step)

    def _check_step(self, step: Any) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise MaterializedError(f"step must be an integer, got {step!r}")
        step = int(step)
        if not self.first_step <= step < self.end_step:
            raise MaterializedError(
                f"step {step} is not materialised in {self.directory} (steps {self.first_step}..{self.end_step - 1}; "
                f"extend it with `zephon-ray materialize RECIPE --steps {self.first_step}:{step + 1} --out DIR`)"
            )
        return step

    def checkpoint(self, step: int, recipe: Any) -> dict[str, Any]:
        """The Zephon state at the boundary before ``step`` (one is recorded at every segment boundary, including
        ``end_step``), checked against ``recipe``: where producers start to continue past this directory."""
        entry = self.checkpoints.get(step)
        if entry is None:
            raise MaterializedError(f"{self.directory / MANIFEST_NAME}: no checkpoint recorded for step {step} "
                                    f"(recorded: {sorted(self.checkpoints)[-4:]})")
        return load_checkpoint(self.directory / entry["file"], recipe, step)

    def digest(self, step: int) -> str:
        """The recorded digest of ``step`` (no read)."""
        step = self._check_step(step)
        return self._digests[step - self.first_step]

    def _file(self, seg: _Segment) -> Any:
        import pyarrow.parquet as pq

        handle = self._files.get(seg.file)
        if handle is None:
            try:
                handle = pq.ParquetFile(seg.file)
            except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for a damaged footer
                raise MaterializedError(f"{seg.file}: unreadable Parquet ({exc})") from None
            if handle.metadata.num_row_groups != seg.end - seg.first:
                raise MaterializedError(f"{seg.file}: {handle.metadata.num_row_groups} row groups, expected "
                                        f"{seg.end - seg.first} (one per step)")
            self._files[seg.file] = handle
            while len(self._files) > self._cache_files:
                self._files.popitem(last=False)
        else:
            self._files.move_to_end(seg.file)
        return handle

    def batch(self, step: int) -> GlobalBatch:
        step = self._check_step(step)
        seg = self._segments[bisect.bisect_right(self._starts, step) - 1]
        try:
            table = self._file(seg).read_row_group(step - seg.first, columns=["step", "tokens", "positions"])
        except MaterializedError:
            raise
        except Exception as exc:
            raise MaterializedError(f"{seg.file}: cannot read step {step} ({exc})") from None
        tokens = _matrix(table.column("tokens"), self.row_length)
        positions = _matrix(table.column("positions"), self.row_length)
        steps = table.column("step").to_numpy()
        if tokens.shape[0] != self.rows or not (steps == step).all():
            raise MaterializedError(f"{seg.file}: row group for step {step} holds other rows (corrupt segment)")
        digest = compute_digest(tokens, positions)
        if digest != self._digests[step - self.first_step]:
            raise MaterializedError(f"{seg.file}: step {step} does not match its recorded digest (corrupt segment)")
        for array in (tokens, positions):
            array.setflags(write=False)
        counts = self._source_tokens[step - self.first_step]
        return GlobalBatch(
            step=step, tokens=tokens, positions=positions, lanes=self._lanes_column,
            source_tokens={name: int(n) for name, n in zip(self.source_names, counts)},
            fingerprint=self.fingerprint, pad_token_id=self.pad_token_id, _digest=digest,
        )

    def slice(self, step: int, rank: int, world: int) -> RankSlice:
        return self.batch(step).slice(rank, world)

    def verify(self) -> None:
        """Hash every segment against the manifest (reads every byte)."""
        from zephon_ray.jobs.pretokenize import sha256_file

        for seg in self._segments:
            if sha256_file(seg.file) != seg.sha256:
                raise MaterializedError(f"{seg.file}: sha256 differs from the manifest (corrupt segment)")

    def files(self) -> list[str]:
        return [str(s.file) for s in self._segments]

    def to_dataset(self) -> Any:
        """A lazy ``ray.data.Dataset`` over the segments (``ray.data.read_parquet``), one row per batch row."""
        import ray.data

        return ray.data.read_parquet(self.files(), columns=list(COLUMNS))

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> "MaterializedSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def batch_table(batch: GlobalBatch) -> Any:
    """One global batch as a pyarrow table, one row per batch row: ``step``, ``lane``, ``row``, ``tokens``,
    ``positions`` (fixed_size_list<int32>) and ``digest`` (the step's). Used by ``DataService.to_dataset``."""
    import pyarrow as pa

    rows, width = batch.tokens.shape
    return pa.table({
        "step": pa.array(np.full(rows, batch.step, dtype=np.int64)),
        "lane": pa.array(np.asarray(batch.lanes, dtype=np.int32)),
        "row": pa.array(np.arange(rows, dtype=np.int32)),
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(batch.tokens, np.int32).reshape(-1)), width),
        "positions": pa.FixedSizeListArray.from_arrays(
            pa.array(np.asarray(batch.positions, np.int32).reshape(-1)), width),
        "digest": pa.array([batch.digest] * rows),
    })


def _matrix(column: Any, width: int) -> np.ndarray:
    """A fixed_size_list<int32> column as a [rows, width] int32 array (one copy at most)."""
    import pyarrow as pa

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    values = [np.asarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype=np.int32) for chunk in chunks]
    flat = values[0] if len(values) == 1 else np.concatenate(values)
    return flat.reshape(-1, width)
