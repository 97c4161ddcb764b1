"""The ledger: what every rank handed its trainer, recorded per loader-state save (or per torchft flush) and merged
into a bounded number of files. Owner of the format (read, write, check, lineage, compaction).

A **record** is one step one rank handed out: ``[step, world, rank, digest, attempt, trained]``:

* ``digest``: :func:`slice_digest` of the rank's real rows (no padding rows), 32 hex digits;
* ``attempt``: 0, or the attempt number when a step is served again (torchft);
* ``trained``: how many times the trainer confirmed it (``Loader.commit``); a loop that never confirms gets 1 for
  every step it was handed, so the ledger then proves what was handed out, not what was trained.

A **segment** is the records of steps ``[first_step, next_step)`` at data-parallel degree ``world``; a **part** is
one rank's records of one segment (format ``zephon-ray/ledger-segment``, version 2; every key always present)::

    {
      "format": "zephon-ray/ledger-segment", "version": 2,
      "run_id": "my-run", "fingerprint": "<recipe sha256>",
      "segment": "<id>", "parent": "<id>" | "",     # the segment of the state this one continues ("" at step 0)
      "first_step": 4, "next_step": 8, "world": 2, "rank": 0,
      "resumed": true,                               # the segment starts at a load_state_dict
      "schedule": {"data_next": 8,                   # the run's mixture schedule that made data steps [0, data_next)
                   "phases": [[0, "sources", "<chain sha256>"], [6, "late", "<chain sha256>"], ...]},
      "records": [[4, 2, 0, "<digest>", 0, 1], ...]
    }

``schedule`` is the run's schedule as it stood when the segment was sealed (:func:`schedule_record`): the data step
its state stands at (``Recipe.data_next``: the training steps unless the run skips data) and, for the sources'
weights and each phase that starts before it, ``[start_step, name, entry of Recipe.schedule_fingerprints]`` (the
chain entry covers the phase's weights and every entry before it). Run-time phases (``add_phase``) are in it as
recipe phases are, so the audit can check that each segment's schedule continues its parent's on every step the
parent recorded (:mod:`zephon_ray.jobs.audit`). Only phases that start before ``data_next`` enter it, and a phase
may only be added beyond every step produced, so every rank records the same schedule. Version 1 (no
``schedule``) is still read: its segments' schedules cannot be checked.

A segment's id is a pure function of ``(run_id, fingerprint, parent, first_step, next_step, world, resumed,
schedule)`` (:func:`segment_id`), so every rank computes the same one without talking to the others, and the loader state
(:mod:`zephon_ray.formats.loader_state`, key ``ledger``) carries it: following ``parent`` links from a checkpoint's
segment back to ``""`` gives the lineage of the weights. A run resumed from an older checkpoint starts a new branch
(its first segment is ``resumed`` from an older parent).

Where parts live, under ``<ledger_dir>`` (a local path or an object-store URI; every write goes through
:mod:`zephon_ray.storage`, whole objects only)::

    <segment>/rank-RRRRR-of-WWWWW.json   a loose part: each rank's, at each loader-state save (LedgerRecorder)
    batches/<name>.json                  a torchft reader's parts of one flush interval (FtLedger):
                                         {"format": "zephon-ray/ledger-batch", "version": 1, "parts": [part, ...]}
    spool/<host>-<pid>-<id>.jsonl        a torchft reader's parts since its last flush, one per line, appended as
                                         each step commits (a later line of the same step replaces an earlier one)
    packs/<pack>.json                    a pack's manifest, the commit point, written last:
                                         {"format": "zephon-ray/ledger-pack", "version": 2, "pack": "<pack>",
                                         "segments": {"object", "bytes", "rows"}, "parts": {"object", "bytes",
                                         "rows", "records"}, "replaces": ["<older pack>", ...]}
    packs/<pack>.segments.parquet        one row per segment: its header (``schedule``: the canonical JSON
                                         text, null for a version-1 segment; version 1 packs lack the column)
    packs/<pack>.parts.parquet           one row per part: segment row, rank, and its records as list columns
                                         (steps, worlds, ranks, attempts, trained: null when every record has the
                                         part's default: its segment's steps, W and rank, attempt 0, trained 1;
                                         digests: 16 bytes each, always)

**Compaction** (:func:`compact`, ``zephon-ray ledger compact DIR``) merges loose parts, batches and the smaller packs
into one new pack: data objects first, then the manifest naming the packs it replaces, then the deletes of its
inputs. A reader sees a pack only through its manifest, ignores the packs a live manifest replaces, and prefers a
spool's, batch's or loose part over a pack's copy of the same ``(segment, rank)`` (they are equal unless the part
was rewritten later), so a merge killed at any point shows either the old files or the merged ones, never a part
twice; a re-run deletes what the killed one left (replaced packs, data without a manifest), packs the inputs it did
not get to delete again together with the pack that holds them, and finishes. A pack merges the packs no larger than what it adds (so each record is rewritten
O(log records) times and a ledger holds O(log records) packs), and every pack that holds a segment it adds (so no
two live packs hold the same part).

Limits: two branches that resume from the same state at the same W and save at the same steps get one id (their
records are the same rows in the same order, so nothing is lost but the count of branches). A loose part is
rewritten whole at each save of the same segment; one rewritten between a compaction's read and its delete keeps
its packed version. Two compactions of one directory at once are not supported, and an audit that lists a pack a
running compaction then deletes fails with one line naming it (run it again). Nothing here is pickled; every JSON
document is bounded (``MAX_RECORDS``).
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import json
import os
import re
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from zephon_ray import storage
from zephon_ray.batch import DIGEST_HEX, SLICE_DIGEST_HEADER, slice_digest  # noqa: F401 - part of the format
from zephon_ray.checks import check_int

FORMAT = "zephon-ray/ledger-segment"
VERSION = 2
"""Version 2 added ``schedule``; version 1 parts are still read (and compacted), their schedules unchecked."""
READABLE_VERSIONS = (1, 2)
"""A slice digest is sha256 truncated to 128 bits: collision-safe for any run, and 16 bytes fewer per record."""
BATCH_FORMAT = "zephon-ray/ledger-batch"
BATCH_VERSION = 1
PACK_FORMAT = "zephon-ray/ledger-pack"
PACK_VERSION = 2
"""Version 2 added the segments' ``schedule`` column; a reader of version 1 would refuse its ids as edited, so the
version says why instead. Version 1 packs are still read."""
READABLE_PACK_VERSIONS = (1, 2)
MAX_RECORDS = 1 << 20
"""Records one part may hold (about 70 MB of JSON); a save at least every million steps stays under it."""
ROW_GROUP_RECORDS = 1 << 20
"""Records per Parquet row group of a pack: what a reader holds at once (about 100 MB of columns at most)."""
SPOOL, BATCHES, PACKS = "spool", "batches", "packs"

PART_KEYS_V1 = (
    "format",
    "version",
    "run_id",
    "fingerprint",
    "segment",
    "parent",
    "first_step",
    "next_step",
    "world",
    "rank",
    "resumed",
    "records",
)
PART_KEYS = PART_KEYS_V1[:-1] + ("schedule", "records")
MAX_SCHEDULE_PHASES = 4096
"""Phases one segment's schedule may hold (as many as a loader state may record, plus the sources' weights)."""
_PART_NAME = re.compile(r"^rank-(\d{5})-of-(\d{5})\.json$")
_SEGMENT_ID = re.compile(r"^[0-9a-f]{24}$")
_DIGEST = re.compile(r"^[0-9a-f]{32}$")
_CHAIN = re.compile(r"^[0-9a-f]{64}$")
_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:40] or "host"


class LedgerError(ValueError):
    """A ledger document that cannot be read or trusted; the message names the file and the key."""


@dataclass(frozen=True)
class Record:
    step: int
    world: int
    rank: int
    digest: str
    attempt: int = 0
    trained: int = 1

    def to_json(self) -> list:
        return [self.step, self.world, self.rank, self.digest, self.attempt, self.trained]


def segment_id(
    *,
    run_id: str,
    fingerprint: str,
    parent: str,
    first_step: int,
    next_step: int,
    world: int,
    resumed: bool,
    schedule: str | dict | None = None,
) -> str:
    """The id every rank computes alike for the same segment (see the module docstring). ``schedule``: the
    segment's :func:`schedule_record` (or its :func:`schedule_text`); None for a version-1 segment, whose id
    hashes the header without it (so ids written before version 2 still verify)."""
    fields = [run_id, fingerprint, parent, first_step, next_step, world, bool(resumed)]
    if schedule is None:
        key = [FORMAT, 1, *fields]
    else:
        key = [FORMAT, VERSION, *fields, schedule if isinstance(schedule, str) else schedule_text(schedule)]
    return hashlib.sha256(json.dumps(key, separators=(",", ":")).encode()).hexdigest()[:24]


def schedule_record(recipe: Any, next_step: int) -> dict[str, Any]:
    """What a segment ending at training step ``next_step`` records of the run's schedule ``recipe`` (the loader's
    run recipe: the file's phases plus the run-time ones): see the module docstring."""
    data_next = recipe.data_next(next_step)
    return {"data_next": int(data_next), "phases": recipe.schedule_history(data_next)}


