"""Loading a config: recipe -> YAML files -> ``--set`` overrides, merged in that order and validated
into one :class:`~vitrain.config.schema.Config`."""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from vitrain.config.schema import Config, ConfigError


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader without YAML 1.1's base-60 numbers: ``2:3`` stays the string "2:3"
    (``train.profile=START:N``) instead of the integer 123; every other scalar reads as before."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
ConfigLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _format_validation_error(error: ValidationError, prefix: str = "") -> str:
    first = error.errors()[0]
    # drop list indices and union-member tags ("constrained-int", "literal[...]") from the path
    path = [part for part in first["loc"] if isinstance(part, str) and part.isidentifier()]
    key = ".".join(([prefix] if prefix else []) + path) or "<config>"
    if first["type"] == "extra_forbidden":
        return _unknown_key_message(key)
    got = first.get("input")
    shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return f"{key}: {first['msg']}{shown}; fix it in --config/--set (see `vitrain show-config`)"


def _fields_of(key: str) -> list[str]:
    """Dotted names of the keys beside ``key`` (its siblings), for suggestions."""
    parent, _, _ = key.rpartition(".")
    model: Any = Config
    for part in filter(None, parent.split(".")):
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
    prefix = f"{parent}." if parent else ""
    return [prefix + name for name in model.model_fields]


def _unknown_key_message(key: str) -> str:
    close = difflib.get_close_matches(key, _fields_of(key), n=1)
    hint = f"did you mean '{close[0]}'?" if close else "see `vitrain show-config` for the valid keys"
    return f"unknown config key '{key}'; {hint}"


def _deep_merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(text: str) -> dict:
    """``a.b=c`` -> ``{"a": {"b": c}}`` with ``c`` parsed as YAML (numbers, lists, null)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set '{text}': expected key=value, e.g. --set train.batch_size=128")
    try:
        value = yaml.load(raw, ConfigLoader) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML ({error.problem})") from None
    nested: dict = {}
    cursor = nested
    parts = key.split(".")
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    return nested


def load_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file; pass the path of a YAML config")
    try:
        loaded = yaml.load(path.read_text(), ConfigLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"--config {path}: not valid YAML ({error})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections at the top level")
    return loaded


MOVED_KEYS = {
    "train.ema_decay": "train.ema.decay",
    "train.ema_warmup": "train.ema.warmup",
    "train.ema_every_steps": "train.ema.every_steps",
    "train.ema_eval": "train.ema.evaluate",
    "train.distill": "train.distill.kind",
    "train.distill_alpha": "train.distill.alpha",
    "train.distill_tau": "train.distill.tau",
    "train.teacher": "train.distill.teacher",
    "train.teacher_weights": "train.distill.teacher_weights",
    "train.teacher_model": "train.distill.teacher_model",
    "data.token_labels": "token_labels.maps",
    "train.mix_token": "token_labels.mix_token",
    "train.mix_token_alpha": "token_labels.mix_token_alpha",
    "train.dense_weight": "token_labels.dense_weight",
    "train.cls_weight": "token_labels.cls_weight",
    "train.token_ground_truth": "token_labels.ground_truth",
    **{
        f"train.{key}": f"performance.{key}"
        for key in (
            "activation_checkpointing",
            "channels_last",
            "host_allocator",
            "cpu_kernels",
            "compile",
            "compile_backend",
            "compile_mode",
        )
    },
}
"""Keys of the flat schema (before the ema, distill, token_labels and performance sections) and where each
lives now. Given in --config/--set they fail naming the new key; in a saved config (checkpoints, exports,
config.yaml of older runs) they are moved."""


def _moved_keys_in(layer: dict) -> list[str]:
    """The old flat keys ``layer`` sets (``train.distill`` only as a value, not as the new section)."""
    found = []
    for old in MOVED_KEYS:
        section, key = old.split(".")
        values = layer.get(section)
        if isinstance(values, dict) and key in values and not isinstance(values[key], dict):
            found.append(old)
    return found


def _refuse_moved_keys(layer: dict, source: str) -> None:
    moved = _moved_keys_in(layer)
    if moved:
        old, new = moved[0], MOVED_KEYS[moved[0]]
        raise ConfigError(f"{source}: config key '{old}' is now '{new}'; rename it (see `vitrain show-config`)")


def migrate_moved_keys(saved: dict) -> dict:
    """``saved`` with the old flat keys moved to where they live now (a copy; other keys unchanged)."""
    migrated = copy.deepcopy(saved)
    for old in _moved_keys_in(saved):
        section, key = old.split(".")
        new_section, *middle, new_key = MOVED_KEYS[old].split(".")
        value = migrated[section].pop(key)
        target = migrated.setdefault(new_section, {})
        for part in middle:
            target = target.setdefault(part, {})
        target[new_key] = value
    return migrated


def stored_config(saved: dict) -> Config:
    """The config a checkpoint, an export or a run folder saved, written by this version or an older one."""
    try:
        return Config.model_validate(migrate_moved_keys(saved))
    except ValidationError as error:
        raise ConfigError(f"the saved config does not validate: {_format_validation_error(error)}") from None


LENGTH_KEYS = ("epochs", "steps", "samples", "budget")
"""train.* keys that each give the run's length; a layer that sets one clears the others."""


def _merge_layer(merged: dict, layer: dict, source: str) -> dict:
    _refuse_moved_keys(layer, source)
    train_layer = layer.get("train") if isinstance(layer.get("train"), dict) else {}
    lengths = [key for key in LENGTH_KEYS if train_layer.get(key) is not None]
    if len(lengths) > 1:
        raise ConfigError(f"{source} sets train.{lengths[0]} and train.{lengths[1]}: the run has one length; keep one")
    if lengths and isinstance(merged.get("train"), dict):
        merged = {**merged, "train": {**merged["train"], **{key: None for key in LENGTH_KEYS}}}
    return _deep_merge(merged, layer)


def build_config(base: Config, files: list[Path] = (), overrides: list[str] = ()) -> Config:
    """Layer YAML files and ``key=value`` overrides over ``base``; validate once."""
    merged = base.model_dump(mode="json")
    for path in files:
        merged = _merge_layer(merged, load_yaml(Path(path)), f"--config {path}")
    for text in overrides:
        merged = _merge_layer(merged, parse_override(text), f"--set {text}")
    try:
        return Config.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error)) from None


def config_to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
