"""The pipeline's stages, in order: one typed entry each. The flow, the stage cache keys and the
lineage config hash, the contract gates, `rlhf runs`, the served deployments and
`infra/prefect.yaml` (checked by a test) all read this table; nothing else lists the stages.

Adding a stage is its module (`run(cfg, tracker, inputs, dist) -> outputs`, optionally
`prepare(cfg, inputs, downloads) -> dict`, work done once in the launching process before any rank
starts; what it copies from a remote store goes into `downloads`, deleted when the stage ends;
optionally `check(cfg)`, which raises a ConfigError for a setting the stage cannot run with, and
`skip_reason(cfg)`, why this configuration needs no such stage), its config class (a section of
`PipelineConfig`) and one `Stage` entry here (or `register(...)`). See docs/architecture.md.

The stage modules are named, not imported: this table sits below them in the import rule
(pyproject.toml [tool.importlinter]), and `Stage.load` imports one only when it is asked about.
So is the data contracts' check (`CONTRACT_CHECK`), which a stage that runs a contract while it
trains (PPO's collapse guard) is handed: data_contracts reads what stages make, so no stage
imports it.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

from stages.leaves.config import CriticRollouts, PipelineConfig


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # importable module with `run` (and maybe `prepare`)
    # Config sections ("sft") or single fields ("ppo.gamma") that the stage's outputs depend on:
    # with its inputs, the key under which a rerun reuses the stage, and the lineage config hash.
    config: tuple[str, ...]
    inputs: tuple[str, ...] = ()  # outputs of earlier stages it reads (every one it reads)
    optional_inputs: tuple[str, ...] = ()  # of those, read only when an earlier stage made them
    outputs: tuple[str, ...] = ()  # what it returns besides `<name>_run` (its MLflow run id)
    registers: str | None = None  # the registered model `<registry_prefix>-<registers>`
    model_output: str | None = None  # the output naming that model version (the gate tags it)
    # The data contract after the stage: GX suite → the output holding its probe frame.
    contract: dict[str, str] = field(default_factory=dict)
    # A resumed attempt continues from the last checkpoint in the MLflow run of the attempt that
    # was killed (run_writers.PipelineRun.stage): one run holds the whole history, each step once.
    resumes: bool = False
    gpu: bool = True  # trains or runs models: served on the GPU work pool, Prefect tag `gpu`
    deployed: bool = True  # served as the deployment `rlhf/<name>` (reads the rest from `from_run`)
    # Run by a pipeline run that names no stages; False: only by a run or a flow that names it
    # (a study's best-of-n draws, which need the study's n, seed and gold RM).
    in_pipeline: bool = True
    # Metrics `rlhf runs` and a run's ending show, in order (`*` matches any part of a name); one
    # logged at step 0 and again later shows as before → after.
    headline: tuple[str, ...] = ()

    @property
    def run_output(self) -> str:
        return f"{self.name}_run"

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    def config_hash(self, cfg: PipelineConfig) -> str:
        """Hash of what the stage's outputs depend on besides its inputs (`config`): its lineage tag
        `rlhf.config_hash` and, with its input URIs, its cache key."""
        return cfg.section_hash(*self.config)

    def check(self, cfg: PipelineConfig) -> None:
        """The stage module's `check(cfg)`, if it has one: the flow runs it before any stage starts."""
        check = getattr(self.load(), "check", None)
        if check is not None:
            check(cfg)

    def skipped(self, cfg: PipelineConfig) -> str | None:
        """Why this configuration does not run the stage (its module's `skip_reason(cfg)`), or None."""
        skip_reason = getattr(self.load(), "skip_reason", None)
        return skip_reason(cfg) if skip_reason is not None else None


# (suite, probe frame, cfg) → the suite's report: the gates' check, for a stage to run while it trains.
CONTRACT_CHECK = "data_contracts.gate:validate"


def contract_check() -> Callable:
    """The data contracts' check (`CONTRACT_CHECK`), imported when a stage asks for it."""
    module, _, name = CONTRACT_CHECK.partition(":")
    return getattr(importlib.import_module(module), name)


PIPELINE = ("model", "data", "sft", "reward")  # the sections every model stage depends on, in order

STAGES: dict[str, Stage] = {}


def register(stage: Stage, after: str | None = None) -> Stage:
    """Add `stage` to the pipeline, at the end or right after stage `after`."""
    if stage.name in STAGES:
        raise ValueError(f"stage '{stage.name}' is registered already")
    order = list(STAGES.values())
    position = len(order) if after is None else [s.name for s in order].index(after) + 1
    order.insert(position, stage)
    STAGES.clear()
    STAGES.update((s.name, s) for s in order)
    return stage


def unregister(name: str) -> None:
    STAGES.pop(name)


def names() -> list[str]:
    return list(STAGES)


