"""`rlhf plan`'s predicted peak memory against the measured peak of real training steps (CPU).

Each stage is measured in a fresh process: after the imports, the model folder and the tokenizer
(the baseline, read from /proc/self/statm), it loads the stage's models as the stage does, builds
its engines and runs a few of its real training steps (SFT: `accumulate_step`; reward:
`forward_pairs` + the engine; PPO: `PPOTrainer.step`, rollout included) on batches of the size the
plan assumes (every sequence at its length cap, no early EOS: random token ids). Measured = peak
RSS (getrusage ru_maxrss) − the baseline: what the stage added, as the plan predicts it. The plan's
number is the stage's per-device peak (`StagePlan.peak`).

    python bench/plan_vs_measured.py --preset demo [--steps 2] [--stages sft,reward,ppo] [--set k=v ...]
                                     [--fixed-mmap-threshold]

glibc's malloc serves blocks under its mmap threshold from the heap and keeps them after `free`;
the threshold rises (dynamically, up to 32 MiB) to the largest block freed so far. A model whose
per-step tensors stay under 32 MiB (the tiny preset's) thus holds freed activations in its RSS,
above the live tensors the plan counts; the demo's larger tensors are mmapped and returned.
`--fixed-mmap-threshold` runs each stage with MALLOC_MMAP_THRESHOLD_=131072 (fixed at 128 KiB),
which measures the live tensors alone.

It prints one row per stage: predicted, measured, their ratio, and each child's JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _model_folder(cfg) -> str:
    from stages.compute import loading
    from stages.pipeline.data import load_pairs

    def corpus() -> list[str]:  # the random model's BPE tokenizer (tiny), as tests/conftest.py trains it
        _, pairs, _ = load_pairs(cfg)
        return [t for p in pairs for t in (p["prompt"], p["chosen"], p["rejected"])]

    return loading.materialise_model(cfg.model, corpus=corpus)


def _tokens(generator, vocab: int, length: int, avoid: set[int]) -> list[int]:
    import torch

    ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
    return [t if t not in avoid else (t + 1) % vocab for t in ids]


def child(stage: str, preset: str, overrides: list[str], steps: int) -> dict:
    import torch

    from stages.compute import loading
    from stages.orchestration import plan
    from stages.leaves import precision
    from stages.orchestration.config_loading import load_config
    from stages.compute.nonfinite import NonFiniteGuard
    from stages.leaves.dist import Dist

    torch.manual_seed(0)
    cfg = load_config(preset, overrides)
    folder = _model_folder(cfg)
    tokenizer = loading.load_tokenizer(folder, cfg.model)
    resolved = precision.resolve(cfg.model.precision, "cpu")
    frozen = precision.dtype(resolved)
    vocab = len(tokenizer)
    special = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    gen = torch.Generator().manual_seed(0)
    dist = Dist()
    predicted = plan.plan(cfg, stages=[stage], device="cpu").stages[0]
    # The code every stage runs is imported before the baseline: modules are not what the plan
    # predicts (tensors are), and transformers/deepspeed pull in megabytes of them lazily.
    import stages.compute.ppo.experience  # noqa: F401
    import stages.compute.ppo.trainer  # noqa: F401
    import stages.pipeline.reward  # noqa: F401
    import stages.pipeline.sft  # noqa: F401
    import gc

    gc.collect()
    baseline = rss_bytes()
    started = time.perf_counter()
    from stages.compute.model_loading import trained_lm
    from stages.compute.training import adamw, cosine_with_warmup, make_engine

    if stage == "sft":
        from stages.pipeline.sft import accumulate_step

        s = cfg.sft
        model = trained_lm(folder, cfg.model, dist.device)
        loading.align_pad_token(model, tokenizer)
        optimizer = adamw(model, lr=s.lr, betas=s.adam_betas, weight_decay=s.weight_decay)
        engine = make_engine(model, optimizer, cosine_with_warmup(optimizer, 0, steps), micro_batch_size=s.micro_batch_size,
                             grad_accum_steps=s.grad_accum_steps, max_grad_norm=s.max_grad_norm, precision=resolved,
                             dist=dist)
        guard = NonFiniteGuard("sft", s.max_nonfinite_steps, dist)
        engine.train()
        prompt = s.max_seq_len - s.max_response_len
        for step in range(steps):
            micro = []
            for _ in range(s.grad_accum_steps):
                chunk = []
                for _ in range(s.micro_batch_size):
                    ids = _tokens(gen, vocab, s.max_seq_len, special)
                    chunk.append((ids, [-100] * prompt + ids[prompt:]))
                micro.append(chunk)
            accumulate_step(engine, micro, tokenizer.pad_token_id, guard, dist, step + 1)
    elif stage == "reward":
        from stages.compute.reward.model import reward_model_from_lm
        from stages.pipeline.reward import EncodedPair, forward_pairs, pair_batch

        r = cfg.reward
        model = reward_model_from_lm(folder, cfg.model)
        optimizer = adamw(model, lr=r.lr, betas=r.adam_betas, weight_decay=r.weight_decay)
        engine = make_engine(model, optimizer, cosine_with_warmup(optimizer, 0, steps), micro_batch_size=1,
                             grad_accum_steps=1, max_grad_norm=r.max_grad_norm, precision=resolved, dist=dist)
        engine.train()
        pairs_per_batch = max(1, plan.reward_batch_tokens(r) // (2 * r.max_seq_len))
        prompt = r.max_seq_len - r.max_response_len
        for _ in range(steps):
            pairs = []
            for _ in range(pairs_per_batch):
                chosen, rejected = (_tokens(gen, vocab, r.max_seq_len, special) for _ in range(2))
                pairs.append(EncodedPair(chosen, [-100] * prompt + chosen[prompt:], rejected))
            batch = pair_batch(pairs, tokenizer.pad_token_id, "cpu")
            loss, _, _ = forward_pairs(engine, batch, len(pairs), r.beta_rm)
            engine.backward(loss.total)
            engine.step()
    elif stage in ("ppo", "critic"):
        from stages.compute.ppo.advantages import needs_critic
        from stages.compute.ppo.experience import reward_model_scores
        from stages.compute.ppo.trainer import PPOTrainer
        from stages.compute.reward.model import RewardModel

        p = cfg.ppo
        train_actor = stage == "ppo"
        if not train_actor:
            p = p.model_copy(update={"rollout_batch_size": cfg.critic.rollout_batch_size,
                                     "minibatch_size": cfg.critic.minibatch_size})
        actor = loading.load_model(folder, cfg.model, None if train_actor else frozen)
        loading.align_pad_token(actor, tokenizer)
        reference = (loading.load_model(folder, cfg.model, frozen).eval().requires_grad_(False)
                     if train_actor else actor)
        reward_model = RewardModel(loading.load_model(folder, cfg.model, frozen)).eval().requires_grad_(False)
        critic = RewardModel(loading.load_model(folder, cfg.model)) if needs_critic(p) else None
        prompts = [_tokens(gen, vocab, p.max_prompt_len, special) for _ in range(max(64, p.rollout_batch_size))]
        ptx = [(ids, list(ids)) for ids in (_tokens(gen, vocab, cfg.sft.max_seq_len, special) for _ in range(16))]
        trainer = PPOTrainer(p, actor=actor, critic=critic, reference=reference,
                             score_fn=reward_model_scores(reward_model), prompts=prompts, ptx_examples=ptx,
                             tokenizer=tokenizer, dist=dist, precision=resolved, train_actor=train_actor)
        for _ in range(steps):
            trainer.step()
    else:
        raise SystemExit(f"no measurement for stage {stage}")
    measured = peak_rss_bytes() - baseline
    return {"stage": stage, "preset": preset, "precision": resolved, "steps": steps, "batch": predicted.batch,
            "predicted": predicted.peak, "predicted_states": predicted.states, "phases": predicted.phases,
            "measured": measured, "ratio": measured / predicted.peak, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--stages", default="sft,reward,ppo")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fixed-mmap-threshold", action="store_true",
                        help="measure with glibc's mmap threshold fixed at 128 KiB (freed blocks go back to the OS)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.preset, args.overrides, args.steps)), flush=True)
        return
    rows = []
    for stage in args.stages.split(","):
        cmd = [sys.executable, __file__, "--child", stage, "--preset", args.preset, "--steps", str(args.steps),
               *[a for o in args.overrides for a in ("--set", o)]]
        env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "131072"} if args.fixed_mmap_threshold else {})}
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not lines:
            raise SystemExit(f"{stage}: measurement failed\n{out.stderr[-3000:]}")
        rows.append(json.loads(lines[-1].removeprefix("RESULT ")))
        print(lines[-1], flush=True)
    gib = 1024**3
    print(f"\n{'stage':<8}{'precision':>10}{'predicted GiB':>15}{'measured GiB':>14}{'measured/predicted':>20}  batch")
    for row in rows:
        print(f"{row['stage']:<8}{row['precision']:>10}{row['predicted'] / gib:>15.2f}{row['measured'] / gib:>14.2f}"
              f"{row['ratio']:>20.2f}  {row['batch']}")


if __name__ == "__main__":
    main()