def schedule_text(schedule: dict[str, Any]) -> str:
    """The canonical JSON text of a segment's schedule: what its id hashes and what a pack stores."""
    return json.dumps(schedule, sort_keys=True, separators=(",", ":"))


def parse_schedule(text: str) -> tuple[int, list[tuple[int, str, str]]]:
    """``(data_next, [(start_step, name, chain entry), ...])`` of a (checked) segment's schedule text."""
    value = json.loads(text)
    return value["data_next"], [(int(p[0]), str(p[1]), str(p[2])) for p in value["phases"]]


def _check_schedule(value: Any, where: str) -> str:
    """A part's ``schedule`` as its canonical text; one LedgerError naming the key when it is not one."""
    ok = isinstance(value, dict) and set(value) == {"data_next", "phases"}
    phases = value.get("phases") if ok else None
    ok = (
        ok
        and isinstance(value["data_next"], int)
        and not isinstance(value["data_next"], bool)
        and value["data_next"] >= 0
        and isinstance(phases, list)
        and 0 < len(phases) <= MAX_SCHEDULE_PHASES
    )
    if ok:
        starts = []
        for entry in cast("list[Any]", phases):  # ok: a list
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and isinstance(entry[0], int)
                and not isinstance(entry[0], bool)
                and isinstance(entry[1], str)
                and isinstance(entry[2], str)
                and _CHAIN.match(entry[2])
            ):
                ok = False
                break
            starts.append(entry[0])
        # step 0 is the sources' weights; later phases start in order, before the data step the state stands at
        ok = (
            ok
            and starts[0] == 0
            and all(a < b for a, b in zip(starts, starts[1:]))
            and (len(starts) == 1 or starts[-1] < value["data_next"])
        )
    if not ok:
        raise LedgerError(
            f'{where}: ledger key \'schedule\' must be {{"data_next": step, "phases": [[start_step, '
            f"name, chain sha256], ...]}} (1 to {MAX_SCHEDULE_PHASES} phases, the first at step 0, "
            f"in order, before data_next), got {str(value)[:120]}"
        )
    return schedule_text(value)


def part_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.json"


