"""PPO-max building blocks against independent, straightforward references."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ppo_helpers import token_mean_minibatch

from stages.compute.losses import kl_estimate, kl_loss, policy_loss, value_loss
from stages.compute.ppo.advantages import gae
from stages.compute.ppo.reward_shaping import RunningMoments, eos_penalty_scores, reparameterise_scores, shape_scores, token_rewards
from stages.leaves.config import ConfigError, PPOConfig
from stages.leaves.logprobs import logprobs_and_entropy
from stages.leaves.tensors import masked_whiten
from stages.orchestration import registry
from stages.orchestration.config_loading import load_config


def gae_reference(rewards, values, gamma, lam):
    """The textbook loop over one episode (lists, no masks)."""
    advantages, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages, [a + v for a, v in zip(advantages, values)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 7), st.integers(0, 3), st.floats(0.5, 1.0), st.floats(0.0, 1.0), st.data())
def test_gae_matches_the_loop_on_padded_rows(rows, width, prompt, gamma, lam, data):
    lengths = [data.draw(st.integers(1, width)) for _ in range(rows)]
    total = prompt + width
    rewards = torch.randn(rows, total, dtype=torch.float64)
    values = torch.randn(rows, total, dtype=torch.float64)
    mask = torch.zeros(rows, total, dtype=torch.float64)
    for i, n in enumerate(lengths):  # prompt positions, then n response tokens, then post-EOS pads
        mask[i, prompt : prompt + n] = 1
    advantages, returns = gae(rewards * mask, values, mask, gamma, lam)
    for i, n in enumerate(lengths):
        span = slice(prompt, prompt + n)
        ref_a, ref_r = gae_reference(rewards[i, span].tolist(), values[i, span].tolist(), gamma, lam)
        np.testing.assert_allclose(advantages[i, span].numpy(), ref_a, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(returns[i, span].numpy(), ref_r, rtol=1e-10, atol=1e-10)
        assert advantages[i, prompt + n :].abs().sum() == 0 and advantages[i, :prompt].abs().sum() == 0


def test_gae_hand_computed():
    # r = [0, 1], V = [0.5, 0.25], γ = 1, λ = 0.5: δ1 = 1 − 0.25 = 0.75, δ0 = 0 + 0.25 − 0.5 = −0.25,
    # A1 = 0.75, A0 = −0.25 + 0.5·0.75 = 0.125; R = A + V = [0.625, 1.0]
    a, r = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 1.0, 0.5)
    assert a.tolist() == [[0.125, 0.75]] and r.tolist() == [[0.625, 1.0]]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-50, 50), min_size=1, max_size=40), st.lists(st.floats(-50, 50), min_size=1, max_size=40))
def test_running_moments_equal_numpy_over_all_data(first, second):
    moments = RunningMoments()
    moments.update(torch.tensor(first, dtype=torch.float64))
    moments.update(torch.tensor(second, dtype=torch.float64))
    everything = np.array(first + second)
    assert moments.count == len(everything)
    assert moments.mean == pytest.approx(everything.mean(), abs=1e-9)
    assert moments.var == pytest.approx(everything.var(), rel=1e-7, abs=1e-7)


def test_parallel_merge_of_two_halves_equals_the_whole():
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=1000)
    left, right = RunningMoments(), RunningMoments()
    left.update(torch.tensor(data[:300]))
    right.update(torch.tensor(data[300:]))
    left.merge(right.mean, right.var, right.count)
    assert left.mean == pytest.approx(data.mean()) and left.var == pytest.approx(data.var())
    # The all-reduce path: two "ranks" summing [n, Σx, Σx²] see the statistics of all of it.
    halves = [data[:300], data[300:]]
    summed = lambda sums: [sum(h.size for h in halves), sum(h.sum() for h in halves), sum((h * h).sum() for h in halves)]
    merged = RunningMoments()
    merged.update(torch.tensor(halves[0]), all_reduce_sum=summed)
    assert merged.mean == pytest.approx(data.mean()) and merged.var == pytest.approx(data.var())


def test_score_reparameterisation():
    moments = RunningMoments(mean=1.0, var=4.0, count=10)
    scores = torch.tensor([1.0, 3.0, 11.0])
    assert reparameterise_scores(scores, moments, "none", 0.5).tolist() == [1.0, 3.0, 11.0]
    assert reparameterise_scores(scores, moments, "scale", 0.5).tolist() == [0.5, 1.5, 5.5]
    assert reparameterise_scores(scores, moments, "normalise", 2.0).tolist() == [0.0, 1.0, 2.0]  # 5.0 clipped


def test_eos_penalty_replaces_scores_of_unfinished_responses():
    moments = RunningMoments(mean=1.0, var=4.0, count=10)
    scores = torch.tensor([0.3, -0.2, 1.5])
    ended = torch.tensor([True, False, True])
    assert eos_penalty_scores(scores, ended, moments, 3.0).tolist() == pytest.approx([0.3, 1.0 - 3 * 2.0, 1.5])
    assert eos_penalty_scores(scores, ended, moments, None) is scores


@settings(max_examples=60, deadline=None)
@given(st.floats(-50, 50), st.floats(0.01, 10), st.floats(-3, 3), st.sampled_from(["normalise", "scale", "none"]))
def test_eos_penalty_in_shaped_units_ranks_a_truncated_response_last(offset, scale, own_score, mode):
    """The audit's reproduction: RM scores centred at −3, the last response has no EOS. With the
    old fixed raw penalty −1.0 mixed into the running statistics, the truncated response got the
    highest shaped score ([-0.67, -0.31, -0.55, 1.97]). Whatever the RM's offset and scale, it must
    get the lowest, and the statistics must hold the RM's own scores only."""
    raw = offset + scale * (torch.tensor([-3.2, -2.9, -3.1, own_score]) + 3.0)
    ended = torch.tensor([True, True, True, False])
    moments = RunningMoments(mean=offset, var=scale**2, count=1.0)  # the RM's held-out statistics
    shaped = shape_scores(raw, ended, moments, mode=mode, clip=10.0, eos_penalty_sigmas=PPOConfig().eos_penalty_sigmas)
    assert shaped[3] < shaped[:3].min(), shaped
    expected = RunningMoments(mean=offset, var=scale**2, count=1.0)
    if mode != "none":
        expected.update(raw)  # the truncated response's own RM score, not a penalty
    assert (moments.mean, moments.var, moments.count) == pytest.approx((expected.mean, expected.var, expected.count))


