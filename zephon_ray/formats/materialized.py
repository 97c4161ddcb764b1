"""The third delivery path's durable format: a materialised directory, its manifest, segment writer and reader.

A directory written by ``zephon-ray materialize`` (:mod:`zephon_ray.jobs.materialize`), local or an object-store
prefix (:mod:`zephon_ray.storage`)::

    DIR/manifest.json                         the commit point, replaced atomically, written last
    DIR/segments/steps-<a>-<b>.parquet        steps a..b-1, ONE ROW GROUP PER STEP, rows in canonical order
    DIR/checkpoints/step-<b>.json             Zephon state at the boundary before step b (resume / extend)

Parquet columns (:func:`segment_schema`): ``step`` (int64), ``lane`` (int32), ``row`` (int32, index in the global
batch), ``tokens`` and ``positions`` (fixed_size_list<int32>[seq_len+1]). ONE row schema for every Ray Data view
(:func:`dataset_schema`: the segment columns plus ``digest``, the step's): ``MaterializedSource.to_dataset`` and
the service's ``to_dataset`` (:func:`batch_table`) give the same schema. The manifest
holds the recipe fingerprint and mixture schedule, the geometry, every segment's size and sha256, and the digest and
per-source token counts of every step.

Commit order (:class:`SegmentWriter`): the segment is written whole (a local rename, or one upload), then the
checkpoint, then the manifest. On an object store each is one object, visible whole; the manifest names only
objects that were complete before it was written, so a reader (who starts from the manifest) never sees a
half-written step, and a run killed at any point leaves the last committed manifest intact, on a local disk and in a bucket alike.

Guarantee: ``MaterializedSource(DIR).batch(s)`` has the same rows, order and digest as
``GlobalBatchSource(recipe).batch(s)`` and the data service, and every read is
checked against the manifest's digest, so a corrupted row group is an error, never a wrong batch. A step is one
row-group read: O(1) in the number of steps (benchmarks/bench_materialize.py measures p50/p99; on S3, ranged
reads: benchmarks/bench_s3.py).

Limits: only steps in ``[first_step, end_step)`` exist; others raise :class:`MaterializedError`. Opening checks
that every segment exists with its recorded size (one listing; a truncated or missing file is named); it does not
hash the segments (:meth:`MaterializedSource.verify` does, reading every byte). Segments written before the lane
column became int32 hold int16; :meth:`MaterializedSource.to_dataset` casts them to the one schema.
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from zephon_ray import storage
from zephon_ray.batch import GlobalBatch, RankSlice, compute_digest, slice_bounds
from zephon_ray.checks import MAX_INT, check_int

MANIFEST_FORMAT = "zephon-ray/materialized/v1"
MANIFEST_NAME = "manifest.json"
SEGMENTS_DIR = "segments"
CHECKPOINTS_DIR = "checkpoints"
COLUMNS = ("step", "lane", "row", "tokens", "positions")
"""Columns of a segment file."""
DATASET_COLUMNS = COLUMNS + ("digest",)
"""Columns of every Ray Data view of global batches (a materialised directory's and the service's)."""
PARQUET_COMPRESSION = "zstd"
TMP_PREFIX = ".tmp-"
WORK_PREFIX = ".work-"

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
KEY_PHASES = "phases"
"""The mixture schedule the directory was made under (``[{"name", "start_step", "weights"}]``; optional: a directory
written before it is the recipe file's): so a run-time phase travels with the directory as with a loader state."""
REQUIRED_KEYS = (
    KEY_FINGERPRINT,
    KEY_GEOMETRY,
    KEY_FIRST,
    KEY_END,
    KEY_SEGMENT_STEPS,
    KEY_SEGMENTS,
    KEY_DIGESTS,
    KEY_SOURCE_TOKENS,
    KEY_CHECKPOINTS,
)
GEOMETRY_KEYS = ("lanes", "rows", "row_length", "sources")
SEGMENT_KEYS = ("file", "first_step", "end_step", "bytes", "sha256")


class MaterializedError(ValueError):
    """A materialised directory that cannot be used as asked; the message names the file, key or step."""


def segment_name(first: int, end: int) -> str:
    return f"{SEGMENTS_DIR}/steps-{first:012d}-{end:012d}.parquet"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINTS_DIR}/step-{step:012d}.json"


