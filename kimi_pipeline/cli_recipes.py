"""How every `kimi` command takes a recipe: the same --recipe/--set help and one loader with one error
behaviour (exit 2 naming each bad field), so `kimi run`, `kimi cluster …`, `kimi plan` and `kimi rehearse`
never disagree about what a recipe is."""

from __future__ import annotations

import typer
from rich.console import Console

from kimi_pipeline.recipes import Recipe, RecipeError, load_recipe

SET_HELP = "Override a recipe field: section.field=value (repeatable)."
RECIPE_HELP = "Preset name or YAML file (which may `extends:` a preset)."

_err = Console(stderr=True)


def _exit_with(e: RecipeError) -> typer.Exit:
    _err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
    return typer.Exit(2)


def recipe_or_exit(name: str, sets: list[str], check: bool = True) -> Recipe:
    """The recipe, or exit 2 with its problems."""
    try:
        return load_recipe(name, sets, check=check)
    except RecipeError as e:
        raise _exit_with(e) from None


def recipe_or_problems(name: str, sets: list[str], check: bool = True) -> Recipe | RecipeError:
    """For reports that must answer even for an invalid layout (`kimi plan`, `kimi rehearse`): the recipe or its
    problems; exit 2 only when there is no recipe to speak of (unknown preset, unreadable file)."""
    try:
        return load_recipe(name, sets, check=check)
    except RecipeError as e:
        if any(p.field in ("<name>", "<file>") for p in e.problems):
            raise _exit_with(e) from None
        return e
