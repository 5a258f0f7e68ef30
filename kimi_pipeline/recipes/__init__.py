"""Typed recipes: presets, overrides and the layout checks run before any GPU is touched."""

from kimi_pipeline.recipes.checks import Problem, check_recipe, pipeline_layers
from kimi_pipeline.recipes.load import RecipeError, load_recipe, preset_names, recipe_to_yaml
from kimi_pipeline.recipes.recipe import Recipe

__all__ = [
    "Problem",
    "Recipe",
    "RecipeError",
    "check_recipe",
    "load_recipe",
    "pipeline_layers",
    "preset_names",
    "recipe_to_yaml",
]