def test_eos_penalty_of_delta_sigmas_is_the_clip_floor():
    moments = RunningMoments(mean=-3.0, var=0.01, count=100)
    shaped = shape_scores(torch.tensor([-3.1, 5.0]), torch.tensor([True, False]), moments, mode="normalise",
                          clip=10.0, eos_penalty_sigmas=10.0, update_moments=False)
    assert shaped.tolist() == pytest.approx([-1.0, -10.0])


def test_k1_k2_and_k3_hand_computed():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    # k1 = log π − log π_ref = [log 2, log 0.5]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([math.log(2), math.log(0.5)])
    # k3 = (ρ − 1) − log ρ, ρ = π_ref/π = [0.5, 2]: [−0.5 + log 2, 1 − log 2]
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([-0.5 + math.log(2), 1 - math.log(2)])
    # k2 = ½ (log π − log π_ref)²
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.5 * math.log(2) ** 2, 0.5 * math.log(0.5) ** 2])


def _exact_expected_kl_gradients(kl_penalty_in: str, estimator: str, beta: float = 0.1, distance: float = 1.0):
    """(E_{a~π}[∇_θ loss(a)], ∇KL(π‖π_ref), ∇KL(π_ref‖π)) for one state with a 5-way softmax
    π = softmax(θ), the expectation taken exactly over the 5 actions, through our own code: the KL
    in the reward (token_rewards, then the clipped surrogate with A = r, one token, V = 0), or as a
    loss term (kl_loss). θ = the reference's logits + `distance` × noise."""
    torch.manual_seed(0)
    ref_logits, noise = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    theta = (ref_logits + distance * noise).requires_grad_(True)
    ref = torch.log_softmax(ref_logits, -1)
    log_pi = torch.log_softmax(theta, -1)
    one = torch.ones(1, 1, dtype=torch.float64)
    expected = torch.zeros(5, dtype=torch.float64)
    for a in range(5):
        logp, ref_a = log_pi[a].view(1, 1), ref[a].view(1, 1)
        if kl_penalty_in == "reward":
            rewards, _ = token_rewards(torch.zeros(1, dtype=torch.float64), logp.detach(), ref_a, one, beta, estimator)
            loss, _ = policy_loss(logp, logp.detach(), rewards, one, clip_eps=0.2)
        else:
            loss = beta * kl_loss(logp, ref_a, one, estimator)
        (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)
        expected += log_pi[a].exp().detach() * grad
    forward = torch.autograd.grad(beta * (log_pi.exp() * (log_pi - ref)).sum(), theta, retain_graph=True)[0]
    reverse = torch.autograd.grad(beta * (ref.exp() * (ref - log_pi)).sum(), theta)[0]
    # The objective is to maximise reward − β·KL: the loss's gradient must be +β∇KL.
    return expected, forward, reverse