def make_part(
    *,
    run_id: str,
    fingerprint: str,
    segment: str,
    parent: str,
    first_step: int,
    next_step: int,
    world: int,
    rank: int,
    resumed: bool,
    records: list[Record],
    schedule: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One rank's part. ``schedule`` (:func:`schedule_record`): a version-2 part; None writes a version-1 part
    (no schedule), which only tests and benchmarks that model an old ledger do: every writer here passes one."""
    part = {
        "format": FORMAT,
        "version": 1 if schedule is None else VERSION,
        "run_id": run_id,
        "fingerprint": fingerprint,
        "segment": segment,
        "parent": parent,
        "first_step": int(first_step),
        "next_step": int(next_step),
        "world": int(world),
        "rank": int(rank),
        "resumed": bool(resumed),
    }
    if schedule is not None:
        part["schedule"] = schedule
    part["records"] = [r.to_json() for r in records]
    return part


def write_part(ledger_dir: str | storage.Location, part: dict[str, Any]) -> storage.Location:
    """Write one rank's part atomically as a loose part (a local path or an object-store URI); returns where."""
    where = storage.location(ledger_dir).join(part["segment"], part_name(part["rank"], part["world"]))
    check_part(part, where=where.uri)
    storage.write_atomic(where, storage.json_bytes(part, compact=True))
    return where


def _int(doc: dict, key: str, where: str, low: int = 0) -> int:
    return check_int(f"{where}: ledger key '{key}'", doc[key], low=low, error=LedgerError)


def check_part(doc: Any, *, where: str) -> dict[str, Any]:
    """Validate one part; returns it. Raises one :class:`LedgerError` line naming the file and the key."""
    if not isinstance(doc, dict):
        raise LedgerError(f"{where}: a ledger segment must be a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise LedgerError(f"{where}: not a ledger segment (key 'format' is {doc.get('format')!r}, expected {FORMAT!r})")
    version = doc.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise LedgerError(
            f"{where}: ledger segment version {version!r} is not supported (expected "
            f"{' or '.join(map(str, READABLE_VERSIONS))})"
        )
    keys = PART_KEYS if version == VERSION else PART_KEYS_V1
    missing = [k for k in keys if k not in doc]
    if missing:
        raise LedgerError(f"{where}: ledger segment lacks key '{missing[0]}'")
    extra = sorted(str(k) for k in doc if k not in keys)
    if extra:
        raise LedgerError(f"{where}: ledger segment has unknown key '{extra[0]}'")
    for key in ("run_id", "fingerprint", "segment", "parent"):
        if not isinstance(doc[key], str):
            raise LedgerError(f"{where}: ledger key '{key}' must be a string, got {doc[key]!r}")
    _check_header(_segment_of(doc, where), where)
    world, rank = doc["world"], _int(doc, "rank", where)
    if rank >= world:
        raise LedgerError(
            f"{where}: ledger segment steps [{doc['first_step']}, {doc['next_step']}) or rank {rank} "
            f"of {world} is impossible"
        )
    records = doc["records"]
    if not isinstance(records, list) or len(records) > MAX_RECORDS:
        raise LedgerError(f"{where}: ledger key 'records' must be a list of at most {MAX_RECORDS} records")
    for i, rec in enumerate(records):
        if not (
            isinstance(rec, list)
            and len(rec) == 6
            and isinstance(rec[3], str)
            and _DIGEST.match(rec[3])
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in rec[:3] + rec[4:])
        ):
            raise LedgerError(
                f"{where}: ledger record {i} must be [step, world, rank, digest (32 hex digits), "
                f"attempt, trained], got {str(rec)[:80]}"
            )
    return doc


def _segment_of(doc: dict, where: str) -> Segment:
    """A part's segment header (its schedule as canonical text, None for a version-1 part)."""
    schedule = _check_schedule(doc["schedule"], where) if "schedule" in doc else None
    return Segment(
        doc["segment"],
        doc["parent"],
        doc["run_id"],
        doc["fingerprint"],
        doc["first_step"],
        doc["next_step"],
        doc["world"],
        doc["resumed"],
        schedule,
    )


def _check_header(seg: Segment, where: str) -> None:
    """A segment header's types, ranges and id (the id is a hash of the rest: an edited header shows)."""
    head = {"first_step": seg.first_step, "next_step": seg.next_step, "world": seg.world}
    first, end = _int(head, "first_step", where), _int(head, "next_step", where)
    world = _int(head, "world", where, 1)
    if not _SEGMENT_ID.match(seg.id) or (seg.parent and not _SEGMENT_ID.match(seg.parent)):
        raise LedgerError(
            f"{where}: ledger keys 'segment'/'parent' must be 24 hex digits, got {seg.id!r}/{seg.parent!r}"
        )
    if end < first:
        raise LedgerError(f"{where}: ledger segment steps [{first}, {end}) or rank 0 of {world} is impossible")
    if not isinstance(seg.resumed, bool):
        raise LedgerError(f"{where}: ledger key 'resumed' must be true or false, got {seg.resumed!r}")
    expected = segment_id(
        run_id=seg.run_id,
        fingerprint=seg.fingerprint,
        parent=seg.parent,
        first_step=first,
        next_step=end,
        world=world,
        resumed=seg.resumed,
        schedule=seg.schedule,
    )
    if seg.id != expected:
        raise LedgerError(
            f"{where}: ledger key 'segment' {seg.id!r} does not match its header (expected "
            f"{expected!r}): the file was edited or corrupted"
        )


def read_part(path: str | storage.Location) -> dict[str, Any]:
    loc = storage.location(path)
    doc = storage.read_json(loc, error=LedgerError, what="ledger segment")
    return check_part(doc, where=loc.uri)


@dataclass
class Segment:
    """A segment's header (as read back) and, from :func:`read_ledger`, each rank's records."""

    id: str
    parent: str
    run_id: str
    fingerprint: str
    first_step: int
    next_step: int
    world: int
    resumed: bool
    schedule: str | None = None
    """The schedule's canonical text (:func:`schedule_text`; :func:`parse_schedule` reads it); None for a segment of
    ledger format version 1, which records none."""
    parts: dict[int, list[Record]] = field(default_factory=dict)

    @property
    def steps(self) -> range:
        return range(self.first_step, self.next_step)

    @property
    def header(self) -> tuple:
        return (
            self.id,
            self.parent,
            self.run_id,
            self.fingerprint,
            self.first_step,
            self.next_step,
            self.world,
            self.resumed,
            self.schedule,
        )


# ---------------------------------------------------------------------------------------------- parts in columns
class SegmentTable:
    """Every segment header met while reading a ledger, each with a code (its index in :attr:`segments`)."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.segments: list[Segment] = []
        self._schedules: dict[str, str] = {}  # one copy of each schedule text: a torchft run has a segment per step

    def add(self, seg: Segment, where: str) -> int:
        code = self.codes.get(seg.id)
        if code is None:
            code = self.codes[seg.id] = len(self.segments)
            kept = Segment(*seg.header)
            if kept.schedule is not None:
                kept.schedule = self._schedules.setdefault(kept.schedule, kept.schedule)
            self.segments.append(kept)
        elif self.segments[code].header != seg.header:
            raise LedgerError(f"{where}: the part's header differs from the other parts of segment {seg.id!r}")
        return code


RECORD_COLUMNS = ("steps", "worlds", "ranks", "attempts", "trained")


@dataclass
class Parts:
    """Parts in columns: part i is segment ``code[i]`` (a :class:`SegmentTable` code), rank ``rank[i]``; its records
    are entries ``[offsets[i], offsets[i+1])`` of the flat record columns (``digests``: 32 hex digits as bytes, only
    when asked for), except a **dense** part (``dense[i]`` records, none materialised): one record per step of its
    segment, each naming the part's W and rank, attempt 0, trained once, as a pack stores it (read without digests
    only). ``where``: the file they came from."""

    code: np.ndarray
    rank: np.ndarray
    offsets: np.ndarray
    steps: np.ndarray
    worlds: np.ndarray
    ranks: np.ndarray
    attempts: np.ndarray
    trained: np.ndarray
    digests: np.ndarray | None
    where: str
    dense: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.code)

    @property
    def records(self) -> int:
        return int(self.offsets[-1]) + (0 if self.dense is None else int(self.dense.sum()))

    def record_list(self, i: int) -> list[Record]:
        assert self.dense is None or not self.dense[i], "a dense part's records are not materialised"
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        digests = self.digests[lo:hi].astype(str).tolist() if self.digests is not None else [""] * (hi - lo)
        cols = [c[lo:hi].tolist() for c in (self.steps, self.worlds, self.ranks, self.attempts, self.trained)]
        return [
            Record(s, w, r, d, a, t) for s, w, r, d, a, t in zip(cols[0], cols[1], cols[2], digests, cols[3], cols[4])
        ]

    def take(self, keep: np.ndarray) -> Parts:
        """The parts where ``keep`` is True."""
        if keep.all():
            return self
        counts = np.diff(self.offsets)
        rec = np.repeat(keep, counts)
        offsets = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
        return Parts(
            self.code[keep],
            self.rank[keep],
            offsets,
            self.steps[rec],
            self.worlds[rec],
            self.ranks[rec],
            self.attempts[rec],
            self.trained[rec],
            None if self.digests is None else self.digests[rec],
            self.where,
            None if self.dense is None else self.dense[keep],
        )


def _parts_from_docs(docs: list[dict], table: SegmentTable, where: str, digests: bool) -> Parts:
    codes, ranks, counts, flat = [], [], [0], []
    for doc in docs:
        codes.append(table.add(_segment_of(doc, where), where))
        ranks.append(doc["rank"])
        counts.append(len(doc["records"]))
        flat.extend(doc["records"])
    cols = list(zip(*flat)) if flat else [()] * 6
    steps, worlds, rec_ranks, attempts, trained = (np.array(cols[i], dtype=np.int64) for i in (0, 1, 2, 4, 5))
    return Parts(
        np.array(codes, dtype=np.int64),
        np.array(ranks, dtype=np.int64),
        np.cumsum(counts, dtype=np.int64),
        steps,
        worlds,
        rec_ranks,
        attempts,
        trained,
        np.array(cols[3], dtype="S32") if digests else None,
        where,
    )


# ---------------------------------------------------------------------------------------------- containers
@dataclass
class Containers:
    """What a ledger directory holds, by kind (see the module docstring); ``garbage``: files a killed compaction
    left (a pack a live manifest replaces, or pack data without a manifest)."""

    base: storage.Location
    loose: dict[str, list[str]] = field(default_factory=dict)  # segment -> its part file names
    batches: list[str] = field(default_factory=list)
    spools: list[str] = field(default_factory=list)
    packs: dict[str, dict] = field(default_factory=dict)  # live packs: name -> manifest
    garbage: list[str] = field(default_factory=list)
    bytes_unpacked: int = 0  # loose parts and batches

    @property
    def file_count(self) -> int:
        """Files a reader opens (a pack counts its two data objects and its manifest)."""
        return sum(len(v) for v in self.loose.values()) + len(self.batches) + len(self.spools) + 3 * len(self.packs)

    def __bool__(self) -> bool:
        return bool(self.loose or self.batches or self.spools or self.packs)


def containers(ledger_dir: str | storage.Location) -> Containers:
    """List a ledger directory (one listing); a pack's manifest is read and checked here."""
    base = storage.location(ledger_dir)
    out = Containers(base)
    data, manifests = set(), {}
    for rel, size in storage.listing(base, recursive=True).items():
        parts = rel.split("/")
        if len(parts) != 2 or parts[1].startswith(".tmp-"):
            continue
        top, name = parts
        if _SEGMENT_ID.match(top) and _PART_NAME.match(name):
            out.loose.setdefault(top, []).append(name)
            out.bytes_unpacked += size
        elif top == BATCHES and name.endswith(".json"):
            out.batches.append(rel)
            out.bytes_unpacked += size
        elif top == SPOOL and name.endswith(".jsonl"):
            out.spools.append(rel)
        elif top == PACKS and name.endswith(".parquet"):
            data.add(rel)
        elif top == PACKS and name.endswith(".json"):
            manifests[name[: -len(".json")]] = _read_manifest(base.join(rel))
    replaced = {p for m in manifests.values() for p in m["replaces"]}
    for name, manifest in sorted(manifests.items()):
        if name in replaced:
            out.garbage.append(f"{PACKS}/{name}.json")  # before its data: a manifest never outlives its data
        else:
            out.packs[name] = manifest
    live = {f"{PACKS}/{m[k]['object']}" for m in out.packs.values() for k in ("segments", "parts")}
    out.garbage.extend(sorted(data - live))
    return out


