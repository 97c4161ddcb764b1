"""Recipes shipped inside the package, addressable by bare name (``tiny``, ``elastic``, ``demo``, ``mixture``).

In the source checkout ``zephon_ray/recipes`` is a symlink to the top-level ``recipes/``; a wheel carries real
copies of the same files (``pyproject.toml`` package data), so one copy lives in git and both work the same way.

Guarantee: ``resolve_recipe_path(arg)`` returns ``arg`` unchanged when it names an existing file, else the
packaged ``<arg>.toml``; anything else is an :class:`UnknownRecipeError` (a ``ValueError``; ``Recipe.from_toml``
re-raises it as its ``RecipeError``) that lists the packaged names, from an installed wheel as from the checkout.
Limit: ``demo`` and ``mixture`` read the stdlib corpus at ``../data/corpus`` next to the recipe directory, which a
wheel cannot ship (it is generated per Python version by ``zephon-ray corpus``); only ``tiny``, ``elastic`` and
``phased`` (tiny's fixture with a mixture schedule) are self-contained. Copy those recipes and point their
``[[sources]] path`` at your corpus instead.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGED_RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
"""``zephon_ray/recipes`` (a symlink to ``recipes/`` in the checkout, a real directory in a wheel)."""
RECIPE_SUFFIX = ".toml"


class UnknownRecipeError(ValueError):
    """Neither an existing recipe file nor a packaged recipe name; the message lists the packaged names."""


def packaged_recipe_names() -> list[str]:
    """Bare names of the packaged recipes, sorted."""
    if not PACKAGED_RECIPES_DIR.is_dir():
        return []
    return sorted(p.stem for p in PACKAGED_RECIPES_DIR.glob(f"*{RECIPE_SUFFIX}") if p.is_file())


def packaged_recipe(name: str) -> Path | None:
    """The packaged recipe file called ``name`` (with or without ``.toml``), or None."""
    stem = name[: -len(RECIPE_SUFFIX)] if name.endswith(RECIPE_SUFFIX) else name
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return None
    path = PACKAGED_RECIPES_DIR / f"{stem}{RECIPE_SUFFIX}"
    return path if path.is_file() else None


def resolve_recipe_path(arg: str | os.PathLike[str]) -> Path:
    """An existing file wins; otherwise a bare name is looked up among the packaged recipes."""
    path = Path(arg)
    if path.is_file():
        return path
    found = packaged_recipe(str(arg))
    if found is not None:
        return found
    names = ", ".join(packaged_recipe_names()) or "none installed"
    raise UnknownRecipeError(f"recipe file not found: {arg} (not a file, nor a packaged recipe name: {names})")
