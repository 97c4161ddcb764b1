"""The service's durable state under ``state_dir``.

Layout (every file is written atomically: temp file, fsync, ``os.replace``, fsync of the directory)::

    state_dir/
      service.json                  # format version, recipe fingerprint, lanes, the recipe's canonical content
      checkpoints/step-00000032.json # merged Zephon checkpoint at the boundary *before* step 32 (LaneStepper state)
      commits.json                  # trainer commits, newest last

Guarantee: a reader never sees a half-written file, and a ``state_dir`` is only ever paired with the recipe
whose fingerprint it records: :meth:`ServiceState.open` refuses any other recipe before writing anything.
Limits: one writer at a time (the coordinator); no locking against two services pointed at the same
``state_dir``. Checkpoints are all kept (a few tens of KiB each), so that any past step stays reachable with at
most K steps of replay.
"""

from __future__ import annotations

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
MAX_COMMITS = 1000
"""Commits kept in commits.json (newest last); older ones are dropped so the file stays small."""
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

    def __init__(self, root: Path, recipe: Recipe) -> None:
        self.root = root
        self.recipe = recipe

    @classmethod
    def open(cls, recipe: Recipe, state_dir: str | os.PathLike) -> "ServiceState":
        """Check the fingerprint first; create the directory and ``service.json`` only when it matches."""
        root = Path(state_dir).expanduser().resolve()
        check_state_dir(recipe, root)
        state = cls(root, recipe)
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
        out = []
        for entry in os.listdir(self.root / CHECKPOINT_DIR):
            m = _CHECKPOINT_RE.match(entry)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def has_checkpoint(self, step: int) -> bool:
        return self.checkpoint_path(step).exists()

    def write_checkpoint(self, state: dict[str, Any]) -> int:
        """Validate (recipe, step boundary) and store a merged checkpoint; returns its step. First writer wins:
        every checkpoint of one step restores the same batches, so an existing file is kept."""
        check_step_state(state, self.recipe)
        step = int(state[KEY_NEXT_STEP])
        path = self.checkpoint_path(step)
        if not path.exists():
            atomic_write_json(path, state)
        return step

    def read_checkpoint(self, step: int) -> dict[str, Any]:
        state = _read_json(self.checkpoint_path(step))
        check_step_state(state, self.recipe)
        return state

    def nearest_checkpoint(self, step: int) -> int | None:
        """The newest durable checkpoint step <= ``step`` (None: start from a fresh pipeline at step 0)."""
        best = None
        for s in self.checkpoint_steps():
            if s <= step:
                best = s
        return best

    # ------------------------------------------------------------------ commits
    def commits(self) -> list[dict[str, Any]]:
        path = self.root / COMMITS_FILE
        if not path.exists():
            return []
        return list(_read_json(path).get(KEY_COMMITS, []))

    def add_commit(self, step: int, consumer: str) -> dict[str, Any]:
        entry = {KEY_STEP: int(step), KEY_CONSUMER: str(consumer), KEY_TIME: time.time()}
        commits = (self.commits() + [entry])[-MAX_COMMITS:]
        atomic_write_json(self.root / COMMITS_FILE, {KEY_FORMAT: STATE_FORMAT, KEY_COMMITS: commits})
        return entry

    def latest_commit(self) -> int | None:
        commits = self.commits()
        return int(commits[-1][KEY_STEP]) if commits else None
