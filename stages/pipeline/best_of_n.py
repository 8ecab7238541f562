"""The best-of-n stage: a study's baseline arms without training (Stiennon et al. 2020; Gao et al.
2022 §3.1). For each held-out prompt answers are drawn from the SFT policy and scored by the proxy
reward model (and by the gold RM, when the study has one); a best-of-n arm keeps, per prompt, the
one of n answers the proxy scores highest (stages/orchestration/study_records.py: `best_of_n_metrics`, KL to
SFT analytic, log n − (n − 1)/n, so it sits on the same √KL axis as PPO's held-out checks).

The draws are shared across n: one more draw than the largest n of `study.best_of_n` per prompt,
the first the SFT baseline the deltas pair with, the next n the candidates of best-of-n. The
answers are sampled as PPO's held-out checks sample (`ppo.generation`, `ppo.heldout_prompts`,
`ppo.max_prompt_len`, `ppo.seed`) and scored as PPO scores them (r(x, y) at the last token, EOS
included when there is one) by the reward model and `ppo.gold_reward_model`. A study runs this
stage once per seed (flows/study.py); it is not a step of a plain pipeline run (registry:
`in_pipeline`). As ranks (`best_of_n.launch`), each rank draws for its share of the prompts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from stages.compute.model_loading import frozen_lm, frozen_reward_model
from stages.compute.ppo.experience import reward_model_scores
from stages.compute.ppo.generation import generate
from stages.compute.ppo.setup import encode_prompts
from stages.leaves import interrupt
from stages.leaves.config import ConfigError, PipelineConfig
from stages.leaves.dist import Dist
from stages.leaves.tags import CONFIG_HASH_TAG, INPUT_TAG_PREFIX
from stages.orchestration import registry, run_writers, tracking
from stages.pipeline.data import read_jsonl

NAME = "best_of_n"
DRAWS_FILE = "draws.npz"  # the stage's output `best_of_n_draws`: one [draws, prompts] array per score
SCORES = ("proxy", "gold", "length")


def draws(cfg: PipelineConfig) -> int:
    """One more draw per prompt than the largest n: the first is the SFT baseline."""
    return max(cfg.study.best_of_n) + 1


def check(cfg: PipelineConfig) -> None:
    if not cfg.study.best_of_n:
        raise ConfigError("stage best_of_n draws for the n of study.best_of_n, which is empty: set it, e.g. "
                          "study.best_of_n=[1, 4, 16]")


def prepare(cfg: PipelineConfig, inputs: dict, downloads: Path) -> dict:
    """Local copies of the splits, the SFT model, the proxy RM and the gold RM."""
    local = {f"{name}_dir": str(tracking.download(inputs[name], downloads))
             for name in ("splits", "sft_model", "reward_model")}
    if cfg.ppo.gold_reward_model:
        local["gold_reward_model_dir"] = str(tracking.download(cfg.ppo.gold_reward_model, downloads))
    return local


@torch.no_grad()
def draw(cfg: PipelineConfig, inputs: dict, rows: list[dict], dist: Dist) -> dict[str, np.ndarray]:
    """`draws(cfg)` sampled answers of the SFT model to each of this rank's held-out prompts
    (`rows[rank::world_size]`): proxy score, gold score (NaN without a gold RM) and length in
    tokens, each [draws, prompts of this rank]."""
    ppo, device = cfg.ppo, dist.device
    model, tokenizer = frozen_lm(inputs["sft_model_dir"], cfg.model, device)
    scorers = {"proxy": inputs["reward_model_dir"]}
    if inputs.get("gold_reward_model_dir"):
        scorers["gold"] = inputs["gold_reward_model_dir"]
    scorers = {name: reward_model_scores(frozen_reward_model(folder, cfg.model, device))
               for name, folder in scorers.items()}
    prompts = encode_prompts(tokenizer, rows[dist.rank :: dist.world_size], ppo.max_prompt_len)
    torch.manual_seed(ppo.seed + dist.rank)  # each rank its own answers; one rank draws as `ppo.seed` says
    total, batch = draws(cfg), cfg.eval.generation_batch_size
    out = {name: np.full((total, len(prompts)), np.nan) for name in SCORES}
    progress = tqdm(total=total * len(prompts), desc=NAME, unit="answer", disable=not dist.is_main, dynamic_ncols=True)
    for d in range(total):
        interrupt.stop_point(dist, NAME, f"before draw {d + 1} of {total}")
        for start in range(0, len(prompts), batch):
            rollout = generate(model, prompts[start : start + batch], eos_id=tokenizer.eos_token_id,
                               pad_id=tokenizer.pad_token_id, device=device, **ppo.generation.model_dump())
            cells = slice(start, start + len(rollout.sequences))
            for name, score in scorers.items():
                out[name][d, cells] = score(rollout.sequences, rollout.attention_mask, rollout.prompt_width,
                                            rollout.response_mask).float().cpu().numpy()
            out["length"][d, cells] = rollout.response_mask.sum(1).cpu().numpy()
            progress.update(len(rollout.sequences))
    progress.close()
    return out


def gathered(drawn: dict[str, np.ndarray], prompts: int, dist: Dist) -> dict[str, np.ndarray]:
    """Every rank's draws as [draws, prompts] in prompt order (each rank holds `[rank::world_size]`)."""
    if not dist.distributed:
        return drawn
    columns = {f"{name}/{d}": list(values) for name, rows in drawn.items() for d, values in enumerate(rows)}
    full = dist.gather_rows(prompts, columns)
    return {name: np.array([full[f"{name}/{d}"] for d in range(len(rows))]) for name, rows in drawn.items()}


def run(cfg: PipelineConfig, tracker: run_writers.StageRun, inputs: dict, dist: Dist) -> dict:
    rows = read_jsonl(Path(inputs["splits_dir"]) / "eval_prompts.jsonl")[: cfg.ppo.heldout_prompts]
    if dist.is_main:  # its lineage: the models it read and the hash of the settings its cache key holds
        spec = registry.get(NAME)
        read = {**{name: inputs[name] for name in spec.inputs}, "gold_reward_model": cfg.ppo.gold_reward_model or ""}
        tracker.log_params({"best_of_n.draws": draws(cfg), "best_of_n.n": cfg.study.best_of_n,
                            "best_of_n.prompts": len(rows), "best_of_n.seed": cfg.ppo.seed,
                            "best_of_n.world_size": dist.world_size,
                            **{f"best_of_n.{name}": uri or "none" for name, uri in read.items()}})
        tracker.set_tags({CONFIG_HASH_TAG: spec.config_hash(cfg),
                          **{f"{INPUT_TAG_PREFIX}{name}": uri for name, uri in read.items()}})
    drawn = gathered(draw(cfg, inputs, rows, dist), len(rows), dist)
    if not dist.is_main:
        return {}
    tracker.log_metrics({f"{NAME}/sft_score": float(drawn["proxy"][0].mean()),
                         f"{NAME}/sft_response_length": float(drawn["length"][0].mean())}, step=0)
    path = tracker.workdir / DRAWS_FILE
    np.savez(path, **drawn)
    tracker.log_artifact(path)
    return {"best_of_n_run": tracker.run_id, "best_of_n_draws": tracker.artifact_uri(DRAWS_FILE)}

