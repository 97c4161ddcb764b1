"""The service's durable state under ``state_dir``: its one owner (read, write, check, inspect).

Layout (``state_dir`` is a local directory or an object-store prefix, :mod:`zephon_ray.storage`)::

    state_dir/
      service.json                       # format version, recipe fingerprint, lanes, the recipe's canonical content,
                                         # its phases and the ones a running service accepted (add_phase)
      checkpoints/step-000000000032.json # merged Zephon checkpoint at the boundary *before* step 32 (LaneStepper state)
      commits.json                       # newest commit per consumer, plus a short history

Every file is one atomic write (:func:`zephon_ray.storage.write_atomic`: temp file, fsync, rename, fsync of the
directory on a local disk; one upload on an object store). Each file is its own commit point: a checkpoint is
whole before it is listed, and ``commits.json`` is replaced whole, so a coordinator killed at any point restarts
from the last complete checkpoint and commit, on a local disk and in a bucket alike. Checkpoint
names read: ``step-`` and 8 or more digits (older state_dirs used 8); written: 12 digits, as everywhere else.

Guarantee: a reader never sees a half-written file, and a ``state_dir`` is only ever paired with the recipe
whose fingerprint it records: :meth:`ServiceState.open` refuses any other recipe before writing anything, except
the recipe without the phases a running service accepted (:meth:`ServiceState.add_phase`), which it runs with them. A
damaged file (not JSON, another format, a malformed commit entry) is one :class:`ServiceStateError` naming the
file and the entry. :func:`inspect` reads a state_dir offline, for
``zephon-ray inspect``.
Bounded: checkpoints are pruned to the
newest ``keep_checkpoints`` plus anchors every ``anchor_every`` steps (so any past step is reachable by replaying
at most ``anchor_every`` steps, recent ones at most K); commits keep the newest per consumer for at most
``MAX_CONSUMERS`` consumers and ``MAX_COMMITS`` history entries; ``nearest_checkpoint`` is a bisect over an
in-memory index built from one listing, not a listing per call.
Object stores: every read and write retries transient faults (an outage, 503 SlowDown, a timeout, a response cut
short) for the storage budget (:mod:`zephon_ray.storage.retries`), so a checkpoint or commit made during a 15 s
outage lands when the store answers again; a spent budget is one :class:`ServiceStateError` (or ``StorageError``)
naming the object.
The in-memory index is guarded by a lock (the coordinator's pump, commit writer and read loop share it); I/O runs
outside it, so a write waiting out an outage never blocks a lookup.
Limits: one writer at a time (the coordinator); no locking against two services pointed at the same
``state_dir``. Anchors themselves accumulate (one file of tens of KiB per ``anchor_every`` steps).
"""

from __future__ import annotations

import bisect
import math
import os
import re
import threading
import time
from typing import Any

from zephon_ray import storage
from zephon_ray.checks import check_int
from zephon_ray.lanes import KEY_NEXT_STEP, check_step_state

STATE_FORMAT = "zephon-ray/service-state/v1"
SERVICE_FILE = "service.json"
CHECKPOINT_DIR = "checkpoints"
COMMITS_FILE = "commits.json"
KEY_FORMAT = "format"
KEY_FINGERPRINT = "fingerprint"
KEY_LANES = "lanes"
KEY_RECIPE = "recipe"
KEY_COMMITS = "commits"
KEY_STEP = "step"
KEY_CONSUMER = "consumer"
KEY_TIME = "time"
KEY_LATEST = "latest"
KEY_ADDED_PHASES = "added_phases"
"""Phases a running service accepted (``add_phase``), oldest first: ``{"name", "start_step", "weights"}``."""
KEY_PHASES = "phases"
MAX_COMMITS = 200
"""History entries kept in commits.json (newest last); older ones are dropped so the file stays small."""
MAX_CONSUMERS = 256
"""Consumers whose newest commit is remembered; the ones that committed longest ago are forgotten first."""
CHECKPOINT_RE = re.compile(r"^step-(\d{8,})\.json$")
_PRUNED_RETRIES = 8
"""How often :meth:`ServiceState.read_nearest` picks another checkpoint after the one it chose was pruned."""


class ServiceStateError(ValueError):
    """A ``state_dir`` file that cannot be used: unreadable, not JSON, another format, a malformed entry. The
    message names the file (and the entry)."""


