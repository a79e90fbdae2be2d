"""Named recipes: functions returning a Config. A variant calls its base and changes fields.

Each docstring says how to run it and what it is expected to reach.
"""

from __future__ import annotations

from collections.abc import Callable

from vitrain.config import Config, ConfigError

RecipeFn = Callable[[], Config]
_RECIPES: dict[str, RecipeFn] = {}
DEFAULT_RECIPE = "fmnist"


def register_recipe(function: RecipeFn) -> RecipeFn:
    _RECIPES[function.__name__] = function
    return function


def get_recipe(name: str) -> Config:
    if name not in _RECIPES:
        raise ConfigError(
            f"--recipe {name!r} is not known; choose one of {', '.join(sorted(_RECIPES))} (`vitrain list-recipes`)"
        )
    config = _RECIPES[name]()
    config.recipe = name
    return config


def list_recipes() -> dict[str, str]:
    return {name: (function.__doc__ or "").strip() for name, function in sorted(_RECIPES.items())}


from vitrain.recipes import budget, fmnist, imagenet, images, papers  # noqa: E402,F401  (registers the recipes)
