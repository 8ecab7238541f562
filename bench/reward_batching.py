"""Reward-model training with fixed-count batches vs dynamic token batches, interleaved in one run.

Same model (the preset's base model), same pairs (the first --pairs of the preset's rm_train
split), same initial weights, one epoch of forward + backward + optimiser step in each mode. Each
mode stays loaded in its own process (so its peak RSS is its own), and the two take turns: the
epoch's batches of each mode are cut into `--turns` consecutive chunks, and turn k runs chunk k of
fixed then of dynamic for even k, dynamic then fixed for odd k, so a slow phase of a shared machine
(minutes long) hits both modes of a turn alike. Prints each turn's tokens/s (real, non-pad tokens)
of both and their ratio, then per mode batches, pairs per batch, tokens/s, padding fraction, peak
RSS, wall and CPU time, dynamic / fixed over the whole epoch, and the median and range of the
turns' ratios. Batch settings come from the preset's `reward` section: `fixed_pairs` for the
baseline, `token_budget`/`min_pairs`/`max_pairs` for dynamic batching.

What the ratio measures: the reward model's forward runs its linear layers on real tokens only
(the Llama fast path gathers them into one [N, hidden] matrix; `model.fast_path`), so padding in a
fixed-count batch costs only what runs in the padded [batch, length] layout: attention, and the
LM loss's head on the chosen answers. Dynamic batching then gains mostly through fewer, fuller
steps. `--set model.fast_path=off` runs both modes on each model's own forward, where every pad
costs a full token, to show what the padding alone would cost.

    .venv/bin/python bench/reward_batching.py                      # demo preset, SmolLM2-135M
    .venv/bin/python bench/reward_batching.py --preset tiny --pairs 96
    .venv/bin/python bench/reward_batching.py --set model.fast_path=off
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import subprocess
import time

MODES = ("fixed", "dynamic")


def worker(mode: str, config: dict, model_dir: str, rows: list[dict], turns: int, connection) -> None:
    """One mode in its own process: builds everything, then runs chunk k of its epoch per message."""
    import torch

    from stages.compute import loading
    from stages.leaves import precision
    from stages.leaves.config import PipelineConfig
    from stages.leaves.dist import Dist
    from stages.compute.reward.model import reward_model_from_lm
    from stages.pipeline.reward import encode_pairs, forward_pairs, make_sampler, pair_batch
    from stages.compute.training import PlainEngine, adamw

    cfg = PipelineConfig.model_validate(config)
    rm = cfg.reward.model_copy(update={"dynamic_batching": mode == "dynamic"})
    torch.manual_seed(rm.seed)
    tokenizer = loading.load_tokenizer(model_dir, cfg.model)
    model = reward_model_from_lm(model_dir, cfg.model)
    loading.align_pad_token(model.lm, tokenizer)
    pairs = encode_pairs(tokenizer, rows, rm.max_seq_len, rm.max_response_len)
    batches = make_sampler(rm, pairs, Dist()).batches(epoch=0)
    optimizer = adamw(model, lr=rm.lr, betas=rm.adam_betas, weight_decay=rm.weight_decay)
    engine = PlainEngine(model, optimizer, torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0),
                         grad_accum_steps=1, max_grad_norm=rm.max_grad_norm,
                         precision=precision.resolve(cfg.model.precision, "cpu"))
    engine.train()
    bounds = [round(i * len(batches) / turns) for i in range(turns + 1)]
    connection.send({"batches": len(batches), "pairs_per_batch": len(pairs) / len(batches)})
    for k in range(turns):
        connection.recv()
        tokens = padded = 0
        started, cpu_started = time.perf_counter(), time.process_time()
        for indices in batches[bounds[k] : bounds[k + 1]]:
            batch = pair_batch([pairs[i] for i in indices], tokenizer.pad_token_id, "cpu")
            loss, _, _ = forward_pairs(engine, batch, len(indices), rm.beta_rm)
            engine.backward(loss.total)
            engine.step()
            tokens, padded = tokens + int(batch["attention_mask"].sum()), padded + batch["attention_mask"].numel()
        connection.send({"tokens": tokens, "padded": padded, "wall_s": time.perf_counter() - started,
                         "cpu_s": time.process_time() - cpu_started})
    connection.send({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--pairs", type=int, default=96,
                        help="pairs of rm_train to train on (default 96: enough pairs to bucket by length)")
    parser.add_argument("--turns", type=int, default=4, help="chunks of each mode's epoch, taken in turns (default 4)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    from stages.compute import loading
    from stages.leaves import precision
    from stages.orchestration.config_loading import load_config
    from stages.pipeline.data import load_pairs, make_splits, split_texts

    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    cfg = load_config(args.preset, args.overrides)
    _, clean, _ = load_pairs(cfg)
    splits = make_splits(clean, cfg)
    model_dir = loading.materialise_model(cfg.model, corpus=lambda: split_texts(splits))
    rows = splits["rm_train"][: args.pairs]
    rm = cfg.reward
    print(f"preset {cfg.preset}, model {cfg.model.name_or_path} (precision {precision.resolve(cfg.model.precision, 'cpu')}, "
          f"fast path {cfg.model.fast_path}; {precision.describe('cpu')}), {len(rows)} pairs, max_seq_len {rm.max_seq_len}; "
          f"fixed: {rm.fixed_pairs} pairs/batch; dynamic: budget {rm.token_budget} tokens, {rm.min_pairs}-{rm.max_pairs} "
          f"pairs; {args.turns} turns", flush=True)

    context = multiprocessing.get_context("spawn")
    pipes, processes, info = {}, [], {}
    for mode in MODES:  # one at a time: loading is not measured
        parent, child = context.Pipe()
        process = context.Process(target=worker, args=(mode, cfg.model_dump(mode="json"), model_dir, rows,
                                                       args.turns, child))
        process.start()
        pipes[mode], info[mode] = parent, parent.recv()
        processes.append(process)
    turns: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for k in range(args.turns):
        for mode in MODES if k % 2 == 0 else tuple(reversed(MODES)):
            pipes[mode].send("go")
            turns[mode].append(pipes[mode].recv())
        fixed, dynamic = (turns[mode][-1] for mode in MODES)
        rate = {mode: turns[mode][-1]["tokens"] / turns[mode][-1]["wall_s"] for mode in MODES}
        print(f"  turn {k + 1}: fixed {rate['fixed']:7.1f} tokens/s ({fixed['wall_s']:.1f} s), dynamic "
              f"{rate['dynamic']:7.1f} tokens/s ({dynamic['wall_s']:.1f} s), ×{rate['dynamic'] / rate['fixed']:.2f}",
              flush=True)
    for mode in MODES:
        info[mode].update(pipes[mode].recv())
    for process in processes:
        process.join()

    results = {}
    for mode, rows_ in turns.items():
        tokens, padded = sum(r["tokens"] for r in rows_), sum(r["padded"] for r in rows_)
        wall, cpu = sum(r["wall_s"] for r in rows_), sum(r["cpu_s"] for r in rows_)
        results[mode] = {"mode": mode, **info[mode], "tokens_per_s": tokens / wall, "padding": 1 - tokens / padded,
                         "wall_s": wall, "cpu_s": cpu}
    columns = [("mode", "mode", "<8", ""), ("batches", "batches", ">7", ""), ("pairs/batch", "pairs_per_batch", ">11", ".1f"),
               ("tokens/s", "tokens_per_s", ">9", ".1f"), ("padding", "padding", ">8", ".3f"),
               ("peak RSS MiB", "peak_rss_mib", ">12", ".0f"), ("wall s", "wall_s", ">7", ".1f"), ("CPU s", "cpu_s", ">7", ".1f")]
    print(" ".join(f"{title:{align}}" for title, _, align, _ in columns))
    for r in results.values():
        print(" ".join(f"{r[key]:{align}{fmt}}" for _, key, align, fmt in columns))
    fixed, dynamic = results["fixed"], results["dynamic"]
    ratios = [("tokens/s", "tokens_per_s"), ("padding", "padding"), ("peak RSS", "peak_rss_mib"), ("wall time", "wall_s"),
              ("CPU time", "cpu_s")]
    print("dynamic / fixed: " + ", ".join(f"{name} ×{dynamic[key] / fixed[key]:.2f}" for name, key in ratios))
    per_turn = sorted((d["tokens"] / d["wall_s"]) / (f["tokens"] / f["wall_s"]) for f, d in zip(turns["fixed"], turns["dynamic"]))
    print(f"tokens/s ×, turn by turn: median ×{statistics.median(per_turn):.2f}, range ×{per_turn[0]:.2f} … ×{per_turn[-1]:.2f}")
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
