"""Supervised fine-tuning on the chosen answers: causal-LM loss on response tokens only."""

from __future__ import annotations

import itertools
import math
import random
import time
from pathlib import Path

import pandas as pd
import torch

from stages.compute import loading, mlflow_models
from stages.compute.losses import shifted_nll
from stages.compute.model_loading import frozen_dtype, save_adapter, trained_lm
from stages.compute.nonfinite import NonFiniteGuard
from stages.compute.training import adamw, cosine_with_warmup, generation_probe, make_engine, trained_model
from stages.leaves import precision
from stages.leaves.config import PipelineConfig
from stages.leaves.dist import Dist
from stages.leaves.rendering import collate, count_cut, encode_example
from stages.leaves.tags import INPUT_TAG_PREFIX, PERPLEXITY_AFTER_TAG, PERPLEXITY_BEFORE_TAG
from stages.orchestration import run_writers, tracking
from stages.pipeline.data import corpus_texts, read_jsonl
from stages.runtime import lifecycle


def response_nll(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over response tokens, and their count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return shifted_nll(logits, batch["labels"])


@torch.no_grad()
def heldout_perplexity(model, examples, pad_id: int, batch_size: int, dist: Dist) -> tuple[float, float]:
    """(mean response-token NLL, perplexity) over `examples`, sharded across ranks."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    shard = examples[dist.rank :: dist.world_size]
    for start in range(0, len(shard), batch_size):
        batch = {k: v.to(dist.device) for k, v in collate(shard[start : start + batch_size], pad_id).items()}
        nll, n = response_nll(model, batch)
        total, count = total + nll.item(), count + n
    total, count = dist.all_reduce_sum([total, count])
    model.train(was_training)
    loss = total / max(count, 1)
    return loss, math.exp(min(loss, 50.0))


def response_tokens(labels: list[int]) -> int:
    """The next-token targets of one example that `shifted_nll` counts."""
    return sum(1 for label in labels[1:] if label != -100)


def accumulate_step(engine, micro_batches: list[list[tuple[list[int], list[int]]]], pad_id: int,
                    guard: NonFiniteGuard, dist: Dist, step: int) -> tuple[float, int]:
    """One optimiser step over this rank's micro-batches, with the gradient of one token mean over
    the whole global batch: Σ NLL / Σ response tokens over every micro-batch of every rank (as TRL
    and OpenRLHF). A mean per micro-batch, averaged, would weigh a token of a short micro-batch
    more than one of a long micro-batch. The engine divides each loss by its grad_accum_steps
    (len(micro_batches)) and DeepSpeed averages gradients over ranks: the scale undoes both.
    Returns this rank's summed response NLL and response-token count over the micro-batches that
    trained."""
    (total,) = dist.all_reduce_sum([sum(response_tokens(labels) for chunk in micro_batches for _, labels in chunk)])
    scale = len(micro_batches) * dist.world_size / max(total, 1)
    loss_sum, tokens = 0.0, 0
    for micro, chunk in enumerate(micro_batches):
        batch = {k: v.to(dist.device) for k, v in collate(chunk, pad_id).items()}
        nll, n = response_nll(engine, batch)
        # A NaN/Inf loss adds no gradient, but its micro-step still counts: the engine steps the
        # optimiser after this step's last micro-batch, on this step's finite ones only (a skipped
        # micro-step would move every later optimiser step into the next step's micro-batches).
        if guard.check({"loss": nll}, f"step {step}, micro-batch {micro + 1}"):
            engine.backward(nll * scale)
            loss_sum, tokens = loss_sum + nll.item(), tokens + n
        engine.step()
    return loss_sum, tokens


def prepare(cfg: PipelineConfig, inputs: dict, downloads: Path) -> dict:
    """Once, before the ranks start: local copies of the splits and of the base model."""
    splits_dir = tracking.download(inputs["splits"], downloads)
    model_dir = loading.materialise_model(cfg.model, corpus=lambda: corpus_texts(splits_dir))
    return {"splits_dir": str(splits_dir), "base_model_dir": model_dir}


class SFTTraining(lifecycle.TrainingStage):
    """One `step` is one optimiser step over a global batch of SFT examples (`accumulate_step`)."""

    name, progress_metrics = "sft", {"loss": "train/loss"}

    def __init__(self, cfg: PipelineConfig, inputs: dict, dist: Dist):
        sft = self.sft = cfg.sft
        self.cfg, self.dist = cfg, dist
        torch.manual_seed(sft.seed)
        self.splits_dir, model_dir = Path(inputs["splits_dir"]), inputs["base_model_dir"]
        tokenizer = self.tokenizer = loading.load_tokenizer(model_dir, cfg.model)
        model = trained_lm(model_dir, cfg.model, dist.device, dist)
        loading.align_pad_token(model, tokenizer)

        def encode(rows):
            return [encode_example(tokenizer, r["messages"], r["chosen"], sft.max_seq_len, sft.max_response_len)
                    for r in rows]

        self.train_set = encode(read_jsonl(self.splits_dir / "sft.jsonl"))
        # Counted here, not in the data stage: that stage has no tokenizer (the tiny preset's is
        # trained on its splits), and max_response_len is this stage's setting.
        cut_responses = count_cut([ids for ids, _ in self.train_set], tokenizer)
        # Evaluation prompts from a prompt-only source of their own have no answers to score: the held-out
        # loss reads the preference pairs' held-out split instead.
        heldout_split = "rm_eval" if cfg.data.eval_prompts_source else "eval_prompts"
        self.heldout = encode(read_jsonl(self.splits_dir / f"{heldout_split}.jsonl")[: sft.heldout_prompts])

        self.per_rank = sft.micro_batch_size * sft.grad_accum_steps
        self.global_batch = self.per_rank * dist.world_size
        self.steps_per_epoch = len(self.train_set) // self.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(f"sft: {len(self.train_set)} examples is less than one global batch ({self.global_batch})")
        self.total = self.steps_per_epoch * sft.epochs
        if sft.max_steps:
            self.total = min(self.total, sft.max_steps)
        self.checkpoint_every, self.log_every = sft.checkpoint_every, sft.log_every

        optimizer = adamw(model, dist, lr=sft.lr, betas=sft.adam_betas, weight_decay=sft.weight_decay)
        self.scheduler = cosine_with_warmup(optimizer, int(sft.warmup_ratio * self.total), self.total, sft.min_lr_ratio)
        self.engine = make_engine(model, optimizer, self.scheduler, micro_batch_size=sft.micro_batch_size,
                                  grad_accum_steps=sft.grad_accum_steps, max_grad_norm=sft.max_grad_norm,
                                  precision=precision.resolve(cfg.model.precision, dist.device), dist=dist)
        self.engines = {"model": self.engine}
        self.guard = NonFiniteGuard("sft", sft.max_nonfinite_steps, dist)
        self.params = {"model": cfg.model.model_dump(mode="json"), "sft": sft.model_dump(mode="json"),
                       "sft.world_size": dist.world_size, "sft.total_steps": self.total,
                       "sft.engine": type(self.engine).__name__, "sft.zero_stage": dist.zero_stage,
                       "sft.base_model": model_dir}
        # The base model's held-out numbers, before a checkpoint replaces its weights.
        self.loss_before, self.ppl_before = heldout_perplexity(self.engine.module, self.heldout, tokenizer.pad_token_id,
                                                               sft.micro_batch_size, dist)
        self.first_metrics = {"eval/loss": self.loss_before, "eval/perplexity": self.ppl_before,
                              "data/cut_responses": cut_responses}
        self.final_train_loss = float("nan")
        self.schedule = None  # each step's indices into train_set, from the first step this attempt trains
        self.engine.train()

    def batches(self):
        """Each step's indices into train_set for this rank, in training order: a fresh shuffle per
        epoch from one seeded generator, so a resumed run skips exactly the steps it had done."""
        order_rng = random.Random(self.sft.seed)
        for _ in itertools.count():
            order = list(range(len(self.train_set)))
            order_rng.shuffle(order)
            for batch_start in range(0, self.steps_per_epoch * self.global_batch, self.global_batch):
                start = batch_start + self.dist.rank * self.per_rank
                yield order[start : start + self.per_rank]

    def state(self) -> dict:
        return {"final_train_loss": self.final_train_loss}

    def load_state(self, state: dict) -> None:
        self.final_train_loss = state["final_train_loss"]

    def step(self, number: int) -> dict[str, float]:
        sft, dist, train_set = self.sft, self.dist, self.train_set
        if self.schedule is None:
            self.schedule = itertools.islice(self.batches(), number - 1, None)
        mine = next(self.schedule)
        step_started = time.perf_counter()
        micro_batches = [[train_set[i] for i in mine[micro * sft.micro_batch_size : (micro + 1) * sft.micro_batch_size]]
                         for micro in range(sft.grad_accum_steps)]
        loss_sum, tokens = accumulate_step(self.engine, micro_batches, self.tokenizer.pad_token_id, self.guard, dist,
                                           number)
        seq_tokens = sum(len(train_set[i][0]) for i in mine)
        loss_sum, tokens, seq_tokens = dist.all_reduce_sum([loss_sum, tokens, seq_tokens])
        if tokens:  # else every micro-batch of the step was skipped
            self.final_train_loss = loss_sum / tokens
        return {
            "train/loss": loss_sum / tokens if tokens else math.nan,
            "train/skipped_steps": self.guard.skipped,
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
            "train/tokens_per_s": seq_tokens / (time.perf_counter() - step_started),
            "train/epoch": number / self.steps_per_epoch,
        }

    def finish(self) -> lifecycle.Finish:
        sft, cfg, tokenizer, engine = self.sft, self.cfg, self.tokenizer, self.engine
        loss_after, ppl_after = heldout_perplexity(engine.module, self.heldout, tokenizer.pad_token_id,
                                                   sft.micro_batch_size, self.dist)
        probe_rows, probe_seconds = [], []
        model = trained_model(engine)  # every rank: a ZeRO-3 engine's weights are gathered

        def save(out: Path) -> None:
            model.config.use_cache = True
            model.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
            save_adapter(model, out)

        def held_out_probe(out: Path) -> None:  # for the SFT contract, on the saved weights (whatever engine trained them)
            started = time.perf_counter()
            rows = read_jsonl(self.splits_dir / "eval_prompts.jsonl")[: sft.probe_prompts]
            saved = loading.load_model(str(out), cfg.model, frozen_dtype(cfg.model, self.dist.device))
            probe_rows.extend(generation_probe(saved, tokenizer, rows, sft.probe_max_new_tokens, sft.max_seq_len))
            probe_seconds.append(time.perf_counter() - started)

        def probe() -> pd.DataFrame:
            frame = pd.DataFrame(probe_rows, columns=["row", "response", "response_tokens", "ended_with_eos"])
            frame["perplexity_before"], frame["perplexity_after"] = self.ppl_before, ppl_after
            frame["final_train_loss"] = self.final_train_loss
            return frame

        def report(tracker) -> None:
            frame = probe()
            tracker.log_metrics({"probe/eos_rate": float(frame["ended_with_eos"].mean()) if probe_rows else 0.0,
                                 "probe/mean_response_tokens": float(frame["response_tokens"].mean()) if probe_rows else 0.0,
                                 "probe/seconds": sum(probe_seconds)}, step=self.total)

        return lifecycle.Finish(
            metrics={"eval/loss": loss_after, "eval/perplexity": ppl_after, "sft/perplexity_before": self.ppl_before,
                     "sft/perplexity_after": ppl_after},
            probe_name="sft_probe", probe=probe, save=save, pack=mlflow_models.chat(cfg), inspect=held_out_probe,
            lineage={f"{INPUT_TAG_PREFIX}base_model": cfg.model.name_or_path, PERPLEXITY_BEFORE_TAG: f"{self.ppl_before:.4f}",
                     PERPLEXITY_AFTER_TAG: f"{ppl_after:.4f}"},
            report=report)


def run(cfg: PipelineConfig, tracker: run_writers.StageRun | None, inputs: dict, dist: Dist) -> dict:
    return lifecycle.run(SFTTraining(cfg, inputs, dist), cfg, tracker, inputs, dist)
