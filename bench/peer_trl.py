"""Our PPO against TRL's, on the same model, prompts and settings, alternating A/B in one run.

TRL's side is `trl.experimental.ppo.PPOTrainer` from trl 1.12.0 (the last release with a PPO
trainer), in a virtual environment this script creates at `bench/.venv-trl` on first use. That
environment sees torch and transformers of `.venv` through a .pth file, so both sides run the same
builds of the same libraries; only trl and its own extra dependencies (datasets) go into it.

Settings, equal on both sides: the demo preset's model (SmolLM2-135M-Instruct, fp32), the same
prompt token ids (the demo's ppo_prompts, cut to `--prompt-length` tokens) in the same order, so
iteration k of both sides rolls out on the same prompts (TRL reads them in the order our trainer's
seeded shuffle draws them: the prompt tokens per iteration, printed, are equal), batch `--batch-size`,
one PPO epoch on one minibatch, `--response-length` new tokens at temperature 0.7 (TRL's default),
no top-p/top-k, stop at EOS; reward model and critic are the base model with the same seeded scalar
head; β = 0.05 (k1), whitened advantages, value clipping 0.2, one gradient clip over policy and
value model (TRL clips its policy-and-value wrapper as one), no PPO-ptx, no score normalisation and
no EOS penalty (TRL's defaults have neither). pad = `<|endoftext|>` ≠ EOS on both sides.

`--bf16`: both sides under bf16 autocast (TRL `bf16=True`, ours `ppo.autocast=bf16`), weights fp32.

Each side runs `--warmup` + `--iterations` iterations in a fresh process; the warm-up ones are
left out. Rounds alternate the order (TRL first, then ours first, ...), so slow drift of the
machine hits both. Printed per side: s/iteration, episodes/s, response tokens/s (tokens up to and
including EOS), prompt and response tokens per iteration, peak RSS of the process, then ours / TRL.

    .venv/bin/python bench/peer_trl.py                      # 2 rounds × 3 measured iterations: ~15 min on 2 cores
    .venv/bin/python bench/peer_trl.py --rounds 1 --iterations 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

BENCH = Path(__file__).resolve().parent
TRL_VENV = BENCH / ".venv-trl"
TRL_VERSION = "1.12.0"
TEMPERATURE = 0.7  # TRL's PPOConfig default
KL_COEF = 0.05
LEARNING_RATE = 3e-6  # TRL's PPOConfig default; ours is set to the same


def trl_python() -> Path:
    """bench/.venv-trl/bin/python with trl installed; created once."""
    python = TRL_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl.experimental.ppo"], capture_output=True).returncode == 0:
        return python
    print(f"creating {TRL_VENV} with trl=={TRL_VERSION} (torch and transformers shared from {sys.prefix})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", TRL_VENV], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_shared_with_rlhf_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    return python


# -- TRL's side (runs in bench/.venv-trl) ------------------------------------------------------
def run_trl(spec: dict) -> dict:
    import resource

    import torch

    torch.set_num_threads(spec["threads"])
    import trl.experimental.ppo.ppo_trainer as trl_ppo
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.pad_token_id, tokenizer.padding_side = spec["pad_id"], "left"
    policy = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, use_safetensors=True)
    reference = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, use_safetensors=True)
    head = load_file(str(Path(spec["reward_dir"]) / "score_head.safetensors"))["weight"]

    def scalar_model():
        model = AutoModelForSequenceClassification.from_pretrained(spec["reward_dir"], num_labels=1, dtype=torch.float32,
                                                                   use_safetensors=True)
        model.score.weight.data.copy_(head)  # the same seeded head as our reward model and critic
        model.config.pad_token_id = spec["pad_id"]
        return model

    reward_model, value_model = scalar_model(), scalar_model()
    for model in (policy, reference):
        model.config.pad_token_id = model.generation_config.pad_token_id = spec["pad_id"]
    batch, total = spec["batch_size"], spec["warmup"] + spec["iterations"]
    dataset = Dataset.from_dict({"input_ids": spec["trl_prompts"]})
    args = PPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=1, local_rollout_forward_batch_size=batch, total_episodes=batch * total,
        response_length=spec["response_length"], temperature=TEMPERATURE, kl_coef=KL_COEF, learning_rate=LEARNING_RATE,
        stop_token="eos", missing_eos_penalty=None, num_sample_generations=0, report_to=[], logging_steps=1,
        save_strategy="no", use_cpu=True, seed=spec["seed"], max_grad_norm=1.0, dataloader_drop_last=True,
        bf16=spec["bf16"],
    )
    response_tokens: list[int] = []
    prompt_tokens: list[int] = []
    original_get_reward = trl_ppo.get_reward

    def counting_get_reward(model, query_responses, pad_token_id, context_length):
        if model is reward_model:  # scored responses are cut after EOS: count up to and including it
            response_tokens.append(int((query_responses[:, context_length:] != pad_token_id).sum()))
            prompt_tokens.append(int((query_responses[:, :context_length] != pad_token_id).sum()))
        return original_get_reward(model, query_responses, pad_token_id, context_length)

    trl_ppo.get_reward = counting_get_reward  # instrumentation only: counts, then calls TRL's own

    def in_order(*args, **kwargs):  # the prompts come in the order our trainer draws them: keep it
        return DataLoader(*args, **{**kwargs, "shuffle": False})

    trl_ppo.DataLoader = in_order
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=reference,
                         reward_model=reward_model, value_model=value_model, train_dataset=dataset,
                         eval_dataset=dataset, callbacks=[Clock()])
    started = time.perf_counter()
    trainer.train()
    stamps = [started, *ends]
    seconds = [b - a for a, b in zip(stamps, stamps[1:])][spec["warmup"] :]
    measured = slice(spec["warmup"], spec["warmup"] + len(seconds))
    return summary("TRL", seconds, response_tokens[measured], prompt_tokens[measured], batch,
                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


# -- our side ----------------------------------------------------------------------------------
def our_trainer(spec: dict):
    """Our PPOTrainer on the spec's models and prompt ids, as the PPO stage builds it."""
    import torch

    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, str(BENCH.parent))
    from stages.config import PipelineConfig
    from stages.launch import Dist
    from stages.ppo.stage import initial_moments, load_models
    from stages.ppo.trainer import PPOTrainer

    cfg = PipelineConfig.model_validate(spec["config"])
    torch.manual_seed(cfg.ppo.seed)
    tokenizer, actor, reference, reward_model, critic, score_fn = load_models(cfg, spec["inputs"], Dist())
    assert tokenizer.pad_token_id == spec["pad_id"], "both sides must pad with the same token"
    return PPOTrainer(cfg.ppo, actor=actor, critic=critic, reference=reference, score_fn=score_fn,
                      prompts=spec["prompts"], ptx_examples=[], tokenizer=tokenizer, dist=Dist(),
                      moments=initial_moments(reward_model))


