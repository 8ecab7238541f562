"""The PPO stage: actor and reference from the SFT model, reward model and critic (pre-trained,
else initialised from the reward model; none when the advantage estimator needs none), PPO-max
iterations with checkpoints, held-out evaluation, sample tables; the final policy registered as
<prefix>-policy."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from stages.compute import loading, mlflow_models
from stages.compute.checkpoint import load_rng_state, rng_state
from stages.compute.model_loading import frozen_reward_model, load_models, save_adapter
from stages.compute.ppo.advantages import needs_critic
from stages.compute.ppo.experience import reward_model_scores
from stages.compute.ppo.external_scores import RewardServerUnavailable
from stages.compute.ppo.setup import encode_prompts, initial_moments
from stages.compute.ppo.trainer import PPOTrainer, check_algorithms, warmup_steps
from stages.compute.training import trained_model
from stages.leaves import precision, stats
from stages.leaves.config import PipelineConfig, StatisticsConfig
from stages.leaves.dist import Dist
from stages.leaves.rendering import encode_example
from stages.leaves.tags import ADVANTAGE_ESTIMATOR_TAG, FINAL_ITERATION_TAG, INPUT_TAG_PREFIX, PPO_PRESET_TAG
from stages.leaves.tensors import masked_mean
from stages.orchestration import registry, run_writers, tracking
from stages.pipeline.data import read_jsonl
from stages.runtime import lifecycle
from stages.runtime.collapse_guard import CollapseGuard, ContractCheck



def check(cfg: PipelineConfig) -> None:
    check_algorithms(cfg.ppo)


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




def ptx_examples(cfg: PipelineConfig, tokenizer, splits_dir: Path) -> tuple[str, list[tuple[list[int], list[int]]]]:
    """(source, examples) for PPO-ptx's LM loss (eq. 17): documents of `ppo.ptx_data` (a `text`
    field per row; every token is a target, cut at sft.max_seq_len), or by default the SFT split's
    chosen answers as the SFT stage saw them."""
    if cfg.ppo.ptx_data is None:
        rows = read_jsonl(splits_dir / "sft.jsonl")
        return "sft split", [encode_example(tokenizer, r["messages"], r["chosen"], cfg.sft.max_seq_len,
                                            cfg.sft.max_response_len) for r in rows]
    source, rows = loading.read_records(cfg.ppo.ptx_data, cfg.data)
    examples = []
    for row in rows:
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise loading.DataError(source, row.get("_row"), "ppo.ptx_data needs a non-empty string `text` field")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.sft.max_seq_len]
        examples.append((ids, list(ids)))
    return source, examples


@torch.no_grad()
def evaluate(trainer: PPOTrainer, prompts: list[list[int]], rows: list[int], gold_fn=None
             ) -> tuple[dict[str, float], pd.DataFrame]:
    """Held-out check of the collapse indicators: mean score, length, perplexity (T = 1), KL to SFT
    (tempered: both models at the sampling temperature, as PPO's penalty), EOS rate,
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
    evaluation): mean paired deltas of score, length, perplexity and EOS, each with its interval;
    the score's (and gold score's) also length-controlled (`_delta_lc`, `stats.length_controlled`)."""
    options = {"level": statistics.ci_level, "resamples": statistics.bootstrap_resamples, "seed": statistics.seed}
    metrics: dict[str, float] = {}
    for column, name in (("score", "score"), ("response_tokens", "response_length"), ("perplexity", "perplexity"),
                         ("ended_with_eos", "eos_rate"), ("gold_score", "gold_score")):
        if column not in frame.columns:
            continue
        interval = stats.paired_delta(frame[column].astype(float), baseline[column].astype(float), **options)
        metrics.update(interval.metrics(f"eval/{name}_delta"))
        if column in ("score", "gold_score"):  # a score gain can be a length effect: also at equal lengths
            length_diff = frame["response_tokens"].astype(float) - baseline["response_tokens"].astype(float)
            controlled = stats.length_controlled(frame[column].astype(float) - baseline[column].astype(float),
                                                 length_diff, **options)
            metrics.update(controlled.metrics(f"eval/{name}_delta_lc"))
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
    import matplotlib  # deferred: matplotlib only for the histograms

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display backend

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.hist(scores, bins=20, color="#4c72b0")
    ax.set_xlabel("reward-model score r(x, y)")
    ax.set_ylabel("responses")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class PPOTraining(lifecycle.TrainingStage):
    """One `step` is one PPO-max iteration; every `ppo.eval_every` iterations the held-out evaluation
    and the collapse guard's verdict on it."""

    name, unit, checkpoint_unit, keep_checkpoints = "ppo", "iteration", "iter", 2
    progress_metrics = {"score": "objective/scores", "kl": "objective/kl"}

    def __init__(self, cfg: PipelineConfig, tracker: run_writers.StageRun | None, inputs: dict, dist: Dist,
                 contract: ContractCheck):
        ppo = self.ppo = cfg.ppo
        self.cfg, self.tracker = cfg, tracker
        torch.manual_seed(ppo.seed)
        splits_dir = Path(inputs["splits_dir"])
        self.tokenizer, actor, reference, reward_model, critic, score_fn = load_models(cfg, inputs, dist)
        prompts = encode_prompts(self.tokenizer, read_jsonl(splits_dir / "ppo_prompts.jsonl"), ppo.max_prompt_len)
        heldout = read_jsonl(splits_dir / "eval_prompts.jsonl")[: ppo.heldout_prompts]
        self.eval_rows = [r["row"] for r in heldout]  # line numbers in the source file
        self.eval_prompts = encode_prompts(self.tokenizer, heldout, ppo.max_prompt_len)[dist.rank :: dist.world_size]
        ptx_source, ptx = ptx_examples(cfg, self.tokenizer, splits_dir) if ppo.switches()["ptx"] else ("off", [])
        pretrained_critic = critic is not None and "critic_model_dir" in inputs
        moments = initial_moments(reward_model, critic if pretrained_critic else None)
        trainer = self.trainer = PPOTrainer(
            ppo, actor=actor, critic=critic, reference=reference, score_fn=score_fn, prompts=prompts,
            ptx_examples=ptx, tokenizer=self.tokenizer, dist=dist, moments=moments,
            warmup=warmup_steps(ppo, pretrained_critic), precision=precision.resolve(cfg.model.precision, dist.device))
        self.total, self.checkpoint_every = ppo.iterations, ppo.checkpoint_every
        self.engines, self.guard = trainer.checkpointed_engines(), trainer.guard
        self.params = {"ppo": ppo.model_dump(mode="json"), "ppo.switches": trainer.switches,
                       "ppo.world_size": dist.world_size, "ppo.engine": type(trainer.actor).__name__,
                       "ppo.sft_model": inputs["sft_model"], "ppo.reward_model": inputs["reward_model"],
                       "ppo.critic_model": inputs.get("critic_model", "reward model") if critic is not None else "none",
                       "ppo.ptx_source": ptx_source, "ppo.warmup_steps": warmup_steps(ppo, pretrained_critic),
                       "ppo.initial_moments": moments.state_dict()}
        # The SFT policy's held-out numbers, before a checkpoint replaces its weights (the checkpoint
        # restores the RNG, so a resumed run samples as an uninterrupted one): the baseline of every
        # curve, of the paired deltas and of the policy contract; the collapse guard's first passing
        # point on a fresh start.
        self.gold_fn = None
        if "gold_reward_model_dir" in inputs:
            self.gold_fn = reward_model_scores(frozen_reward_model(inputs["gold_reward_model_dir"], cfg.model,
                                                                   dist.device, dist))
        self.first_metrics, self.baseline = evaluate(trainer, self.eval_prompts, self.eval_rows, self.gold_fn)
        self.collapse_guard = CollapseGuard(cfg, self.baseline, dist.workdir, dist, contract)

    def start_fresh(self) -> None:
        self.collapse_guard.start(self.trainer)

    def state(self) -> dict:
        # The guard's passing points stay for the kept checkpoints and the one being written (which may fail).
        return {**self.trainer.state(), "collapse_guard": self.collapse_guard.state_dict(self.keep_checkpoints + 1)}

    def load_state(self, state: dict) -> None:
        self.trainer.load_state(state)
        self.collapse_guard.load_state_dict(state["collapse_guard"])

    def step(self, number: int) -> dict[str, float]:
        ppo, trainer = self.ppo, self.trainer
        boundary = trainer.state(), rng_state()
        try:
            metrics = trainer.step()
        except RewardServerUnavailable as err:  # nothing of the iteration is kept: it reruns on resuming
            trainer.load_state(boundary[0])
            load_rng_state(boundary[1])
            raise lifecycle.StepInterrupted(err) from None
        if number % ppo.eval_every == 0 or number == ppo.iterations:
            try:
                heldout_metrics, frame = evaluate(trainer, self.eval_prompts, self.eval_rows, self.gold_fn)
            except RewardServerUnavailable as err:  # the iteration trained: kept, without held-out numbers
                raise lifecycle.StepInterrupted(err, metrics) from None
            metrics.update({**heldout_metrics, **paired_deltas(frame, self.baseline, self.cfg.statistics),
                            **self.collapse_guard.check(trainer, frame)})
        if trainer.dist.is_main and (number % ppo.samples_every == 0 or number == ppo.iterations):
            table = samples_table(self.tokenizer, trainer)
            self.tracker.log_table(table, f"samples/iteration_{number:05d}.json")
            histogram = self.tracker.workdir / f"scores_{number:05d}.png"
            score_histogram(table["score"].tolist(), f"scores at iteration {number}", histogram)
            self.tracker.log_artifact(histogram, "samples", buffered=True)
        return metrics

    def stopped(self) -> bool:
        return self.collapse_guard.stopped

    def finish(self) -> lifecycle.Finish:
        ppo, trainer, guard = self.ppo, self.trainer, self.collapse_guard
        final_iteration = trainer.iteration
        # The policy to register: the last one the guard passed (the final one unless a breach came after).
        # The final policy is kept beside it, so the eval stage judges the policy the last held-out
        # numbers describe as well as the registered one.
        final_policy = self.publish_final_policy() if guard.state.passing_iteration != final_iteration else None
        if guard.state.passing_iteration != final_iteration:
            trainer.roll_back_to(guard.passing_folder())
        policy = trained_model(trainer.actor)  # every rank: a ZeRO-3 engine's weights are gathered

        def save(out: Path) -> None:
            policy.config.use_cache = True
            policy.save_pretrained(out, safe_serialization=True)
            self.tokenizer.save_pretrained(out)
            save_adapter(policy, out)

        lineage = {PPO_PRESET_TAG: ppo.preset, ADVANTAGE_ESTIMATOR_TAG: ppo.advantage_estimator, **guard.tags()}
        if trainer.critic is None:  # a critic-free estimator read no critic, whatever the inputs held
            lineage[f"{INPUT_TAG_PREFIX}critic_model"] = ""
        tags = {**guard.tags(), FINAL_ITERATION_TAG: str(final_iteration)}
        return lifecycle.Finish({}, "policy_probe", probe=guard.passing_probe, save=save, pack=mlflow_models.chat(self.cfg),
                                lineage=lineage, tags=tags, folders=(guard.directory,),
                                outputs={"final_policy_model": final_policy or ""})

    def publish_final_policy(self) -> str | None:
        """The final policy's folder as the artifact `final_policy` of the stage's run (main rank):
        its URI, None on the other ranks."""
        policy = trained_model(self.trainer.actor)  # every rank: a ZeRO-3 engine's weights are gathered
        if policy is None:
            return None
        folder = self.tracker.workdir / "final_policy"
        policy.config.use_cache = True
        policy.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        self.tracker.log_artifacts(folder, "final_policy")
        return self.tracker.artifact_uri("final_policy")


def run(cfg: PipelineConfig, tracker: run_writers.StageRun | None, inputs: dict, dist: Dist) -> dict:
    stage = PPOTraining(cfg, tracker, inputs, dist, contract=registry.contract_check())
    return lifecycle.run(stage, cfg, tracker, inputs, dist)
