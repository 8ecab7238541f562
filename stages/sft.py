"""Supervised fine-tuning on the chosen answers: causal-LM loss on response tokens only."""

from __future__ import annotations

import itertools
import math
import random
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from stages import interrupt, mlflow_models, precision, sources, tracking
from stages.checkpoint import StepCheckpoints
from stages.config import PipelineConfig
from stages.data import corpus_texts, count_cut, encode_example, read_jsonl
from stages.nonfinite import NonFiniteGuard
from stages.launch import Dist
from stages.losses import shifted_nll
from stages.training import adamw, collate, cosine_with_warmup, generation_probe, make_engine, trained_model


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
        # A NaN/Inf loss adds no gradient: the engine's accumulation waits for the next finite
        # micro-batch, so no optimiser step ever takes in a non-finite one.
        if not guard.check({"loss": nll}, f"step {step}, micro-batch {micro + 1}"):
            continue
        engine.backward(nll * scale)
        engine.step()
        loss_sum, tokens = loss_sum + nll.item(), tokens + n
    return loss_sum, tokens


def prepare(cfg: PipelineConfig, inputs: dict, downloads: Path) -> dict:
    """Once, before the ranks start: local copies of the splits and of the base model."""
    splits_dir = tracking.download(inputs["splits"], downloads)
    model_dir = sources.materialise_model(cfg.model, corpus=lambda: corpus_texts(splits_dir))
    return {"splits_dir": str(splits_dir), "base_model_dir": model_dir}


