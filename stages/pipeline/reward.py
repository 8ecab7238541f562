"""The reward stage: a reward model from the SFT model, trained on rm_train (a gold RM: on
gold_rm_train, `reward.pairs`) with the pairwise + LM loss in dynamic token batches, evaluated on
rm_eval (gold_rm_eval, and rm_eval too, so a study compares it with the proxy on the same pairs),
each pair's outcome logged by its identity, saved and registered as <prefix>-reward."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from stages.compute import loading
from stages.compute.losses import RewardLoss, pairwise_loss, reward_model_loss
from stages.compute.model_loading import save_adapter, trained_reward_model
from stages.compute.nonfinite import NonFiniteGuard
from stages.compute.reward.model import load_reward_model, save_reward_model
from stages.compute.training import adamw, cosine_with_warmup, make_engine, trained_model
from stages.leaves import precision, stats
from stages.leaves.config import ConfigError, PipelineConfig, RewardConfig
from stages.leaves.dist import Dist
from stages.leaves.pair_batching import PairBatchSampler
from stages.leaves.rendering import collate, count_cut, encode_example
from stages.leaves.reward_report import PAIR_OUTCOMES, margin_histogram, pair_outcomes, worst_pairs
from stages.orchestration import run_writers, tracking
from stages.pipeline.data import RM_SPLITS, pair_digest, read_jsonl
from stages.reward.pyfunc import scorer_pack
from stages.runtime import lifecycle
from stages.leaves.tags import (HELDOUT_ACCURACY_CI_HIGH_TAG, HELDOUT_ACCURACY_CI_LOW_TAG, HELDOUT_ACCURACY_TAG,
                                HELDOUT_PAIRS_TAG, SCORE_MEAN_TAG, SCORE_STD_TAG)

WORST_PAIRS = 16  # rows of the eval/worst_pairs table


@dataclass
class EncodedPair:
    chosen_ids: list[int]
    chosen_labels: list[int]  # -100 on the prompt: the LM loss sees the chosen response only
    rejected_ids: list[int]

    @property
    def length(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))


def encode_pairs(tokenizer, rows: list[dict], max_seq_len: int, max_response_len: int) -> list[EncodedPair]:
    pairs = []
    for row in rows:
        chosen_ids, chosen_labels = encode_example(tokenizer, row["messages"], row["chosen"], max_seq_len, max_response_len)
        rejected_ids, _ = encode_example(tokenizer, row["messages"], row["rejected"], max_seq_len, max_response_len)
        pairs.append(EncodedPair(chosen_ids, chosen_labels, rejected_ids))
    return pairs


def make_sampler(rm: RewardConfig, pairs: list[EncodedPair], dist: Dist) -> PairBatchSampler:
    return PairBatchSampler([p.length for p in pairs], dynamic=rm.dynamic_batching, token_budget=rm.token_budget,
                            min_pairs=rm.min_pairs, max_pairs=rm.max_pairs, fixed_pairs=rm.fixed_pairs,
                            seed=rm.seed, rank=dist.rank, world_size=dist.world_size)


def pair_batch(pairs: list[EncodedPair], pad_id: int, device: str) -> dict[str, torch.Tensor]:
    """Chosen answers in the first rows, rejected in the rest, all right-padded to one width."""
    rows = [(p.chosen_ids, p.chosen_labels) for p in pairs] + [(p.rejected_ids, [-100] * len(p.rejected_ids)) for p in pairs]
    return {name: tensor.to(device) for name, tensor in collate(rows, pad_id).items()}


def forward_pairs(model, batch: dict[str, torch.Tensor], n_pairs: int, beta_rm: float):
    """(loss, r(chosen), r(rejected)) of a batch made by `pair_batch`. With β_rm = 0 the LM head
    makes no pass over the chosen answers: their LM loss is not in the loss."""
    lm_labels = batch["labels"][:n_pairs] if beta_rm else None
    rewards, lm = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], lm_labels=lm_labels)
    r_chosen, r_rejected = rewards[:n_pairs], rewards[n_pairs:]
    loss = reward_model_loss(r_chosen, r_rejected, *(lm or (None, None)), beta_rm)
    return loss, r_chosen, r_rejected


@dataclass
class HeldoutScores:
    r_chosen: np.ndarray
    r_rejected: np.ndarray
    lm_loss: float | None  # None: β_rm = 0, not computed
    beta_rm: float

    @property
    def margins(self) -> np.ndarray:
        return self.r_chosen - self.r_rejected

    def metrics(self, ci_level: float) -> dict[str, float]:
        """Held-out loss, accuracy (with its Wilson interval at `ci_level`), margin, score statistics."""
        scores = np.concatenate([self.r_chosen, self.r_rejected])
        accuracy = stats.wilson(int(np.sum(self.margins > 0)), len(self.margins), ci_level)
        pairwise = float(pairwise_loss(torch.from_numpy(self.r_chosen), torch.from_numpy(self.r_rejected)))
        lm = {} if self.lm_loss is None else {"eval/lm_loss": self.lm_loss}
        return {
            "eval/loss": pairwise + self.beta_rm * (self.lm_loss or 0.0),
            "eval/pairwise_loss": pairwise,
            **lm,
            **accuracy.metrics("eval/accuracy"),
            "eval/margin": float(np.mean(self.margins)),
            "eval/score_mean": float(scores.mean()),
            "eval/score_std": float(scores.std()),
        }

    def probe(self, rows: list[dict]) -> pd.DataFrame:
        """One row per held-out pair (`row`: its line number in the source file), for the RM contract."""
        return pd.DataFrame({"row": [r["row"] for r in rows], "r_chosen": self.r_chosen,
                             "r_rejected": self.r_rejected, "margin": self.margins})


@torch.no_grad()
def score_heldout(model, pairs: list[EncodedPair], sampler: PairBatchSampler, pad_id: int, beta_rm: float,
                  dist: Dist) -> HeldoutScores:
    """Scores of every held-out pair; ranks score their own batches and sum into full vectors."""
    was_training = model.training
    model.eval()
    n = len(pairs)
    r_chosen, r_rejected = np.zeros(n), np.zeros(n)
    nll_sum, lm_tokens = 0.0, 0
    for indices in sampler.batches(epoch=0):
        batch = pair_batch([pairs[i] for i in indices], pad_id, dist.device)
        loss, chosen, rejected = forward_pairs(model, batch, len(indices), beta_rm)
        r_chosen[indices], r_rejected[indices] = chosen.cpu().numpy(), rejected.cpu().numpy()
        nll_sum, lm_tokens = nll_sum + loss.lm.item() * loss.lm_tokens, lm_tokens + loss.lm_tokens
    total = dist.all_reduce_sum([*r_chosen, *r_rejected, nll_sum, lm_tokens])
    model.train(was_training)
    lm_loss = total[-2] / max(total[-1], 1) if beta_rm else None
    return HeldoutScores(np.array(total[:n]), np.array(total[n : 2 * n]), lm_loss, beta_rm)


def relabelled(rows: list[dict], folder: str, cfg: PipelineConfig, tokenizer, pad_id: int, dist: Dist
               ) -> tuple[list[dict], int]:
    """`rows` as the reward model in `folder` (`reward.labels_from`) prefers them: chosen and rejected
    swapped where it scores the rejected answer higher; and how many it swapped."""
    rm = cfg.reward
    labeller = load_reward_model(folder, cfg.model, precision.dtype(precision.resolve(cfg.model.precision,
                                                                                      dist.device)))
    pairs = encode_pairs(tokenizer, rows, rm.max_seq_len, rm.max_response_len)
    scores = score_heldout(labeller.to(dist.device), pairs, make_sampler(rm, pairs, dist), pad_id, 0.0, dist)
    swap = scores.r_rejected > scores.r_chosen
    return ([{**row, "chosen": row["rejected"], "rejected": row["chosen"]} if swapped else row
             for row, swapped in zip(rows, swap)], int(swap.sum()))


def read_rm_splits(rm: RewardConfig, splits_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(training pairs, held-out pairs, the proxy's held-out pairs) of `reward.pairs`. A gold RM
    (`gold`) is evaluated on the proxy's held-out pairs (rm_eval) too, the first `heldout_pairs`
    as the proxy is, so a study compares the two RMs on the same pairs; the data stage's splits
    hold disjoint prompts, and a pair whose prompt the gold RM trains on is left out all the same.
    The proxy's own held-out pairs are its held-out split: the third list is empty."""
    train_split, heldout_split = RM_SPLITS[rm.pairs]
    train_rows, heldout_rows = ((read_jsonl(path) if path.exists() else []) for path in
                                (splits_dir / f"{train_split}.jsonl", splits_dir / f"{heldout_split}.jsonl"))
    if not train_rows or not heldout_rows:
        raise ConfigError(f"reward.pairs={rm.pairs} reads the {train_split} and {heldout_split} splits, and the "
                          f"data stage wrote {len(train_rows)} and {len(heldout_rows)} pairs: set "
                          f"data.splits.{train_split} and data.splits.{heldout_split}")
    proxy_rows = []
    proxy_path = splits_dir / f"{RM_SPLITS['proxy'][1]}.jsonl"
    if rm.pairs != "proxy" and proxy_path.exists():
        trained = {row["prompt"] for row in train_rows}
        proxy_rows = [row for row in read_jsonl(proxy_path)[: rm.heldout_pairs] if row["prompt"] not in trained]
    return train_rows, heldout_rows[: rm.heldout_pairs], proxy_rows


