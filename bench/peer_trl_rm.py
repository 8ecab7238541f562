"""Our reward-model training step against TRL's `RewardTrainer`, on the same model, pairs, token
budget and precision, taking turns in one run.

TRL's side is `trl.RewardTrainer` of trl 1.12.0 (the version bench/peer_trl.py pins), in the
virtual environment `bench/.venv-trl` (bench/turns.py: it sees the torch and transformers of our
environment, so both sides run the same builds; only trl and datasets go in).

Equal on both sides:
- the weights: the preset's base model (demo: SmolLM2-135M-Instruct, de-quantised once from its
  GGUF file by our loader into a safetensors folder) with one seeded scalar head (bias 0, so TRL's
  bias-free `score` layer computes the same function), saved once as a local folder both load;
- the pairs and their tokens: the first --pairs of the preset's rm_train split, encoded by the
  reward stage (chat template, prompt cut from the left to `max_seq_len`, answers cut at
  `max_response_len`, EOS on whole answers only); TRL gets these token ids as its documented
  pre-tokenised `chosen_ids`/`rejected_ids` columns, and its `max_length` filter is off;
- one epoch, fused AdamW with the reward section's lr, betas, weight decay and gradient clip,
  cosine schedule with its warm-up ratio, seed, no gradient accumulation, no evaluation;
- precision: `--precision fp32` (default) both in fp32. `--precision bf16`: ours with
  `model.precision=bf16` (bf16 weights, fp32 master weights and AdamW states), and TRL twice in the
  same run, in fp32 and with `bf16=True` (its autocast over fp32 weights): the faster of the two is
  the baseline ("TRL best"), so bf16 is never credited to us where TRL gains from it too.

Batches: ours are the stage's dynamic token batches (the reward section's `token_budget`,
`min_pairs`, `max_pairs`: pairs sorted by length, each batch at most the budget of padded
positions). TRL's collator pads a fixed number of pairs per step, drawn at random: its
`per_device_train_batch_size` is our mean pairs per step, rounded, so both epochs hold the same
pairs and about the same real tokens per step; the table prints both sides' steps, pairs, real
tokens and padded positions per step, so the match can be checked.

What differs, by design of each: ours computes the paper's loss, pairwise + beta_rm × the LM loss
on the chosen answers (an LM-head pass over them that TRL does not make), on Llama's padding-free
forward (`model.fast_path`); TRL computes the pairwise loss on transformers' forward. TRL's gradient
checkpointing (on by default in RewardConfig) is off, so both sides do the same forward and
backward work; `--trl-gradient-checkpointing` runs TRL's default instead (less memory, more time).

All sides stay loaded in their own processes and take turns: a warm-up turn of `--warmup-steps`
steps each (left out), then each side's remaining steps cut into `--turns` chunks, the order of the
sides rotating from turn to turn, so a slow phase of a shared machine hits all sides of a turn
alike. Printed: the load average before and after; each turn's tokens/s (real, non-pad tokens) of
every side and ours / TRL; per side steps, pairs, real tokens and padded positions per step, padding
fraction, tokens/s, wall and CPU seconds, peak RSS; ours / each TRL run over the measured turns with
the median and range of the turns' ratios; and the target (ours ≥ 2× TRL best's tokens/s at
no more than its peak memory) against what was measured.

    .venv/bin/python bench/peer_trl_rm.py                       # demo preset, 96 pairs, fp32
    .venv/bin/python bench/peer_trl_rm.py --precision bf16      # ours bf16 against TRL's best of fp32 and bf16
    .venv/bin/python bench/peer_trl_rm.py --preset tiny --pairs 48
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from turns import (ALLOCATOR_HELP, Worker, chunk_bounds, finish, load_average, page_faults, ready, report_turn,
                   side_environment, spread, synchronize, take_turns, trl_python, wait_for_the_end, wait_for_turn)

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # the stages of this checkout, whatever the environment has installed
TRL_VENV = BENCH / ".venv-trl"
TRL_VERSION = "1.12.0"  # as bench/peer_trl.py
TARGET_SPEED = 2.0  # the speed-up the bench checks: ours ≥ 2× TRL's tokens/s at ≤ its peak memory


def turn_bounds(steps: int, warmup: int) -> list[int]:
    """Says how many steps this side has, then reads how many measured turns the parent chose: the
    bounds of the warm-up chunk and of the measured chunks."""
    ready(steps=steps)
    turns = int(sys.stdin.readline())
    return [0] + [warmup + b for b in chunk_bounds(steps - warmup, turns)]


# -- TRL's side (runs in bench/.venv-trl) ------------------------------------------------------
def run_trl(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["reward_dir"])
    tokenizer.pad_token_id = spec["pad_id"]
    model = AutoModelForSequenceClassification.from_pretrained(spec["reward_dir"], num_labels=1, dtype=torch.float32,
                                                               use_safetensors=True)
    head = load_file(str(Path(spec["reward_dir"]) / "score_head.safetensors"))
    assert not head["bias"].any(), "TRL's score layer has no bias: ours must start at 0"
    model.score.weight.data.copy_(head["weight"])  # the same seeded head as ours
    model.config.pad_token_id = spec["pad_id"]
    dataset = Dataset.from_dict({"chosen_ids": spec["chosen_ids"], "rejected_ids": spec["rejected_ids"]})
    rm = spec["reward"]
    batch, pairs = spec["trl_batch_size"], len(spec["chosen_ids"])
    steps = -(-pairs // batch)
    args = RewardConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_train_epochs=1, learning_rate=rm["lr"], adam_beta1=rm["adam_betas"][0], adam_beta2=rm["adam_betas"][1],
        weight_decay=rm["weight_decay"], max_grad_norm=rm["max_grad_norm"], lr_scheduler_type="cosine",
        warmup_steps=int(rm["warmup_ratio"] * steps), optim="adamw_torch_fused",
        gradient_checkpointing=spec["trl_gradient_checkpointing"], bf16=spec["trl_bf16"], use_cpu=spec["device"] == "cpu",
        seed=rm["seed"], max_length=None, dataloader_drop_last=False, dataloader_num_workers=0, report_to=[],
        save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    counted = {"tokens": 0, "padded": 0, "pairs": 0}

    class Turns(TrainerCallback):
        def __init__(self):
            self.bounds, self.step, self.chunk, self.started, self.cpu_started = [], 0, 0, 0.0, 0.0

        def on_step_end(self, args, state, control, **kwargs):
            self.step += 1
            if self.step == self.bounds[self.chunk + 1]:
                synchronize()
                report_turn(wall_s=time.perf_counter() - self.started, cpu_s=time.process_time() - self.cpu_started,
                            steps=self.bounds[self.chunk + 1] - self.bounds[self.chunk], **counted)
                counted.update(tokens=0, padded=0, pairs=0)
                self.chunk += 1
                if self.chunk + 1 < len(self.bounds):
                    self.started, self.cpu_started = wait_for_turn(), time.process_time()
                else:
                    wait_for_the_end()  # before the trainer's own wrap-up

    turns = Turns()
    trainer = RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[turns])
    assert len(trainer.train_dataset) == pairs, "TRL dropped pairs"
    original_compute_loss = trainer.compute_loss

    def counting_compute_loss(model, inputs, *more, **options):  # instrumentation only: counts, then TRL's own
        if model.training:
            mask = inputs["attention_mask"]
            counted.update(tokens=counted["tokens"] + int(mask.sum()), padded=counted["padded"] + mask.numel(),
                           pairs=counted["pairs"] + mask.shape[0] // 2)
        return original_compute_loss(model, inputs, *more, **options)

    trainer.compute_loss = counting_compute_loss
    assert len(trainer.get_train_dataloader()) == steps
    turns.bounds = turn_bounds(steps, spec["warmup_steps"])
    turns.started, turns.cpu_started = wait_for_turn(), time.process_time()
    trainer.train()
    assert turns.step == steps, f"TRL ran {turns.step} steps, not {steps}"
    finish()


# -- our side ----------------------------------------------------------------------------------
def run_ours(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    from stages.compute import loading
    from stages.leaves import precision
    from stages.leaves.config import PipelineConfig
    from stages.compute.nonfinite import NonFiniteGuard
    from stages.leaves.dist import Dist
    from stages.compute.reward.model import load_reward_model
    from stages.pipeline.reward import encode_pairs, forward_pairs, make_sampler, pair_batch, step_totals
    from stages.compute.training import adamw, cosine_with_warmup, make_engine

    cfg = PipelineConfig.model_validate(spec["config"])
    rm, dist = cfg.reward, Dist(device=spec["device"])
    torch.manual_seed(rm.seed)
    tokenizer = loading.load_tokenizer(spec["reward_dir"], cfg.model)
    model = load_reward_model(spec["reward_dir"], cfg.model).to(dist.device)
    loading.align_pad_token(model.lm, tokenizer)
    pairs = encode_pairs(tokenizer, spec["rows"], rm.max_seq_len, rm.max_response_len)
    assert [p.chosen_ids for p in pairs] == spec["chosen_ids"] and [p.rejected_ids for p in pairs] == spec["rejected_ids"]
    batches = make_sampler(rm, pairs, dist).batches(epoch=0)
    optimizer = adamw(model, lr=rm.lr, betas=rm.adam_betas, weight_decay=rm.weight_decay)
    scheduler = cosine_with_warmup(optimizer, int(rm.warmup_ratio * len(batches)), len(batches))
    engine = make_engine(model, optimizer, scheduler, micro_batch_size=rm.max_pairs, grad_accum_steps=1,
                         max_grad_norm=rm.max_grad_norm, precision=precision.resolve(cfg.model.precision, dist.device),
                         dist=dist)
    guard = NonFiniteGuard("reward", rm.max_nonfinite_steps, dist)
    engine.train()
    bounds = turn_bounds(len(batches), spec["warmup_steps"])
    for start, end in zip(bounds[:-1], bounds[1:]):
        tokens = padded = pairs_done = 0
        started = wait_for_turn()
        cpu_started = time.process_time()
        for step, indices in enumerate(batches[start:end], start=start + 1):  # the reward stage's step
            batch = pair_batch([pairs[i] for i in indices], tokenizer.pad_token_id, dist.device)
            loss, r_chosen, r_rejected = forward_pairs(engine, batch, len(indices), rm.beta_rm)
            if guard.check({"loss": loss.total}, f"step {step}"):
                engine.backward(loss.total)
                engine.step()
            dist.all_reduce_sum(step_totals(loss, r_chosen, r_rejected, batch))  # the step's metrics
            tokens += int(batch["attention_mask"].sum())
            padded += batch["attention_mask"].numel()
            pairs_done += len(indices)
        synchronize()
        report_turn(wall_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu_started, steps=end - start,
                    tokens=tokens, padded=padded, pairs=pairs_done)
    finish()


# -- the parent --------------------------------------------------------------------------------
def prepare(args, tmp: Path) -> dict:
    """What the sides share: the config, the pairs (rows and our token ids), the reward folder
    (base model + seeded head, fp32 safetensors), TRL's batch size."""
    import torch

    from stages.compute import loading
    from stages.orchestration.config_loading import load_config
    from stages.pipeline.data import load_pairs, make_splits, split_texts
    from stages.leaves.dist import Dist
    from stages.compute.reward.model import reward_model_from_lm, save_reward_model
    from stages.pipeline.reward import encode_pairs, make_sampler

    cfg = load_config(args.preset, ["reward.dynamic_batching=true", f"model.precision={args.precision}",
                                    *args.overrides])
    _, clean, _ = load_pairs(cfg)
    splits = make_splits(clean, cfg)
    model_dir = loading.materialise_model(cfg.model, corpus=lambda: split_texts(splits))
    rows = splits["rm_train"][: args.pairs]
    rm = cfg.reward
    tokenizer = loading.load_tokenizer(model_dir, cfg.model)
    reward_dir = tmp / "reward"
    torch.manual_seed(rm.seed)  # one seeded head, saved once, for every side
    save_reward_model(reward_model_from_lm(model_dir, cfg.model), tokenizer, reward_dir,
                      {"role": "benchmark: base model with an untrained head"})
    pairs = encode_pairs(tokenizer, rows, rm.max_seq_len, rm.max_response_len)
    our_steps = len(make_sampler(rm, pairs, Dist()).batches(epoch=0))
    return {"config": cfg.model_dump(mode="json"), "reward": rm.model_dump(mode="json"), "rows": rows,
            "chosen_ids": [p.chosen_ids for p in pairs], "rejected_ids": [p.rejected_ids for p in pairs],
            "reward_dir": str(reward_dir), "pad_id": tokenizer.pad_token_id,
            "trl_batch_size": max(1, round(len(pairs) / our_steps)), "our_steps": our_steps,
            "trl_gradient_checkpointing": args.trl_gradient_checkpointing, "threads": args.threads,
            "device": args.device, "warmup_steps": args.warmup_steps, "model_name": cfg.model.name_or_path}