@pytest.mark.parametrize("kl_penalty_in, estimator, which", [("reward", "k1", "forward"), ("loss", "k2", "forward"),
                                                             ("loss", "k3", "reverse")])
def test_kl_penalty_expected_gradient_is_the_kl_gradient(kl_penalty_in, estimator, which):
    """Each supported place × estimator: the expected gradient equals β∇KL exactly — KL(π‖π_SFT),
    or for k3 as a loss the reverse KL(π_SFT‖π), which agrees with it to second order around π_SFT
    (both vanish at π = π_SFT and pull π back to it)."""
    expected, forward, reverse = _exact_expected_kl_gradients(kl_penalty_in, estimator)
    torch.testing.assert_close(expected, forward if which == "forward" else reverse, rtol=1e-9, atol=1e-12)


def test_k3_in_the_reward_barely_constrains_the_policy():
    """The audit's case: k3 as a per-token reward gives ∇KL(π‖ref) − ∇KL(ref‖π), which cancels to
    first order; hence the config refuses it (below)."""
    expected, forward, reverse = _exact_expected_kl_gradients("reward", "k3")
    torch.testing.assert_close(expected, forward - reverse, rtol=1e-9, atol=1e-12)
    # Near π_SFT, ∇KL shrinks like the distance, k3-as-reward's gradient like its square.
    ratio = {}
    for distance in (0.1, 0.01):
        expected, forward, _ = _exact_expected_kl_gradients("reward", "k3", distance=distance)
        ratio[distance] = float(expected.norm() / forward.norm())
    assert ratio[0.01] < 0.2 * ratio[0.1], ratio


@pytest.mark.parametrize("place, estimator", [("reward", "k2"), ("reward", "k3"), ("loss", "k1")])
def test_kl_estimator_in_a_place_where_its_gradient_is_not_the_kl_is_a_config_error(place, estimator):
    with pytest.raises(ConfigError, match=f"kl_estimator={estimator}"):
        load_config("tiny", [f"ppo.kl_penalty_in={place}", f"ppo.kl_estimator={estimator}"])
    load_config("tiny", ["ppo.kl_penalty_in=loss", "ppo.kl_estimator=k3"])  # the supported ones load
    load_config("tiny", ["ppo.kl_penalty_in=reward", "ppo.kl_estimator=k1"])


def test_token_rewards_with_left_padded_prompts_and_post_eos_padding():
    # Row 0: 2 pad, 2 prompt, 3 response tokens. Row 1: 0 pad, 4 prompt, 1 response token, 2 pads after EOS.
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 0, 0]], dtype=torch.float32)
    logp = torch.full((2, 7), -1.0)
    ref = torch.full((2, 7), -1.5)  # k1 = 0.5 on every token
    rewards, kl = token_rewards(torch.tensor([2.0, -1.0]), logp, ref, mask, kl_coef=0.1, kl_kind="k1")
    assert rewards[0].tolist() == pytest.approx([0, 0, 0, 0, -0.05, -0.05, 2.0 - 0.05])
    assert rewards[1].tolist() == pytest.approx([0, 0, 0, 0, -1.0 - 0.05, 0, 0])
    assert kl.sum().item() == pytest.approx(0.5 * 4)


