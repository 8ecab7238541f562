"""Reward-model training with fixed-count batches vs dynamic token batches, measured in one run.

Same model (the preset's base model), same pairs (the first --pairs of the preset's rm_train
split), same initial weights, one epoch of forward + backward + optimiser step in each mode. Each
mode runs in a fresh process, so its peak RSS is its own. Prints tokens/s (real, non-pad tokens),
padding fraction, peak RSS, wall time, CPU time (less sensitive than wall time to other load on the
machine), and the dynamic/fixed ratios. Batch settings come from the
preset's `reward` section: `fixed_pairs` for the baseline, `token_budget`/`min_pairs`/`max_pairs`
for dynamic batching.

    .venv/bin/python bench/reward_batching.py                      # demo preset, SmolLM2-135M
    .venv/bin/python bench/reward_batching.py --preset tiny --pairs 96
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor

MODES = ("fixed", "dynamic")


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def measure(mode: str, config: dict, model_dir: str, rows: list[dict]) -> dict:
    """One epoch over `rows` in one batching mode, in this (fresh) process."""
    import torch

    from stages import sources
    from stages.config import PipelineConfig
    from stages.launch import Dist
    from stages.training import PlainEngine
    from stages.reward.model import reward_model_from_lm
    from stages.reward.stage import encode_pairs, forward_pairs, make_sampler, pair_batch

    cfg = PipelineConfig.model_validate(config)
    rm = cfg.reward.model_copy(update={"dynamic_batching": mode == "dynamic"})
    torch.manual_seed(rm.seed)
    tokenizer = sources.load_tokenizer(model_dir, cfg.model)
    model = reward_model_from_lm(model_dir, cfg.model)
    sources.align_pad_token(model.lm, tokenizer)
    pairs = encode_pairs(tokenizer, rows, rm.max_seq_len, rm.max_response_len)
    batches = make_sampler(rm, pairs, Dist()).batches(epoch=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=rm.lr, betas=rm.adam_betas, weight_decay=rm.weight_decay)
    engine = PlainEngine(model, optimizer, torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0),
                         grad_accum_steps=1, max_grad_norm=rm.max_grad_norm)
    rss_before = rss_mib()
    tokens = padded = 0
    engine.train()
    started, cpu_started = time.perf_counter(), time.process_time()
    for indices in batches:
        batch = pair_batch([pairs[i] for i in indices], tokenizer.pad_token_id, "cpu")
        loss, _, _ = forward_pairs(engine, batch, len(indices), rm.beta_rm)
        engine.backward(loss.total)
        engine.step()
        tokens, padded = tokens + int(batch["attention_mask"].sum()), padded + batch["attention_mask"].numel()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"mode": mode, "batches": len(batches), "pairs_per_batch": len(pairs) / len(batches),
            "tokens_per_s": tokens / wall, "padding": 1 - tokens / padded, "peak_rss_mib": peak,
            "train_rss_mib": peak - rss_before, "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--pairs", type=int, default=96,
                        help="pairs of rm_train to train on (default 96: enough pairs to bucket by length)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    from stages import sources
    from stages.config import load_config
    from stages.data import SPLITS, load_pairs, make_splits

    cfg = load_config(args.preset, args.overrides)
    _, clean, _ = load_pairs(cfg)
    splits = make_splits(clean, cfg)
    corpus = [text for name in SPLITS for row in splits[name] for text in (row["prompt"], row["chosen"], row["rejected"])]
    model_dir = sources.materialise_model(cfg.model, corpus=lambda: corpus)
    rows = splits["rm_train"][: args.pairs]
    rm = cfg.reward
    print(f"preset {cfg.preset}, model {cfg.model.name_or_path}, {len(rows)} pairs, max_seq_len {rm.max_seq_len}; "
          f"fixed: {rm.fixed_pairs} pairs/batch; dynamic: budget {rm.token_budget} tokens, {rm.min_pairs}-{rm.max_pairs} pairs")

    results = {}
    for mode in MODES:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[mode] = pool.submit(measure, mode, cfg.model_dump(mode="json"), model_dir, rows).result()

    columns = [("mode", "mode", "<8", ""), ("batches", "batches", ">7", ""), ("pairs/batch", "pairs_per_batch", ">11", ".1f"),
               ("tokens/s", "tokens_per_s", ">9", ".1f"), ("padding", "padding", ">8", ".3f"),
               ("peak RSS MiB", "peak_rss_mib", ">12", ".0f"), ("train RSS MiB", "train_rss_mib", ">13", ".0f"),
               ("wall s", "wall_s", ">7", ".1f"), ("CPU s", "cpu_s", ">7", ".1f")]
    print(" ".join(f"{title:{align}}" for title, _, align, _ in columns))
    for r in results.values():
        print(" ".join(f"{r[key]:{align}{fmt}}" for _, key, align, fmt in columns))
    fixed, dynamic = results["fixed"], results["dynamic"]
    ratios = [("tokens/s", "tokens_per_s"), ("padding", "padding"), ("peak RSS", "peak_rss_mib"), ("wall time", "wall_s"),
              ("CPU time", "cpu_s")]
    print("dynamic / fixed: " + ", ".join(f"{name} ×{dynamic[key] / fixed[key]:.2f}" for name, key in ratios))

if __name__ == "__main__":
    main()
