"""Loading a config: a preset file from `infra/presets/`, `--set section.key=value` overrides
merged over it, unknown keys named with the closest known one, and a config recorded by an earlier
version (a pipeline run's config.json) upgraded to today's keys; and where a named DeepSpeed
config lives. The sections themselves, their defaults and validation, are stages.leaves.config's.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from stages.leaves.config import REPO_ROOT, ConfigError, PipelineConfig

PRESETS_DIR = REPO_ROOT / "infra" / "presets"
DEEPSPEED_DIR = REPO_ROOT / "infra" / "deepspeed"


def _known_keys(model: type[BaseModel]) -> list[str]:
    return sorted(model.model_fields)


# Keys that were renamed or replaced: an old config names the new key instead of failing as unknown.
RENAMED = {
    "sft.eval_examples": "sft.heldout_prompts",
    "reward.eval_pairs": "reward.heldout_pairs",
    "critic.eval_prompts": "critic.heldout_prompts",
    "ppo.eval_prompts": "ppo.heldout_prompts",
    "eval.prompts": "eval.heldout_prompts",
    "model.dtype": "model.precision",
    "ppo.autocast": "model.precision",
    "eval.champion_margin": "eval.champion_min_lower_bound",
    "sft.gradient_checkpointing": "model.gradient_checkpointing",  # one switch for every trained model
}


def upgrade_recorded(values: dict) -> dict:
    """A config recorded by an earlier version (a pipeline run's config.json, which `--resume`
    reuses) with its renamed keys under their new names: the run resumes with the values it had."""
    out = json.loads(json.dumps(values))
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = out.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        if old == "model.dtype":  # the weights' dtype was the whole precision then (ppo.autocast aside)
            value = "bf16" if value == "bfloat16" else "fp32"
        elif old in ("ppo.autocast", "eval.champion_margin"):  # no value of the new key means the same
            continue
        out.setdefault(new_section, {})[new_key] = value
    for judge in out.get("eval", {}).get("judges", []):
        if isinstance(judge, dict) and "prompts" in judge:
            judge["max_prompts"] = judge.pop("prompts")
    return out


def _check_keys(model: type[BaseModel], values: dict, where: str, prefix: str = "") -> None:
    """Name the first unknown key with its dotted path, the file it came from and the choices."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        field = model.model_fields.get(key)
        if field is None and path in RENAMED:
            raise ConfigError(f"{where}: '{path}' was renamed to '{RENAMED[path]}' (see rlhf config --explain)")
        if field is None:
            close = difflib.get_close_matches(key, _known_keys(model), 1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{where}: unknown key '{path}'{hint}; known keys here: {', '.join(_known_keys(model))}"
            )
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{path}' is a section and needs a mapping, got {value!r}")
            _check_keys(sub, value, where, prefix=f"{path}.")


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_yaml(text: str, where: str) -> Any:
    """YAML text → values; any fault in the text is a ConfigError naming `where`."""
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError) as err:  # also: ints past 4300 digits, nesting too deep
        raise ConfigError(f"{where}: not valid YAML ({err})") from None


def parse_override(text: str) -> dict:
    """`sft.lr=2e-5` → {"sft": {"lr": 2e-05}}; values are read as YAML scalars/lists."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}': expected section.key=value")
    value = _load_yaml(raw, f"override '{text}'") if raw.strip() else None
    if isinstance(value, str):
        # YAML 1.1 reads 2e-5 as a string; numbers in overrides should be numbers.
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def nest_overrides(overrides: dict | list[str] | None) -> dict:
    """Accept `{"sft": {"lr": 1e-5}}`, `{"sft.lr": 1e-5}` or `["sft.lr=1e-5"]`."""
    if not overrides:
        return {}
    if isinstance(overrides, (list, tuple)):
        merged: dict = {}
        for item in overrides:
            merged = _deep_merge(merged, parse_override(str(item)))
        return merged
    merged = {}
    for key, value in overrides.items():
        if "." in key:
            node: dict = {}
            leaf = node
            parts = key.split(".")
            for part in parts[:-1]:
                leaf = leaf.setdefault(part, {})
            leaf[parts[-1]] = value
            merged = _deep_merge(merged, node)
        else:
            merged = _deep_merge(merged, {key: value})
    return merged


def preset_path(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"preset file {path} does not exist")
        return path
    path = PRESETS_DIR / f"{preset}.yaml"
    if not path.exists():
        names = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown preset '{preset}'; presets: {', '.join(names)}")
    return path


def load_config(preset: str = "demo", overrides: dict | list[str] | None = None) -> PipelineConfig:
    path = preset_path(preset)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 (byte {err.start})") from None
    values = _load_yaml(text, str(path)) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a preset must be a mapping of sections")
    _check_keys(PipelineConfig, values, str(path))
    extra = nest_overrides(overrides)
    _check_keys(PipelineConfig, extra, "override")
    merged = _deep_merge(values, extra)
    merged.setdefault("preset", path.stem)
    try:
        return PipelineConfig.model_validate(merged)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path} + overrides: '{loc}': {first['msg']} (got {first.get('input')!r})") from None


def deepspeed_config_path(name: str) -> Path:
    path = Path(name)
    if not path.suffix:
        path = DEEPSPEED_DIR / f"{name}.json"
    if not path.exists():
        raise ConfigError(f"DeepSpeed config {path} does not exist")
    return path