def _read_manifest(loc: storage.Location) -> dict:
    doc = storage.read_json(loc, error=LedgerError, what="ledger pack manifest")
    where = loc.uri
    if not isinstance(doc, dict) or doc.get("format") != PACK_FORMAT:
        raise LedgerError(
            f"{where}: not a ledger pack manifest (key 'format' is "
            f"{doc.get('format') if isinstance(doc, dict) else None!r}, expected {PACK_FORMAT!r})"
        )
    if doc.get("version") not in READABLE_PACK_VERSIONS or isinstance(doc.get("version"), bool):
        raise LedgerError(
            f"{where}: ledger pack version {doc.get('version')!r} is not supported (expected "
            f"{' or '.join(map(str, READABLE_PACK_VERSIONS))})"
        )
    try:
        for key in ("segments", "parts"):
            int(doc[key]["bytes"]), int(doc[key]["rows"]), str(doc[key]["object"])
        assert isinstance(doc["replaces"], list) and all(isinstance(p, str) for p in doc["replaces"])
    except (KeyError, TypeError, ValueError, AssertionError):
        raise LedgerError(
            f"{where}: ledger pack manifest lacks or garbles key 'segments', 'parts' or 'replaces'"
        ) from None
    return doc


def scan(
    ledger_dir: str | storage.Location, table: SegmentTable, *, digests: bool = False, found: Containers | None = None
) -> Iterator[Parts]:
    """Every part of the ledger once, in batches, registering each segment header in ``table``. Spools first, then
    batches, loose parts and packs: a part already met is skipped, so a copy left by a killed compaction or flush is
    never counted twice. Memory: one batch at a time (a pack's row group, or one file), plus the keys of the parts
    that are not packed."""
    found = found if found is not None else containers(ledger_dir)
    if not found:
        raise LedgerError(f"{found.base.uri}: no ledger segments there (not a ledger directory, or nothing was saved)")
    seen: set[tuple[int, int]] = set()
    seen_codes: set[int] = set()

    def fresh(parts: Parts) -> Parts:
        keys = list(zip(parts.code.tolist(), parts.rank.tolist()))
        keep = np.array([k not in seen for k in keys], dtype=bool)
        seen.update(keys)
        seen_codes.update(parts.code.tolist())
        return parts.take(keep)

    for rel in found.spools:
        yield fresh(_parts_from_docs(read_spool(found.base.join(rel)), table, found.base.join(rel).uri, digests))
    for rel in found.batches:
        yield fresh(_parts_from_docs(read_batch(found.base.join(rel)), table, found.base.join(rel).uri, digests))
    for seg, names in sorted(found.loose.items()):
        for name in names:
            loc = found.base.join(seg, name)
            part = read_part(loc)
            named = cast("re.Match[str]", _PART_NAME.match(name))  # the listing kept only matching names
            if part["segment"] != seg or named.groups() != (f"{part['rank']:05d}", f"{part['world']:05d}"):
                raise LedgerError(
                    f"{loc.uri}: the part names segment {part['segment']!r} rank {part['rank']} of "
                    f"{part['world']}, not what its path says"
                )
            yield fresh(_parts_from_docs([part], table, loc.uri, digests))
    for name, manifest in found.packs.items():
        for parts in read_pack(found.base, name, manifest, table, digests=digests):
            if seen_codes and np.isin(parts.code, list(seen_codes)).any():
                parts = parts.take(
                    np.array([(c, r) not in seen for c, r in zip(parts.code.tolist(), parts.rank.tolist())], dtype=bool)
                )
            yield parts


