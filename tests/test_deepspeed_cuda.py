"""The training engines under DeepSpeed ZeRO-2 and ZeRO-3 on one CUDA rank (NCCL) take the steps
the plain engine takes: the SFT, reward and critic losses and a PPO iteration's, on the same
batches, in bf16 with fp32 master weights on both sides.

Tolerance: the first step's forward runs the same bf16 weights (equal up to the order of sums);
each later step's weights are the bf16 roundings of fp32 masters that two AdamW implementations
(torch's fused one under `PlainEngine`, DeepSpeed's around the same optimiser) updated, which
differ by about one bf16 rounding (2⁻⁸ relative) of a weight. `BF16_RTOL` = 2 % allows a few of
those through three steps of a tiny model; a wrong gradient scale, a missed clip or a step not
taken moves the losses by far more (lr 3e-3: the losses fall by ~10 % in three steps).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device")

BF16_RTOL = 0.02
STEPS = 3
ZERO_STAGES = ["zero2", "zero3"]


@pytest.fixture(scope="module")
def one_nccl_rank():
    """This process as rank 0 of a world of one, over NCCL, as `stages.orchestration.launch` starts a rank."""
    import deepspeed
    import torch.distributed as torch_dist

    from stages.orchestration.launch import free_port

    rank_environment = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port()))
    before = {name: os.environ.get(name) for name in rank_environment}
    os.environ.update(rank_environment)
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    yield
    torch_dist.destroy_process_group()
    for name, value in before.items():  # later tests' ranks (torchrun) must not inherit them
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def dist_for(zero: str | None):
    from stages.leaves.config import LaunchConfig
    from stages.leaves.dist import Dist
    from stages.orchestration.launch import resolve_deepspeed_config

    config = resolve_deepspeed_config("sft", LaunchConfig(deepspeed=zero)) if zero else None
    return Dist(deepspeed_config=config, device="cuda:0")


def train(make_model, loss_of, zero: str | None, lr: float = 3e-3) -> list[float]:
    """Losses of STEPS steps of `loss_of(engine, step)` on a fresh model under the plain engine (zero
    None) or DeepSpeed's, in bf16."""
    from stages.compute.training import adamw, make_engine

    torch.manual_seed(0)
    model = make_model().to("cuda:0")
    optimizer = adamw(model, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    engine = make_engine(model, optimizer, scheduler, micro_batch_size=4, grad_accum_steps=1, max_grad_norm=1.0,
                         precision="bf16", dist=dist_for(zero))
    losses = []
    for step in range(STEPS):
        loss = loss_of(engine, step)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_same_losses(plain: list[float], ours: list[float]) -> None:
    assert all(torch.isfinite(torch.tensor(plain + ours)))
    assert ours == pytest.approx(plain, rel=BF16_RTOL), (plain, ours)
    assert plain[-1] < plain[0]  # the steps trained: a step not taken would also agree with itself


def batches(tiny, rows: int = 4) -> list[dict[str, torch.Tensor]]:
    """STEPS right-padded batches of the tiny preset's encoded prompts, labels = the ids."""
    from stages.leaves.rendering import collate

    _, tokenizer, prompts = tiny
    return [{k: v.to("cuda:0") for k, v in collate([(p, p) for p in prompts[step * rows : (step + 1) * rows]],
                                                     tokenizer.pad_token_id).items()}
            for step in range(STEPS)]


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_sft_loss_under_deepspeed_equals_the_plain_engines(one_nccl_rank, tiny, zero):
    from stages.orchestration.config_loading import load_config
    from stages.pipeline.sft import response_nll
    from stages.compute.loading import load_model

    folder = tiny[0]
    data = batches(tiny)

    def loss_of(engine, step):
        nll, count = response_nll(engine, data[step])
        return nll / count

    def model():
        return load_model(folder, load_config("tiny").model)

    assert_same_losses(train(model, loss_of, None), train(model, loss_of, zero))


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_reward_and_critic_losses_under_deepspeed_equal_the_plain_engines(one_nccl_rank, tiny, zero):
    """The reward model's pairwise loss (paper eq. 1) and the critic's value loss on the reward
    model's architecture."""
    from stages.orchestration.config_loading import load_config
    from stages.compute.losses import pairwise_loss, value_loss
    from stages.compute.ppo.experience import token_values
    from stages.compute.reward.model import RewardModel
    from stages.compute.loading import load_model

    folder = tiny[0]
    chosen, rejected = batches(tiny), [batches(tiny)[(step + 1) % STEPS] for step in range(STEPS)]
    returns = [torch.randn(4, batch["input_ids"].shape[1] - 1, generator=torch.Generator().manual_seed(step)).cuda()
               for step, batch in enumerate(chosen)]

    def model():
        return RewardModel(load_model(folder, load_config("tiny").model))

    def reward_loss(engine, step):
        r_chosen, _ = engine(chosen[step]["input_ids"], chosen[step]["attention_mask"])
        r_rejected, _ = engine(rejected[step]["input_ids"], rejected[step]["attention_mask"])
        return pairwise_loss(r_chosen, r_rejected)

    def critic_loss(engine, step):
        batch = chosen[step]
        values = token_values(engine.module, batch["input_ids"], batch["attention_mask"], prompt_width=1)
        mask = batch["attention_mask"][:, 1:].float()
        return value_loss(values, values.detach(), returns[step], mask, clip_eps=None)[0]

    assert_same_losses(train(model, reward_loss, None), train(model, reward_loss, zero))
    assert_same_losses(train(model, critic_loss, None), train(model, critic_loss, zero))


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_a_ppo_iteration_under_deepspeed_equals_the_plain_engines(one_nccl_rank, tiny, zero):
    """One greedy PPO iteration (the actor's and the critic's engines) under each engine: the same
    rollout and the same losses. Every model on its own transformers forward (`model.fast_path: off`):
    under ZeRO-3 the fast decoder does not apply, and two decoders' bf16 roundings could part the
    greedy rollouts at a near tie."""
    from ppo_helpers import make_trainer

    from stages.orchestration.config_loading import load_config
    from stages.leaves.precision import dtype
    from stages.compute.reward.model import RewardModel
    from stages.compute.loading import load_model

    folder = tiny[0]
    model_cfg = load_config("tiny", ["model.fast_path=off"]).model
    results = {}
    for name in (None, zero):
        torch.manual_seed(0)
        trainer = make_trainer(
            tiny, "ppo.rollout_batch_size=8", "ppo.minibatch_size=8", "ppo.generation.do_sample=false",
            "ppo.generation.max_new_tokens=8", "model.precision=bf16", "model.fast_path=off", actor=load_model(folder, model_cfg).cuda(),
            critic=RewardModel(load_model(folder, model_cfg)).cuda(),
            reference=load_model(folder, model_cfg, dtype("bf16")).cuda().eval().requires_grad_(False),
            dist=dist_for(name), precision="bf16")
        results[name] = (trainer.step(), trainer.last_experience.sequences)
    (plain, plain_sequences), (ours, our_sequences) = results[None], results[zero]
    assert torch.equal(plain_sequences, our_sequences)
    for metric in ("objective/scores", "loss/policy_avg", "loss/value_avg"):
        assert ours[metric] == pytest.approx(plain[metric], rel=BF16_RTOL, abs=1e-4), metric