def pipeline_names() -> list[str]:
    """The stages of a pipeline run that names none (`in_pipeline`), in order."""
    return [name for name, stage in STAGES.items() if stage.in_pipeline]


def get(name: str) -> Stage:
    if name not in STAGES:
        raise KeyError(unknown_stage_message([name]))
    return STAGES[name]


def unknown_stage_message(unknown: list[str]) -> str:
    hints = [f"'{name}'" + (f" (did you mean '{close[0]}'?)" if (close := difflib.get_close_matches(name, STAGES, 1)) else "")
             for name in unknown]
    return f"unknown stage{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; stages: {', '.join(STAGES)}"


for _stage in (
    Stage("data", "stages.pipeline.data", config=("data",),
          outputs=("splits", "data_digest", "data_source", "raw_pairs_probe", "splits_probe"),
          contract={"raw_pairs": "raw_pairs_probe", "splits": "splits_probe"},
          gpu=False, deployed=False, headline=("data/rows", "data/dropped")),
    Stage("sft", "stages.pipeline.sft", config=("model", "data", "sft"), inputs=("splits",),
          outputs=("sft_model", "sft_model_artifact", "sft_probe"), registers="sft", model_output="sft_model",
          contract={"sft": "sft_probe"}, resumes=True, headline=("eval/perplexity",)),  # before → after
    Stage("reward", "stages.pipeline.reward", config=(*PIPELINE, "statistics.ci_level"), inputs=("splits", "sft_model"),
          outputs=("reward_model", "reward_model_artifact", "reward_probe"), registers="reward", model_output="reward_model",
          contract={"reward": "reward_probe"}, resumes=True, headline=("eval/accuracy", "eval/margin")),
    # The critic reads of `ppo` only what PipelineConfig.critic_ppo passes on: CriticRollouts' fields.
    Stage("critic", "stages.pipeline.critic",
          config=(*PIPELINE, "critic", *(f"ppo.{name}" for name in CriticRollouts.model_fields)),
          inputs=("splits", "sft_model", "reward_model"), outputs=("critic_model", "critic_model_artifact", "critic_probe"),
          registers="critic", model_output="critic_model", contract={"critic": "critic_probe"}, resumes=True,
          headline=("critic/final_value_loss", "critic/final_explained_variance")),
    # ppo reads contracts.policy: the live collapse guard checks its bands at each held-out evaluation.
    Stage("ppo", "stages.pipeline.ppo", config=(*PIPELINE, "critic", "ppo", "contracts.policy", "statistics"),
          inputs=("splits", "sft_model", "reward_model", "critic_model"), optional_inputs=("critic_model",),
          # final_policy_model: the final policy when a breach came after the registered one's check, else ""
          outputs=("policy_model", "policy_model_artifact", "policy_probe", "final_policy_model"), registers="policy",
          model_output="policy_model",
          contract={"policy": "policy_probe"}, resumes=True,
          # held out, before → after; the paired delta to SFT with its interval
          headline=("eval/score", "eval/score_delta", "eval/score_delta_lc", "eval/kl", "eval/response_length",
                    "eval/eos_rate")),
    # eval reads `reward`: the lengths the score judge reads; `statistics`: the intervals the champion rests on;
    # `contracts.eval`: which judges can judge (the champion's judge is the first of them).
    Stage("eval", "stages.pipeline.evaluate", config=("model", "data", "reward", "eval", "statistics", "contracts.eval"),
          inputs=("splits", "sft_model", "reward_model", "policy_model", "final_policy_model"),
          optional_inputs=("reward_model", "policy_model", "final_policy_model"), outputs=("eval_probe", "eval_report", "eval_summary"),
          contract={"evaluation": "eval_probe", "judge": "eval_probe"},
          headline=("eval/judge/*/accuracy", "eval/judge/*/win_rate", "eval/judge/*/tie_rate", "eval/judge/*/lose_rate",
                    "eval/judge/*/n", "eval/judge/*/net_win", "eval/judge/*/net_win_lc", "eval/ceval_*shot/overall/delta",
                    "eval/lm_eval/*/delta")),
    # A study's best-of-n arms (flows/study.py runs it once per seed): the SFT model's draws, scored by the
    # reward model and `ppo.gold_reward_model`, sampled as PPO's held-out checks sample (`ppo.*` below).
    Stage("best_of_n", "stages.pipeline.best_of_n",
          config=("model", "data", "best_of_n", "study.best_of_n", "ppo.generation", "ppo.heldout_prompts",
                  "ppo.max_prompt_len", "ppo.seed", "ppo.gold_reward_model", "eval.generation_batch_size"),
          inputs=("splits", "sft_model", "reward_model"), outputs=("best_of_n_draws",), deployed=False,
          in_pipeline=False, headline=("best_of_n/sft_score", "best_of_n/sft_response_length")),
):
    register(_stage)