def summarise(rows: list[dict]) -> dict:
    total = {key: sum(r[key] for r in rows) for key in ("wall_s", "cpu_s", "steps", "pairs", "tokens", "padded")}
    total["tokens_per_s"] = total["tokens"] / total["wall_s"]
    total["padding"] = 1 - total["tokens"] / total["padded"]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--pairs", type=int, default=96, help="pairs of rm_train, one epoch (default 96)")
    parser.add_argument("--turns", type=int, default=6, help="measured chunks of each side's epoch (default 6)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="steps of each side run first, in a turn left out of the numbers (default 1)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="ours: model.precision; bf16 runs TRL in fp32 and in bf16 and takes its faster run")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL with gradient checkpointing (RewardConfig's default); off unless set")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--trl-allocator", choices=["system", "tcmalloc"], default="system", help=ALLOCATOR_HELP)
    parser.add_argument("--device", default="cpu", help="cpu or cuda: where every side runs (default cpu)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config overrides (the reward section's settings reach every side)")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, spec = args.worker
        (run_trl if kind == "trl" else run_ours)(json.loads(Path(spec).read_text()))
        return

    from stages.leaves.precision import describe

    print(f"before: {load_average()}", flush=True)
    python = trl_python(TRL_VENV, TRL_VERSION, f"import trl; from trl import RewardTrainer; "
                                               f"assert trl.__version__ == '{TRL_VERSION}'")
    trl_runs = {"TRL fp32": False} if args.precision == "fp32" else {"TRL fp32": False, "TRL bf16": True}
    sides = [*trl_runs, "ours"]
    workers: dict[str, Worker] = {}
    steps: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec = prepare(args, Path(tmp))
        rm = spec["reward"]
        where = f"CPU, {args.threads} threads" if args.device == "cpu" else args.device
        print(f"preset {args.preset}, model {spec['model_name']}, ours in {args.precision}, TRL in "
              f"{' and '.join(trl_runs)}; {where}, {describe(args.device)}; {len(spec['rows'])} pairs "
              f"of rm_train, one epoch; max_seq_len {rm['max_seq_len']}, max_response_len {rm['max_response_len']}; "
              f"ours: dynamic batches, budget {rm['token_budget']} padded tokens, {rm['min_pairs']}-{rm['max_pairs']} "
              f"pairs, loss pairwise + {rm['beta_rm']} × LM; TRL {TRL_VERSION} RewardTrainer: "
              f"per_device_train_batch_size {spec['trl_batch_size']} = round({len(spec['rows'])} pairs / "
              f"{spec['our_steps']} of our steps), pairwise loss, gradient checkpointing "
              f"{'on' if args.trl_gradient_checkpointing else 'off'}", flush=True)
        for side in sides:  # one at a time: loading is not measured, and it peaks memory
            side_spec = {**spec, "trl_bf16": trl_runs.get(side, False),
                         "output_dir": str(Path(tmp) / f"out-{side.replace(' ', '-')}")}
            path = Path(tmp) / f"{side.replace(' ', '-')}.json"
            path.write_text(json.dumps(side_spec))
            kind = "ours" if side == "ours" else "trl"
            workers[side] = Worker(side, [python if kind == "trl" else sys.executable, __file__, "--worker", kind, path],
                                   Path(tmp) / f"{side.replace(' ', '-')}.log", side_environment(kind, args.trl_allocator))
            built = workers[side].ready()
            steps[side] = built["steps"]
            print(f"{side}: malloc {built['allocator']}", flush=True)
        turns = min(args.turns, *(n - args.warmup_steps for n in steps.values()))
        if turns < 1:
            sys.exit(f"no steps left after {args.warmup_steps} warm-up step(s): {steps}")
        for worker in workers.values():
            worker.send(str(turns))
        print(", ".join(f"{side} {n} steps" for side, n in steps.items()) + f": {args.warmup_steps} warm-up step(s) "
              f"each, then the rest in {turns} turns each; who goes first rotates from turn to turn", flush=True)

        def show(k: int, turn: dict) -> None:
            rate = {side: turn[side]["tokens"] / turn[side]["wall_s"] for side in sides}
            label = "warm-up" if k == 0 else f"turn {k}"
            print(f"  {label:<8} " + ", ".join(f"{side} {rate[side]:7.1f} tokens/s ({turn[side]['steps']} steps, "
                                                f"{turn[side]['wall_s']:5.1f} s)" for side in sides)
                  + "; ours / " + ", ".join(f"{side} ×{rate['ours'] / rate[side]:.2f}" for side in trl_runs)
                  + "; " + page_faults(turn), flush=True)

        reports = take_turns(workers, 1 + turns, show)
        peaks = {side: worker.peak_rss_mib() for side, worker in workers.items()}
        gpu_peaks = {side: worker.peak_gpu_mib for side, worker in workers.items()}

    results = {side: summarise(rows[1:]) for side, rows in reports.items()}
    print(f"{'side':<9}{'steps':>6}{'pairs/step':>11}{'tokens/step':>12}{'padded/step':>12}{'padding':>8}{'tokens/s':>9}"
          f"{'wall s':>8}{'CPU s':>7}{'peak RSS MiB':>13}")
    for side, r in results.items():
        print(f"{side:<9}{r['steps']:>6}{r['pairs'] / r['steps']:>11.1f}{r['tokens'] / r['steps']:>12.0f}"
              f"{r['padded'] / r['steps']:>12.0f}{r['padding']:>8.3f}{r['tokens_per_s']:>9.1f}{r['wall_s']:>8.1f}"
              f"{r['cpu_s']:>7.1f}{peaks[side]:>13.0f}")
    ours = results["ours"]
    best = max(trl_runs, key=lambda side: results[side]["tokens_per_s"])
    for side in trl_runs:
        trl = results[side]
        label = " (TRL best)" if len(trl_runs) > 1 and side == best else ""
        paired = [(o["tokens"] / o["wall_s"]) / (t["tokens"] / t["wall_s"]) for t, o in zip(reports[side][1:], reports["ours"][1:])]
        print(f"ours / {side}{label}: tokens/s ×{ours['tokens_per_s'] / trl['tokens_per_s']:.2f}, CPU s per real token "
              f"×{(ours['cpu_s'] / ours['tokens']) / (trl['cpu_s'] / trl['tokens']):.2f}, peak RSS "
              f"×{peaks['ours'] / peaks[side]:.2f}; turn by turn: {spread(paired)}")
    speed, memory = ours["tokens_per_s"] / results[best]["tokens_per_s"], peaks["ours"] / peaks[best]
    print(f"target, ours ≥ ×{TARGET_SPEED:.0f} {best}'s tokens/s at ≤ its peak RSS: tokens/s ×{speed:.2f} "
          f"({'met' if speed >= TARGET_SPEED else 'not met'}), peak RSS ×{memory:.2f} "
          f"({'met' if memory <= 1 else 'not met'})")
    if args.device != "cpu":
        print("peak GPU MiB: " + ", ".join(f"{side} {gpu_peaks[side] or 0:.0f}" for side in sides)
              + f"; ours / {best} ×{(gpu_peaks['ours'] or 0) / (gpu_peaks[best] or 1):.2f}")
    print(f"after: {load_average()}")


if __name__ == "__main__":
    main()
