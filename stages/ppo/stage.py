"""The PPO stage: actor and reference from the SFT model, reward model and critic (pre-trained,
else initialised from the reward model; none when the advantage estimator needs none), PPO-max
iterations with checkpoints, held-out evaluation, sample tables; the final policy registered as
<prefix>-policy."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from stages import interrupt, mlflow_models, precision, sources, stats, tracking
from stages.config import PipelineConfig, StatisticsConfig, is_text_reward_source
from stages.data import encode_example, read_jsonl, render_prompt
from stages.launch import Dist
from stages.ppo import checkpoint
from stages.ppo.advantages import needs_critic
from stages.ppo.guard import CollapseGuard
from stages.reward_sources import text_scores
from stages.ppo.experience import reward_model_scores, rule_scores
from stages.ppo.rewards import RunningMoments, ScoreMode
from stages.ppo.trainer import PPOTrainer, warmup_steps
from stages.reward.model import load_reward_model
from stages.training import masked_mean, trained_model



def prepare(cfg: PipelineConfig, inputs: dict, downloads: Path) -> dict:
    """Once, before the ranks start: local copies of the splits and of every model."""
    local = {"splits_dir": str(tracking.download(inputs["splits"], downloads)),
             "sft_model_dir": str(tracking.download(inputs["sft_model"], downloads)),
             "reward_model_dir": str(tracking.download(inputs["reward_model"], downloads))}
    if inputs.get("critic_model") and needs_critic(cfg.ppo):
        local["critic_model_dir"] = str(tracking.download(inputs["critic_model"], downloads))
    if cfg.ppo.gold_reward_model:
        local["gold_reward_model_dir"] = str(tracking.download(cfg.ppo.gold_reward_model, downloads))
    return local


def encode_prompts(tokenizer, rows: list[dict], max_prompt_len: int) -> list[list[int]]:
    """Prompt token ids, the oldest turns cut when longer than max_prompt_len."""
    return [tokenizer(render_prompt(tokenizer, r["messages"]), add_special_tokens=False)["input_ids"][-max_prompt_len:]
            for r in rows]


def load_models(cfg: PipelineConfig, inputs: dict, dist: Dist, train_actor: bool = True):
    """(tokenizer, actor, reference, reward model, critic, score_fn); frozen ones in eval mode. The
    critic is None when the advantage estimator needs none (the reward model still gives the scores,
    or with a rule reward the initial score statistics). Models to train load in fp32 (their engine
    keeps those as master weights under bf16), frozen ones in the run's precision; train_actor=False:
    the actor is frozen too (critic pre-training)."""
    sft_dir, rm_dir = inputs["sft_model_dir"], inputs["reward_model_dir"]
    tokenizer = sources.load_tokenizer(sft_dir, cfg.model)
    frozen = precision.dtype(precision.resolve(cfg.model.precision, dist.device))  # trained ones: fp32 (make_engine)
    actor = sources.load_model(sft_dir, cfg.model, None if train_actor else frozen).to(dist.device)
    sources.align_pad_token(actor, tokenizer)
    reference = sources.load_model(sft_dir, cfg.model, frozen).to(dist.device).eval().requires_grad_(False)
    reward_model = load_reward_model(rm_dir, cfg.model, frozen).to(dist.device).eval().requires_grad_(False)
    critic = None
    if needs_critic(cfg.ppo):
        critic = load_reward_model(inputs.get("critic_model_dir", rm_dir), cfg.model).to(dist.device)
        if "critic_model_dir" not in inputs:  # a pre-trained critic is on this scale already
            values_on_the_shaped_scale(critic, initial_moments(reward_model), cfg.ppo.switches()["score_mode"])
    if cfg.ppo.reward == "rm":
        score_fn = reward_model_scores(reward_model)
    elif is_text_reward_source(cfg.ppo.reward):
        score_fn = text_scores(cfg.ppo, tokenizer)
    else:
        score_fn = rule_scores(tokenizer, cfg.ppo.reward)
    return tokenizer, actor, reference, reward_model, critic, score_fn


@torch.no_grad()
def values_on_the_shaped_scale(critic, moments: RunningMoments, mode: ScoreMode) -> None:
    """The critic starts as the reward model (§5.3.3), but it predicts rewards that carry the RM's
    scores reparameterised (§5.3.1): fold that affine map, on the statistics PPO starts from, into
    its scalar head, so its first values are on the rewards' scale. Left as the RM's, the values
    sit μ/σ off their targets, and with Adam's per-parameter steps of about lr the head's bias
    cannot move that far: the rest of the network has to carry the offset."""
    if mode == "none":
        return
    head = critic.score_head
    head.weight.div_(moments.std)
    if mode == "normalise":
        head.bias.sub_(moments.mean)
    head.bias.div_(moments.std)


def initial_moments(reward_model, critic=None) -> RunningMoments:
    """Running score statistics: those critic pre-training ended with (every score it saw, with
    their count), else the reward model's held-out mean and std with count 1."""
    if critic is not None and critic.running_moments is not None:
        return RunningMoments(**critic.running_moments)
    return RunningMoments(mean=reward_model.score_mean, var=reward_model.score_std**2, count=1.0)


