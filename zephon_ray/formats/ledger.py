"""The ledger: what every rank handed its trainer, one small append-only segment per loader-state save. Owner of
the format (read, write, check, lineage).

A **record** is one step one rank handed out: ``[step, world, rank, digest, attempt, trained]``:

* ``digest``: :func:`slice_digest` of the rank's real rows (no padding rows), 32 hex digits;
* ``attempt``: 0, or the attempt number when a step is served again (torchft);
* ``trained``: how many times the trainer confirmed it (``Loader.commit``); a loop that never confirms gets 1 for
  every step it was handed, so the ledger then proves what was handed out, not what was trained.

A **segment** is the records of steps ``[first_step, next_step)`` at data-parallel degree ``world``, written as one
JSON part per rank under ``<ledger_dir>/<segment>/rank-RRRRR-of-WWWWW.json`` (each rank writes its own part: no
collective is needed, so it works the same in local, service and dataset mode, on a path or object storage).
Layout of a part (format ``zephon-ray/ledger-segment``, version 1; every key always present)::

    {
      "format": "zephon-ray/ledger-segment", "version": 1,
      "run_id": "my-run", "fingerprint": "<recipe sha256>",
      "segment": "<id>", "parent": "<id>" | "",     # the segment of the state this one continues ("" at step 0)
      "first_step": 4, "next_step": 8, "world": 2, "rank": 0,
      "resumed": true,                               # the segment starts at a load_state_dict
      "records": [[4, 2, 0, "<digest>", 0, 1], ...]
    }

A segment's id is a pure function of ``(run_id, fingerprint, parent, first_step, next_step, world, resumed)``
(:func:`segment_id`), so every rank computes the same one without talking to the others, and the loader state
(:mod:`zephon_ray.formats.loader_state`, key ``ledger``) carries it: following ``parent`` links from a checkpoint's
segment back to ``""`` gives the lineage of the weights. A run resumed from an older checkpoint starts a new branch
(its first segment is ``resumed`` from an older parent); the segments the rollback abandoned stay in the directory
as a discarded branch.

Limits: two branches that resume from the same state at the same W and save at the same steps get one id (their
records are the same rows in the same order, so nothing is lost but the count of branches). A part is rewritten
whole at each save of the same segment. Nothing here is pickled; every document is bounded (``MAX_RECORDS``).
Tests: ``tests/test_ledger.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from zephon_ray import files
from zephon_ray.batch import DIGEST_HEX, SLICE_DIGEST_HEADER, slice_digest  # noqa: F401 - part of the format
from zephon_ray.checks import check_int

FORMAT = "zephon-ray/ledger-segment"
VERSION = 1
"""A slice digest is sha256 truncated to 128 bits: collision-safe for any run, and 16 bytes fewer per record."""
MAX_RECORDS = 1 << 20
"""Records one part may hold (about 70 MB of JSON); a save at least every million steps stays under it."""

PART_KEYS = ("format", "version", "run_id", "fingerprint", "segment", "parent", "first_step", "next_step", "world",
             "rank", "resumed", "records")
_PART_NAME = re.compile(r"^rank-(\d{5})-of-(\d{5})\.json$")
_SEGMENT_ID = re.compile(r"^[0-9a-f]{24}$")


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


def segment_id(*, run_id: str, fingerprint: str, parent: str, first_step: int, next_step: int, world: int,
               resumed: bool) -> str:
    """The id every rank computes alike for the same segment (see the module docstring)."""
    key = json.dumps([FORMAT, VERSION, run_id, fingerprint, parent, first_step, next_step, world, bool(resumed)],
                     separators=(",", ":"))
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def part_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.json"


def make_part(*, run_id: str, fingerprint: str, segment: str, parent: str, first_step: int, next_step: int,
              world: int, rank: int, resumed: bool, records: list[Record]) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "run_id": run_id, "fingerprint": fingerprint, "segment": segment,
            "parent": parent, "first_step": int(first_step), "next_step": int(next_step), "world": int(world),
            "rank": int(rank), "resumed": bool(resumed), "records": [r.to_json() for r in records]}


def write_part(ledger_dir: "str | files.Location", part: dict[str, Any]) -> files.Location:
    """Write one rank's part atomically (a local path or an object-store URI); returns where."""
    where = files.location(ledger_dir).join(part["segment"], part_name(part["rank"], part["world"]))
    check_part(part, where=where.uri)
    files.write_atomic(where, files.json_bytes(part, compact=True))
    return where


def _int(doc: dict, key: str, where: str, low: int = 0) -> int:
    return check_int(f"{where}: ledger key '{key}'", doc[key], low=low, error=LedgerError)