def test_policy_loss_hand_computed():
    # ρ = [1.5, 0.5], A = [1, 1], ε = 0.2: min(ρA, clip(ρ)A) = [1.2, 0.5] → loss −0.85; one of two clipped
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))
    loss, stats = policy_loss(new, old, torch.ones(1, 2), torch.ones(1, 2), clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.85)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    assert stats["ratio"].item() == pytest.approx(1.0)
    # A = −1: min(−ρ, −clip(ρ)) = [−1.5, −0.8] → loss 1.15; the second token is clipped
    loss, stats = policy_loss(new, old, -torch.ones(1, 2), torch.ones(1, 2), clip_eps=0.2)
    assert loss.item() == pytest.approx(1.15) and stats["clipfrac"].item() == pytest.approx(0.5)
    # vanilla: −mean(ρA) = −1.0; masked tokens do not count
    loss, _ = policy_loss(new, old, torch.ones(1, 2), torch.tensor([[1.0, 0.0]]), clip_eps=None)
    assert loss.item() == pytest.approx(-1.5)


def test_value_loss_hand_computed():
    # V = [1.0, 0.0], V_old = [0.5, 0.5], R = [0.0, 1.0], ε_v = 0.2:
    # unclipped (V−R)² = [1, 1]; clipped V = [0.7, 0.3] → (0.7)², (0.7)² = [0.49, 0.49]; max = [1, 1] → 0.5
    v, v_old, r = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]]), torch.tensor([[0.0, 1.0]])
    loss, stats = value_loss(v, v_old, r, torch.ones(1, 2), clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5) and stats["clipfrac"].item() == 0.0
    # R = [1.2, −0.2]: unclipped [0.04, 0.04]; clipped [(0.7−1.2)², (0.3+0.2)²] = [0.25, 0.25] → 0.125
    loss, stats = value_loss(v, v_old, torch.tensor([[1.2, -0.2]]), torch.ones(1, 2), clip_eps=0.2)
    assert loss.item() == pytest.approx(0.125) and stats["clipfrac"].item() == 1.0
    loss, _ = value_loss(v, v_old, torch.tensor([[1.2, -0.2]]), torch.ones(1, 2), clip_eps=None)
    assert loss.item() == pytest.approx(0.02)


def test_whitening_and_entropy():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = masked_whiten(x, mask)
    assert w[0, :3].tolist() == pytest.approx([-1.2247, 0.0, 1.2247], abs=1e-4) and w[0, 3] == 0
    token = torch.tensor([[0]])
    _, uniform = logprobs_and_entropy(torch.zeros(1, 1, 4), token, 1.0)
    assert uniform.item() == pytest.approx(math.log(4))
    _, peaked = logprobs_and_entropy(torch.tensor([[[0.0, 0.0, 50.0]]]), token, 1.0)
    assert peaked.item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])  # clips; does not clip
def test_the_joint_clip_gives_torchs_clipped_gradients_over_both_engines(max_norm):
    from stages.compute.training import clip_grad_norm, PlainEngine

    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    twins = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    for model, twin in zip(models, twins):
        twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    for pair in (models, twins):
        pair[1](pair[0](x)).square().sum().backward()
    engines = [PlainEngine(m, None, None, grad_accum_steps=1, max_grad_norm=math.inf) for m in models]
    norm = clip_grad_norm(engines, max_norm)
    expected = torch.nn.utils.clip_grad_norm_([p for m in twins for p in m.parameters()], max_norm)
    assert norm == pytest.approx(float(expected))
    assert (norm > max_norm) == (max_norm == 0.5)
    for ours, theirs in zip((p for m in models for p in m.parameters()), (p for m in twins for p in m.parameters())):
        assert torch.equal(ours.grad, theirs.grad)


