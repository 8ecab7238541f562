"""Shared by the config tests: the configuration's field names, read from the classes."""

from __future__ import annotations

from pydantic import BaseModel


def dotted_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of every non-section field (`ppo.generation.temperature`)."""
    keys = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += dotted_keys(sub, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys
