"""The run's schedule on the command line: ``--schedule-from STATE`` (a loader state or a service ``state_dir``)
adds the mixture phases and skips a run recorded while it trained to the recipe file's. Shared by the data and the
service commands.

Usage: ``recipe = load_recipe(args)`` in a command that takes ``RECIPE`` and ``--schedule-from``. Guarantee: the
recipe is the one the run trained on, so digests, ``show`` and ``locate`` name the run's own steps. Limits: a phase
that contradicts the recipe file is one line naming both; the recipe file itself must be the run's.
"""

from __future__ import annotations

import argparse
from typing import Any

from zephon_ray.errors import UserInputError
from zephon_ray.recipe import Recipe

SCHEDULE_FROM_HELP = (
    "take the mixture phases a run decided while it trained from this loader state (a JSON file, "
    "or a directory holding zephon_loader.json) or service state_dir, on top of the recipe's"
)


def load_recipe(args: argparse.Namespace, **kw: Any) -> Recipe:
    """``args.recipe``, with the run-time phases of ``args.schedule_from`` (a loader state or a service
    ``state_dir``) when given: a phase that contradicts the recipe file is one line naming both."""
    recipe = Recipe.from_toml(args.recipe, **kw)
    path = getattr(args, "schedule_from", None)
    return recipe if path is None else recipe_with_schedule(recipe, path)


def recipe_with_schedule(recipe: Recipe, path: str) -> Recipe:
    from zephon_ray import storage
    from zephon_ray.formats.loader_state import check_state, run_recipe
    from zephon_ray.formats.service_state import SERVICE_FILE, check_state_dir

    loc = storage.location(path)
    if storage.is_file(loc.join(SERVICE_FILE)):
        return check_state_dir(recipe, loc)
    state_file = loc if storage.is_file(loc) else loc.join("zephon_loader.json")
    if not storage.is_file(state_file):
        raise UserInputError(f"--schedule-from {path}: neither a loader state nor a service state_dir")
    state = storage.read_json(state_file, error=UserInputError, what="loader state")
    check_state(
        state,
        run_id=state.get("run_id") if isinstance(state, dict) else None,
        fingerprint=recipe.fingerprint,
        recipe=recipe,
        recipe_name=recipe.describe(),
    )
    return run_recipe(state, recipe)