def check_part(doc: Any, *, where: str) -> dict[str, Any]:
    """Validate one part; returns it. Raises one :class:`LedgerError` line naming the file and the key."""
    if not isinstance(doc, dict):
        raise LedgerError(f"{where}: a ledger segment must be a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise LedgerError(f"{where}: not a ledger segment (key 'format' is {doc.get('format')!r}, expected "
                          f"{FORMAT!r})")
    if doc.get("version") != VERSION:
        raise LedgerError(f"{where}: ledger segment version {doc.get('version')!r} is not supported (expected "
                          f"{VERSION})")
    missing = [k for k in PART_KEYS if k not in doc]
    if missing:
        raise LedgerError(f"{where}: ledger segment lacks key '{missing[0]}'")
    extra = sorted(str(k) for k in doc if k not in PART_KEYS)
    if extra:
        raise LedgerError(f"{where}: ledger segment has unknown key '{extra[0]}'")
    for key in ("run_id", "fingerprint", "segment", "parent"):
        if not isinstance(doc[key], str):
            raise LedgerError(f"{where}: ledger key '{key}' must be a string, got {doc[key]!r}")
    if not _SEGMENT_ID.match(doc["segment"]) or (doc["parent"] and not _SEGMENT_ID.match(doc["parent"])):
        raise LedgerError(f"{where}: ledger keys 'segment'/'parent' must be 24 hex digits, got "
                          f"{doc['segment']!r}/{doc['parent']!r}")
    first, end = _int(doc, "first_step", where), _int(doc, "next_step", where)
    world, rank = _int(doc, "world", where, 1), _int(doc, "rank", where)
    if end < first or rank >= world:
        raise LedgerError(f"{where}: ledger segment steps [{first}, {end}) or rank {rank} of {world} is impossible")
    if not isinstance(doc["resumed"], bool):
        raise LedgerError(f"{where}: ledger key 'resumed' must be true or false, got {doc['resumed']!r}")
    expected = segment_id(run_id=doc["run_id"], fingerprint=doc["fingerprint"], parent=doc["parent"],
                          first_step=first, next_step=end, world=world, resumed=doc["resumed"])
    if doc["segment"] != expected:
        raise LedgerError(f"{where}: ledger key 'segment' {doc['segment']!r} does not match its header (expected "
                          f"{expected!r}): the file was edited or corrupted")
    records = doc["records"]
    if not isinstance(records, list) or len(records) > MAX_RECORDS:
        raise LedgerError(f"{where}: ledger key 'records' must be a list of at most {MAX_RECORDS} records")
    for i, rec in enumerate(records):
        if not (isinstance(rec, list) and len(rec) == 6 and isinstance(rec[3], str)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in rec[:3] + rec[4:])):
            raise LedgerError(f"{where}: ledger record {i} must be [step, world, rank, digest, attempt, trained], "
                              f"got {str(rec)[:80]}")
    return doc


def read_part(path: "str | files.Location") -> dict[str, Any]:
    loc = files.location(path)
    doc = files.read_json(loc, error=LedgerError, what="ledger segment")
    return check_part(doc, where=loc.uri)


@dataclass
class Segment:
    """A segment as read back: the header its parts share and each rank's records."""

    id: str
    parent: str
    run_id: str
    fingerprint: str
    first_step: int
    next_step: int
    world: int
    resumed: bool
    parts: dict[int, list[Record]] = field(default_factory=dict)

    @property
    def steps(self) -> range:
        return range(self.first_step, self.next_step)


def read_segment(ledger_dir: "str | files.Location", segment: str) -> Segment:
    """Every part of ``segment``; a part of another segment, world or header is one LedgerError naming it."""
    base = files.location(ledger_dir).join(segment)
    names = sorted(n for n in files.entries(base) if _PART_NAME.match(n))
    if not names:
        raise LedgerError(f"{base.uri}: ledger segment {segment!r} has no parts (missing, or not a ledger)")
    seg: Segment | None = None
    for name in names:
        part = read_part(base.join(name))
        where = base.join(name).uri
        header = (part["segment"], part["parent"], part["run_id"], part["fingerprint"], part["first_step"],
                  part["next_step"], part["world"], part["resumed"])
        if part["segment"] != segment or _PART_NAME.match(name).groups() != (f"{part['rank']:05d}",
                                                                               f"{part['world']:05d}"):
            raise LedgerError(f"{where}: the part names segment {part['segment']!r} rank {part['rank']} of "
                              f"{part['world']}, not what its path says")
        if seg is None:
            seg = Segment(*header)
        elif header != (seg.id, seg.parent, seg.run_id, seg.fingerprint, seg.first_step, seg.next_step, seg.world,
                        seg.resumed):
            raise LedgerError(f"{where}: the part's header differs from the other parts of segment {segment!r}")
        seg.parts[part["rank"]] = [Record(*rec) for rec in part["records"]]
    assert seg is not None
    return seg


def list_segments(ledger_dir: "str | files.Location") -> list[str]:
    """The segment ids in a ledger directory (other entries are ignored)."""
    loc = files.location(ledger_dir)
    found = [n for n in files.entries(loc) if _SEGMENT_ID.match(n)]
    if not found:
        raise LedgerError(f"{loc.uri}: no ledger segments there (not a ledger directory, or nothing was saved)")
    return found