def run(cfg: PipelineConfig, tracker: tracking.StageRun | None, inputs: dict, dist: Dist) -> dict:
    sft = cfg.sft
    torch.manual_seed(sft.seed)
    splits_dir, model_dir = Path(inputs["splits_dir"]), inputs["base_model_dir"]
    tokenizer = sources.load_tokenizer(model_dir, cfg.model)
    model = sources.load_model(model_dir, cfg.model).to(dist.device)
    sources.align_pad_token(model, tokenizer)
    if sft.gradient_checkpointing:  # transformers 5 renamed it; 4.x has only the old name
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.config.use_cache = False

    def encode(rows):
        return [encode_example(tokenizer, r["messages"], r["chosen"], sft.max_seq_len, sft.max_response_len) for r in rows]

    train_set = encode(read_jsonl(splits_dir / "sft.jsonl"))
    # Counted here, not in the data stage: that stage has no tokenizer (the tiny preset's is
    # trained on its splits), and max_response_len is this stage's setting.
    cut_responses = count_cut([ids for ids, _ in train_set], tokenizer)
    # Evaluation prompts from a prompt-only source of their own have no answers to score: the held-out
    # loss reads the preference pairs' held-out split instead.
    heldout_split = "rm_eval" if cfg.data.eval_prompts_source else "eval_prompts"
    heldout_rows = read_jsonl(splits_dir / f"{heldout_split}.jsonl")
    heldout = encode(heldout_rows[: sft.heldout_prompts])

    per_rank = sft.micro_batch_size * sft.grad_accum_steps
    global_batch = per_rank * dist.world_size
    steps_per_epoch = len(train_set) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"sft: {len(train_set)} examples is less than one global batch ({global_batch})")
    total_steps = steps_per_epoch * sft.epochs
    if sft.max_steps:
        total_steps = min(total_steps, sft.max_steps)

    optimizer = adamw(model, lr=sft.lr, betas=sft.adam_betas, weight_decay=sft.weight_decay)
    scheduler = cosine_with_warmup(optimizer, int(sft.warmup_ratio * total_steps), total_steps, sft.min_lr_ratio)
    engine = make_engine(model, optimizer, scheduler, micro_batch_size=sft.micro_batch_size,
                         grad_accum_steps=sft.grad_accum_steps, max_grad_norm=sft.max_grad_norm,
                         precision=precision.resolve(cfg.model.precision, dist.device), dist=dist)

    pad_id = tokenizer.pad_token_id
    # The base model's held-out numbers, before a checkpoint replaces its weights.
    loss_before, ppl_before = heldout_perplexity(engine.module, heldout, pad_id, sft.micro_batch_size, dist)
    guard = NonFiniteGuard("sft", sft.max_nonfinite_steps, dist)
    checkpoints = StepCheckpoints(dist, sft.checkpoint_every)
    resumed = checkpoints.begin({"model": engine}, guard, tracker, params={
        "model": cfg.model.model_dump(mode="json"), "sft": sft.model_dump(mode="json"),
        "sft.world_size": dist.world_size, "sft.total_steps": total_steps, "sft.engine": type(engine).__name__,
        "sft.zero_stage": dist.zero_stage, "sft.base_model": model_dir})
    step, final_train_loss = (resumed["step"], resumed["final_train_loss"]) if resumed else (0, float("nan"))
    if dist.is_main:
        tracker.log_metrics({"eval/loss": loss_before, "eval/perplexity": ppl_before,
                             "data/cut_responses": cut_responses}, step=0)

    def batches():
        """Each step's indices into train_set for this rank, in training order: a fresh shuffle per
        epoch from one seeded generator, so a resumed run skips exactly the steps it had done."""
        order_rng = random.Random(sft.seed)
        for _ in itertools.count():
            order = list(range(len(train_set)))
            order_rng.shuffle(order)
            for batch_start in range(0, steps_per_epoch * global_batch, global_batch):
                yield order[batch_start + dist.rank * per_rank : batch_start + (dist.rank + 1) * per_rank]

    def state() -> dict:
        return {"step": step, "final_train_loss": final_train_loss, "guard": guard.state_dict()}

    engine.train()
    progress = tqdm(total=total_steps, initial=step, desc="sft", disable=not dist.is_main, dynamic_ncols=True)
    started = time.perf_counter()
    for mine in itertools.islice(batches(), step, total_steps):
        interrupt.stop_point(dist, "sft", f"after step {step} of {total_steps}",
                             save=lambda: f"checkpoint {checkpoints.save(step, {'model': engine}, state())}")
        step_started = time.perf_counter()
        micro_batches = [[train_set[i] for i in mine[micro * sft.micro_batch_size : (micro + 1) * sft.micro_batch_size]]
                         for micro in range(sft.grad_accum_steps)]
        loss_sum, tokens = accumulate_step(engine, micro_batches, pad_id, guard, dist, step + 1)
        seq_tokens = sum(len(train_set[i][0]) for i in mine)
        loss_sum, tokens, seq_tokens = dist.all_reduce_sum([loss_sum, tokens, seq_tokens])
        step += 1
        if tokens:  # else every micro-batch of the step was skipped
            final_train_loss = loss_sum / tokens
        elapsed = time.perf_counter() - step_started
        if dist.is_main and (step % sft.log_every == 0 or step == total_steps):
            tracker.log_metrics({
                "train/loss": loss_sum / tokens if tokens else math.nan,
                "train/skipped_steps": guard.skipped,
                "train/lr": scheduler.get_last_lr()[0],
                "train/grad_norm": float(engine.get_global_grad_norm() or 0.0),
                "train/tokens_per_s": seq_tokens / elapsed,
                "train/epoch": step / steps_per_epoch,
            }, step=step)
        if checkpoints.due(step, total_steps):
            checkpoints.save(step, {"model": engine}, state())
        progress.update(1)
        progress.set_postfix(loss=f"{loss_sum / max(tokens, 1):.3f}")
    progress.close()
    train_seconds = time.perf_counter() - started

    loss_after, ppl_after = heldout_perplexity(engine.module, heldout, pad_id, sft.micro_batch_size, dist)
    outputs: dict = {}
    if dist.is_main:
        tracker.log_metrics({"eval/loss": loss_after, "eval/perplexity": ppl_after}, step=step)
        tracker.log_metrics({"sft/perplexity_before": ppl_before, "sft/perplexity_after": ppl_after,
                             "sft/train_seconds": train_seconds}, step=step)
        probe_started, probe = time.perf_counter(), []

        def save(out: Path) -> None:
            model = trained_model(engine)
            model.config.use_cache = True
            model.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)

        def held_out_probe(out: Path) -> None:  # for the SFT contract, on the saved weights (whatever engine trained them)
            probe_rows = read_jsonl(splits_dir / "eval_prompts.jsonl")[: sft.probe_prompts]
            saved = sources.load_model(str(out), cfg.model, precision.dtype(precision.resolve(cfg.model.precision, dist.device)))
            probe.extend(generation_probe(saved, tokenizer, probe_rows,
                                          sft.probe_max_new_tokens, sft.max_seq_len))

        published = tracker.publish_model(
            save, cfg=cfg, inputs=inputs, pack=mlflow_models.chat(cfg), inspect=held_out_probe,
            lineage={"rlhf.input.base_model": cfg.model.name_or_path, "rlhf.perplexity_before": f"{ppl_before:.4f}",
                     "rlhf.perplexity_after": f"{ppl_after:.4f}"})
        probe_frame = pd.DataFrame(probe, columns=["row", "response", "response_tokens", "ended_with_eos"])
        probe_frame["perplexity_before"], probe_frame["perplexity_after"] = ppl_before, ppl_after
        probe_frame["final_train_loss"] = final_train_loss
        probe_uri = tracker.log_probe(probe_frame, "sft_probe")
        tracker.log_metrics({"probe/eos_rate": float(probe_frame["ended_with_eos"].mean()) if probe else 0.0,
                             "probe/mean_response_tokens": float(probe_frame["response_tokens"].mean()) if probe else 0.0,
                             "probe/seconds": time.perf_counter() - probe_started}, step=step)
        outputs = {**published, "sft_run": tracker.run_id, "sft_probe": probe_uri}
    dist.barrier()
    checkpoints.remove()  # the published model is the result; they served resuming only
    return outputs
