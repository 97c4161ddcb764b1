"""The loader state: small, JSON-safe, versioned, and identical on every reader. Owner of the format, and the one
place its layout is written down (the docs and the loader point here).

Usage: the loader builds a state with :func:`make_state` at a step boundary and checks a loaded one with
:func:`check_state`; a trainer stores it as it comes (TorchTitan's DCP, Ray Train's checkpoint, a JSON file).

Layout (format version 4); every key is always present::

    {
      "version":        4,              # STATE_VERSION; anything else is refused
      "run_id":         "my-run",       # the loader config's run_id ("" when unset)
      "fingerprint":    "<sha256>",     # Recipe.fingerprint
      "next_step":      12,             # first global step not yet consumed
      "zephon":         "<json>" | "",  # local mode: newest merged Zephon checkpoint at or before next_step;
                                        # "" when there is none (always so in service and dataset mode)
      "replayed_steps": 0,              # steps this run re-produced to resume without an exact checkpoint, so far
      "ledger":         "<segment id>", # the ledger segment that ends at next_step ("" at step 0): the lineage
                                        # of the weights (zephon_ray.formats.ledger)
      "run_schedule":   "<json>" | "",  # {"phases": [...], "skips": [...]}: the mixture phases the run decided
    }                                   # beyond its recipe file (a service's add_phase, Loader.add_phase) and
                                        # every deliberate skip of its schedule; every resume replays them

``next_step`` counts training steps; the data step a training step reads is ``Recipe.data_step`` of it (the same
unless the run skips data: ``[[skips]]``), and ``fingerprint`` and ``zephon`` describe the data read so far
(``Recipe.data_next``).

Guarantee: the same state on every reader, loadable at any data-parallel degree and in any mode. Limits: a state of
another format version is refused with a message saying so (DCP loads by key, so the key set is part of the
format), and :func:`check_state` refuses a state that lacks a key or has one more, naming it.

Every value is a str or an int, so DCP stores each key once (every rank holds the same value) and the state loads
at any data-parallel degree. The merged Zephon checkpoint is kept as one JSON string rather than a nested dict so
the *set of keys* never depends on the Zephon version or on the run's progress: DCP loads by key, and a template
taken before iteration must name exactly the keys that a saved state holds. Nothing here is pickled.
"""

from __future__ import annotations

import json
from typing import Any

from zephon_ray.checks import check_int

STATE_VERSION = 4
KEY_VERSION = "version"
KEY_RUN_ID = "run_id"
KEY_FINGERPRINT = "fingerprint"
KEY_NEXT_STEP = "next_step"
KEY_ZEPHON = "zephon"
KEY_REPLAYED_STEPS = "replayed_steps"
KEY_LEDGER = "ledger"
KEY_RUN_SCHEDULE = "run_schedule"
STATE_KEYS = (
    KEY_VERSION,
    KEY_RUN_ID,
    KEY_FINGERPRINT,
    KEY_NEXT_STEP,
    KEY_ZEPHON,
    KEY_REPLAYED_STEPS,
    KEY_LEDGER,
    KEY_RUN_SCHEDULE,
)
MAX_SCHEDULE_ENTRIES = 4096
"""Phases, and skips, one state may record."""


class LoaderStateError(ValueError):
    """A loader state that cannot be taken or loaded; the message names what differs."""


def make_state(
    *,
    run_id: str | None,
    fingerprint: str,
    next_step: int,
    zephon: dict[str, Any] | None,
    replayed_steps: int = 0,
    ledger: str = "",
    schedule: dict[str, list] | None = None,
) -> dict:
    """``schedule``: :func:`schedule_of` the run's recipe (its run-time phases and its skips)."""
    return {
        KEY_VERSION: STATE_VERSION,
        KEY_RUN_ID: run_id or "",
        KEY_FINGERPRINT: fingerprint,
        KEY_NEXT_STEP: int(next_step),
        KEY_ZEPHON: "" if zephon is None else json.dumps(zephon, sort_keys=True, separators=(",", ":")),
        KEY_REPLAYED_STEPS: int(replayed_steps),
        KEY_LEDGER: ledger,
        # phases' weights in recipe source order (no sort_keys): readable, and the same on every rank
        KEY_RUN_SCHEDULE: json.dumps(schedule, separators=(",", ":")) if schedule and any(schedule.values()) else "",
    }


def schedule_of(recipe: Any, base: Any) -> dict[str, list]:
    """What a state records of the run's schedule ``recipe`` beyond its recipe file ``base``: the phases the run
    decided while it trained, and every skip (a resume then refuses a file that rewrites a past one)."""
    return {"phases": recipe.run_phases(base), "skips": [s.canonical() for s in recipe.skips]}


