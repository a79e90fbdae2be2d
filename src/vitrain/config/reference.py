"""Every config key as a Markdown reference: one table per section, each key with its default and its doc.

The page is docs/reference.md, written by ``python -m vitrain.config.reference > docs/reference.md``; the docs
tests fail when it differs from :func:`markdown`."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from vitrain.config.schema import Config

REGENERATE = "PYTHONPATH=src python -m vitrain.config.reference > docs/reference.md"
"""The command that writes docs/reference.md."""

HEADER = f"""# Config key reference

Every key of a run's config, with its default (before a recipe changes it) and what it does. Set one with
`--set section.key=value` or in a `--config` YAML file; `vitrain show-config --raw` prints a recipe's values.
How the layers combine and what `resolve()` derives: [config.md](config.md).

Generated from `src/vitrain/config/schema.py`; do not edit by hand: `{REGENERATE}`.
"""


def _section_model(annotation: object) -> type[BaseModel] | None:
    """The section class a field holds, itself or as the items of a list; None for plain values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return _section_model(item)
    return None


def _value(value: object) -> str:
    """A default as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _cell(text: str) -> str:
    """One line of text that a Markdown table cell shows as written."""
    text = " ".join(text.split())
    for char, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;")):
        text = text.replace(char, escaped)
    return text


def _row(name: str, field: FieldInfo) -> str:
    default = "required" if field.is_required() else f"`{_value(field.get_default(call_default_factory=True))}`"
    return f"| `{name}` | {default} | {_cell(field.description or '')} |"


def _sections(model: type[BaseModel], title: str, doc: str | None) -> Iterator[tuple[str, str, list[str]]]:
    """(title, doc, table rows) of a section, then of each section nested in it, depth first."""
    rows, nested = [], []
    prefix = "" if title == "top level" else f"{title}."
    for name, field in model.model_fields.items():
        inner = _section_model(field.annotation)
        if inner is None or typing.get_origin(field.annotation) is list:
            rows.append(_row(prefix + name, field))
        if inner is not None:
            suffix = "[]" if typing.get_origin(field.annotation) is list else ""
            nested.append((inner, f"{prefix}{name}{suffix}", inner.__doc__ or field.description))
    yield title, doc or "", rows
    for inner, inner_title, inner_doc in nested:
        yield from _sections(inner, inner_title, inner_doc)


def markdown() -> str:
    """docs/reference.md: every config key, one table per section (nested sections as their own tables)."""
    parts = [HEADER]
    for title, doc, rows in _sections(Config, "top level", None):
        if not rows:
            continue
        parts.append(f"## {title}\n")
        if doc:
            parts.append(_cell(doc) + "\n")
        parts.append("\n".join(["| key | default | what it does |", "|---|---|---|", *rows]) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(markdown(), end="")
