"""The fields of a resolved config, one by one, with their values, defaults and descriptions: what
`rlhf config --explain` prints and the config reference (docs/config.md) is made from.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from stages.leaves.config import PPOConfig


@dataclass
class ConfigField:
    """One line of `rlhf config --explain`: a field of a resolved config, by dotted name."""

    name: str  # dotted: `ppo.generation.temperature`; list items as `eval.judges[0].name`
    value: Any  # JSON-like (tuples as lists, sections as mappings)
    default: Any  # the field's typed default, JSON-like
    description: str
    section: bool = False  # a nested section (or a list item): a heading, its fields follow
    effective: Any = None  # a PPO switch left at None: the value `ppo.preset` gives it


def config_fields(model: BaseModel, prefix: str = "") -> Iterator[ConfigField]:
    """Every field of `model`: its own values first, then each nested section as a heading
    followed by its fields (depth first). A list of sections (eval.judges) is a value; each item
    then follows as a heading with its own fields."""
    switches = model.switches() if isinstance(model, PPOConfig) else {}
    sections: list[tuple[str, BaseModel, str]] = []
    for name, field in type(model).model_fields.items():
        path = f"{prefix}{name}"
        value = getattr(model, name)
        description = " ".join((field.description or "").split())
        if isinstance(value, BaseModel):
            sections.append((path, value, description))
            continue
        effective = switches.get(name) if value is None else None
        yield ConfigField(path, to_jsonable_python(value), to_jsonable_python(field.get_default()), description,
                          effective=effective)
        if isinstance(value, list) and value and all(isinstance(item, BaseModel) for item in value):
            sections += [(f"{path}[{i}]", item, " ".join((type(item).__doc__ or "").split()))
                         for i, item in enumerate(value)]
    for path, value, description in sections:
        yield ConfigField(path, to_jsonable_python(value), None, description, section=True)
        yield from config_fields(value, f"{path}.")