# -- advantage estimators and policy losses, through their registries ----------------------------
def _estimate(name, rewards, mask, groups, values=None, all_reduce_sum=None, **ppo):
    from stages.leaves.config import PPOConfig
    from stages.compute.ppo.advantages import AdvantageInputs, advantage_estimator

    values = None if values is None else torch.tensor(values)
    inputs = AdvantageInputs(torch.tensor(rewards), torch.tensor(mask), values, torch.tensor(groups), PPOConfig(**ppo),
                             all_reduce_sum)
    return advantage_estimator(name).fn(inputs)


def _close(tensor, expected, atol=1e-6):
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=tensor.dtype), rtol=1e-5, atol=atol)


# Five rows in two groups (labels 5 and 2: any labels do), response masks of 2, 3, 1, 3 and 2 tokens.
# Token rewards = −β·KL_t plus the score on the last token; a sequence's reward is their sum:
#   row 0: −0.5 + 0.5 = 0;  row 1: 0 − 1 + 3 = 2;  row 2: 4;    (group 5: 0, 2, 4)
#   row 3: 0 + 0 + 1 = 1;   row 4: 0.25 + 2.75 = 3              (group 2: 1, 3)
GROUP_REWARDS = [[-0.5, 0.5, 0.0], [0.0, -1.0, 3.0], [4.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.25, 2.75, 0.0]]
GROUP_MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
GROUPS = [5, 5, 5, 2, 2]


def test_grpo_hand_computed():
    # group 5: mean 2, std (n − 1) = √((4 + 0 + 4) / 2) = 2 → (r − 2) / 2 = −1, 0, 1
    # group 2: mean 2, std = √((1 + 1) / 1) = √2 → ∓1/√2; each row's value on all its response tokens
    a, returns = _estimate("grpo", GROUP_REWARDS, GROUP_MASK, GROUPS, samples_per_prompt=2)
    s = 1 / math.sqrt(2)
    _close(a, [[-1, -1, 0], [0, 0, 0], [1, 0, 0], [-s, -s, -s], [s, s, 0]])
    assert returns is None
    # A group of equal rewards has std 0: (r − mean) / (0 + ε) = 0. A group of one gets 0 too.
    a, _ = _estimate("grpo", [[1.0, 2.0], [3.0, 0.0], [7.0, 0.0]], [[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]], [0, 0, 1],
                     samples_per_prompt=2)
    assert a.tolist() == [[0, 0], [0, 0], [0, 0]]


def test_rloo_hand_computed():
    # r_i − mean of the others: group 5: 0 − (2 + 4)/2 = −3, 2 − (0 + 4)/2 = 0, 4 − (0 + 2)/2 = 3;
    # group 2: 1 − 3 = −2, 3 − 1 = 2 (= k/(k−1) · (r − mean), k = 3: 3/2 · (−2, 0, 2))
    a, returns = _estimate("rloo", GROUP_REWARDS, GROUP_MASK, GROUPS, samples_per_prompt=2)
    _close(a, [[-3, -3, 0], [0, 0, 0], [3, 0, 0], [-2, -2, -2], [2, 2, 0]])
    assert returns is None
    a, _ = _estimate("rloo", [[5.0]], [[1.0]], [0], samples_per_prompt=2)  # no other sample: no signal
    assert a.tolist() == [[0.0]]