_SCHEDULE_KEYS = {"phases": {"name", "start_step", "weights"}, "skips": {"name", "start_step", "end_step"}}


def run_schedule(state: dict) -> dict[str, list]:
    """The run's schedule a (checked) state records: ``{"phases": [...], "skips": [...]}``, oldest first."""
    blob = state.get(KEY_RUN_SCHEDULE, "")
    if not isinstance(blob, str):
        raise LoaderStateError(
            f"loader state key '{KEY_RUN_SCHEDULE}' must be a JSON string or \"\", got {type(blob).__name__}"
        )
    if not blob:
        return {"phases": [], "skips": []}
    try:
        value = json.loads(blob)
    except ValueError as exc:
        raise LoaderStateError(f"loader state key '{KEY_RUN_SCHEDULE}' is not valid JSON: {exc}") from None
    if (
        not isinstance(value, dict)
        or set(value) != set(_SCHEDULE_KEYS)
        or not all(
            isinstance(value[k], list)
            and len(value[k]) <= MAX_SCHEDULE_ENTRIES
            and all(isinstance(e, dict) and set(e) == fields for e in value[k])
            for k, fields in _SCHEDULE_KEYS.items()
        )
    ):
        raise LoaderStateError(
            f"loader state key '{KEY_RUN_SCHEDULE}' must be a table of 'phases' {{name, "
            f"start_step, weights}} and 'skips' {{name, start_step, end_step}} lists of at most "
            f"{MAX_SCHEDULE_ENTRIES} each"
        )
    return value


def added_phases(state: dict) -> list[dict[str, Any]]:
    """The phases a (checked) state records that the run decided while it trained."""
    return run_schedule(state)["phases"]


def check_state(state: Any, *, run_id: str | None, fingerprint: str, recipe_name: str, recipe: Any = None) -> int:
    """Validate a saved state against this run; return its ``next_step``. Raises :class:`LoaderStateError`.

    With ``recipe`` (a :class:`~zephon_ray.recipe.Recipe`), the state's fingerprint is compared with the history
    fingerprint at ``next_step`` of ``recipe`` with the phases the state records (:func:`run_recipe`): a recipe with
    mixture phases may change the phases that start at or after the state's ``next_step`` (docs/recipes.md, "Mixture
    schedules"), except the ones the run recorded; ``make_state`` then takes that fingerprint too. For a recipe
    without phases it is ``recipe.fingerprint``."""
    if not isinstance(state, dict):
        raise LoaderStateError(f"loader state must be a dict, got {type(state).__name__}")
    if KEY_VERSION not in state:
        raise LoaderStateError(f"loader state lacks key '{KEY_VERSION}' (keys present: {sorted(map(str, state))})")
    version = state[KEY_VERSION]
    if version != STATE_VERSION:
        raise LoaderStateError(
            f"loader state key '{KEY_VERSION}': version {version!r} is not supported (expected "
            f"{STATE_VERSION}; version 2 added '{KEY_REPLAYED_STEPS}', version 3 "
            f"'{KEY_LEDGER}', version 4 '{KEY_RUN_SCHEDULE}')"
        )
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise LoaderStateError(
            f"loader state lacks key '{missing[0]}' (format {STATE_VERSION} has {STATE_KEYS}; "
            f"keys present: {sorted(map(str, state))})"
        )
    extra = sorted(str(k) for k in state if k not in STATE_KEYS)
    if extra:
        raise LoaderStateError(f"loader state has unknown key '{extra[0]}' (format {STATE_VERSION} has {STATE_KEYS})")
    if recipe is not None:
        step = state[KEY_NEXT_STEP]
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            recipe = run_recipe(state, recipe)
            fingerprint = recipe.history_fingerprint(recipe.data_next(step))
            if state[KEY_FINGERPRINT] != fingerprint and recipe.phases:
                raise LoaderStateError(
                    f"loader state key '{KEY_FINGERPRINT}': "
                    + _schedule_mismatch(state, recipe, recipe.data_next(step))
                )
    if state[KEY_FINGERPRINT] != fingerprint:
        raise LoaderStateError(
            f"loader state key '{KEY_FINGERPRINT}': the checkpoint was written for recipe fingerprint "
            f"{str(state[KEY_FINGERPRINT])[:12]}, but this run uses {recipe_name} (fingerprint {fingerprint[:12]}); "
            "resume with the recipe the run started with"
        )
    saved_run = state[KEY_RUN_ID]
    if not isinstance(saved_run, str):
        raise LoaderStateError(f"loader state key '{KEY_RUN_ID}' must be a string, got {saved_run!r}")
    if saved_run != (run_id or ""):
        raise LoaderStateError(
            f"loader state key '{KEY_RUN_ID}': the checkpoint belongs to run_id {saved_run!r}, "
            f"but this loader has run_id {run_id!r}"
        )
    step = check_int(f"loader state key '{KEY_NEXT_STEP}'", state[KEY_NEXT_STEP], low=0, error=LoaderStateError)
    head = state[KEY_LEDGER]
    if not isinstance(head, str) or (head and not (len(head) == 24 and all(c in "0123456789abcdef" for c in head))):
        raise LoaderStateError(
            f"loader state key '{KEY_LEDGER}' must be a ledger segment id (24 hex digits) or \"\", "
            f"got {str(head)[:40]!r}"
        )
    return step