# ---------------------------------------------------------------------- the one row schema
def segment_schema(width: int) -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("step", pa.int64()),
            ("lane", pa.int32()),
            ("row", pa.int32()),
            ("tokens", pa.list_(pa.int32(), width)),
            ("positions", pa.list_(pa.int32(), width)),
        ]
    )


def dataset_schema(width: int) -> Any:
    """The segment columns plus ``digest`` (string): every ``to_dataset`` returns exactly this."""
    import pyarrow as pa

    return segment_schema(width).append(pa.field("digest", pa.string()))


def step_table(
    step: int, tokens: np.ndarray, positions: np.ndarray, lanes: np.ndarray, digest: str | None = None
) -> Any:
    """One global batch as a pyarrow table, one row per batch row, in the segment schema (plus ``digest`` when
    given: the dataset schema)."""
    import pyarrow as pa

    rows, width = tokens.shape
    columns = {
        "step": pa.array(np.full(rows, step, dtype=np.int64)),
        "lane": pa.array(np.asarray(lanes, dtype=np.int32)),
        "row": pa.array(np.arange(rows, dtype=np.int32)),
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(tokens, np.int32).reshape(-1)), width),
        "positions": pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(positions, np.int32).reshape(-1)), width),
    }
    if digest is None:
        return pa.table(columns, schema=segment_schema(width))
    columns["digest"] = pa.array([digest] * rows, type=pa.string())
    return pa.table(columns, schema=dataset_schema(width))


def batch_table(batch: GlobalBatch) -> Any:
    """One global batch in the dataset schema (:func:`dataset_schema`). Used by ``DataService.to_dataset``."""
    return step_table(batch.step, batch.tokens, batch.positions, batch.lanes, batch.digest)


# ---------------------------------------------------------------------- manifest
def _missing(path: storage.Location, key: str) -> MaterializedError:
    return MaterializedError(
        f"{path}: manifest key '{key}' missing (a damaged or foreign manifest; re-run "
        "`zephon-ray materialize` into a new --out)"
    )


def read_manifest(directory: str | storage.Location) -> dict[str, Any]:
    """The parsed, structurally checked manifest, or one clear :class:`MaterializedError` naming the file and,
    for a missing or malformed key, the key."""
    directory = storage.location(directory)
    path = directory.join(MANIFEST_NAME)
    try:
        if not storage.exists(path):
            if not storage.is_dir(directory):
                raise MaterializedError(f"materialised directory not found: {directory}")
            raise MaterializedError(
                f"{path}: manifest missing (not a materialised directory, or no step committed yet)"
            )
    except storage.StorageError as exc:  # a missing bucket, refused credentials, an unreachable endpoint
        raise MaterializedError(str(exc)) from None
    manifest: dict[str, Any] = storage.read_json(
        path, expect_format=MANIFEST_FORMAT, error=MaterializedError, what="manifest"
    )
    for key in REQUIRED_KEYS:
        if key not in manifest:
            raise _missing(path, key)
    geometry = manifest[KEY_GEOMETRY]
    if not isinstance(geometry, dict):
        raise MaterializedError(f"{path}: manifest key 'geometry' must be a table, got {type(geometry).__name__}")
    for key in GEOMETRY_KEYS:
        if key not in geometry:
            raise _missing(path, f"geometry.{key}")
    try:
        first, end = int(manifest[KEY_FIRST]), int(manifest[KEY_END])
        rows, width = int(geometry["rows"]), int(geometry["row_length"])
        digests, source_tokens = manifest[KEY_DIGESTS], manifest[KEY_SOURCE_TOKENS]
        covered = first
        for i, seg in enumerate(manifest[KEY_SEGMENTS]):
            for key in SEGMENT_KEYS:
                if key not in seg:
                    raise _missing(path, f"segments[{i}].{key}")
            if int(seg["first_step"]) != covered or int(seg["end_step"]) <= covered:
                raise ValueError(f"segment {seg.get('file')} does not continue at step {covered}")
            covered = int(seg["end_step"])
            str(seg["file"]), int(seg["bytes"]), str(seg["sha256"])
        if covered != end or len(digests) != end - first or len(source_tokens) != end - first:
            raise ValueError(f"segments, digests and source_tokens do not all cover steps {first}..{end - 1}")
        if rows < 1 or width < 2 or not isinstance(manifest[KEY_FINGERPRINT], str):
            raise ValueError("bad geometry or fingerprint")
        dict(manifest[KEY_CHECKPOINTS])
    except MaterializedError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise MaterializedError(f"{path}: corrupt manifest ({type(exc).__name__}: {exc})") from None
    return manifest


