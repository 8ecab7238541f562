"""`rlhf config --explain`: the resolved config one field a line, with what changed each value; and
`--markdown`: the reference of every field (docs/config.md)."""

from __future__ import annotations

import types
import typing

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from stages.leaves.config import ConfigError, PipelineConfig
from stages.orchestration.config_fields import config_fields
from stages.orchestration.config_loading import load_config


def flow_style(value) -> str:
    """A value as one line of YAML (flow style), as `rlhf config` would print it."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, allow_unicode=True, width=1 << 30).strip()
    return text.removesuffix("\n...").strip()


def short(value) -> str:
    """A list of sections (eval.judges) by its items' names; anything else as `flow_style`."""
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        return "[" + ", ".join(str(v["name"]) for v in value) + "]"
    return flow_style(value)


def explain(cfg, preset: str, overrides: list[str]) -> str:
    """`rlhf config --explain`: every field of the resolved config, one line each: dotted name =
    value, then the typed default and what changed it (the preset or --set), then the
    description, which names the value's source. Sections are comment headings."""

    by_preset: dict | None = None
    if overrides:
        try:
            by_preset = {f.name: f.value for f in config_fields(load_config(preset))}
        except ConfigError:  # the preset alone does not validate: name both layers
            by_preset = None
    fields = list(config_fields(cfg))
    lefts = {}
    for f in fields:
        if f.section:
            continue
        left = f"{f.name} = {short(f.value)}"
        if f.effective is not None:
            left += f" (ppo.preset {cfg.ppo.preset}: {flow_style(f.effective)})"
        if f.value != f.default:
            if not overrides:
                layer = f"preset {cfg.preset}"
            elif by_preset is None:
                layer = f"preset {cfg.preset} or --set"
            else:
                layer = f"preset {cfg.preset}" if by_preset.get(f.name, object()) == f.value else "--set"
            left += f" (default {short(f.default)}, {layer})"
        lefts[f.name] = left
    width = max((len(left) for left in lefts.values() if len(left) <= 72), default=0)
    lines = [f"# rlhf config --preset {preset}" + "".join(f" --set {o}" for o in overrides)
             + ": name = value (default, changed by)  # description and source"]
    for f in fields:
        if f.section:
            lines.append(f"\n# {f.name}: {f.description}" if f.description else f"\n# {f.name}")
        else:
            lines.append(f"{lefts[f.name]:<{width}}  # {f.description}".rstrip())
    return "\n".join(lines)


REFERENCE_COMMAND = "rlhf config --explain --markdown > docs/config.md"


def _type_name(annotation) -> str:
    """A field's type as a reader writes it: `int | None`, `'stop' | 'warn'`, `list[str]`, a
    section's class name."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _sections_in(annotation) -> list:
    """The config sections (pydantic models) a field holds: itself one, or the items of a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [found for arg in typing.get_args(annotation) for found in _sections_in(arg)]


def _markdown_section(model: type, path: str, heading: str, description: str, depth: int) -> list[str]:
    """A config section as markdown: its heading and description, a table of its own fields (name,
    type, default, description), then each nested section at the next heading level."""

    def cell(text: str) -> str:
        """Text in a table cell: pipes escaped, and outside code spans `<` and `*`, which markdown
        would read as an HTML tag (`<prefix>`) or emphasis."""
        parts = text.replace("|", "\\|").replace("\n", " ").split("`")
        return "`".join(part if k % 2 else part.replace("<", "&lt;").replace("*", "\\*") for k, part in enumerate(parts))

    lines = [f"{'#' * depth} {heading}", ""]
    if description:
        lines += [description, ""]
    rows, nested = [], []
    for name, field in model.model_fields.items():
        dotted = f"{path}{name}"
        about = " ".join((field.description or "").split())
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            nested.append((field.annotation, f"{dotted}.", dotted, about))
            continue
        default = "(required)" if field.is_required() else \
            "`" + short(to_jsonable_python(field.get_default(call_default_factory=True))).replace("|", "\\|") + "`"
        rows.append(f"| `{dotted}` | {cell(_type_name(field.annotation))} | {default} | {cell(about)} |")
        for item in _sections_in(field.annotation):  # a list of sections (eval.judges): each kind's fields
            kind = item.model_fields.get("kind")
            title = f"{dotted}[] with kind: {kind.default}" if kind is not None else f"{dotted}[]"
            nested.append((item, f"{dotted}[].", title, " ".join((item.__doc__ or "").split())))
    if rows:
        lines += ["| field | type | default | description |", "|---|---|---|---|", *rows, ""]
    for section, prefix, title, about in nested:
        lines += _markdown_section(section, prefix, title, about, min(depth + 1, 4))
    return lines


def config_reference() -> str:
    """`rlhf config --explain --markdown`: every field of the config with its type, its typed
    default and its description (which names its source), one section per stage config; the
    page docs/config.md."""
    intro = " ".join([
        f"Generated from the fields of `stages/leaves/config.py` by `{REFERENCE_COMMAND}`: edit the",
        "`Field(description=…)` there, not this page. A preset (`infra/presets`) or `--set section.field=value`",
        "changes a value; `rlhf config --explain --preset NAME` prints a preset's values and what changed them.",
        "The defaults are the typed defaults (the paper's, where it gives one): the top-level fields first, then",
        "one section per stage and shared setting."])
    return "\n".join(_markdown_section(PipelineConfig, "", "Configuration reference", intro, 1)).rstrip() + "\n"
