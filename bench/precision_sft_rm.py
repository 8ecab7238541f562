"""SFT and reward-model training in fp32 and in bf16, interleaved in one run: tokens/s, and the
held-out loss after the same steps.

For each of SFT and the reward model, two engines are built as the stages build them (AdamW,
the stage's schedule, `PlainEngine` with precision fp32 or bf16: bf16 weights over fp32 master
weights), from the same initial weights (the preset's base model; the reward model also starts from
it, where the reward stage would start from the SFT model) and take the same batches in the same
order. Step k runs fp32 then bf16 for even k and bf16 then fp32 for odd k, so a slow phase of a
shared machine hits both alike. Printed: each step's pair of seconds and their ratio, tokens/s
(real, non-pad tokens) per precision, bf16 / fp32 over all steps, the median and range of the
pairs' ratios; then the held-out loss of both trained models, each evaluated in fp32 on its fp32
(master) weights, so that the weights are compared and not the precision of the evaluation, and
their relative difference against `--tolerance`.

    .venv/bin/python bench/precision_sft_rm.py                      # demo preset (SmolLM2-135M)
    .venv/bin/python bench/precision_sft_rm.py --preset tiny --steps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("fp32", "bf16")


def load_inputs(preset: str, threads: int):
    import torch

    from stages.compute import loading
    from stages.orchestration.config_loading import load_config
    from stages.pipeline.data import load_pairs, make_splits, split_texts

    torch.set_num_threads(threads)
    cfg = load_config(preset, ["model.precision=fp32"])
    _, clean, _ = load_pairs(cfg)
    splits = make_splits(clean, cfg)
    model_dir = loading.materialise_model(cfg.model, corpus=lambda: split_texts(splits))
    tokenizer = loading.load_tokenizer(model_dir, cfg.model)
    return cfg, splits, model_dir, tokenizer


def interleaved(engines: dict, steps: int, run_step) -> dict[str, list[tuple[float, int]]]:
    """(seconds, real tokens) of each step per mode; the order alternates step by step."""
    timings: dict[str, list[tuple[float, int]]] = {mode: [] for mode in engines}
    for k in range(steps):
        for mode in MODES if k % 2 == 0 else tuple(reversed(MODES)):
            started = time.perf_counter()
            tokens = run_step(engines[mode], k)
            timings[mode].append((time.perf_counter() - started, tokens))
        fp32, bf16 = timings["fp32"][-1], timings["bf16"][-1]
        print(f"  step {k + 1}: fp32 {fp32[0]:6.2f} s, bf16 {bf16[0]:6.2f} s ({fp32[1]} tokens), "
              f"×{fp32[0] / bf16[0]:.2f}", flush=True)
    return timings


def summary(what: str, timings: dict[str, list[tuple[float, int]]]) -> None:
    rates = {mode: sum(t for _, t in rows) / sum(s for s, _ in rows) for mode, rows in timings.items()}
    pairs = sorted(f[0] / b[0] for f, b in zip(timings["fp32"], timings["bf16"]))
    print(f"{what}: tokens/s fp32 {rates['fp32']:.1f}, bf16 {rates['bf16']:.1f}, bf16 / fp32 ×{rates['bf16'] / rates['fp32']:.2f} "
          f"(step pairs: median ×{statistics.median(pairs):.2f}, range ×{pairs[0]:.2f} … ×{pairs[-1]:.2f})")


def compare(what: str, losses: dict[str, float], tolerance: float, extra: str = "") -> None:
    difference = abs(losses["bf16"] - losses["fp32"]) / abs(losses["fp32"])
    verdict = "PASS" if difference <= tolerance else "FAIL"
    print(f"{what} held-out loss after the same steps: fp32 {losses['fp32']:.4f}, bf16 {losses['bf16']:.4f}, "
          f"|Δ| / fp32 = {difference:.2%} (tolerance {tolerance:.0%}): {verdict}{extra}")


def bench_sft(cfg, splits, model_dir, tokenizer, steps: int, tolerance: float) -> None:
    import torch

    from stages.compute import loading
    from stages.leaves.rendering import encode_example
    from stages.compute.nonfinite import NonFiniteGuard
    from stages.leaves.dist import Dist
    from stages.pipeline.sft import accumulate_step, heldout_perplexity
    from stages.compute.training import PlainEngine, adamw, cosine_with_warmup, trained_model

    sft, dist = cfg.sft, Dist()

    def encode(rows):
        return [encode_example(tokenizer, r["messages"], r["chosen"], sft.max_seq_len, sft.max_response_len) for r in rows]

    train_set, heldout = encode(splits["sft"]), encode(splits["eval_prompts"][: sft.heldout_prompts])
    per_step = sft.micro_batch_size * sft.grad_accum_steps
    steps = min(steps, len(train_set) // per_step)
    engines = {}
    for mode in MODES:
        torch.manual_seed(sft.seed)
        model = loading.load_model(model_dir, cfg.model)
        loading.align_pad_token(model, tokenizer)
        model.config.use_cache = False
        optimizer = adamw(model, lr=sft.lr, betas=sft.adam_betas, weight_decay=sft.weight_decay)
        scheduler = cosine_with_warmup(optimizer, int(sft.warmup_ratio * steps), steps, sft.min_lr_ratio)
        engines[mode] = PlainEngine(model, optimizer, scheduler, sft.grad_accum_steps, sft.max_grad_norm, mode)
        engines[mode].train()
    guards = {id(engine): NonFiniteGuard("sft", sft.max_nonfinite_steps, dist) for engine in engines.values()}

    def step(engine, k: int) -> int:
        rows = train_set[k * per_step : (k + 1) * per_step]
        micro = [rows[i : i + sft.micro_batch_size] for i in range(0, len(rows), sft.micro_batch_size)]
        accumulate_step(engine, micro, tokenizer.pad_token_id, guards[id(engine)], dist, k + 1)
        return sum(len(ids) for ids, _ in rows)

    print(f"SFT: {steps} steps of {per_step} sequences (micro-batches of {sft.micro_batch_size}), "
          f"max_seq_len {sft.max_seq_len}", flush=True)
    summary("SFT", interleaved(engines, steps, step))
    losses = {mode: heldout_perplexity(trained_model(engine).float(), heldout, tokenizer.pad_token_id,
                                       sft.micro_batch_size, dist)[0] for mode, engine in engines.items()}
    compare("SFT", losses, tolerance, f" ({len(heldout)} held-out answers, response-token NLL)")


def bench_rm(cfg, splits, model_dir, tokenizer, steps: int, tolerance: float) -> None:
    import torch

    from stages.leaves.dist import Dist
    from stages.compute.reward.model import reward_model_from_lm
    from stages.pipeline.reward import encode_pairs, forward_pairs, make_sampler, pair_batch, score_heldout
    from stages.compute.training import PlainEngine, adamw, cosine_with_warmup, trained_model

    rm, dist = cfg.reward, Dist()
    train_set = encode_pairs(tokenizer, splits["rm_train"], rm.max_seq_len, rm.max_response_len)
    heldout = encode_pairs(tokenizer, splits["rm_eval"][: rm.heldout_pairs], rm.max_seq_len, rm.max_response_len)
    batches = list(make_sampler(rm, train_set, dist).batches(epoch=0))
    steps = min(steps, len(batches))
    engines = {}
    for mode in MODES:
        torch.manual_seed(rm.seed)  # the same scalar head on both
        model = reward_model_from_lm(model_dir, cfg.model)
        optimizer = adamw(model, lr=rm.lr, betas=rm.adam_betas, weight_decay=rm.weight_decay)
        scheduler = cosine_with_warmup(optimizer, int(rm.warmup_ratio * steps), steps)
        engines[mode] = PlainEngine(model, optimizer, scheduler, 1, rm.max_grad_norm, mode)
        engines[mode].train()

    def step(engine, k: int) -> int:
        batch = pair_batch([train_set[i] for i in batches[k]], tokenizer.pad_token_id, dist.device)
        loss, _, _ = forward_pairs(engine, batch, len(batches[k]), rm.beta_rm)
        engine.backward(loss.total)
        engine.step()
        return int(batch["attention_mask"].sum())

    print(f"RM: {steps} dynamic batches (token budget {rm.token_budget}, {rm.min_pairs}–{rm.max_pairs} pairs)", flush=True)
    summary("RM", interleaved(engines, steps, step))
    scores = {}
    for mode, engine in engines.items():
        model = trained_model(engine).float()
        scores[mode] = score_heldout(model, heldout, make_sampler(rm, heldout, dist), tokenizer.pad_token_id,
                                     rm.beta_rm, dist).metrics(cfg.statistics.ci_level)
    compare("RM", {mode: m["eval/loss"] for mode, m in scores.items()}, tolerance,
            f" ({len(heldout)} held-out pairs; accuracy fp32 {scores['fp32']['eval/accuracy']:.3f}, "
            f"bf16 {scores['bf16']['eval/accuracy']:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=int, default=8, help="optimiser steps per precision and model (default 8)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--only", choices=["sft", "rm"])
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative held-out loss difference (default 2 %%)")
    args = parser.parse_args()

    from stages.leaves.precision import describe

    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    cfg, splits, model_dir, tokenizer = load_inputs(args.preset, args.threads)
    print(f"preset {args.preset}, model {cfg.model.name_or_path}, {describe('cpu')}, {args.threads} threads", flush=True)
    if args.only in (None, "sft"):
        bench_sft(cfg, splits, model_dir, tokenizer, args.steps, args.tolerance)
    if args.only in (None, "rm"):
        bench_rm(cfg, splits, model_dir, tokenizer, args.steps, args.tolerance)
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