class FingerprintMismatchError(ServiceStateError):
    """A ``state_dir`` that belongs to another recipe. Refused before anything is written."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:012d}.json"


def read_service_file(state_dir: str | os.PathLike[str] | storage.Location) -> dict[str, Any] | None:
    """``service.json`` checked for format (None when the state_dir has none yet)."""
    path = storage.location(state_dir).join(SERVICE_FILE)
    if not storage.exists(path):
        return None
    meta = storage.read_json(path, expect_format=STATE_FORMAT, error=ServiceStateError, what=SERVICE_FILE)
    return meta


def check_state_dir(recipe: Any, state_dir: str | os.PathLike[str] | storage.Location) -> Any:
    """The recipe to run on ``state_dir``: ``recipe`` itself, or ``recipe`` with the phases a running service
    accepted there (``add_phase``: recorded in ``service.json``, so a restart with the recipe file it started from,
    or with that file updated, resumes under the same schedule). Raise :class:`FingerprintMismatchError` if
    ``state_dir`` belongs to another recipe or its service.json is not one, :class:`ServiceStateError` if it cannot
    be reached (a missing bucket, refused credentials); write nothing."""
    try:
        meta = read_service_file(state_dir)
    except ServiceStateError as exc:
        raise FingerprintMismatchError(f"state_dir {state_dir}: {exc}") from None
    except (storage.StorageError, FileNotFoundError) as exc:
        raise ServiceStateError(f"state_dir unusable: {exc}") from None
    if meta is None:
        return recipe
    if meta.get(KEY_FINGERPRINT) == recipe.fingerprint:
        return recipe
    updated = with_added_phases(recipe, meta.get(KEY_ADDED_PHASES))
    if updated is not None and updated.fingerprint == meta.get(KEY_FINGERPRINT):
        return updated
    raise FingerprintMismatchError(
        f"state_dir {state_dir} belongs to recipe fingerprint {str(meta.get(KEY_FINGERPRINT))[:12]}, not "
        f"{recipe.describe()}; start with the original recipe or use a new state_dir"
    )


def with_added_phases(recipe: Any, added: Any) -> Any:
    """``recipe`` with the phases a running service accepted (``service.json`` ``added_phases``) that it does not
    already have (:meth:`Recipe.with_run_phases`); None when there are none or one of them contradicts it."""
    if not isinstance(added, list) or not added:
        return None
    try:
        return recipe.with_run_phases(added)
    except ValueError:
        return None


def checkpoint_index(state_dir: str | os.PathLike[str] | storage.Location) -> dict[int, str]:
    """``{step: file name}`` of the checkpoints under ``state_dir`` (one listing)."""
    out = {}
    for name in storage.listing(storage.location(state_dir).join(CHECKPOINT_DIR)):
        m = CHECKPOINT_RE.match(name)
        if m:
            out[int(m.group(1))] = name
    return out


def _check_entry(path: storage.Location, where: str, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ServiceStateError(f"{path}: {where} is malformed (a {type(entry).__name__}, not a table)")
    step, consumer, when = entry.get(KEY_STEP), entry.get(KEY_CONSUMER), entry.get(KEY_TIME, 0.0)
    check_int(f"{path}: {where} is malformed: '{KEY_STEP}'", step, low=0, error=ServiceStateError)
    if not isinstance(consumer, str) or not consumer:
        raise ServiceStateError(
            f"{path}: {where} is malformed ('{KEY_CONSUMER}' must be a non-empty string, got {consumer!r})"
        )
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        raise ServiceStateError(f"{path}: {where} is malformed ('{KEY_TIME}' must be a number, got {when!r})")
    return {KEY_STEP: step, KEY_CONSUMER: consumer, KEY_TIME: float(when)}


def read_commits(state_dir: str | os.PathLike[str] | storage.Location) -> dict[str, Any]:
    """``{"commits": [history, newest last], "latest": {consumer: entry}}``, every entry checked; an absent file is
    no commits. A malformed file or entry is one :class:`ServiceStateError` naming the file and the entry."""
    path = storage.location(state_dir).join(COMMITS_FILE)
    if not storage.exists(path):
        return {KEY_COMMITS: [], KEY_LATEST: {}}
    payload = storage.read_json(path, expect_format=STATE_FORMAT, error=ServiceStateError, what=COMMITS_FILE)
    raw_history = payload.get(KEY_COMMITS, [])
    if not isinstance(raw_history, list):
        raise ServiceStateError(f"{path}: '{KEY_COMMITS}' must be a list, got {type(raw_history).__name__}")
    history = [_check_entry(path, f"commits[{i}]", e) for i, e in enumerate(raw_history)]
    raw_latest = payload.get(KEY_LATEST)
    if raw_latest is None:  # written before per-consumer commits: derive them from the history
        latest = {}
        for entry in history:
            latest[entry[KEY_CONSUMER]] = entry
    elif not isinstance(raw_latest, dict):
        raise ServiceStateError(f"{path}: '{KEY_LATEST}' must be a table, got {type(raw_latest).__name__}")
    else:
        latest = {str(c): _check_entry(path, f"latest[{c!r}]", e) for c, e in raw_latest.items()}
    return {KEY_COMMITS: history, KEY_LATEST: latest}


def service_meta(recipe: Any, added_phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The content of ``service.json`` for ``recipe`` (its schedule included, for ``inspect``)."""
    return {
        KEY_FORMAT: STATE_FORMAT,
        KEY_FINGERPRINT: recipe.fingerprint,
        KEY_LANES: recipe.lanes,
        KEY_RECIPE: recipe.canonical(),
        KEY_PHASES: [p.canonical(recipe.source_names) for p in recipe.phases],
        KEY_ADDED_PHASES: added_phases,
        KEY_TIME: time.time(),
    }