def run_ours(spec: dict) -> dict:
    import resource

    trainer = our_trainer(spec)
    seconds, tokens, prompt_tokens = [], [], []
    for _ in range(spec["warmup"] + spec["iterations"]):
        started = time.perf_counter()
        trainer.step()
        seconds.append(time.perf_counter() - started)
        exp = trainer.last_experience
        tokens.append(int(exp.response_mask.sum()))
        prompt_tokens.append(int(exp.attention_mask[:, : exp.prompt_width].sum()))
    measured = slice(spec["warmup"], None)
    return summary("ours", seconds[measured], tokens[measured], prompt_tokens[measured], spec["batch_size"],
                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def summary(side: str, seconds: list[float], tokens: list[int], prompt_tokens: list[int], batch: int,
            peak_rss_mib: float) -> dict:
    total = sum(seconds)
    return {"side": side, "iteration_s": total / len(seconds), "episodes_per_s": batch * len(seconds) / total,
            "tokens_per_s": sum(tokens) / total, "response_tokens": sum(tokens) / len(seconds),
            "prompt_tokens": sum(prompt_tokens) / len(seconds),
            "peak_rss_mib": peak_rss_mib, "iterations": len(seconds)}


def ours_config(args) -> dict:
    from stages.config import load_config

    overrides = [
        f"ppo.rollout_batch_size={args.batch_size}", f"ppo.minibatch_size={args.batch_size}", "ppo.ppo_epochs=1",
        f"ppo.max_prompt_len={args.prompt_length}", f"ppo.generation.max_new_tokens={args.response_length}",
        f"ppo.generation.temperature={TEMPERATURE}", "ppo.generation.top_p=1.0", "ppo.generation.top_k=0",
        "ppo.preset=vanilla", "ppo.kl_penalty=true", f"ppo.kl_coef={KL_COEF}", "ppo.kl_estimator=k1",
        "ppo.whiten_advantages=true", "ppo.value_clip=true", "ppo.global_grad_clip=true", "ppo.ptx=false",
        "ppo.score_mode=none", "ppo.eos_penalty=false", f"ppo.actor_lr={LEARNING_RATE}", f"ppo.critic_lr={LEARNING_RATE}",
        "ppo.adam_betas=[0.9,0.999]",  # TRL: the transformers Trainer's AdamW defaults
        f"ppo.autocast={'bf16' if args.bf16 else 'none'}",
    ]
    return load_config(args.preset, overrides + args.overrides)


def prepare(args, tmp: Path) -> tuple[dict, str, Path]:
    """(the spec both sides share, the model folder, a reward-model folder): the preset's model
    materialised, its ppo_prompts encoded as the PPO stage encodes them, and the base model with a
    seeded scalar head saved as reward model (and critic initialisation)."""
    import torch

    from stages import sources
    from stages.data import SPLITS, load_pairs, make_splits
    from stages.ppo.stage import encode_prompts
    from stages.ppo.trainer import shuffled_order
    from stages.reward.model import reward_model_from_lm, save_reward_model

    cfg = ours_config(args)
    _, clean, _ = load_pairs(cfg)
    splits = make_splits(clean, cfg)
    corpus = [text for name in SPLITS for row in splits[name] for text in (row["prompt"], row["chosen"], row["rejected"])]
    model_dir = sources.materialise_model(cfg.model, corpus=lambda: corpus)
    tokenizer = sources.load_tokenizer(model_dir, cfg.model)
    reward_dir = tmp / "reward"
    torch.manual_seed(cfg.ppo.seed)  # one seeded scalar head for both sides' reward model and critic
    save_reward_model(reward_model_from_lm(model_dir, cfg.model), tokenizer, reward_dir,
                      {"role": "benchmark: base model with an untrained head"})
    prompts = encode_prompts(tokenizer, splits["ppo_prompts"], args.prompt_length)
    needed = args.batch_size * (args.warmup + args.iterations)
    if needed > len(prompts):
        sys.exit(f"{needed} prompts needed, the preset has {len(prompts)} ppo_prompts")
    # Both sides get the same prompts in each iteration: TRL's side reads them in our trainer's order.
    in_our_order = [prompts[i] for i in shuffled_order(len(prompts), random.Random(cfg.ppo.seed))[:needed]]
    common = {"batch_size": args.batch_size, "response_length": args.response_length, "threads": args.threads,
              "warmup": args.warmup, "iterations": args.iterations, "seed": cfg.ppo.seed,
              "prompts": prompts, "trl_prompts": in_our_order,
              "pad_id": tokenizer.pad_token_id, "model_name": cfg.model.name_or_path, "config": cfg.model_dump(mode="json"),
              "bf16": args.bf16}
    return common, model_dir, reward_dir


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations per run (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="iterations run first and left out (default 1)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 autocast on both sides (TRL: bf16=True; ours: ppo.autocast=bf16), weights fp32")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="more overrides of our side only (e.g. to try a switch)")
    return parser


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds, the order alternating (default 2)")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "trl":
        print("RESULT " + json.dumps(run_trl(json.loads(Path(args.spec).read_text()))), flush=True)
        return

    python = trl_python()
    results: dict[str, list[dict]] = {"TRL": [], "ours": []}
    with tempfile.TemporaryDirectory() as tmp:
        common, model_dir, reward_dir = prepare(args, Path(tmp))
        print(f"model {common['model_name']} (fp32 weights{', bf16 autocast' if args.bf16 else ''}, CPU, {args.threads} threads); batch {args.batch_size}, prompts ≤"
              f"{args.prompt_length} tokens (mean {statistics.mean(map(len, common['prompts'])):.0f}), ≤{args.response_length} "
              f"new tokens; {args.rounds} rounds × ({args.warmup} warm-up + {args.iterations} measured) iterations per side",
              flush=True)
        trl_spec = Path(tmp) / "trl.json"
        trl_spec.write_text(json.dumps({**common, "model_dir": model_dir, "reward_dir": str(reward_dir),
                                        "output_dir": str(Path(tmp) / "trl-out")}))
        ours_spec = {**common, "inputs": {"sft_model_dir": model_dir, "reward_model_dir": str(reward_dir)}}
        for round_ in range(args.rounds):
            for side in (("TRL", "ours") if round_ % 2 == 0 else ("ours", "TRL")):
                if side == "TRL":
                    out = subprocess.run([python, __file__, "--worker", "trl", "--spec", trl_spec],
                                         capture_output=True, text=True)
                    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
                    if out.returncode != 0 or not lines:
                        sys.exit(f"TRL's side failed:\n{out.stderr[-4000:]}")
                    result = json.loads(lines[-1].removeprefix("RESULT "))
                else:
                    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                        result = pool.submit(run_ours, ours_spec).result()
                results[side].append(result)
                print(f"  round {round_ + 1} {side:<5} {result['iteration_s']:6.2f} s/iteration  "
                      f"{result['episodes_per_s']:.3f} episodes/s  {result['tokens_per_s']:5.1f} tokens/s  "
                      f"{result['prompt_tokens']:.0f} prompt + {result['response_tokens']:.0f} response tokens/iteration  peak RSS {result['peak_rss_mib']:.0f} MiB",
                      flush=True)
    table = {}
    for side, rows in results.items():
        seconds = sum(r["iteration_s"] * r["iterations"] for r in rows)
        count = sum(r["iterations"] for r in rows)
        tokens = sum(r["tokens_per_s"] * r["iteration_s"] * r["iterations"] for r in rows)
        table[side] = {"iteration_s": seconds / count, "episodes_per_s": args.batch_size * count / seconds,
                       "tokens_per_s": tokens / seconds, "peak_rss_mib": max(r["peak_rss_mib"] for r in rows)}
    print(f"{'side':<6}{'s/iteration':>12}{'episodes/s':>12}{'tokens/s':>10}{'peak RSS MiB':>14}")
    for side, r in table.items():
        print(f"{side:<6}{r['iteration_s']:>12.2f}{r['episodes_per_s']:>12.3f}{r['tokens_per_s']:>10.1f}{r['peak_rss_mib']:>14.0f}")
    ours, trl = table["ours"], table["TRL"]
    print(f"ours / TRL: episodes/s ×{ours['episodes_per_s'] / trl['episodes_per_s']:.2f}, "
          f"tokens/s ×{ours['tokens_per_s'] / trl['tokens_per_s']:.2f}, peak RSS ×{ours['peak_rss_mib'] / trl['peak_rss_mib']:.2f}")
    # Each round's pair ran back to back: its ratio shows how much the machine drifted between rounds.
    paired = [o["episodes_per_s"] / t["episodes_per_s"] for o, t in zip(results["ours"], results["TRL"])]
    print("episodes/s ×, round by round: " + ", ".join(f"×{ratio:.2f}" for ratio in paired))


if __name__ == "__main__":
    main()