def test_reinforce_plus_plus_hand_computed():
    # γ = 0.5. Row 0 (3 tokens): G_2 = 3, G_1 = −0.5 + 0.5·3 = 1, G_0 = 2.5 + 0.5·1 = 3.
    # Row 1 (1 token, then pads): G_0 = 1. The KL terms are in r_t; λ and the values play no part.
    rewards, mask = [[2.5, -0.5, 3.0], [1.0, 0.0, 0.0]], [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    a, returns = _estimate("reinforce++", rewards, mask, [0, 1], gamma=0.5, lam=0.0)
    assert returns.tolist() == [[3, 1, 3], [1, 0, 0]]
    # Whitened over the batch's 4 response tokens {3, 1, 3, 1}: mean 2, std 1 → ±1; pads stay 0
    _close(a, [[1, -1, 1], [-1, 0, 0]])
    # Two ranks, row 1 on the other one: the sums [tokens, ΣG] and then Σ(G − mean)² take in its
    # [1, 1] and (1 − 2)² = 1, and row 0 is whitened on the global batch's mean and std as above.
    other_rank = iter([[1.0, 1.0], [1.0]])
    a, _ = _estimate("reinforce++", rewards[:1], mask[:1], [0], gamma=0.5,
                     all_reduce_sum=lambda sums: [x + y for x, y in zip(sums, next(other_rank))])
    _close(a, [[1, -1, 1]])


def test_gae_through_the_registry_is_gae():
    # The hand-computed case of test_gae_hand_computed: A = [0.125, 0.75], R = [0.625, 1.0]
    a, r = _estimate("gae", [[0.0, 1.0]], [[1.0, 1.0]], [0], values=[[0.5, 0.25]], gamma=1.0, lam=0.5)
    assert a.tolist() == [[0.125, 0.75]] and r.tolist() == [[0.625, 1.0]]


def test_registry_entries_say_which_estimators_need_a_critic():
    from stages.leaves.config import PPOConfig
    from stages.compute.ppo.advantages import ADVANTAGE_ESTIMATORS, needs_critic

    assert {name: e.needs_critic for name, e in ADVANTAGE_ESTIMATORS.items()} == {
        "gae": True, "grpo": False, "rloo": False, "reinforce++": False}
    assert needs_critic(PPOConfig()) and not needs_critic(PPOConfig(advantage_estimator="reinforce++"))
    assert not needs_critic(PPOConfig(advantage_estimator="grpo", samples_per_prompt=2))


def test_ppo_clip_through_the_registry_is_the_clipped_surrogate():
    from stages.leaves.config import PPOConfig
    from stages.compute.losses import registered_policy_loss

    # The hand-computed case of test_policy_loss_hand_computed: ρ = [1.5, 0.5], A = 1, ε = 0.2 → −0.85
    loss, stats = registered_policy_loss("ppo_clip")(torch.log(torch.tensor([[1.5, 0.5]])), torch.zeros(1, 2),
                                                     torch.ones(1, 2), torch.ones(1, 2), PPOConfig(clip_eps=0.2))
    assert loss.item() == pytest.approx(-0.85) and stats["clipfrac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("loss_agg, expected", [("token_mean", -2.5), ("seq_mean", -3.0)])
def test_the_policy_loss_aggregates_by_token_or_by_sequence(loss_agg, expected):
    """ρ = 1, so the clipped surrogate is A itself. Row 0 has 3 response tokens (A = 1, 2, 3), row 1
    one (A = 4): token_mean −(1 + 2 + 3 + 4) / 4 = −2.5; seq_mean −((1 + 2 + 3) / 3 + 4) / 2 = −3.0."""
    from stages.compute.losses import registered_policy_loss

    advantages = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    logprobs = torch.zeros(2, 3)
    loss, stats = registered_policy_loss("ppo_clip")(logprobs, logprobs, advantages, mask, PPOConfig(loss_agg=loss_agg))
    assert loss.item() == pytest.approx(expected)
    assert stats["ratio"].item() == pytest.approx(1.0) and stats["clipfrac"].item() == 0.0  # statistics: token means
    # The KL loss term follows the same switch: k2 = ½ (log π − log π_SFT)² = [[½, ½, ½], [2]] →
    # token_mean (1.5 + 2) / 4 = 0.875; seq_mean (½ + 2) / 2 = 1.25.
    ref = -torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 0.0]])
    assert kl_loss(logprobs, ref, mask, "k2", loss_agg).item() == pytest.approx({"token_mean": 0.875,
                                                                                 "seq_mean": 1.25}[loss_agg])


def test_token_and_sequence_means_agree_when_every_response_has_the_same_length():
    from stages.compute.losses import aggregate

    per_token, mask = torch.randn(4, 5), torch.ones(4, 5)
    mask[:, 3:] = 0
    token_mean = aggregate(per_token, mask, "token_mean").item()
    assert aggregate(per_token, mask, "seq_mean").item() == pytest.approx(token_mean)
    mask[0, 1:] = 0  # one response of one token: it weighs a quarter under seq_mean, a tenth under token_mean
    token_mean = aggregate(per_token, mask, "token_mean").item()
    assert aggregate(per_token, mask, "seq_mean").item() != pytest.approx(token_mean)
    with pytest.raises(ConfigError, match="'ppo.loss_agg'"):
        load_config("tiny", ["ppo.loss_agg=seq_sum"])


