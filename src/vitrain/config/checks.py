"""Helpers every part of :func:`~vitrain.config.resolve.resolve` checks with: a requirement that raises
:class:`ConfigError`, the model catalog's facts of a name, and the keys of a section left on while the section is off."""

from __future__ import annotations

from typing import Any

from vitrain.config.plan import ModelFacts, ModelLookup
from vitrain.config.schema import ConfigError


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def model_facts_of(name: str, models: ModelLookup, key: str = "model.name") -> ModelFacts:
    """What the model catalog knows of ``name``; an unknown name is a ConfigError on ``key``."""
    try:
        return models(name)
    except KeyError as error:
        raise ConfigError(f"{key}: {error.args[0]}") from None


def changed_keys(section: Any, on: str) -> list[str]:
    """The keys of ``section`` other than ``on`` that differ from their defaults."""
    fields = type(section).model_fields
    return [key for key in fields if key != on and getattr(section, key) != fields[key].default]


def require_unused(section: Any, name: str, on: str, without: str, how: str) -> None:
    """Keys of a section that is off (``on`` at its default) change nothing: a mistake, named with the fix."""
    changed = changed_keys(section, on)
    if changed:
        key = changed[0]
        raise ConfigError(f"{name}.{key}={getattr(section, key)} has no effect without {without}; {how} or remove it")
