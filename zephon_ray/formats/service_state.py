"""The service's durable state under ``state_dir``.

Layout (every file is written atomically: temp file, fsync, ``os.replace``, fsync of the directory)::

    state_dir/
      service.json                  # format version, recipe fingerprint, lanes, the recipe's canonical content
      checkpoints/step-00000032.json # merged Zephon checkpoint at the boundary *before* step 32 (LaneStepper state)
      commits.json                  # newest commit per consumer, plus a short history

Guarantee: a reader never sees a half-written file, and a ``state_dir`` is only ever paired with the recipe
whose fingerprint it records: :meth:`ServiceState.open` refuses any other recipe before writing anything.
Bounded (tests/test_service_state.py, benchmarks/bench_service_load.py ``--long``): checkpoints are pruned to the
newest ``keep_checkpoints`` plus anchors every ``anchor_every`` steps (so any past step is reachable by replaying
at most ``anchor_every`` steps, recent ones at most K); commits keep the newest per consumer for at most
``MAX_CONSUMERS`` consumers and ``MAX_COMMITS`` history entries; ``nearest_checkpoint`` is a bisect over an
in-memory index, not a directory listing.
Limits: one writer at a time (the coordinator); no locking against two services pointed at the same
``state_dir``. Anchors themselves accumulate (one file of tens of KiB per ``anchor_every`` steps).
"""

from __future__ import annotations

import bisect
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from zephon_ray.lanes import KEY_NEXT_STEP, check_step_state
from zephon_ray.recipe import Recipe
from zephon_ray.service.errors import FingerprintMismatchError

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
MAX_COMMITS = 200
"""History entries kept in commits.json (newest last); older ones are dropped so the file stays small."""
MAX_CONSUMERS = 256
"""Consumers whose newest commit is remembered; the ones that committed longest ago are forgotten first."""
_CHECKPOINT_RE = re.compile(r"^step-(\d{8,})\.json$")


