"""Our PPO against TRL's, on the same model, prompts and settings, alternating A/B in one run.

TRL's side is `trl.experimental.ppo.PPOTrainer` from trl 1.12.0 (the last release with a PPO
trainer), in a virtual environment this script creates at `bench/.venv-trl` on first use. That
environment sees torch and transformers of `.venv` through a .pth file, so both sides run the same
builds of the same libraries; only trl and its own extra dependencies (datasets) go into it.

Settings, equal on both sides: the demo preset's model (SmolLM2-135M-Instruct), the same
prompt token ids (the demo's ppo_prompts, cut to `--prompt-length` tokens) in the same order, so
iteration k of both sides rolls out on the same prompts (TRL reads them in the order our trainer's
seeded shuffle draws them: the prompt tokens per iteration, printed, are equal), batch `--batch-size`,
one PPO epoch on one minibatch, `--response-length` new tokens at temperature 0.7 (TRL's default),
no top-p/top-k, stop at EOS; reward model and critic are the base model with the same seeded scalar
head; β = 0.05 (k1), whitened advantages, value clipping 0.2, one gradient clip over policy and
value model (TRL clips its policy-and-value wrapper as one), no PPO-ptx, no score normalisation and
no EOS penalty (TRL's defaults have neither). pad = `<|endoftext|>` ≠ EOS on both sides.

`--precision fp32` (the default): both sides in fp32. `--precision bf16`: ours with
`model.precision=bf16` (bf16 weights, fp32 master weights); TRL runs twice in the same run, in fp32
and with `bf16=True` (its autocast over fp32 weights), and the faster of the two is the baseline
("TRL best"), so bf16 is never credited to us where TRL gains from it too.

Each TRL run and ours live in their own processes (about 20 GiB together at the defaults) and take
turns, one iteration at a time: pair k runs TRL's iteration k then ours for even k, ours then TRL's
for odd k, so a slow phase of a shared machine (minutes long) hits both sides of a pair alike. With
two TRL runs, ours plays each in turn (a fresh process of ours per TRL run; three at once would not
fit in 24 GiB). The first `--warmup` pairs of each are left out. Printed: each pair's seconds and
TRL / ours, our phases' seconds and each side's page faults in that iteration; per side
s/iteration, episodes/s, response tokens/s (tokens up to and including EOS), prompt and response
tokens per iteration, peak RSS; ours / TRL (best) over all measured
iterations; the median and range of the pairs' ratios; which bf16 support the CPU has; and our MFU
over the measured iterations per phase (generate, experience, train; bench/flops.py's model FLOPs)
against the matmul peak of our precision measured right after.

    .venv/bin/python bench/peer_trl.py                      # fp32: 1 warm-up + 6 measured iterations per side
    .venv/bin/python bench/peer_trl.py --precision bf16     # ours bf16 against TRL's best of fp32 and bf16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from turns import (ALLOCATOR_HELP, Worker, finish, load_average, page_faults, ready, report_turn, side_environment,
                   synchronize, take_turns, trl_python, wait_for_the_end, wait_for_turn)

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # the stages of this checkout, whatever the environment has installed
TRL_VENV = BENCH / ".venv-trl"
TRL_VERSION = "1.12.0"
TEMPERATURE = 0.7  # TRL's PPOConfig default
KL_COEF = 0.05
LEARNING_RATE = 3e-6  # TRL's PPOConfig default; ours is set to the same


# -- TRL's side (runs in bench/.venv-trl) ------------------------------------------------------
def run_trl(spec: dict) -> None:
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
        save_strategy="no", use_cpu=spec["device"] == "cpu", seed=spec["seed"], max_grad_norm=1.0, dataloader_drop_last=True,
        bf16=spec["trl_bf16"],
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
    state = {"started": 0.0, "done": 0}

    class Turns(TrainerCallback):
        def on_step_end(self, args, state_, control, **kwargs):
            synchronize()
            report_turn(seconds=time.perf_counter() - state["started"], response_tokens=response_tokens[-1],
                        prompt_tokens=prompt_tokens[-1])
            state["done"] += 1
            if state["done"] < total:
                state["started"] = wait_for_turn()
            else:
                wait_for_the_end()  # before the trainer's own wrap-up

    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=reference,
                         reward_model=reward_model, value_model=value_model, train_dataset=dataset,
                         eval_dataset=dataset, callbacks=[Turns()])
    ready()
    state["started"] = wait_for_turn()
    trainer.train()
    finish()


# -- our side ----------------------------------------------------------------------------------
def our_trainer(spec: dict):
    """Our PPOTrainer on the spec's models and prompt ids, as the PPO stage builds it."""
    import torch

    torch.set_num_threads(spec["threads"])
    from stages.leaves.config import PipelineConfig
    from stages.leaves.dist import Dist
    from stages.compute.model_loading import load_models
    from stages.compute.ppo.setup import initial_moments
    from stages.compute.ppo.trainer import PPOTrainer
    from stages.leaves.precision import resolve

    cfg = PipelineConfig.model_validate(spec["config"])
    torch.manual_seed(cfg.ppo.seed)
    dist = Dist(device=spec["device"])
    tokenizer, actor, reference, reward_model, critic, score_fn = load_models(cfg, spec["inputs"], dist)
    assert tokenizer.pad_token_id == spec["pad_id"], "both sides must pad with the same token"
    return PPOTrainer(cfg.ppo, actor=actor, critic=critic, reference=reference, score_fn=score_fn,
                      prompts=spec["prompts"], ptx_examples=[], tokenizer=tokenizer, dist=dist,
                      precision=resolve(cfg.model.precision, spec["device"]), moments=initial_moments(reward_model))