def ptx_examples(cfg: PipelineConfig, tokenizer, splits_dir: Path) -> tuple[str, list[tuple[list[int], list[int]]]]:
    """(source, examples) for PPO-ptx's LM loss (eq. 17): documents of `ppo.ptx_data` (a `text`
    field per row; every token is a target, cut at sft.max_seq_len), or by default the SFT split's
    chosen answers as the SFT stage saw them."""
    if cfg.ppo.ptx_data is None:
        rows = read_jsonl(splits_dir / "sft.jsonl")
        return "sft split", [encode_example(tokenizer, r["messages"], r["chosen"], cfg.sft.max_seq_len,
                                            cfg.sft.max_response_len) for r in rows]
    source, rows = sources.read_records(cfg.ppo.ptx_data, cfg.data)
    examples = []
    for row in rows:
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise sources.DataError(source, row.get("_row"), "ppo.ptx_data needs a non-empty string `text` field")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.sft.max_seq_len]
        examples.append((ids, list(ids)))
    return source, examples


@torch.no_grad()
def evaluate(trainer: PPOTrainer, prompts: list[list[int]], rows: list[int], gold_fn=None
             ) -> tuple[dict[str, float], pd.DataFrame]:
    """Held-out check of the collapse indicators: mean score, length, perplexity, KL to SFT, EOS rate,
    distinct-2 (repetition inside a response), the score-length correlation (a reward-hacking sign);
    and per response (each rank's share of `rows`, gathered) what the policy contract judges. With
    `gold_fn` (a gold RM's score_fn) each response's gold score too."""
    exp, _, _ = trainer.rollout(prompts, update_moments=False)
    mask = exp.response_mask
    kl = ((exp.logprobs - exp.ref_logprobs) * mask).sum(1)
    responses = [seq[m.bool()].tolist() for seq, m in zip(exp.sequences[:, exp.prompt_width :], mask)]
    per_response = {"response_tokens": mask.sum(1), "ended_with_eos": exp.ended_with_eos, "kl": kl,
                    "perplexity": torch.exp(-masked_mean(exp.model_logprobs, mask, dim=1)), "score": exp.scores,
                    "distinct_2": torch.tensor([stats.distinct_n([r], 2) for r in responses])}
    if gold_fn is not None:
        per_response["gold_score"] = gold_fn(exp.sequences, exp.attention_mask, exp.prompt_width, mask).float()
    gathered = trainer.dist.gather_rows(len(rows), {name: values.tolist() for name, values in per_response.items()})
    frame = pd.DataFrame({"row": rows, **gathered}).astype({"response_tokens": int, "ended_with_eos": bool})
    metrics = {  # over all ranks' responses (the gathered frame)
        "eval/score": frame["score"].mean(),
        "eval/response_length": frame["response_tokens"].mean(),
        "eval/perplexity": float(torch.exp(-masked_mean(exp.model_logprobs, mask)).item()),  # T = 1, this rank's tokens
        "eval/kl": frame["kl"].mean(),
        "eval/eos_rate": frame["ended_with_eos"].mean(),
        "eval/distinct_2": frame["distinct_2"].mean(),
        "eval/score_length_corr": stats.correlation(frame["score"], frame["response_tokens"]),
    }
    if gold_fn is not None:
        metrics["eval/gold_score"] = frame["gold_score"].mean()
    metrics["eval/perplexity"] = trainer.mean_across_ranks({"p": metrics["eval/perplexity"]})["p"]
    return {k: float(v) for k, v in metrics.items()}, frame