def test_a_toy_estimator_registered_here_is_a_config_choice(monkeypatch):
    """One function and the decorator, in this test: `ppo.advantage_estimator=<its name>` passes the
    PPO stage's check."""
    from stages.compute.ppo import advantages

    monkeypatch.setattr(advantages, "ADVANTAGE_ESTIMATORS", dict(advantages.ADVANTAGE_ESTIMATORS))  # undone after

    @advantages.register_advantage_estimator("toy", needs_critic=False, min_samples_per_prompt=3)
    def toy(inputs):
        return advantages.sequence_rewards(inputs)[:, None] * inputs.mask, None

    cfg = load_config("tiny", ["ppo.advantage_estimator=toy", "ppo.samples_per_prompt=4"])
    registry.get("ppo").check(cfg)
    assert cfg.ppo.advantage_estimator == "toy" and not advantages.needs_critic(cfg.ppo)
    with pytest.raises(ConfigError, match="advantage_estimator=toy .* needs samples_per_prompt ≥ 3"):
        registry.get("ppo").check(load_config("tiny", ["ppo.advantage_estimator=toy", "ppo.samples_per_prompt=2"]))
    with pytest.raises(ValueError, match="registered already"):
        advantages.register_advantage_estimator("toy", needs_critic=False)(toy)


# One rank of a 2-rank gloo group in a fresh interpreter: its rows of a minibatch, the policy loss
# as the trainer composes it (ppo_clip under loss_agg=token_mean, times token_mean_share), the
# gradient averaged over the ranks as DeepSpeed averages it.
TOKEN_MEAN_RANK = """
import json, sys, torch
from stages.compute.losses import registered_policy_loss, token_mean_share
from stages.leaves.config import PPOConfig
from stages.leaves.dist import Dist
sys.path.insert(0, "tests")
from ppo_helpers import token_mean_minibatch
rank, port = int(sys.argv[1]), sys.argv[2]
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
theta, tokens, old, advantages, mask = token_mean_minibatch()
rows = slice(2 * rank, 2 * rank + 2)
logprobs = torch.log_softmax(theta, -1)[tokens[rows]]
loss, _ = registered_policy_loss("ppo_clip")(logprobs, old[rows], advantages[rows], mask[rows],
                                             PPOConfig(loss_agg="token_mean", clip_eps=0.2))
loss = loss * token_mean_share(mask[rows], Dist(rank=rank, world_size=2))
loss.backward()
torch.distributed.all_reduce(theta.grad)
(mean_loss,) = Dist(rank=rank, world_size=2).all_reduce_sum([loss.item() / 2])
print(json.dumps({"grad": (theta.grad / 2).tolist(), "loss": mean_loss}))
torch.distributed.destroy_process_group()
"""


def test_token_mean_is_over_the_global_minibatch_on_ranks_with_unequal_token_counts():
    """loss_agg=token_mean on two ranks, one with 11 response tokens, one with 3: the gradient the
    ranks average, and the mean of their losses, are the single process's token mean over all 14
    tokens (a mean of the two per-rank means would weigh each of rank 1's tokens 11/3 times as
    much as one of rank 0's)."""
    from stages.orchestration.launch import free_port
    from stages.compute.losses import registered_policy_loss

    theta, tokens, old, advantages, mask = token_mean_minibatch()
    loss, _ = registered_policy_loss("ppo_clip")(torch.log_softmax(theta, -1)[tokens], old, advantages, mask,
                                                 PPOConfig(loss_agg="token_mean", clip_eps=0.2))
    loss.backward()
    port, repo = str(free_port()), Path(__file__).resolve().parents[1]
    ranks = [subprocess.Popen([sys.executable, "-c", TOKEN_MEAN_RANK, str(rank), port], cwd=repo,
                              stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    for output in outputs:
        assert output["grad"] == pytest.approx(theta.grad.tolist(), abs=1e-6)
        assert output["loss"] == pytest.approx(loss.item(), abs=1e-6)