def step_totals(loss: RewardLoss, r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                batch: dict[str, torch.Tensor]) -> list[float]:
    """This rank's sums for the step's metrics (summed over ranks before they are logged)."""
    margins = (r_chosen - r_rejected).detach()
    return [len(margins), loss.pairwise.item() * len(margins), float((margins > 0).sum()), float(margins.sum()),
            loss.lm.item() * loss.lm_tokens, loss.lm_tokens, float(batch["attention_mask"].sum()),
            batch["attention_mask"].numel()]


def prepare(cfg: PipelineConfig, inputs: dict, downloads: Path) -> dict:
    """Once, before the ranks start: local copies of the splits and of the SFT model."""
    labels = {"labels_from_dir": str(tracking.download(cfg.reward.labels_from, downloads))} \
        if cfg.reward.labels_from else {}
    return {"splits_dir": str(tracking.download(inputs["splits"], downloads)),
            "sft_model_dir": str(tracking.download(inputs["sft_model"], downloads)), **labels}


class RewardTraining(lifecycle.TrainingStage):
    """One `step` is one optimiser step over a batch of preference pairs (pairwise + LM loss)."""

    name, progress_metrics = "reward", {"loss": "train/loss", "acc": "train/accuracy"}

    def __init__(self, cfg: PipelineConfig, inputs: dict, dist: Dist):
        rm = self.rm = cfg.reward
        self.cfg, self.dist = cfg, dist
        torch.manual_seed(rm.seed)
        splits_dir, sft_dir = Path(inputs["splits_dir"]), inputs["sft_model_dir"]
        self.tokenizer = loading.load_tokenizer(sft_dir, cfg.model)
        model = trained_reward_model(sft_dir, cfg.model, dist.device, dist)
        loading.align_pad_token(model.lm, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id

        train_rows, heldout_rows, self.proxy_rows = read_rm_splits(rm, splits_dir)
        # A pair's identity is the split's pair, whatever labels the relabelling gives it.
        self.heldout_keys, self.proxy_keys = ([pair_digest(r["prompt"], r["chosen"], r["rejected"]) for r in rows]
                                              for rows in (heldout_rows, self.proxy_rows))
        swapped = {}
        if "labels_from_dir" in inputs:  # Gao et al.'s synthetic labels: the labelling RM is the truth
            (train_rows, swapped["train"]), (heldout_rows, swapped["heldout"]) = (
                relabelled(rows, inputs["labels_from_dir"], cfg, self.tokenizer, self.pad_id, dist)
                for rows in (train_rows, heldout_rows))
        self.heldout_rows = heldout_rows
        self.train_set = encode_pairs(self.tokenizer, train_rows, rm.max_seq_len, rm.max_response_len)
        self.heldout = encode_pairs(self.tokenizer, self.heldout_rows, rm.max_seq_len, rm.max_response_len)
        self.proxy_heldout = encode_pairs(self.tokenizer, self.proxy_rows, rm.max_seq_len, rm.max_response_len)
        self.sampler, self.heldout_sampler = make_sampler(rm, self.train_set, dist), make_sampler(rm, self.heldout, dist)
        self.total = self.sampler.steps_per_epoch * rm.epochs
        if rm.max_steps:
            self.total = min(self.total, rm.max_steps)
        self.checkpoint_every, self.log_every = rm.checkpoint_every, rm.log_every

        optimizer = adamw(model, dist, lr=rm.lr, betas=rm.adam_betas, weight_decay=rm.weight_decay)
        self.scheduler = cosine_with_warmup(optimizer, int(rm.warmup_ratio * self.total), self.total)
        self.engine = make_engine(model, optimizer, self.scheduler,
                                  micro_batch_size=rm.max_pairs if rm.dynamic_batching else rm.fixed_pairs,
                                  grad_accum_steps=1, max_grad_norm=rm.max_grad_norm,
                                  precision=precision.resolve(cfg.model.precision, dist.device), dist=dist)
        self.engines = {"model": self.engine}
        self.guard = NonFiniteGuard("reward", rm.max_nonfinite_steps, dist)
        self.params = {
            "model": cfg.model.model_dump(mode="json"), "reward": rm.model_dump(mode="json"),
            "reward.world_size": dist.world_size, "reward.total_steps": self.total,
            "reward.steps_per_epoch": self.sampler.steps_per_epoch, "reward.train_pairs": len(self.train_set),
            "reward.heldout_pairs": len(self.heldout), "reward.engine": type(self.engine).__name__,
            "reward.zero_stage": dist.zero_stage, "reward.sft_model": inputs["sft_model"]}
        # Chosen and rejected answers of rm_train cut at reward.max_response_len (they end without EOS).
        self.first_metrics = {"data/cut_answers": count_cut([p.chosen_ids for p in self.train_set] +
                                                            [p.rejected_ids for p in self.train_set], self.tokenizer),
                              **{f"data/relabelled_{split}_pairs": float(n) for split, n in swapped.items()}}
        self.schedule = None  # each step's pair indices, from the first step this attempt trains
        self.engine.train()

    def step(self, number: int) -> dict[str, float]:
        rm, dist = self.rm, self.dist
        if self.schedule is None:
            # The batches are a function of the epoch (the sampler's seed): a resumed run skips the ones done.
            schedule = (indices for epoch in range(rm.epochs) for indices in self.sampler.batches(epoch))
            self.schedule = itertools.islice(schedule, number - 1, None)
        indices = next(self.schedule)
        step_started = time.perf_counter()
        batch = pair_batch([self.train_set[i] for i in indices], self.pad_id, dist.device)
        loss, r_chosen, r_rejected = forward_pairs(self.engine, batch, len(indices), rm.beta_rm)
        if self.guard.check({"loss": loss.total}, f"step {number}"):  # else skipped: no gradient, no weight moves
            self.engine.backward(loss.total)
            self.engine.step()
        pairs, pairwise_sum, correct, margin_sum, nll_sum, lm_tokens, tokens, padded = dist.all_reduce_sum(
            step_totals(loss, r_chosen, r_rejected, batch))
        elapsed = time.perf_counter() - step_started
        return {
            "train/loss": pairwise_sum / pairs + rm.beta_rm * nll_sum / max(lm_tokens, 1),
            "train/pairwise_loss": pairwise_sum / pairs,
            **({"train/lm_loss": nll_sum / max(lm_tokens, 1)} if rm.beta_rm else {}),  # 0: not computed
            "train/accuracy": correct / pairs,
            "train/margin": margin_sum / pairs,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
            "train/tokens_per_s": tokens / elapsed,
            "train/padding_fraction": 1.0 - tokens / padded,
            "train/pairs": pairs,
            "train/epoch": number / self.sampler.steps_per_epoch,
            "train/skipped_steps": self.guard.skipped,
        }

    def on_proxy_pairs(self) -> tuple[dict[str, float], pd.DataFrame]:
        """A gold RM on the proxy's held-out pairs: its accuracy there with its Wilson interval, the
        pair count and the mean margin (eval/rm_eval/...), and each pair's outcome."""
        split = RM_SPLITS["proxy"][1]
        sampler = make_sampler(self.rm, self.proxy_heldout, self.dist)
        scores = score_heldout(self.engine.module, self.proxy_heldout, sampler, self.pad_id, 0.0, self.dist)
        accuracy = stats.wilson(int(np.sum(scores.margins > 0)), len(scores.margins), self.cfg.statistics.ci_level)
        metrics = {**accuracy.metrics(f"eval/{split}/accuracy"), f"eval/{split}/pairs": float(len(scores.margins)),
                   f"eval/{split}/margin": float(np.mean(scores.margins))}
        return metrics, pair_outcomes(self.proxy_keys, split, scores.r_chosen, scores.r_rejected)

    def finish(self) -> lifecycle.Finish:
        engine, heldout = self.engine, self.heldout
        scores = score_heldout(engine.module, heldout, self.heldout_sampler, self.pad_id, self.rm.beta_rm, self.dist)
        metrics = scores.metrics(self.cfg.statistics.ci_level)
        engine.module.score_mean, engine.module.score_std = metrics["eval/score_mean"], metrics["eval/score_std"]
        outcomes = [pair_outcomes(self.heldout_keys, RM_SPLITS[self.rm.pairs][1], scores.r_chosen, scores.r_rejected)]
        if self.proxy_heldout:
            proxy_metrics, proxy_outcomes = self.on_proxy_pairs()
            metrics.update(proxy_metrics)
            outcomes.append(proxy_outcomes)
        model = trained_model(engine)  # every rank: a ZeRO-3 engine's weights are gathered

        def report(tracker) -> None:
            histogram = tracker.workdir / "margin_histogram.png"
            margin_histogram(scores.margins, histogram)
            tracker.log_artifact(histogram, "eval")
            tracker.log_table(worst_pairs(self.heldout_rows, scores.r_chosen, scores.r_rejected, WORST_PAIRS),
                              "eval/worst_pairs.json")
            tracker.log_table(pd.concat(outcomes, ignore_index=True), PAIR_OUTCOMES)

        def save(out: Path) -> None:
            save_reward_model(model, self.tokenizer, out, {"heldout_pairs": len(heldout),
                                                           "heldout_accuracy": metrics["eval/accuracy"]})
            save_adapter(model, out)

        return lifecycle.Finish(
            metrics, "reward_probe", probe=lambda: scores.probe(self.heldout_rows), save=save,
            pack=scorer_pack(self.cfg, self.dist),
            # The accuracy with its interval and pair count: the eval stage reads them to decide whether
            # this model, as a judge, can tell a better answer from a worse one (stages/compute/evaluate/quality.py).
            lineage={HELDOUT_ACCURACY_TAG: f"{metrics['eval/accuracy']:.4f}",
                     HELDOUT_ACCURACY_CI_LOW_TAG: f"{metrics['eval/accuracy_ci_low']:.4f}",
                     HELDOUT_ACCURACY_CI_HIGH_TAG: f"{metrics['eval/accuracy_ci_high']:.4f}",
                     HELDOUT_PAIRS_TAG: str(len(heldout)),
                     SCORE_MEAN_TAG: f"{metrics['eval/score_mean']:.6g}",
                     SCORE_STD_TAG: f"{metrics['eval/score_std']:.6g}"},
            report=report)


def run(cfg: PipelineConfig, tracker: run_writers.StageRun | None, inputs: dict, dist: Dist) -> dict:
    return lifecycle.run(RewardTraining(cfg, inputs, dist), cfg, tracker, inputs, dist)