def run_ours(spec: dict) -> None:
    from flops import Shapes, phase_flops

    trainer = our_trainer(spec)
    shapes = Shapes(trainer.actor.module.config)
    ready()
    for _ in range(spec["warmup"] + spec["iterations"]):
        started = wait_for_turn()
        metrics = trainer.step()
        synchronize()
        seconds = time.perf_counter() - started
        exp = trainer.last_experience
        flops = phase_flops(shapes, exp, critic=trainer.critic is not None)
        phase_seconds = {"generate": metrics["time/generate"], "train": metrics["time/train"],
                         "experience": sum(metrics.get(f"time/{p}", 0.0) for p in ("ref_logprobs", "values", "scores"))}
        report_turn(seconds=seconds, response_tokens=int(exp.response_mask.sum()),
                    prompt_tokens=int(exp.attention_mask[:, : exp.prompt_width].sum()), model_flops=sum(flops.values()), phase_flops=flops, phase_seconds=phase_seconds)
    finish()


def ours_config(args) -> dict:
    from stages.orchestration.config_loading import load_config

    overrides = [
        f"ppo.rollout_batch_size={args.batch_size}", f"ppo.minibatch_size={args.batch_size}", "ppo.ppo_epochs=1",
        f"ppo.max_prompt_len={args.prompt_length}", f"ppo.generation.max_new_tokens={args.response_length}",
        f"ppo.generation.temperature={TEMPERATURE}", "ppo.generation.top_p=1.0", "ppo.generation.top_k=0",
        "ppo.preset=vanilla", "ppo.kl_penalty=true", f"ppo.kl_coef={KL_COEF}", "ppo.kl_estimator=k1",
        "ppo.whiten_advantages=true", "ppo.value_clip=true", "ppo.global_grad_clip=true", "ppo.ptx=false",
        "ppo.score_mode=none", "ppo.eos_penalty=false", f"ppo.actor_lr={LEARNING_RATE}", f"ppo.critic_lr={LEARNING_RATE}",
        "ppo.adam_betas=[0.9,0.999]",  # TRL: the transformers Trainer's AdamW defaults
        f"model.precision={args.precision}",
    ]
    return load_config(args.preset, overrides + args.overrides)