def read_ledger(ledger_dir: str | storage.Location) -> dict[str, Segment]:
    """Every segment with every rank's records, in memory: for small ledgers and tests (the audit streams)."""
    table = SegmentTable()
    out: dict[str, Segment] = {}
    for parts in scan(ledger_dir, table, digests=True):
        for i in range(len(parts)):
            seg = table.segments[int(parts.code[i])]
            out.setdefault(seg.id, seg).parts[int(parts.rank[i])] = parts.record_list(i)
    return out


def read_segment(ledger_dir: str | storage.Location, segment: str) -> Segment:
    """Every part of ``segment`` (wherever it is stored); a missing one is one LedgerError naming it."""
    found = read_ledger(ledger_dir).get(segment)
    if found is None:
        raise LedgerError(
            f"{storage.location(ledger_dir).uri}: ledger segment {segment!r} has no parts (missing, or not a ledger)"
        )
    return found


# ---------------------------------------------------------------------------------------------- torchft: spool, batch
def write_batch(ledger_dir: str | storage.Location, parts: list[dict]) -> storage.Location:
    """One torchft flush: the parts, checked, as one new object under ``batches/``; returns where."""
    where = storage.location(ledger_dir).join(BATCHES, f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json")
    for part in parts:
        check_part(part, where=where.uri)
    storage.write_atomic(
        where, storage.json_bytes({"format": BATCH_FORMAT, "version": BATCH_VERSION, "parts": parts}, compact=True)
    )
    return where


def read_batch(loc: storage.Location) -> list[dict]:
    doc = storage.read_json(loc, error=LedgerError, what="ledger batch")
    if not isinstance(doc, dict) or doc.get("format") != BATCH_FORMAT or not isinstance(doc.get("parts"), list):
        raise LedgerError(f"{loc.uri}: not a ledger batch (expected format {BATCH_FORMAT!r} with a list 'parts')")
    if doc.get("version") != BATCH_VERSION:
        raise LedgerError(
            f"{loc.uri}: ledger batch version {doc.get('version')!r} is not supported (expected {BATCH_VERSION})"
        )
    return [check_part(p, where=loc.uri) for p in doc["parts"]]


class Spool:
    """An append-only file of one torchft reader's parts since its last flush: a part appended is on disk when
    :meth:`append` returns (``write`` to a file opened for appending: a SIGKILL of the process loses nothing
    appended; a crash of the machine loses what the page cache held). The directory is ``<ledger_dir>/spool`` on a
    local ledger (the audit reads it there), else ``local_dir`` (flushed to the ledger on the next start on this
    host: :func:`adopt_spools`)."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}.jsonl")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, part: dict) -> None:
        check_part(part, where=self.path)
        os.write(self._fd, storage.json_bytes(part, compact=True))

    def close(self, *, remove: bool) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def spool_dir(ledger_dir: str | storage.Location, local_dir: str | None = None) -> str:
    """Where a reader of ``ledger_dir`` spools: inside a local ledger; else ``local_dir`` or a directory under the
    system temp directory named after the ledger's URI."""
    loc = storage.location(ledger_dir)
    if not loc.remote:
        return os.path.join(loc.path, SPOOL)
    if local_dir:
        return local_dir
    import tempfile

    key = hashlib.sha256(loc.uri.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"zephon-ray-{os.getuid()}", "ledger-spool", key)


def read_spool(path: str | storage.Location) -> list[dict]:
    """A spool's parts, the last line of each step winning; a last line cut short (the writer was killed while
    appending it: the step was never confirmed) is left out, a bad line before it is one LedgerError."""
    loc = storage.location(path)
    try:
        text = storage.read_bytes(loc, limit=storage.MAX_DOCUMENT_BYTES).decode()
    except FileNotFoundError:
        return []  # rotated away by its writer since the listing: its parts are in a batch now
    lines = text.split("\n")
    by_step: dict[int, dict] = {}
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise LedgerError(f"{loc.uri}: line {i + 1} of the ledger spool is not JSON") from None
        part = check_part(doc, where=f"{loc.uri} line {i + 1}")
        by_step[part["first_step"]] = part
    return [by_step[s] for s in sorted(by_step)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def adopt_spools(ledger_dir: str | storage.Location, local_dir: str | None = None) -> int:
    """Flush the spools that readers on this host left when they died (their process is gone) into batches of
    ``ledger_dir``, then remove them; returns how many. A spool of a live process, or of another host, is left."""
    directory = spool_dir(ledger_dir, local_dir)
    adopted = 0
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        host, _, rest = name.rpartition(".jsonl")[0].rpartition("-")[0].rpartition("-")
        pid = rest
        if not name.endswith(".jsonl") or host != _HOST or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        parts = read_spool(path)
        if parts:
            write_batch(ledger_dir, parts)
        os.unlink(path)
        adopted += 1
    return adopted


# ---------------------------------------------------------------------------------------------- packs
def _pa():
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa, pq


def _segment_schema():
    pa, _ = _pa()
    return pa.schema(
        [
            ("segment", pa.string()),
            ("parent", pa.string()),
            ("run_id", pa.string()),
            ("fingerprint", pa.string()),
            ("first_step", pa.int64()),
            ("next_step", pa.int64()),
            ("world", pa.int64()),
            ("resumed", pa.bool_()),
            ("schedule", pa.string()),
        ]
    )


def _part_schema():
    pa, _ = _pa()
    return pa.schema(
        [("seg", pa.int64()), ("rank", pa.int64())]
        + [(c, pa.list_(pa.int64())) for c in RECORD_COLUMNS]
        + [("digests", pa.list_(pa.binary(16)))]
    )


def read_pack(
    base: storage.Location, name: str, manifest: dict, table: SegmentTable, *, digests: bool = False
) -> Iterator[Parts]:
    """A live pack's parts, one row group at a time; ``digests`` False skips that column (most of the bytes)."""
    _, pq = _pa()
    where = base.join(PACKS, manifest["parts"]["object"])
    for key in ("segments", "parts"):
        loc = base.join(PACKS, manifest[key]["object"])
        if storage.size(loc) != manifest[key]["bytes"]:
            raise LedgerError(
                f"{loc.uri}: ledger pack object is {storage.size(loc)} bytes, its manifest says "
                f"{manifest[key]['bytes']} (missing, cut short or replaced)"
            )
    seg_loc = base.join(PACKS, manifest["segments"]["object"])
    segs = pq.ParquetFile(storage.open_input_file(seg_loc)).read().to_pydict()  # not read_table: it imports pandas
    codes = []
    schedules = segs.get("schedule") or [None] * len(segs["segment"])  # a version-1 pack has no such column
    checked: set[str] = set()  # each distinct schedule text once: a torchft run repeats one per step
    for i in range(len(segs["segment"])):
        seg = Segment(
            segs["segment"][i],
            segs["parent"][i],
            segs["run_id"][i],
            segs["fingerprint"][i],
            segs["first_step"][i],
            segs["next_step"][i],
            segs["world"][i],
            segs["resumed"][i],
            schedules[i],
        )
        if seg.schedule is not None and seg.schedule not in checked:
            try:
                value = json.loads(seg.schedule)
            except ValueError:
                value = seg.schedule
            if _check_schedule(value, seg_loc.uri) != seg.schedule:
                raise LedgerError(
                    f"{seg_loc.uri}: ledger key 'schedule' of segment {seg.id!r} is not canonical "
                    "JSON: the file was edited or corrupted"
                )
            checked.add(seg.schedule)
        _check_header(seg, seg_loc.uri)
        codes.append(table.add(seg, seg_loc.uri))
    mapping = np.array(codes, dtype=np.int64)
    worlds = np.array(segs["world"], dtype=np.int64)
    firsts, ends = np.array(segs["first_step"], dtype=np.int64), np.array(segs["next_step"], dtype=np.int64)
    pf = pq.ParquetFile(storage.open_input_file(where))
    columns = ["seg", "rank", *RECORD_COLUMNS] + (["digests"] if digests else [])
    for g in range(pf.num_row_groups):
        batch = pf.read_row_group(g, columns=columns)
        local = batch.column("seg").to_numpy()
        rank = batch.column("rank").to_numpy()
        if len(local) and (
            local.min() < 0 or local.max() >= len(mapping) or (rank >= worlds[local]).any() or rank.min() < 0
        ):
            raise LedgerError(f"{where.uri}: row group {g} names a segment row or rank outside the pack")
        lists = [batch.column(c).combine_chunks() for c in columns[2:]]
        try:
            yield _decode(mapping[local], rank, firsts[local], ends[local], worlds[local], lists, digests, where.uri)
        except ValueError as exc:
            raise LedgerError(f"{where.uri}: row group {g}: {exc}") from None


def _list_parts(col: Any) -> tuple[np.ndarray, np.ndarray, Any]:
    """(null per part, length per part, flat values: a pyarrow array) of a list column."""
    offsets = np.asarray(col.offsets, dtype=np.int64)
    return (np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool), np.diff(offsets), col.flatten())


def _decode(
    code: np.ndarray,
    rank: np.ndarray,
    first: np.ndarray,
    end: np.ndarray,
    world: np.ndarray,
    lists: list,
    digests: bool,
    where: str,
) -> Parts:
    """A pack's row group as :class:`Parts`. A null record column is the part's default (steps ``first..end-1``,
    its W, its rank, attempt 0, trained 1); a part with every column null stays dense unless digests are read."""
    cols = [_list_parts(col) for col in lists[:5]]
    null_steps, len_steps, _ = cols[0]
    count = np.where(null_steps, end - first, len_steps)
    for name, (null, length, _) in zip(RECORD_COLUMNS[1:], cols[1:]):
        if (~null & (length != count)).any():
            raise ValueError(f"record column '{name}' of a part has another length than its steps")
    dense = np.logical_and.reduce([c[0] for c in cols])
    show = np.ones(len(code), dtype=bool) if digests else ~dense
    n = np.where(show, count, 0)
    offsets = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    total = int(offsets[-1])
    pos = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], n)
    defaults = [
        np.repeat(first, n) + pos,
        np.repeat(world, n),
        np.repeat(rank, n),
        np.zeros(total, dtype=np.int64),
        np.ones(total, dtype=np.int64),
    ]
    flat = []
    for default, (null, length, values) in zip(defaults, cols):
        stored = show & ~null  # parts whose stored list is read
        if stored.any():
            values = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(length)])[:-1]
            take = np.repeat(starts[stored], n[stored]) + (
                np.arange(int(n[stored].sum())) - np.repeat(np.cumsum(n[stored]) - n[stored], n[stored])
            )
            default[np.repeat(stored, n)] = values[take]
        flat.append(default)
    hexes = None
    if digests:
        null, length, raw = _list_parts(lists[5])
        if (null | (length != count)).any():
            raise ValueError("a part's digests are not one per record")
        buf = raw.buffers()[1].to_pybytes()[raw.offset * 16 : (raw.offset + len(raw)) * 16]
        hexes = np.frombuffer(binascii.hexlify(buf), dtype="S32")
    steps, worlds, ranks, attempts, trained = flat
    return Parts(
        code,
        rank,
        offsets,
        steps,
        worlds,
        ranks,
        attempts,
        trained,
        hexes,
        where,
        None if digests else np.where(dense, count, 0),
    )