def atomic_write_json(path: Path, payload: Any) -> None:
    """Write JSON so that ``path`` holds either the old or the new content, never a mix, even on a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _read_json(path: Path) -> Any:
    with path.open("rb") as fh:
        return json.load(fh)


def check_state_dir(recipe: Recipe, state_dir: str | os.PathLike) -> None:
    """Raise :class:`FingerprintMismatchError` if ``state_dir`` belongs to another recipe; write nothing."""
    path = Path(state_dir) / SERVICE_FILE
    if not path.exists():
        return
    try:
        meta = _read_json(path)
    except (OSError, ValueError) as exc:
        raise FingerprintMismatchError(f"state_dir {state_dir}: {SERVICE_FILE} is unreadable ({exc})") from None
    found = meta.get(KEY_FORMAT) if isinstance(meta, dict) else type(meta).__name__
    if found != STATE_FORMAT:
        raise FingerprintMismatchError(
            f"state_dir {state_dir}: {SERVICE_FILE} has format {found!r}, expected {STATE_FORMAT!r}")
    if meta.get(KEY_FINGERPRINT) != recipe.fingerprint:
        raise FingerprintMismatchError(
            f"state_dir {state_dir} belongs to recipe fingerprint {str(meta.get(KEY_FINGERPRINT))[:12]}, not "
            f"{recipe.describe()}; start with the original recipe or use a new state_dir")


class ServiceState:
    """Durable state of one service. Open it with :meth:`open`."""

    def __init__(self, root: Path, recipe: Recipe, *, keep_checkpoints: int = 4, anchor_every: int = 0) -> None:
        self.root = root
        self.recipe = recipe
        self.keep_checkpoints = keep_checkpoints
        self.anchor_every = anchor_every
        self._steps: list[int] | None = None  # sorted index of checkpoint steps, loaded once
        self.pinned: set[int] = set()  # never pruned by this process (a materialised prefix's end)

    @classmethod
    def open(cls, recipe: Recipe, state_dir: str | os.PathLike, *, keep_checkpoints: int = 4,
             anchor_every: int = 0) -> "ServiceState":
        """Check the fingerprint first; create the directory and ``service.json`` only when it matches.
        ``anchor_every=0`` keeps every checkpoint (no pruning)."""
        root = Path(state_dir).expanduser().resolve()
        check_state_dir(recipe, root)
        state = cls(root, recipe, keep_checkpoints=keep_checkpoints, anchor_every=anchor_every)
        meta_path = root / SERVICE_FILE
        if not meta_path.exists():
            atomic_write_json(meta_path, {
                KEY_FORMAT: STATE_FORMAT,
                KEY_FINGERPRINT: recipe.fingerprint,
                KEY_LANES: recipe.lanes,
                KEY_RECIPE: recipe.canonical(),
                KEY_TIME: time.time(),
            })
        (root / CHECKPOINT_DIR).mkdir(exist_ok=True)
        return state

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_path(self, step: int) -> Path:
        return self.root / CHECKPOINT_DIR / f"step-{step:08d}.json"

    def checkpoint_steps(self) -> list[int]:
        if self._steps is None:  # one listing per open; later writes and prunes keep the index current
            out = []
            for entry in os.listdir(self.root / CHECKPOINT_DIR):
                m = _CHECKPOINT_RE.match(entry)
                if m:
                    out.append(int(m.group(1)))
            self._steps = sorted(out)
        return list(self._steps)

    def has_checkpoint(self, step: int) -> bool:
        self.checkpoint_steps()
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
        path = self.checkpoint_path(step)
        if not path.exists():
            atomic_write_json(path, state)
        self.checkpoint_steps()
        if not self.has_checkpoint(step):
            bisect.insort(self._steps, step)
        self.prune()
        return step

    def prune(self) -> list[int]:
        """Delete checkpoints that are neither among the newest ``keep_checkpoints`` nor an anchor (a multiple of
        ``anchor_every``) nor pinned; returns the deleted steps."""
        if not self.anchor_every:
            return []
        steps = self.checkpoint_steps()
        recent = set(steps[-self.keep_checkpoints:])
        doomed = [s for s in steps if s not in recent and s % self.anchor_every and s not in self.pinned]
        for step in doomed:
            self.checkpoint_path(step).unlink(missing_ok=True)
        if doomed:
            gone = set(doomed)
            self._steps = [s for s in self._steps if s not in gone]
        return doomed

    def read_checkpoint(self, step: int) -> dict[str, Any]:
        state = _read_json(self.checkpoint_path(step))
        check_step_state(state, self.recipe)
        return state

    def nearest_checkpoint(self, step: int) -> int | None:
        """The newest durable checkpoint step <= ``step`` (None: start from a fresh pipeline at step 0)."""
        self.checkpoint_steps()
        i = bisect.bisect_right(self._steps, step)
        return self._steps[i - 1] if i else None

    # ------------------------------------------------------------------ commits
    def _read_commits(self) -> dict[str, Any]:
        path = self.root / COMMITS_FILE
        if not path.exists():
            return {KEY_COMMITS: [], KEY_LATEST: {}}
        payload = _read_json(path)
        history = list(payload.get(KEY_COMMITS, []))
        latest = payload.get(KEY_LATEST)
        if latest is None:  # written before per-consumer commits: derive them from the history
            latest = {}
            for entry in history:
                latest[entry[KEY_CONSUMER]] = entry
        return {KEY_COMMITS: history, KEY_LATEST: latest}

    def commits(self) -> list[dict[str, Any]]:
        """The recent commit history, newest last."""
        return self._read_commits()[KEY_COMMITS]

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
        atomic_write_json(self.root / COMMITS_FILE, {KEY_FORMAT: STATE_FORMAT, KEY_COMMITS: history,
                                                     KEY_LATEST: latest})
        return entry

    def latest_commit(self) -> int | None:
        commits = self.commits()
        return int(commits[-1][KEY_STEP]) if commits else None