class ServiceState:
    """Durable state of one service. Open it with :meth:`open`. ``root`` is a :class:`zephon_ray.storage.Location`
    (``str(root)`` is the path or URI)."""

    def __init__(
        self, root: storage.Location, recipe: Any, *, keep_checkpoints: int = 4, anchor_every: int = 0
    ) -> None:
        self.root = storage.location(root)
        self.recipe = recipe
        self.keep_checkpoints = keep_checkpoints
        self.anchor_every = anchor_every
        self._steps: list[int] | None = None  # sorted index of checkpoint steps, loaded once
        self._names: dict[int, str] = {}
        self._commits: dict[str, Any] | None = None  # this process is the one writer: read once, then kept
        self.pinned: set[int] = set()  # never pruned by this process (a materialised prefix's end)
        self._lock = threading.RLock()  # the index; never held across I/O except the first listing

    @classmethod
    def open(
        cls,
        recipe: Any,
        state_dir: str | os.PathLike[str] | storage.Location,
        *,
        keep_checkpoints: int = 4,
        anchor_every: int = 0,
    ) -> ServiceState:
        """Check the fingerprint first; create the directory and ``service.json`` only when it matches.
        ``anchor_every=0`` keeps every checkpoint (no pruning)."""
        root = storage.location(state_dir)
        recipe = check_state_dir(recipe, root)  # with the phases a running service accepted here
        state = cls(root, recipe, keep_checkpoints=keep_checkpoints, anchor_every=anchor_every)
        meta_path = root.join(SERVICE_FILE)
        storage.make_dirs(root.join(CHECKPOINT_DIR))
        if not storage.exists(meta_path):
            storage.write_json(meta_path, service_meta(recipe, []), compact=True)  # last: the commit point
        return state

    def add_phase(self, recipe: Any, name: str) -> list[int]:
        """Adopt ``recipe`` (this state's recipe plus phase ``name``, checked by the caller against what consumers
        read): first delete the checkpoints after the phase's start (made under the old schedule; a restore there
        would be refused), then record the phase in ``service.json`` (one atomic write: the commit point). A crash
        between the two leaves the old schedule with fewer checkpoints, never a checkpoint of the old schedule under
        the new one. Returns the deleted checkpoint steps."""
        phase = next(p for p in recipe.phases if p.name == name)
        doomed = [s for s in self.checkpoint_steps() if s > phase.start_step]
        paths = [self.checkpoint_path(step) for step in doomed]
        with self._lock:
            gone = set(doomed)
            assert self._steps is not None  # checkpoint_steps() loaded the index
            self._steps = [s for s in self._steps if s not in gone]
            for step in doomed:
                self._names.pop(step, None)
        for path in paths:
            storage.delete(path)
        meta_path = self.root.join(SERVICE_FILE)
        meta = read_service_file(self.root) or {}
        added = list(meta.get(KEY_ADDED_PHASES) or [])
        added.append(phase.canonical(recipe.source_names))
        storage.write_json(
            meta_path, {**service_meta(recipe, added), KEY_TIME: meta.get(KEY_TIME, time.time())}, compact=True
        )
        self.recipe = recipe
        return doomed

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_path(self, step: int) -> storage.Location:
        """Where the checkpoint of ``step`` is (an older 8-digit name when that is what is there)."""
        self.checkpoint_steps()
        with self._lock:
            return self.root.join(CHECKPOINT_DIR, self._names.get(step, checkpoint_name(step)))

    def checkpoint_steps(self) -> list[int]:
        if self._steps is None:  # one listing per open; later writes and prunes keep the index current
            names = checkpoint_index(self.root)
            with self._lock:
                if self._steps is None:
                    self._names = names
                    self._steps = sorted(names)
        with self._lock:
            return list(self._steps)

    def has_checkpoint(self, step: int) -> bool:
        self.checkpoint_steps()
        with self._lock:
            assert self._steps is not None  # checkpoint_steps() loaded the index
            i = bisect.bisect_left(self._steps, step)
            return i < len(self._steps) and self._steps[i] == step

    def write_checkpoint(self, state: dict[str, Any], *, pin: bool = False) -> int:
        """Validate (recipe, step boundary) and store a merged checkpoint; returns its step. First writer wins:
        every checkpoint of one step restores the same batches, so an existing file is kept. ``pin`` keeps it
        from pruning while this process runs."""
        check_step_state(state, self.recipe)
        step = int(state[KEY_NEXT_STEP])
        if pin:
            self.pinned.add(step)
        if not self.has_checkpoint(step):
            storage.write_json(self.checkpoint_path(step), state, compact=True)  # listed only once it is whole
            with self._lock:
                if step not in self._names:
                    self._names[step] = checkpoint_name(step)
                    assert self._steps is not None  # has_checkpoint() loaded the index
                    bisect.insort(self._steps, step)
        self.prune()
        return step

    def prune(self) -> list[int]:
        """Delete checkpoints that are neither among the newest ``keep_checkpoints`` nor an anchor (a multiple of
        ``anchor_every``) nor pinned; returns the deleted steps."""
        if not self.anchor_every:
            return []
        steps = self.checkpoint_steps()
        recent = set(steps[-self.keep_checkpoints :])
        doomed = [s for s in steps if s not in recent and s % self.anchor_every and s not in self.pinned]
        if doomed:  # out of the index first: no reader picks a checkpoint being deleted
            paths = [self.checkpoint_path(step) for step in doomed]
            gone = set(doomed)
            with self._lock:
                assert self._steps is not None  # checkpoint_steps() loaded the index
                self._steps = [s for s in self._steps if s not in gone]
                for step in doomed:
                    self._names.pop(step, None)
            for path in paths:
                storage.delete(path)
        return doomed

    def read_checkpoint(self, step: int) -> dict[str, Any]:
        state = storage.read_json(self.checkpoint_path(step), error=ServiceStateError, what="checkpoint")
        check_step_state(state, self.recipe)
        return state

    def nearest_checkpoint(self, step: int) -> int | None:
        """The newest durable checkpoint step <= ``step`` (None: start from a fresh pipeline at step 0)."""
        self.checkpoint_steps()
        with self._lock:
            assert self._steps is not None  # checkpoint_steps() loaded the index
            i = bisect.bisect_right(self._steps, step)
            return self._steps[i - 1] if i else None

    def read_nearest(self, step: int) -> tuple[int, dict[str, Any] | None]:
        """``(step, state)`` of the newest durable checkpoint <= ``step``, or ``(0, None)``: a fresh pipeline. Safe
        beside a :meth:`prune` in another thread: a checkpoint pruned between its choice and its read is replaced by
        the next one <= ``step`` (the prune takes it out of the index before deleting it, so no retry picks it)."""
        for _ in range(_PRUNED_RETRIES):
            found = self.nearest_checkpoint(step)
            if not found:
                return 0, None
            try:
                return found, self.read_checkpoint(found)
            except ServiceStateError:
                with self._lock:
                    if found in self._names:  # not pruned: missing or damaged
                        raise
        raise ServiceStateError(f"{self.root.uri}: the checkpoints <= step {step} kept being pruned while read")

    # ------------------------------------------------------------------ commits
    def _read_commits(self) -> dict[str, Any]:
        if self._commits is None:
            self._commits = read_commits(self.root)
        return self._commits

    def commits(self) -> list[dict[str, Any]]:
        """The recent commit history, newest last."""
        return list(self._read_commits()[KEY_COMMITS])

    def consumer_commits(self) -> dict[str, int]:
        """The newest commit step of every remembered consumer."""
        return {c: int(e[KEY_STEP]) for c, e in self._read_commits()[KEY_LATEST].items()}

    def add_commit(self, step: int, consumer: str) -> dict[str, Any]:
        entry = {KEY_STEP: int(step), KEY_CONSUMER: str(consumer), KEY_TIME: time.time()}
        payload = self._read_commits()
        history = (payload[KEY_COMMITS] + [entry])[-MAX_COMMITS:]
        latest = dict(payload[KEY_LATEST])
        latest[str(consumer)] = entry
        if len(latest) > MAX_CONSUMERS:
            latest = dict(sorted(latest.items(), key=lambda kv: kv[1][KEY_TIME])[-MAX_CONSUMERS:])
        storage.write_json(
            self.root.join(COMMITS_FILE),
            {KEY_FORMAT: STATE_FORMAT, KEY_COMMITS: history, KEY_LATEST: latest},
            compact=True,
        )
        self._commits = {KEY_COMMITS: history, KEY_LATEST: latest}
        return entry

    def latest_commit(self) -> int | None:
        commits = self.commits()
        return int(commits[-1][KEY_STEP]) if commits else None