class PackWriter:
    """Writes one pack: parts as they come (row groups of about :data:`ROW_GROUP_RECORDS` records) into a local
    spool, then :meth:`commit` uploads the data objects and writes the manifest last."""

    def __init__(self, base: storage.Location, table: SegmentTable) -> None:
        _, pq = _pa()
        self.base, self.table = base, table
        self.name = f"pack-{uuid.uuid4().hex[:16]}"
        self._target = base.join(PACKS, f"{self.name}.parts.parquet")
        self._spool = storage.spool_path(self._target)
        self._writer = pq.ParquetWriter(self._spool, _part_schema(), compression="zstd")
        self._local: dict[int, int] = {}  # table code -> segment row of this pack
        self._pending: list[Parts] = []
        self._pending_records = 0
        self.rows = self.records = 0

    def add(self, parts: Parts) -> None:
        if not len(parts):
            return
        if parts.digests is None:
            raise ValueError("PackWriter.add: parts read without digests")
        self._pending.append(parts)
        self._pending_records += parts.records
        if self._pending_records >= ROW_GROUP_RECORDS:
            self._flush()

    def _flush(self) -> None:
        pa, _ = _pa()
        if not self._pending:
            return
        for parts in self._pending:
            for code in parts.code.tolist():
                self._local.setdefault(code, len(self._local))
        codes = np.concatenate([p.code for p in self._pending])
        lookup = np.vectorize(self._local.__getitem__, otypes=[np.int64])
        offsets = [np.asarray(p.offsets) for p in self._pending]
        shifts = np.cumsum([0] + [o[-1] for o in offsets[:-1]])
        joined = np.concatenate([offsets[0][:1]] + [o[1:] + s for o, s in zip(offsets, shifts)]).astype(np.int32)
        rank = np.concatenate([p.rank for p in self._pending])
        arrays = [pa.array(lookup(codes)), pa.array(rank)]
        counts = np.diff(joined).astype(np.int64)
        segs = [self.table.segments[c] for c in codes.tolist()]
        first = np.array([s.first_step for s in segs], dtype=np.int64)
        end = np.array([s.next_step for s in segs], dtype=np.int64)
        pos = np.arange(int(joined[-1]), dtype=np.int64) - np.repeat(joined[:-1].astype(np.int64), counts)
        defaults = [
            np.repeat(first, counts) + pos,
            np.repeat([s.world for s in segs], counts),
            np.repeat(rank, counts),
            0,
            1,
        ]
        for col, default in zip(RECORD_COLUMNS, defaults):
            values = np.concatenate([getattr(p, col) for p in self._pending])
            differs = np.bincount(np.repeat(np.arange(len(codes)), counts)[values != default], minlength=len(codes)) > 0
            if col == "steps":
                differs |= counts != end - first
            kept = np.where(differs, counts, 0)  # a part whose column is all default stores null
            offsets = pa.array(np.concatenate([[0], np.cumsum(kept)]).astype(np.int32))
            arrays.append(
                pa.ListArray.from_arrays(
                    offsets, pa.array(values[np.repeat(differs, counts)], pa.int64()), mask=pa.array(~differs)
                )
            )
        hexes = np.concatenate([p.digests for p in self._pending])
        try:
            raw = binascii.unhexlify(hexes.tobytes())
        except binascii.Error:
            raise LedgerError(f"{self._pending[0].where}: a digest is not 32 hex digits") from None
        digests = pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), len(hexes), [None, pa.py_buffer(raw)])
        arrays.append(pa.ListArray.from_arrays(pa.array(joined), digests))
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=_part_schema()))
        self.rows += len(codes)
        self.records += int(joined[-1])
        self._pending, self._pending_records = [], 0

    def commit(self, replaces: list[str], hook: Any = None) -> dict:
        """Upload the data objects, then write the manifest (the commit point); returns the manifest. ``hook("packed")``
        runs between the two (a test kills the process there)."""
        pa, pq = _pa()
        self._flush()
        self._writer.close()
        parts_bytes = os.path.getsize(self._spool)
        storage.upload(self._spool, self._target)
        segs = [self.table.segments[c] for c, _ in sorted(self._local.items(), key=lambda kv: kv[1])]
        seg_table = pa.Table.from_pylist(
            [
                dict(
                    zip(
                        (
                            "segment",
                            "parent",
                            "run_id",
                            "fingerprint",
                            "first_step",
                            "next_step",
                            "world",
                            "resumed",
                            "schedule",
                        ),
                        s.header,
                    )
                )
                for s in segs
            ],
            schema=_segment_schema(),
        )
        seg_target = self.base.join(PACKS, f"{self.name}.segments.parquet")
        with storage.spool(seg_target) as tmp:
            pq.write_table(seg_table, tmp, compression="zstd")
            seg_bytes = os.path.getsize(tmp)
        if hook is not None:
            hook("packed")
        manifest = {
            "format": PACK_FORMAT,
            "version": PACK_VERSION,
            "pack": self.name,
            "segments": {"object": f"{self.name}.segments.parquet", "bytes": seg_bytes, "rows": len(segs)},
            "parts": {
                "object": f"{self.name}.parts.parquet",
                "bytes": parts_bytes,
                "rows": self.rows,
                "records": self.records,
            },
            "replaces": replaces,
        }
        storage.write_json(self.base.join(PACKS, f"{self.name}.json"), manifest, compact=True)
        return manifest

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()
        with contextlib.suppress(OSError):
            os.unlink(self._spool)