def prepare(args, tmp: Path) -> tuple[dict, str, Path]:
    """(the spec both sides share, the model folder, a reward-model folder): the preset's model
    materialised, its ppo_prompts encoded as the PPO stage encodes them, and the base model with a
    seeded scalar head saved as reward model (and critic initialisation)."""
    import torch

    from stages.compute import loading
    from stages.pipeline.data import load_pairs, make_splits, split_texts
    from stages.compute.ppo.setup import encode_prompts
    from stages.compute.ppo.trainer import shuffled_order
    from stages.compute.reward.model import reward_model_from_lm, save_reward_model

    cfg = ours_config(args)
    _, clean, _ = load_pairs(cfg)
    splits = make_splits(clean, cfg)
    model_dir = loading.materialise_model(cfg.model, corpus=lambda: split_texts(splits))
    tokenizer = loading.load_tokenizer(model_dir, cfg.model)
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
              "device": args.device,
              "warmup": args.warmup, "iterations": args.iterations, "seed": cfg.ppo.seed,
              "prompts": prompts, "trl_prompts": in_our_order,
              "pad_id": tokenizer.pad_token_id, "model_name": cfg.model.name_or_path, "config": cfg.model_dump(mode="json")}
    return common, model_dir, reward_dir


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--iterations", type=int, default=6, help="measured iterations per side (default 6)")
    parser.add_argument("--warmup", type=int, default=1, help="iterations run first and left out (default 1)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--response-length", type=int, default=48)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--trl-allocator", choices=["system", "tcmalloc"], default="system", help=ALLOCATOR_HELP)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where both sides run (default cpu)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="ours: model.precision; bf16 runs TRL in fp32 and in bf16 and takes its faster run")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="more overrides of our side only (e.g. to try a switch)")
    return parser


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--worker", choices=["trl", "ours"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        run_trl(spec) if args.worker == "trl" else run_ours(spec)
        return

    import torch

    from flops import matmul_peak

    from stages.leaves.precision import describe

    torch.set_num_threads(args.threads)
    print(f"before: {load_average()}", flush=True)
    python = trl_python(TRL_VENV, TRL_VERSION, "import trl.experimental.ppo")
    trl_runs = {"TRL fp32": False} if args.precision == "fp32" else {"TRL fp32": False, "TRL bf16": True}
    iterations: dict[str, list[dict]] = {}
    peaks: dict[str, float] = {}
    gpu_peaks: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        common, model_dir, reward_dir = prepare(args, Path(tmp))
        total = args.warmup + args.iterations
        where = f"CPU, {args.threads} threads" if args.device == "cpu" else args.device
        print(f"model {common['model_name']}, ours in {args.precision}, TRL in {' and '.join(trl_runs)}; {where}, "
              f"{describe(args.device)}; batch {args.batch_size}, prompts ≤{args.prompt_length} tokens "
              f"(mean {statistics.mean(map(len, common['prompts'])):.0f}), ≤{args.response_length} new tokens; "
              f"{args.warmup} warm-up + {args.iterations} measured iterations per side, one at a time, the sides "
              "taking turns", flush=True)
        for trl_side, trl_bf16 in trl_runs.items():
            ours_side = f"ours vs {trl_side}" if len(trl_runs) > 1 else "ours"
            specs = {trl_side: {**common, "model_dir": model_dir, "reward_dir": str(reward_dir), "trl_bf16": trl_bf16,
                                "output_dir": str(Path(tmp) / f"trl-out-{trl_bf16}")},
                     ours_side: {**common, "inputs": {"sft_model_dir": model_dir, "reward_model_dir": str(reward_dir)}}}
            workers = {}
            for side, spec in specs.items():  # one at a time: loading is not measured, and it peaks memory
                path = Path(tmp) / f"{side.replace(' ', '-')}.json"
                path.write_text(json.dumps(spec))
                kind = "trl" if side == trl_side else "ours"
                interpreter = python if kind == "trl" else sys.executable
                workers[side] = Worker(side, [interpreter, __file__, "--worker", kind, "--spec", path],
                                       Path(tmp) / f"{side.replace(' ', '-')}.log", side_environment(kind, args.trl_allocator))
                print(f"{side}: malloc {workers[side].ready()['allocator']}", flush=True)
            # Turn k runs TRL then ours for even k, ours then TRL for odd k: drift of the machine's
            # speed (minutes long on a shared VM) hits both sides of a pair alike.
            def show(k: int, pair: dict) -> None:
                trl, ours = pair[trl_side], pair[ours_side]
                phases = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in ours["phase_seconds"].items())
                print(f"  iteration {k + 1}{' (warm-up)' if k < args.warmup else ''}: {trl_side} {trl['seconds']:6.2f} s "
                      f"({trl['response_tokens']} response tokens), ours {ours['seconds']:6.2f} s "
                      f"({ours['response_tokens']}), ×{trl['seconds'] / ours['seconds']:.2f}; ours: {phases} s; "
                      + page_faults({trl_side: trl, "ours": ours}), flush=True)

            iterations.update(take_turns(workers, total, show))
            peaks.update({side: worker.peak_rss_mib() for side, worker in workers.items()})
            gpu_peaks.update({side: worker.peak_gpu_mib for side, worker in workers.items()})

    table = {}
    for side, rows in iterations.items():
        measured = rows[args.warmup :]
        seconds = sum(r["seconds"] for r in measured)
        table[side] = {"iteration_s": seconds / len(measured), "episodes_per_s": args.batch_size * len(measured) / seconds,
                       "tokens_per_s": sum(r["response_tokens"] for r in measured) / seconds,
                       "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in measured),
                       "response_tokens": statistics.mean(r["response_tokens"] for r in measured),
                       "peak_rss_mib": peaks[side], "peak_gpu_mib": gpu_peaks[side]}
    gpu = args.device != "cpu"
    print(f"{'side':<18}{'s/iteration':>12}{'episodes/s':>12}{'tokens/s':>10}{'prompt+response tokens':>24}{'peak RSS MiB':>14}"
          + (f"{'peak GPU MiB':>14}" if gpu else ""))
    for side, r in table.items():
        tokens = f"{r['prompt_tokens']:.0f} + {r['response_tokens']:.0f}"
        print(f"{side:<18}{r['iteration_s']:>12.2f}{r['episodes_per_s']:>12.3f}{r['tokens_per_s']:>10.1f}{tokens:>24}{r['peak_rss_mib']:>14.0f}"
              + (f"{r['peak_gpu_mib'] or 0:>14.0f}" if gpu else ""))
    # Each TRL run is compared with the run of ours it took turns with (the same minutes of the machine).
    def ours_against(trl_side: str) -> str:
        return f"ours vs {trl_side}" if len(trl_runs) > 1 else "ours"

    best = max(trl_runs, key=lambda side: table[side]["episodes_per_s"])
    for trl_side in trl_runs:
        ours, trl = table[ours_against(trl_side)], table[trl_side]
        label = " (TRL best)" if len(trl_runs) > 1 and trl_side == best else ""
        print(f"ours / {trl_side}{label}: episodes/s ×{ours['episodes_per_s'] / trl['episodes_per_s']:.2f}, "
              f"tokens/s ×{ours['tokens_per_s'] / trl['tokens_per_s']:.2f}, peak RSS ×{ours['peak_rss_mib'] / trl['peak_rss_mib']:.2f}"
              + (f", peak GPU memory ×{ours['peak_gpu_mib'] / trl['peak_gpu_mib']:.2f}" if gpu else ""))
        paired = sorted(t["seconds"] / o["seconds"] for t, o in zip(iterations[trl_side][args.warmup :],
                                                                     iterations[ours_against(trl_side)][args.warmup :]))
        print(f"  pair by pair: median ×{statistics.median(paired):.2f}, range ×{paired[0]:.2f} … ×{paired[-1]:.2f}")
    ours_rows = [r for trl_side in trl_runs for r in iterations[ours_against(trl_side)][args.warmup :]]
    ours_seconds = sum(r["seconds"] for r in ours_rows)
    # Measured right after the iterations, so that both see the machine in a like state.
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak = matmul_peak(dtype, device=args.device)
    achieved = sum(r["model_flops"] for r in ours_rows) / ours_seconds
    print(f"our MFU: {achieved / peak:.1%} ({achieved / 1e9:.1f} GFLOP/s of model FLOPs, real tokens only, against this "
          f"machine's {args.precision} matmul peak of {peak / 1e9:.1f} GFLOP/s measured after the iterations); by phase:")
    for phase in ("generate", "experience", "train"):
        flops = sum(r["phase_flops"][phase] for r in ours_rows)
        seconds = sum(r["phase_seconds"][phase] for r in ours_rows)
        print(f"  {phase:<11}{flops / seconds / 1e9:8.1f} GFLOP/s  MFU {flops / seconds / peak:6.1%}  "
              f"({seconds / len(ours_rows):.2f} s/iteration)")
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