def read_nearest_checkpoint(
    state_dir: str | os.PathLike[str] | storage.Location, recipe: Any, step: int
) -> tuple[int, dict[str, Any]] | None:
    """``(checkpoint step, state)`` of the newest durable checkpoint at or before ``step`` under ``state_dir``, read
    beside the running service without writing anything (one listing, one read); None when there is none. A
    checkpoint the service pruned between the listing and the read is looked up once more."""
    for attempt in (1, 2):
        state = ServiceState(storage.location(state_dir), recipe)
        found = state.nearest_checkpoint(step)
        if found is None:
            return None
        try:
            return found, state.read_checkpoint(found)
        except ServiceStateError:
            if attempt == 2 or storage.exists(state.checkpoint_path(found)):
                raise
    return None


def inspect(state_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What a service left under ``state_dir`` (a path or URI): format, fingerprint, lanes, checkpoints, commits.
    Reads the files only (no Ray, no recipe). A missing or damaged file is one :class:`ServiceStateError` (or
    ``FileNotFoundError`` for a directory that is not a state_dir) naming it."""
    root = storage.location(state_dir)
    meta = read_service_file(root)
    if meta is None:
        raise FileNotFoundError(f"{root}: no {SERVICE_FILE}; not a zephon-ray service state_dir")
    steps = sorted(checkpoint_index(root))
    commits = read_commits(root)
    history, latest = commits[KEY_COMMITS], commits[KEY_LATEST]
    recipe: dict[str, Any] = meta[KEY_RECIPE] if isinstance(meta.get(KEY_RECIPE), dict) else {}
    sources: list[Any] = recipe["sources"] if isinstance(recipe.get("sources"), list) else []
    return {
        "state_dir": root.uri,
        "format": meta.get(KEY_FORMAT),
        "fingerprint": meta.get(KEY_FINGERPRINT),
        "lanes": meta.get(KEY_LANES),
        "created": meta.get(KEY_TIME),
        "recipe": {
            k: recipe.get(k)
            for k in ("seed", "lanes", "microbatches_per_lane", "rows_per_microbatch", "seq_len", "packing")
            if k in recipe
        },
        "sources": [s.get("name") for s in sources if isinstance(s, dict)],
        "schedule": _schedule(recipe, meta),
        "checkpoints": {"count": len(steps), "latest": steps[-1] if steps else None, "steps": steps},
        "commits": {
            "count": len(history),
            "latest_step": history[-1][KEY_STEP] if history else None,
            "by_consumer": {c: e[KEY_STEP] for c, e in latest.items()},
        },
    }


def _schedule(recipe: dict[str, Any], meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The mixture schedule a state_dir records: the sources' weights from step 0, then each phase (``added``: a
    running service accepted it with ``add_phase``)."""
    sources = [s for s in recipe.get("sources") or [] if isinstance(s, dict)]
    out = [
        {
            "name": "sources",
            "start_step": 0,
            "weights": {s.get("name"): s.get("weight") for s in sources},
            "added": False,
        }
    ]
    added = {(p.get("name"), p.get("start_step")) for p in meta.get(KEY_ADDED_PHASES) or [] if isinstance(p, dict)}
    order = [s.get("name") for s in sources]
    for p in meta.get(KEY_PHASES) or []:
        if isinstance(p, dict):
            weights: dict[str, Any] = p["weights"] if isinstance(p.get("weights"), dict) else {}
            weights = {n: weights[n] for n in order if n in weights} | weights  # recipe order (the file sorts keys)
            out.append(
                {
                    "name": p.get("name"),
                    "start_step": p.get("start_step"),
                    "weights": weights,
                    "added": (p.get("name"), p.get("start_step")) in added,
                }
            )
    return out
