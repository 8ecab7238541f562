"""Where the time of a PPO iteration goes, PPO-max against vanilla PPO, measured in one run.

The real PPOTrainer on the preset's base model (SmolLM2-135M for demo), loaded as the PPO stage
loads an SFT run's outputs: the base model as actor and reference, and with a fresh scalar head
(seeded) as reward model and critic; prompts from the preset's ppo_prompts split, PPO-ptx data from
its sft split. No pipeline or MLflow run is needed. Each mode runs in a fresh process with the same
seed, so its peak RSS is its own and its first rollout is the other's. Per mode it prints, as means
over iterations, the rollout phases (generation, which also yields log π_old; the experience
forwards: log π_SFT, V_old unless the training forward gives it, RM score), the training time (forward + backward + optimiser step over the minibatches,
PPO-ptx included), tokens/s (generated response tokens per second of the iteration), episodes/s and
peak RSS. The first `--warmup` iterations are left out of the means. Vanilla is the baseline: PPO-max adds the PPO-ptx
batch to every step; its other tricks cost next to nothing.

    .venv/bin/python bench/ppo_step.py               # demo preset on CPU: ~3 minutes of CPU time
    .venv/bin/python bench/ppo_step.py --threads 1   # the same on cores that other jobs load
    .venv/bin/python bench/ppo_step.py --iterations 4 --batch-size 16 --response-length 128 --device cuda
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MODES = ("vanilla", "ppo-max")
PHASES = ("generate", "ref_logprobs", "values", "scores", "train")  # log π_old comes with generation


def measure(mode: str, config: dict, inputs: dict, prompt_rows: list[dict], sft_rows: list[dict], iterations: int,
            warmup: int, device: str, threads: int | None) -> dict:
    """`warmup + iterations` PPO iterations in one mode, in this (fresh) process."""
    import torch

    if threads:
        torch.set_num_threads(threads)

    from stages.leaves.config import PipelineConfig
    from stages.leaves.rendering import encode_example
    from stages.leaves.dist import Dist
    from stages.compute.model_loading import load_models
    from stages.compute.ppo.setup import encode_prompts, initial_moments
    from stages.compute.ppo.trainer import PPOTrainer
    from stages.leaves.precision import resolve

    cfg = PipelineConfig.model_validate(config)
    ppo = cfg.ppo.model_copy(update={"preset": mode})
    torch.manual_seed(ppo.seed)
    dist = Dist(device=device)
    tokenizer, actor, reference, reward_model, critic, score_fn = load_models(cfg, inputs, dist)
    prompts = encode_prompts(tokenizer, prompt_rows, ppo.max_prompt_len)
    ptx = [encode_example(tokenizer, r["messages"], r["chosen"], cfg.sft.max_seq_len, cfg.sft.max_response_len)
           for r in sft_rows]
    trainer = PPOTrainer(ppo, actor=actor, critic=critic, reference=reference, score_fn=score_fn, prompts=prompts,
                         ptx_examples=ptx, tokenizer=tokenizer, dist=dist,
                         precision=resolve(cfg.model.precision, device), moments=initial_moments(reward_model))
    rows = []
    for _ in range(warmup + iterations):
        started = time.perf_counter()
        metrics = trainer.step()
        rows.append({**metrics, "iteration": time.perf_counter() - started,
                     "tokens": metrics["policy/response_length"] * ppo.rollout_batch_size})
    rows = rows[warmup:]
    # time/values is absent when V_old comes from the critic's training forward (one minibatch).
    result = {phase: statistics.mean(r.get(f"time/{phase}", 0.0) for r in rows) for phase in PHASES}
    seconds, tokens = sum(r["iteration"] for r in rows), sum(r["tokens"] for r in rows)
    result.update(mode=mode, iteration=seconds / len(rows), response_tokens=tokens / len(rows),
                  tokens_per_s=tokens / seconds, generated_tokens_per_s=tokens / sum(r["time/generate"] for r in rows),
                  eps=ppo.rollout_batch_size * len(rows) / seconds,
                  peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux
    if device.startswith("cuda"):
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--iterations", type=int, default=2, help="measured iterations per mode (default 2)")
    parser.add_argument("--warmup", type=int, default=0, help="iterations run first and left out (default 0)")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per iteration (default 4)")
    parser.add_argument("--response-length", type=int, default=32, help="max new tokens per response (default 32)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available; bf16 there)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default: torch's, one per core; on a machine others load, 1 is often faster)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()

    import torch

    from stages.compute import loading
    from stages.leaves import precision
    from stages.orchestration.config_loading import load_config
    from stages.pipeline.data import load_pairs, make_splits, split_texts
    from stages.compute.reward.model import reward_model_from_lm, save_reward_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(args.preset, [f"ppo.rollout_batch_size={args.batch_size}",
                                    f"ppo.generation.max_new_tokens={args.response_length}",
                                    *args.overrides])
    cfg.ppo.minibatch_size = min(cfg.ppo.minibatch_size, cfg.ppo.rollout_batch_size)
    _, clean, _ = load_pairs(cfg)
    splits = make_splits(clean, cfg)
    model_dir = loading.materialise_model(cfg.model, corpus=lambda: split_texts(splits))  # tiny: its BPE tokenizer learns on these
    ppo = cfg.ppo
    print(f"preset {cfg.preset}, model {cfg.model.name_or_path} (precision {cfg.model.precision} → "
          f"{precision.resolve(cfg.model.precision, device)}; {precision.describe(device)}) on {device}; "
          f"{ppo.rollout_batch_size} prompts × ≤{ppo.generation.max_new_tokens} new tokens per iteration, "
          f"minibatch {ppo.minibatch_size}, ptx batch {ppo.ptx_batch_size}; {args.iterations} iterations per mode "
          f"after {args.warmup} warm-up; {args.threads or torch.get_num_threads()} threads")

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        rm_dir = Path(tmp)
        torch.manual_seed(ppo.seed)  # the reward model's fresh scalar head, the same for both modes
        save_reward_model(reward_model_from_lm(model_dir, cfg.model), loading.load_tokenizer(model_dir, cfg.model),
                          rm_dir, {"role": "benchmark: base model with an untrained head"})
        inputs = {"sft_model_dir": model_dir, "reward_model_dir": str(rm_dir)}
        for mode in MODES:
            with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                results[mode] = pool.submit(measure, mode, cfg.model_dump(mode="json"), inputs, splits["ppo_prompts"],
                                            splits["sft"], args.iterations, args.warmup, device, args.threads).result()

    columns = [("mode", "mode", "<8", ""), *((f"{p} s", p, f">{max(len(p) + 2, 8)}", ".2f") for p in PHASES),
               ("iteration s", "iteration", ">11", ".2f"), ("resp tokens", "response_tokens", ">11", ".0f"),
               ("tokens/s", "tokens_per_s", ">8", ".1f"), ("gen tokens/s", "generated_tokens_per_s", ">12", ".1f"),
               ("episodes/s", "eps", ">10", ".3f"), ("peak RSS MiB", "peak_rss_mib", ">12", ".0f")]
    if device.startswith("cuda"):
        columns.append(("peak GPU MiB", "peak_gpu_mib", ">12", ".0f"))
    print(" ".join(f"{title:{align}}" for title, _, align, _ in columns))
    for r in results.values():
        print(" ".join(f"{r[key]:{align}{fmt}}" for _, key, align, fmt in columns))
    vanilla, ppo_max = results["vanilla"], results["ppo-max"]
    ratios = [("iteration time", "iteration"), ("train time", "train"), ("generation time", "generate"),
              ("tokens/s", "tokens_per_s"), ("peak RSS", "peak_rss_mib")]
    print("ppo-max / vanilla: " + ", ".join(f"{name} ×{ppo_max[key] / vanilla[key]:.2f}" for name, key in ratios))
    for r in results.values():
        share = {phase: r[phase] / r["iteration"] for phase in PHASES}
        print(f"{r['mode']}: share of the iteration: " + ", ".join(f"{p} {s:.0%}" for p, s in share.items()))


if __name__ == "__main__":
    main()