def recipe_of(manifest: dict[str, Any], recipe: Any) -> Any:
    """``recipe`` with the run-time phases ``manifest`` records beyond it (the directory's schedule); None when they
    contradict it."""
    phases = manifest.get(KEY_PHASES)
    if not isinstance(phases, list):
        return recipe
    mine = [p.canonical(recipe.source_names) for p in recipe.phases]
    try:
        return recipe.with_run_phases([p for p in phases if p not in mine], what="the directory's run")
    except ValueError:
        return None


def write_manifest(directory: storage.Location, manifest: dict[str, Any]) -> None:
    """The commit point: written after the segments and checkpoints it names."""
    storage.write_json(directory.join(MANIFEST_NAME), manifest)


def load_checkpoint(path: str | storage.Location, recipe: Any, step: int) -> dict[str, Any]:
    """The Zephon state in ``path``: it must exist, parse, belong to ``recipe`` and sit at the boundary before
    ``step``; else one :class:`MaterializedError` naming the file."""
    from zephon_ray.lanes import KEY_NEXT_STEP, StepStateError, check_step_state

    path = storage.location(path)
    state: dict[str, Any] = storage.read_json(
        path, error=MaterializedError, what="checkpoint", missing_hint=f" (the manifest records it for step {step})"
    )
    try:
        check_step_state(state, recipe)
    except (ValueError, StepStateError, KeyError, TypeError, AttributeError) as exc:
        raise MaterializedError(f"{path}: unusable checkpoint ({exc})") from None
    if int(state[KEY_NEXT_STEP]) != step:
        raise MaterializedError(f"{path}: checkpoint is for step {state[KEY_NEXT_STEP]}, not {step}")
    return state


def clean_leftovers(directory: storage.Location) -> None:
    """Remove what a killed run left behind: aggregation prefixes (``.work-*``) and local temp files (``.tmp-*``).
    Committed files are never touched."""
    for name in storage.listing(directory, recursive=True):
        top = name.split("/", 1)[0]
        if top.startswith(WORK_PREFIX):
            storage.delete_tree(directory.join(top))
        elif name.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
            storage.delete(directory.join(name))