@dataclass
class CompactResult:
    files_before: int
    files_after: int
    parts: int
    records: int
    pack: str | None


def compact(ledger_dir: str | storage.Location, *, hook: Any = None) -> CompactResult:
    """Merge the loose parts, batches and smaller packs of a ledger into one new pack (see the module docstring),
    after deleting what a killed compaction left. Spools of dead readers on this host become batches first.
    ``hook(stage)``, if given, is called at "packed" (data objects uploaded, no manifest yet) and "committed"
    (manifest written, nothing deleted yet): where a test kills it."""
    base = storage.location(ledger_dir)
    adopt_spools(base)
    found = containers(base)
    if not found:
        raise LedgerError(f"{base.uri}: no ledger segments there (not a ledger directory, or nothing was saved)")
    before = found.file_count + len(found.garbage)
    _delete(found.base, found.garbage)
    chosen = _choose_packs(found)
    if not found.loose and not found.batches and len(chosen) < 2:
        return CompactResult(before, containers(base).file_count, 0, 0, None)
    sub = Containers(base, loose=found.loose, batches=found.batches, packs={n: found.packs[n] for n in chosen})
    table = SegmentTable()
    writer = PackWriter(base, table)
    try:
        for parts in scan(base, table, digests=True, found=sub):
            writer.add(parts)
        manifest = writer.commit(sorted(chosen), hook)
    except BaseException:
        writer.abort()
        raise
    if hook is not None:
        hook("committed")
    inputs = [f"{seg}/{n}" for seg, names in found.loose.items() for n in names] + found.batches
    _delete(
        base,
        inputs
        + [f"{PACKS}/{n}.json" for n in chosen]
        + [f"{PACKS}/{found.packs[n][k]['object']}" for n in chosen for k in ("segments", "parts")],
    )
    return CompactResult(
        before, containers(base).file_count, manifest["parts"]["rows"], manifest["parts"]["records"], manifest["pack"]
    )