def run_recipe(state: dict, recipe: Any) -> Any:
    """``recipe`` with the schedule the state records (``run_schedule``): the run's phases and skips, which a resume
    serves whatever the recipe file says about them; one that contradicts the file, or a skip of the file that
    rewrites the run's past, is one :class:`LoaderStateError`."""
    schedule = run_schedule(state)
    try:
        return recipe.with_run_phases(schedule["phases"], what="the loader state's run").with_run_skips(
            schedule["skips"], int(state[KEY_NEXT_STEP]), what="the loader state's run"
        )
    except ValueError as exc:
        if isinstance(exc, LoaderStateError):
            raise
        raise LoaderStateError(f"loader state key '{KEY_RUN_SCHEDULE}': {exc}") from None


def _schedule_mismatch(state: dict, recipe: Any, step: int) -> str:
    """Name the phase that differs at data step ``step``: exactly from the schedule a local-mode Zephon state
    records, else from where the saved fingerprint sits in the recipe's chain."""
    try:
        inner = json.loads(state[KEY_ZEPHON]) if state[KEY_ZEPHON] else None
    except ValueError:
        inner = None
    if isinstance(inner, dict) and isinstance(inner.get("schedule"), list):
        try:
            recipe.check_history(inner["schedule"], step, what="the checkpoint")
        except ValueError as exc:
            return str(exc)
    chain = list(recipe.schedule_fingerprints)
    used = recipe.phase_index(max(step - 1, 0))
    saved = state[KEY_FINGERPRINT]
    if saved in chain and chain.index(saved) < used:
        first = recipe.phases[chain.index(saved)]
        return (
            f"phase '{first.name}' starts at step {first.start_step}, before step {step}, which the run has "
            f"already produced without it; a resume at step {step} may only add phases starting at or after step "
            f"{step}"
        )
    before = ", ".join(f"'{p.name}' (start_step {p.start_step})" for p in recipe.phases[:used]) or "none"
    return (
        f"the checkpoint's schedule before step {step} (fingerprint {str(saved)[:12]}) is not "
        f"{recipe.describe()}'s (its phases before step {step}: {before}): a resume at step {step} may only change "
        f"phases starting at or "
        f"after step {step}"
    )


def zephon_state(state: dict, *, next_step: int | None = None) -> dict[str, Any] | None:
    """The merged Zephon checkpoint carried by a state, or None (its ``zephon`` is ""). Its own ``next_step``
    must be an int, at or before the state's ``next_step`` when that is given."""
    blob = state.get(KEY_ZEPHON, "")
    if not isinstance(blob, str):
        raise LoaderStateError(
            f"loader state key '{KEY_ZEPHON}' must be a JSON string or \"\", got {type(blob).__name__}"
        )
    if not blob:
        return None
    try:
        value = json.loads(blob)
    except ValueError as exc:
        raise LoaderStateError(f"loader state key '{KEY_ZEPHON}' is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise LoaderStateError(f"loader state key '{KEY_ZEPHON}' must hold a JSON object")
    at = check_int(
        f"loader state key '{KEY_ZEPHON}': the Zephon checkpoint's '{KEY_NEXT_STEP}'",
        value.get(KEY_NEXT_STEP),
        low=0,
        error=LoaderStateError,
    )
    if next_step is not None and at > next_step:
        raise LoaderStateError(
            f"loader state key '{KEY_ZEPHON}': the Zephon checkpoint is at step {at}, after "
            f"'{KEY_NEXT_STEP}' {next_step}"
        )
    return value


def replayed_steps(state: dict) -> int:
    """The ``replayed_steps`` a state carries (non-negative)."""
    return check_int(
        f"loader state key '{KEY_REPLAYED_STEPS}'", state.get(KEY_REPLAYED_STEPS, 0), low=0, error=LoaderStateError
    )