def paired_deltas(frame: pd.DataFrame, baseline: pd.DataFrame, statistics: StatisticsConfig) -> dict[str, float]:
    """The held-out evaluation against the SFT policy's responses to the same prompts (the baseline
    evaluation): mean paired deltas of score, length, perplexity and EOS, each with its interval."""
    options = {"level": statistics.ci_level, "resamples": statistics.bootstrap_resamples, "seed": statistics.seed}
    metrics: dict[str, float] = {}
    for column, name in (("score", "score"), ("response_tokens", "response_length"), ("perplexity", "perplexity"),
                         ("ended_with_eos", "eos_rate"), ("gold_score", "gold_score")):
        if column not in frame.columns:
            continue
        interval = stats.paired_delta(frame[column].astype(float), baseline[column].astype(float), **options)
        metrics.update(interval.metrics(f"eval/{name}_delta"))
    return metrics


def samples_table(tokenizer, trainer: PPOTrainer) -> pd.DataFrame:
    exp = trainer.last_experience
    width = exp.prompt_width
    return pd.DataFrame({
        "prompt": tokenizer.batch_decode(exp.sequences[:, :width], skip_special_tokens=True),
        "response": tokenizer.batch_decode(exp.sequences[:, width:], skip_special_tokens=True),
        "score": exp.scores.tolist(),
        "ended_with_eos": exp.ended_with_eos.tolist(),
    })


