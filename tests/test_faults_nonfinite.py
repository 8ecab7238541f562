"""NaN/Inf in rewards or losses (stages/compute/nonfinite.py), on real tiny runs: the step is skipped and
counted, no weight moves, training goes on; K skipped steps in a row stop the stage with a
NonFiniteError naming the step and the tensor. Faults are injected as inputs: a score function
that returns NaN/Inf on chosen iterations, a critic weight set to NaN, a loss that turns NaN."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from ppo_helpers import make_trainer

from stages.compute.nonfinite import NonFiniteError
from stages.compute.training import PlainEngine
from stages.orchestration import lineage, run_writers, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import execute, free_port
from stages.pipeline import sft


def nonfinite_scores(score_fn, value: float, iterations: set[int]):
    """The rule reward, with every score of the given iterations (1-based calls) replaced by `value`."""
    calls = 0

    def score(*args):
        nonlocal calls
        calls += 1
        scores = score_fn(*args)
        return torch.full_like(scores, value) if calls in iterations else scores

    return score


def weights(*models) -> list[torch.Tensor]:
    return [p.detach().clone() for model in models for p in model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) for x, y in zip(a, b, strict=True))


def finite(params: list[torch.Tensor]) -> bool:
    return all(torch.isfinite(p).all() for p in params)


def test_ppo_skips_an_iteration_with_nonfinite_scores_and_trains_on(tiny):
    trainer = make_trainer(tiny)
    trainer.score_fn = nonfinite_scores(trainer.score_fn, math.nan, {2})
    models = (trainer.actor.module, trainer.critic.module)
    first = trainer.step()
    assert first["train/skipped_steps"] == 0 and "loss/policy_avg" in first
    before, moments = weights(*models), trainer.moments.state_dict()

    skipped = trainer.step()
    assert skipped["train/skipped_steps"] == 1 and "loss/policy_avg" not in skipped
    assert same(before, weights(*models))  # no optimiser stepped
    assert trainer.moments.state_dict() == moments  # the running score statistics left the batch out

    later = [trainer.step() for _ in range(2)]
    assert all("loss/policy_avg" in m and m["train/skipped_steps"] == 1 for m in later)
    assert trainer.iteration == 4 and trainer.guard.in_a_row == 0
    assert not same(before, weights(*models)) and finite(weights(*models))
    assert all(math.isfinite(v) for v in (trainer.moments.mean, trainer.moments.std))


def test_ppo_stops_after_k_iterations_of_nonfinite_scores(tiny):
    trainer = make_trainer(tiny, "ppo.max_nonfinite_steps=2")
    trainer.score_fn = nonfinite_scores(trainer.score_fn, math.inf, set(range(1, 100)))
    start = weights(trainer.actor.module, trainer.critic.module)
    assert trainer.step()["train/skipped_steps"] == 1
    # Clipped normalisation makes the rewards of an infinite score finite: the scores decide.
    with pytest.raises(NonFiniteError, match=r"ppo: NaN/Inf in scores at iteration 2; 2 steps in a row"):
        trainer.step()
    assert same(start, weights(trainer.actor.module, trainer.critic.module))


def test_ppo_skips_minibatches_whose_loss_is_nonfinite_and_stops_after_k(tiny):
    trainer = make_trainer(tiny)  # 32 rollouts in minibatches of 16: two steps per iteration
    models = (trainer.actor.module, trainer.critic.module)
    head = trainer.critic.module.score_head.weight
    healthy = head.detach().clone()
    with torch.no_grad():
        head[0, 0] = math.nan  # values, hence GAE advantages and both losses, become NaN
    before = weights(*models)
    metrics = trainer.step()
    assert metrics["train/skipped_steps"] == 2 and "loss/value_avg" not in metrics
    assert same(before, weights(*models))

    with torch.no_grad():
        head.copy_(healthy)
    metrics = trainer.step()  # healthy again: trains, the count of steps in a row starts over
    assert "loss/value_avg" in metrics and trainer.guard.in_a_row == 0 and trainer.guard.skipped == 2
    assert finite(weights(*models))

    with torch.no_grad():
        head[0, 0] = math.inf
    before = weights(*models)
    trainer.step()  # minibatches 1 and 2 skipped
    with pytest.raises(NonFiniteError, match=r"NaN/Inf in value loss, policy loss at iteration 4, minibatch 1; 3 steps"):
        trainer.step()
    assert same(before, weights(*models))


@pytest.fixture(scope="module")
def splits(hh_file):
    cfg = load_config("tiny")
    pipeline = run_writers.PipelineRun.start(cfg, ["data"])
    outputs = execute("data", cfg, pipeline.run_id, {})
    pipeline.finish("FINISHED")
    return outputs


def nonfinite_training_loss(monkeypatch, steps: set[int]) -> None:
    """SFT's training loss turns NaN on the given training forwards (1-based); held-out ones stay."""
    real, calls = sft.response_nll, 0

    def response_nll(model, batch):
        nonlocal calls
        nll, n = real(model, batch)
        if isinstance(model, PlainEngine):  # a training forward (held-out ones get the bare model)
            calls += 1
            nll = nll * math.nan if calls in steps else nll
        return nll, n

    monkeypatch.setattr(sft, "response_nll", response_nll)