def _delete(base: storage.Location, rels: list[str]) -> None:
    for rel in rels:
        storage.delete(base.join(rel))
    if not base.remote:  # a loose segment's directory, once empty
        for seg in {rel.split("/")[0] for rel in rels if _SEGMENT_ID.match(rel.split("/")[0])}:
            with contextlib.suppress(OSError):
                os.rmdir(base.join(seg).path)


def _choose_packs(found: Containers) -> list[str]:
    """The live packs to merge: every pack holding a segment of the loose parts or batches (so no two live packs
    hold the same part), then the smallest packs while each holds no more records than those gathered so far (the
    new parts estimated from their bytes), so packs grow geometrically."""
    _, pq = _pa()
    wanted = set(found.loose)
    for rel in found.batches:
        wanted.update(p["segment"] for p in read_batch(found.base.join(rel)))
    chosen, gathered = [], found.bytes_unpacked // 40  # about 40-60 bytes of JSON per record
    for name, manifest in found.packs.items():
        if wanted:
            seg_loc = found.base.join(PACKS, manifest["segments"]["object"])
            ids = pq.ParquetFile(storage.open_input_file(seg_loc)).read(columns=["segment"]).column(0).to_pylist()
            if wanted.intersection(ids):
                chosen.append(name)
                gathered += manifest["parts"]["records"]
    for name, manifest in sorted(found.packs.items(), key=lambda kv: (kv[1]["parts"]["records"], kv[0])):
        if name not in chosen and (not gathered or manifest["parts"]["records"] <= gathered):
            chosen.append(name)
            gathered += manifest["parts"]["records"]
        elif name not in chosen:
            break
    return chosen