# ---------------------------------------------------------------------- writer
class SegmentWriter:
    """Writes steps in order into a spooled segment file; at each boundary commits the segment, its checkpoint and
    the manifest (last)."""

    def __init__(
        self, directory: storage.Location, manifest: dict[str, Any], *, lanes: int, rows_per_lane: int, row_length: int
    ) -> None:
        self.directory = directory
        self.manifest = manifest
        self.schema = segment_schema(row_length)
        self.lanes = np.repeat(np.arange(lanes, dtype=np.int32), rows_per_lane)
        self.rows = lanes * rows_per_lane
        self._writer: Any = None
        self._tmp: str | None = None
        self._segment_first = 0
        self._digests: list[str] = []
        self._source_tokens: list[list[int]] = []

    def add(self, step: int, tokens: np.ndarray, positions: np.ndarray, source_tokens: np.ndarray, state: str) -> None:
        import pyarrow.parquet as pq

        if self._writer is None:
            self._segment_first = step
            self._tmp = storage.spool_path(self.directory.join(SEGMENTS_DIR, f"steps-{step:012d}"))
            self._writer = pq.ParquetWriter(self._tmp, self.schema, compression=PARQUET_COMPRESSION)
        self._writer.write_table(step_table(step, tokens, positions, self.lanes), row_group_size=self.rows)
        self._digests.append(compute_digest(tokens, positions))
        self._source_tokens.append([int(x) for x in source_tokens])
        if state:
            self._commit(step + 1, state)

    def _commit(self, end: int, state: str) -> None:
        self._writer.close()
        self._writer = None
        assert self._tmp is not None  # the segment this commit closes was spooled there
        name = segment_name(self._segment_first, end)
        size, digest = os.path.getsize(self._tmp), storage.sha256_file(self._tmp)
        storage.upload(self._tmp, self.directory.join(name))  # 1. the data object, whole
        self._tmp = None
        ckpt_name = checkpoint_name(end)
        storage.write_atomic(self.directory.join(ckpt_name), (state + "\n").encode())  # 2. the resume point
        m = self.manifest
        m[KEY_SEGMENTS].append(
            {"file": name, "first_step": self._segment_first, "end_step": end, "bytes": size, "sha256": digest}
        )
        m[KEY_DIGESTS].extend(self._digests)
        m[KEY_SOURCE_TOKENS].extend(self._source_tokens)
        # No hash of the checkpoint: its bytes record Zephon's read-ahead, which is not a function of the step.
        m[KEY_CHECKPOINTS][str(end)] = {"file": ckpt_name}
        m[KEY_END] = end
        self._digests, self._source_tokens = [], []
        write_manifest(self.directory, m)  # 3. the commit point

    def abort(self) -> None:
        """Drop an unfinished segment (the run failed or was interrupted): committed files stay as they are."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass
            self._tmp = None


# ---------------------------------------------------------------------- reader
@dataclass(frozen=True)
class _Segment:
    file: storage.Location
    first: int
    end: int
    bytes: int
    sha256: str


class MaterializedSource:
    """Random access to a materialised run: ``batch(s)``, ``slice(s, rank, world)``, ``digest(s)``.

    ``directory`` is a local path or an object-store URI. ``recipe`` (optional) must have the manifest's
    fingerprint, or be the recipe it was made from less phases decided at run time, which the manifest records
    (:attr:`recipe` is then the directory's schedule); pass it wherever a run's identity matters (the loader and the
    CLI do). ``cache_files`` bounds the open Parquet footers kept.
    """

    def __init__(
        self, directory: str | os.PathLike[str] | storage.Location, *, recipe: Any = None, cache_files: int = 8
    ) -> None:
        self.location = storage.location(directory)
        self.directory = self.location.uri
        self._provenance: Any = None  # a ProvenanceSource, built at the first provenance() call
        manifest = read_manifest(self.location)
        self._manifest_path = self.location.join(MANIFEST_NAME)
        self.fingerprint: str = manifest[KEY_FINGERPRINT]
        self.recipe = recipe
        if recipe is not None and recipe.fingerprint != self.fingerprint:
            self.recipe = recipe_of(manifest, recipe)
            if self.recipe is None or self.recipe.fingerprint != self.fingerprint:
                made = manifest.get(KEY_PHASES)
                missing = (
                    ""
                    if not isinstance(made, list)
                    else ", ".join(
                        f"'{p.name}' from step {p.start_step}"
                        for p in recipe.phases
                        if p.canonical(recipe.source_names) not in made
                    )
                )
                raise MaterializedError(
                    f"{self._manifest_path}: materialised from recipe fingerprint {self.fingerprint[:12]}, not "
                    f"{recipe.describe()}"
                    + (
                        f" (the run's schedule has phase(s) {missing}, which it was not made "
                        "with: materialise these steps with the run's schedule, `zephon-ray "
                        "materialize --schedule-from STATE`)"
                        if missing
                        else ""
                    )
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
            _Segment(
                self.location.join(s["file"]),
                int(s["first_step"]),
                int(s["end_step"]),
                int(s["bytes"]),
                str(s["sha256"]),
            )
            for s in manifest[KEY_SEGMENTS]
        ]
        self._starts = [s.first for s in self._segments]
        try:
            present = storage.listing(self.location.join(SEGMENTS_DIR)) if self._segments else {}
        except storage.StorageError as exc:
            raise MaterializedError(str(exc)) from None
        for seg in self._segments:
            size = present.get(seg.file.name)
            if size is None:
                raise MaterializedError(f"{seg.file}: segment missing (steps {seg.first}..{seg.end - 1})")
            if size != seg.bytes:
                raise MaterializedError(
                    f"{seg.file}: {size} bytes, the manifest records {seg.bytes} (truncated or rewritten; steps "
                    f"{seg.first}..{seg.end - 1})"
                )
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._cache_files = max(1, int(cache_files))
        self._lanes_column = np.repeat(np.arange(self.lanes, dtype=np.int32), self.rows // self.lanes)
        self._lanes_column.setflags(write=False)

    @property
    def steps(self) -> range:
        return range(self.first_step, self.end_step)

    def _check_step(self, step: Any) -> int:
        # Only the type here: a step out of range is told which steps are materialised, below.
        step = check_int("step", step, low=-MAX_INT, numpy_ok=True, error=MaterializedError)
        if not self.first_step <= step < self.end_step:
            raise MaterializedError(
                f"step {step} is not materialised in {self.directory} (steps {self.first_step}..{self.end_step - 1}; "
                f"extend it with `zephon-ray materialize RECIPE --steps {self.first_step}:{step + 1} --out DIR`)"
            )
        return cast(int, step)

    def checkpoint(self, step: int, recipe: Any) -> dict[str, Any]:
        """The Zephon state at the boundary before ``step`` (one is recorded at every segment boundary, including
        ``end_step``), checked against ``recipe``: where producers start to continue past this directory."""
        entry = self.checkpoints.get(step)
        if entry is None:
            raise MaterializedError(
                f"{self._manifest_path}: no checkpoint recorded for step {step} "
                f"(recorded: {sorted(self.checkpoints)[-4:]})"
            )
        return load_checkpoint(self.location.join(entry["file"]), recipe, step)

    def digest(self, step: int) -> str:
        """The recorded digest of ``step`` (no read)."""
        step = self._check_step(step)
        return self._digests[step - self.first_step]

    def _file(self, seg: _Segment) -> Any:
        import pyarrow.parquet as pq

        handle = self._files.get(seg.file.uri)
        if handle is None:
            try:
                handle = pq.ParquetFile(storage.open_input_file(seg.file))
            except storage.StorageError as exc:
                raise MaterializedError(f"segment unreadable: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a damaged footer
                raise MaterializedError(f"{seg.file}: unreadable Parquet ({storage.describe_error(exc)})") from None
            if handle.metadata.num_row_groups != seg.end - seg.first:
                raise MaterializedError(
                    f"{seg.file}: {handle.metadata.num_row_groups} row groups, expected "
                    f"{seg.end - seg.first} (one per step)"
                )
            self._files[seg.file.uri] = handle
            while len(self._files) > self._cache_files:
                self._files.popitem(last=False)
        else:
            self._files.move_to_end(seg.file.uri)
        return handle

    def batch(self, step: int) -> GlobalBatch:
        step = self._check_step(step)
        seg = self._segments[bisect.bisect_right(self._starts, step) - 1]

        def read() -> Any:
            return self._file(seg).read_row_group(step - seg.first, columns=["step", "tokens", "positions"])

        def forget(_exc: BaseException) -> None:
            self._files.pop(seg.file.uri, None)  # a failed read (an unreachable store) must not poison the cache

        try:
            # transient faults (an outage, 503 SlowDown, a response cut short) retried for the storage budget
            table = storage.retry(read, str(seg.file), on_retry=forget)
        except MaterializedError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever pyarrow raised becomes one line naming the file
            forget(exc)
            raise MaterializedError(f"{seg.file}: cannot read step {step} ({storage.describe_error(exc)})") from None
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
            step=step,
            tokens=tokens,
            positions=positions,
            lanes=self._lanes_column,
            source_tokens={name: int(n) for name, n in zip(self.source_names, counts)},
            fingerprint=self.fingerprint,
            pad_token_id=self.pad_token_id,
            _digest=digest,
        )

    def slice(self, step: int, rank: int, world: int) -> RankSlice:
        return self.batch(step).slice(rank, world)

    def provenance(
        self,
        step: int,
        rank: int | None = None,
        world: int | None = None,
        *,
        rows: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> Any:
        """Which document pieces every row of step ``step`` holds (all rows, or rank ``rank`` of ``world``'s): a
        :class:`zephon_ray.provenance.StepProvenance`, recomputed from the recipe (nothing of it is stored here) by a
        provenance-mode pipeline restored from this directory's nearest checkpoint at or before ``step``, and
        checked against the rows stored for that step (``rows``: those already read). Needs the ``recipe`` this
        source was opened with."""
        from zephon_ray.provenance import ProvenanceSource, slice_provenance

        if self.recipe is None:
            raise MaterializedError(
                f"{self.directory}: provenance needs the recipe: open it with MaterializedSource(DIR, recipe=RECIPE)"
            )
        step = self._check_step(step)
        first = 0 if rank is None else slice_bounds(self.rows, rank, cast(int, world))[0]
        if rows is None:
            served = self.batch(step) if rank is None else self.slice(step, rank, cast(int, world))
            rows = (served.tokens, served.positions)
        if self._provenance is None:
            self._provenance = ProvenanceSource(self.recipe, checkpoints=self._nearest_checkpoint)
        return slice_provenance(self._provenance.provenance(step, rows=rows, first_row=first), rank, world)

    def _nearest_checkpoint(self, step: int) -> tuple[int, dict[str, Any]] | None:
        kept = [s for s in self.checkpoints if s <= step]
        return (max(kept), self.checkpoint(max(kept), self.recipe)) if kept else None

    def verify(self) -> None:
        """Hash every segment against the manifest (reads every byte)."""
        for seg in self._segments:
            try:
                digest = storage.sha256(seg.file)
            except (FileNotFoundError, storage.StorageError) as exc:
                raise MaterializedError(f"segment unreadable: {exc}") from None
            if digest != seg.sha256:
                raise MaterializedError(f"{seg.file}: sha256 differs from the manifest (corrupt segment)")

    def files(self) -> list[str]:
        """The segment files (local paths or URIs), in step order."""
        return [s.file.uri for s in self._segments]

    def to_dataset(self) -> Any:
        """A lazy ``ray.data.Dataset`` over the segments, one row per batch row, in :func:`dataset_schema` (the
        digest comes from the manifest). Reads go through the same pyarrow filesystem as everything else."""
        import ray.data

        paths = [s.file.path for s in self._segments]
        fs = storage.filesystem(self.location)
        digests, first, width = list(self._digests), self.first_step, self.row_length
        dataset = ray.data.read_parquet(paths, filesystem=fs, columns=list(COLUMNS))
        return dataset.map_batches(_WithDigest(digests, first, width), batch_format="pyarrow", zero_copy_batch=True)

    def close(self) -> None:
        if self._provenance is not None:
            self._provenance.close()
            self._provenance = None
        self._files.clear()

    def __enter__(self) -> MaterializedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _WithDigest:
    """Ray Data map: segment rows -> the dataset schema (``lane`` cast to int32, ``digest`` from the manifest)."""

    def __init__(self, digests: list[str], first: int, width: int) -> None:
        self.digests, self.first, self.width = digests, first, width

    def __call__(self, table: Any) -> Any:
        import pyarrow as pa

        steps = table.column("step").to_numpy()
        digest = pa.array([self.digests[int(s) - self.first] for s in steps], type=pa.string())
        table = table.select(list(COLUMNS)).cast(segment_schema(self.width))
        return table.append_column("digest", digest)


def _matrix(column: Any, width: int) -> np.ndarray:
    """A fixed_size_list<int32> column as a [rows, width] int32 array (one copy at most)."""
    import pyarrow as pa

    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    values = [np.asarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype=np.int32) for chunk in chunks]
    flat = values[0] if len(values) == 1 else np.concatenate(values)
    return flat.reshape(-1, width)
