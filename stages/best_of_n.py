"""Best-of-n sampling from the SFT model, a study's baseline arm without training (Stiennon et al.
2020; Gao et al. 2022 §3.1): for each held-out prompt n answers are drawn from the SFT policy and
the one the proxy reward model scores highest is kept. Its KL to the SFT policy is analytic,
KL_bon = log n − (n − 1)/n (Gao et al. 2022, eq. 1), so it sits on the same √KL axis as PPO's
held-out checks; the gold RM, when the study has one, judges the kept answers on the same prompts.

The draws are shared across n: one more draw than the largest n per prompt, the first the SFT
baseline the deltas pair with, the next n the candidates of best-of-n. The answers are sampled
as PPO's held-out checks sample (`ppo.generation`, `ppo.heldout_prompts`, `ppo.max_prompt_len`)
and scored as PPO scores them (r(x, y) at the last token, EOS included when there is one).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from stages import stats, tracking
from stages.config import PipelineConfig
from stages.data import read_jsonl
from stages.model_loading import frozen_lm, frozen_reward_model
from stages.ppo.experience import reward_model_scores
from stages.ppo.generation import generate
from stages.ppo.setup import encode_prompts


def analytic_kl(n: int) -> float:
    """KL(best-of-n ‖ SFT) = log n − (n − 1)/n nats (Gao et al. 2022, eq. 1)."""
    return math.log(n) - (n - 1) / n


@torch.no_grad()
def draw(cfg: PipelineConfig, chain: dict[str, str], gold_model: str | None, draws: int, seed: int,
         device: str = "cpu") -> dict[str, np.ndarray]:
    """`draws` sampled answers of the SFT model to each held-out prompt: proxy score, gold score
    (NaN without a gold RM) and length in tokens, each [draws, prompts]."""
    ppo = cfg.ppo
    with tempfile.TemporaryDirectory(prefix="best-of-n-") as tmp:
        downloads = Path(tmp)
        splits_dir = tracking.download(chain["splits"], downloads)
        sft_dir = tracking.download(chain["sft_model"], downloads)
        model, tokenizer = frozen_lm(sft_dir, cfg.model, device)
        scorers = {"proxy": tracking.download(chain["reward_model"], downloads)}
        if gold_model:
            scorers["gold"] = tracking.download(gold_model, downloads)
        scorers = {name: reward_model_scores(frozen_reward_model(folder, cfg.model, device))
                   for name, folder in scorers.items()}
        rows = read_jsonl(splits_dir / "eval_prompts.jsonl")[: ppo.heldout_prompts]
        prompts = encode_prompts(tokenizer, rows, ppo.max_prompt_len)
        torch.manual_seed(seed)
        out = {name: np.full((draws, len(prompts)), np.nan) for name in ("proxy", "gold", "length")}
        batch = cfg.eval.generation_batch_size
        for d in range(draws):
            for start in range(0, len(prompts), batch):
                rollout = generate(model, prompts[start : start + batch], eos_id=tokenizer.eos_token_id,
                                   pad_id=tokenizer.pad_token_id, device=device, **ppo.generation.model_dump())
                cells = slice(start, start + len(rollout.sequences))
                for name, score in scorers.items():
                    out[name][d, cells] = score(rollout.sequences, rollout.attention_mask, rollout.prompt_width,
                                                rollout.response_mask).float().cpu().numpy()
                out["length"][d, cells] = rollout.response_mask.sum(1).cpu().numpy()
    return out


def arm_metrics(drawn: dict[str, np.ndarray], n: int, cfg: PipelineConfig) -> dict[str, float]:
    """Best-of-n's numbers under the names of PPO's last held-out check (eval/score, eval/kl,
    eval/score_delta with its paired interval, ...), so a study's table and figure read both alike."""
    options = {"level": cfg.statistics.ci_level, "resamples": cfg.statistics.bootstrap_resamples,
               "seed": cfg.statistics.seed}
    candidates = drawn["proxy"][1 : n + 1]
    kept = candidates.argmax(axis=0) + 1
    columns = np.arange(candidates.shape[1])
    metrics = {"eval/kl": analytic_kl(n), "eval/best_of_n": float(n)}
    for name, metric in (("proxy", "score"), ("gold", "gold_score"), ("length", "response_length")):
        if np.isnan(drawn[name]).all():
            continue
        chosen, baseline = drawn[name][kept, columns], drawn[name][0]
        metrics[f"eval/{metric}"] = float(chosen.mean())
        metrics[f"eval/sft_{metric}"] = float(baseline.mean())
        metrics.update(stats.paired_delta(chosen, baseline, **options).metrics(f"eval/{metric}_delta"))
    return metrics