def score_histogram(scores: list[float], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.hist(scores, bins=20, color="#4c72b0")
    ax.set_xlabel("reward-model score r(x, y)")
    ax.set_ylabel("responses")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: PipelineConfig, tracker: tracking.StageRun | None, inputs: dict, dist: Dist) -> dict:
    ppo = cfg.ppo
    torch.manual_seed(ppo.seed)
    splits_dir = Path(inputs["splits_dir"])
    tokenizer, actor, reference, reward_model, critic, score_fn = load_models(cfg, inputs, dist)
    prompts = encode_prompts(tokenizer, read_jsonl(splits_dir / "ppo_prompts.jsonl"), ppo.max_prompt_len)
    heldout = read_jsonl(splits_dir / "eval_prompts.jsonl")[: ppo.heldout_prompts]
    eval_rows = [r["row"] for r in heldout]  # line numbers in the source file
    eval_prompts = encode_prompts(tokenizer, heldout, ppo.max_prompt_len)[dist.rank :: dist.world_size]
    ptx_source, ptx = ptx_examples(cfg, tokenizer, splits_dir) if ppo.switches()["ptx"] else ("off", [])
    pretrained_critic = critic is not None and "critic_model_dir" in inputs
    moments = initial_moments(reward_model, critic if pretrained_critic else None)
    trainer = PPOTrainer(ppo, actor=actor, critic=critic, reference=reference, score_fn=score_fn, prompts=prompts,
                         ptx_examples=ptx, tokenizer=tokenizer, dist=dist, moments=moments,
                         warmup=warmup_steps(ppo, pretrained_critic),
                         precision=precision.resolve(cfg.model.precision, dist.device))

    checkpoints = dist.workdir / "checkpoints"
    resume_from = checkpoint.latest(checkpoints)
    # The SFT policy's held-out numbers, before a checkpoint replaces its weights (the checkpoint
    # restores the RNG, so a resumed run samples as an uninterrupted one): the baseline of every
    # curve, of the paired deltas and of the policy contract.
    gold_fn = None
    if "gold_reward_model_dir" in inputs:
        gold = load_reward_model(inputs["gold_reward_model_dir"], cfg.model,
                                 precision.dtype(precision.resolve(cfg.model.precision, dist.device)))
        gold_fn = reward_model_scores(gold.to(dist.device).eval().requires_grad_(False))
    baseline_metrics, baseline = evaluate(trainer, eval_prompts, eval_rows, gold_fn)
    guard = CollapseGuard(cfg, baseline, dist.workdir, dist)
    if resume_from is not None:
        checkpoint.load(trainer, resume_from)
    else:
        guard.start(trainer)
    if dist.is_main:
        tracker.start_attempt({"ppo": ppo.model_dump(mode="json"), "ppo.switches": trainer.switches,
                               "ppo.world_size": dist.world_size, "ppo.engine": type(trainer.actor).__name__,
                               "ppo.sft_model": inputs["sft_model"], "ppo.reward_model": inputs["reward_model"],
                               "ppo.critic_model": (inputs.get("critic_model", "reward model") if critic is not None
                                                    else "none"),
                               "ppo.ptx_source": ptx_source, "ppo.warmup_steps": warmup_steps(ppo, pretrained_critic),
                               "ppo.initial_moments": moments.state_dict()}, resume_from)
        tracker.log_metrics(baseline_metrics, step=0)
    progress = tqdm(total=ppo.iterations, initial=trainer.iteration, desc=f"ppo ({ppo.preset})",
                    disable=not dist.is_main, dynamic_ncols=True)
    started = time.perf_counter()
    while trainer.iteration < ppo.iterations and not guard.stopped:
        interrupt.stop_point(dist, "ppo", f"after iteration {trainer.iteration} of {ppo.iterations}",
                             save=lambda: f"checkpoint {checkpoint.save(trainer, checkpoints)}")
        metrics = trainer.step()
        it = trainer.iteration
        if it % ppo.eval_every == 0 or it == ppo.iterations:
            heldout_metrics, frame = evaluate(trainer, eval_prompts, eval_rows, gold_fn)
            metrics.update({**heldout_metrics, **paired_deltas(frame, baseline, cfg.statistics),
                            **guard.check(trainer, frame)})
        if dist.is_main:
            tracker.log_metrics(metrics, step=it)
            if it % ppo.samples_every == 0 or it == ppo.iterations:
                table = samples_table(tokenizer, trainer)
                tracker.log_table(table, f"samples/iteration_{it:05d}.json")
                histogram = tracker.workdir / f"scores_{it:05d}.png"
                score_histogram(table["score"].tolist(), f"scores at iteration {it}", histogram)
                tracker.log_artifact(histogram, "samples", buffered=True)
        if it % ppo.checkpoint_every == 0 and it < ppo.iterations and not guard.stopped:
            checkpoint.save(trainer, checkpoints)
        progress.update(1)
        progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
    progress.close()
    # The policy to register: the last one the guard passed (the final one unless a breach came after).
    if guard.state.passing_iteration != trainer.iteration:
        checkpoint.roll_back(trainer, checkpoint.latest(guard.directory))
    probe = guard.passing_probe() if dist.is_main else None

    outputs: dict = {}
    if dist.is_main:
        tracker.log_metrics({"ppo/train_seconds": time.perf_counter() - started}, step=trainer.iteration)
        tracker.set_tags(guard.tags())
        policy = trained_model(trainer.actor)

        def save(out: Path) -> None:
            policy.config.use_cache = True
            policy.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)

        lineage = {"rlhf.ppo_preset": ppo.preset, "rlhf.advantage_estimator": ppo.advantage_estimator, **guard.tags()}
        if critic is None:  # a critic-free estimator read no critic, whatever the inputs held
            lineage["rlhf.input.critic_model"] = ""
        published = tracker.publish_model(save, cfg=cfg, inputs=inputs, pack=mlflow_models.chat(cfg), lineage=lineage)
        outputs = {**published, "ppo_run": tracker.run_id, "policy_probe": tracker.log_probe(probe, "policy_probe")}
    dist.barrier()
    checkpoint.discard(dist, checkpoints, guard.directory)  # the published policy is the result
    return outputs