def test_sft_skips_a_nonfinite_step_and_trains_on(splits, monkeypatch):
    nonfinite_training_loss(monkeypatch, {2})
    cfg = load_config("tiny", ["sft.max_steps=5"])
    pipeline = run_writers.PipelineRun.start(cfg, ["sft"])
    outputs = execute("sft", cfg, pipeline.run_id, splits)
    pipeline.finish("FINISHED")
    run = lineage.stage_runs(pipeline.run_id)[0]
    history = tracking.client().get_metric_history(run.info.run_id, "train/skipped_steps")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [0, 1, 1, 1, 1]
    loss = {m.step: m.value for m in tracking.client().get_metric_history(run.info.run_id, "train/loss")}
    assert math.isnan(loss[2]) and all(math.isfinite(loss[s]) for s in (1, 3, 4, 5))
    model = tracking.download(outputs["sft_model_artifact"])
    tensors = load_file(next(model.glob("*.safetensors")))
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values())


def test_sft_stops_after_k_nonfinite_steps(splits, monkeypatch):
    nonfinite_training_loss(monkeypatch, set(range(2, 100)))
    cfg = load_config("tiny", ["sft.max_steps=8"])
    pipeline = run_writers.PipelineRun.start(cfg, ["sft"])
    with pytest.raises(NonFiniteError, match=r"sft: NaN/Inf in loss at step 4, micro-batch 1; 3 steps in a row"):
        execute("sft", cfg, pipeline.run_id, splits)
    assert lineage.stage_runs(pipeline.run_id)[0].info.status == "FAILED"



# One rank of a 2-rank gloo group, in a fresh interpreter that imports only what the guard needs.
# Rank 0 alone sees a NaN at step 1, rank 1 alone an Inf at step 2; step 3 is finite on both.
RANK = """
import json, math, sys, torch
from stages.compute.nonfinite import NonFiniteGuard
from stages.leaves.dist import Dist
rank, port = int(sys.argv[1]), sys.argv[2]
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
guard = NonFiniteGuard("sft", 3, Dist(rank=rank, world_size=2))
losses = [[math.nan, 1.0, 1.0], [1.0, math.inf, 1.0]][rank]
decisions = [guard.check({"loss": torch.tensor(loss)}, f"step {i}") for i, loss in enumerate(losses, start=1)]
print(json.dumps({"decisions": decisions, "skipped": guard.skipped}))
torch.distributed.destroy_process_group()
"""


def test_ranks_skip_the_same_steps():
    """Under several ranks a NaN on one rank skips the step on all, else the ranks would part
    ways in their collectives and hang."""
    port, repo = str(free_port()), Path(__file__).resolve().parents[1]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), port], cwd=repo, stdout=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    assert outputs[0] == outputs[1] == {"decisions": [False, False, True], "skipped": 2}


@pytest.mark.parametrize("joint_clip", [False, True], ids=["own clip", "joint clip"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_finite_loss_whose_gradient_is_not_finite_moves_no_weight(precision, joint_clip):
    """A loss can be finite while its gradient is not: found on a random 30-layer Llama, whose
    gradient grew ×~100 a layer going back and overflowed (bench/random_model.py). Here the same
    at one weight: |w|^0.1 at w = 0 is 0, its derivative 0.1·|w|^-0.9 is inf. The step is skipped
    as DeepSpeed's optimisers skip an overflow (gradients dropped, no update, no lr step) and
    counted; the next step with a finite gradient trains. With the joint clip (PPO's actor and
    critic clipped as one) the engines learn the norm from `clip_grad_norm`."""
    from stages.compute.training import clip_grad_norm, linear_warmup

    torch.manual_seed(0)
    engines = []
    for _ in range(2 if joint_clip else 1):
        model = torch.nn.Linear(4, 1)
        with torch.no_grad():
            model.weight[0, 0] = 0.0
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        engines.append(PlainEngine(model, optimizer, linear_warmup(optimizer, 0), grad_accum_steps=1,
                                   max_grad_norm=math.inf if joint_clip else 1.0, precision=precision))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x = torch.ones(3, 4, dtype=dtype)

    def train_step(loss_of) -> None:
        for engine in engines:
            engine.backward(loss_of(engine.module))
        if joint_clip:
            clip_grad_norm(engines, 1.0)
        for engine in engines:
            engine.step()

    before = [p.detach().clone() for e in engines for p in e.trainable_parameters()]
    train_step(lambda m: (m.weight.abs() ** 0.1).sum() + m(x).float().sum())  # finite loss, inf gradient
    after = [p.detach().clone() for e in engines for p in e.trainable_parameters()]
    assert all(torch.isfinite(p).all() for p in after), "a non-finite gradient reached the weights"
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "weights moved on a skipped step"
    assert [e.skipped_steps for e in engines] == [1] * len(engines)
    assert [e.lr_scheduler.last_epoch for e in engines] == [0] * len(engines)
    assert all(p.grad is None for e in engines for p in e.trainable_parameters())

    train_step(lambda m: m(x).float().sum())  # a finite gradient: this one trains
    trained = [p.detach().clone() for e in engines for p in e.trainable_parameters()]
    assert all(torch.isfinite(p).all() for p in trained)
    assert not any(torch.equal(a, b) for a, b in zip(after, trained) if a.dim() == 2)
    assert [e.skipped_steps for e in engines] == [1] * len(engines)
