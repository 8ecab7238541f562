"""The reward model: its loss, last-non-pad-token pooling, save/load, and learning a preference."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from stages.compute.loading import train_bpe_tokenizer
from stages.compute.losses import next_token_targets, reward_model_loss
from stages.compute.reward.model import RewardModel, last_token_index, load_reward_model, save_reward_model
from stages.compute.training import PlainEngine, cosine_with_warmup
from stages.leaves.config import ModelConfig, RewardConfig
from stages.leaves.dist import Dist
from stages.pipeline.reward import encode_pairs, forward_pairs, make_sampler, pair_batch, score_heldout

WORDS = ("river stone cloud apple window garden paper music summer forest candle orange bridge "
         "silver yellow market winter letter basket pillow mirror engine ticket planet").split()
TOPICS = "cats trains bread rain chess maps tea boats".split()
MARKER = "thanks"  # the word that makes an answer preferred


def synthetic_pairs(count: int, seed: int) -> list[dict]:
    """Pairs whose chosen answer carries the marker word somewhere; same length as the rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = f"Tell me about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}."
        size = rng.randint(4, 12)
        chosen = [rng.choice(WORDS) for _ in range(size - 1)]
        chosen.insert(rng.randrange(size), MARKER)
        rejected = [rng.choice(WORDS) for _ in range(size)]
        rows.append({"prompt": f"\n\nHuman: {prompt}\n\nAssistant:", "messages": [{"role": "user", "content": prompt}],
                     "chosen": " ".join(chosen), "rejected": " ".join(rejected)})
    return rows


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    texts = [r[k] for r in synthetic_pairs(200, seed=0) for k in ("prompt", "chosen", "rejected")]
    folder = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer(texts, vocab_size=300, out=folder)
    return AutoTokenizer.from_pretrained(folder)


def tiny_reward_model(tokenizer, seed: int = 0) -> RewardModel:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    return RewardModel(LlamaForCausalLM(config))


def test_loss_matches_a_hand_computed_case():
    r_chosen, r_rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    # Pairwise: margins 2 and −1; log(1 + e^−2) = 0.126928, log(1 + e^1) = 1.313262; mean 0.720095.
    # LM (vocabulary of 2): the prompt token is masked; position 0 predicts token 1 with logits
    # (0, ln 3), p = 3/4, NLL = ln(4/3) = 0.287682; position 1 predicts token 0 with logits (0, 0),
    # p = 1/2, NLL = ln 2 = 0.693147; the last position predicts nothing. Mean 0.490415.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [5.0, -5.0]],
                           [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    labels = torch.tensor([[-100, 1, 0], [-100, -100, -100]])
    positions, targets = next_token_targets(labels)
    assert positions.tolist() == [0, 1] and targets.tolist() == [1, 0]
    loss = reward_model_loss(r_chosen, r_rejected, logits.reshape(-1, 2)[positions], targets, beta_rm=0.5)
    assert loss.pairwise.item() == pytest.approx(0.720095, abs=1e-6)
    assert loss.lm.item() == pytest.approx(0.490415, abs=1e-6)
    assert loss.lm_tokens == 2
    assert loss.total.item() == pytest.approx(0.720095 + 0.5 * 0.490415, abs=1e-6)


def test_the_loss_and_its_gradients_equal_the_whole_logits_formula(tokenizer):
    """The stage's loss takes the LM head on the chosen answers' predicting positions only; the same
    loss from the model's own forward, the LM head on every position and cross-entropy over the
    shifted labels, gives the same value and the same gradient on every weight (fp32, the precision
    of both losses' arithmetic)."""
    pairs = encode_pairs(tokenizer, synthetic_pairs(6, seed=5), max_seq_len=64, max_response_len=16)
    batch = pair_batch(pairs, tokenizer.pad_token_id, "cpu")
    n, beta_rm = len(pairs), 0.7
    model = tiny_reward_model(tokenizer)

    def gradients(loss):
        model.zero_grad()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ours, ours_grads = gradients(forward_pairs(model, batch, n, beta_rm)[0].total)

    rewards, _ = model(batch["input_ids"], batch["attention_mask"])
    logits = model.lm(input_ids=batch["input_ids"][:n], attention_mask=batch["attention_mask"][:n]).logits
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:n, 1:].flatten(),
                                           ignore_index=-100)
    pairwise = -torch.nn.functional.logsigmoid(rewards[:n] - rewards[n:]).mean()
    whole, whole_grads = gradients(pairwise + beta_rm * lm)

    torch.testing.assert_close(ours, whole, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_without_the_lm_term_the_lm_head_makes_no_pass(tokenizer):
    """β_rm = 0 (MOSS's setting): the loss is the pairwise one, and the LM head never runs over the
    chosen answers (a pass over the vocabulary whose loss the weight 0 throws away); the held-out
    metrics report no LM loss."""
    pairs = encode_pairs(tokenizer, synthetic_pairs(6, seed=5), max_seq_len=64, max_response_len=16)
    batch = pair_batch(pairs, tokenizer.pad_token_id, "cpu")
    n = len(pairs)
    model = tiny_reward_model(tokenizer)
    head_passes = []
    hook = model.lm.get_output_embeddings().register_forward_hook(lambda *_: head_passes.append(1))
    loss, r_chosen, r_rejected = forward_pairs(model, batch, n, beta_rm=0.0)
    hook.remove()
    assert head_passes == [] and loss.lm_tokens == 0
    torch.testing.assert_close(loss.total, -torch.nn.functional.logsigmoid(r_chosen - r_rejected).mean())
    loss.total.backward()
    assert model.score_head.weight.grad.abs().sum() > 0

    sampler = make_sampler(RewardConfig(max_pairs=4, min_pairs=1), pairs, Dist())
    metrics = score_heldout(model, pairs, sampler, tokenizer.pad_token_id, 0.0, Dist()).metrics(0.95)
    assert "eval/lm_loss" not in metrics and metrics["eval/loss"] == metrics["eval/pairwise_loss"]


def test_last_token_pooling_is_the_same_for_left_and_right_padding(tokenizer):
    model = tiny_reward_model(tokenizer).eval()
    sequences = [[5, 9, 17, 33, 8], [12, 7], [40, 41, 42, 43, 44, 45, 46], [3]]
    width, pad = max(map(len, sequences)), tokenizer.pad_token_id

    def padded(left: bool):
        ids = torch.tensor([[pad] * (width - len(s)) + s if left else s + [pad] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) if left else [1] * len(s) + [0] * (width - len(s))
                             for s in sequences])
        return ids, mask

    (right_ids, right_mask), (left_ids, left_mask) = padded(left=False), padded(left=True)
    assert last_token_index(right_mask).tolist() == [4, 1, 6, 0]
    assert last_token_index(left_mask).tolist() == [6, 6, 6, 6]
    with torch.no_grad():
        right, _ = model(right_ids, right_mask)
        left, _ = model(left_ids, left_mask)
        alone = torch.cat([model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in sequences])
    torch.testing.assert_close(left, right, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=1e-5)


def test_cut_answer_of_a_pair_gets_no_eos(tokenizer):
    """The RM reads its score at the last token: a cut answer ending in EOS would score as finished."""
    row, eos = synthetic_pairs(1, seed=3)[0], tokenizer.eos_token_id
    whole = encode_pairs(tokenizer, [row], max_seq_len=256, max_response_len=64)[0]
    cut = encode_pairs(tokenizer, [row], max_seq_len=256, max_response_len=3)[0]
    assert whole.chosen_ids[-1] == whole.rejected_ids[-1] == eos
    assert eos not in cut.chosen_ids and eos not in cut.rejected_ids
    assert cut.chosen_ids == whole.chosen_ids[: len(cut.chosen_ids)]  # the prompt and the answer's first tokens
    assert cut.rejected_ids == whole.rejected_ids[: len(cut.rejected_ids)]
    assert [label for label in cut.chosen_labels if label != -100] == cut.chosen_ids[-3:]


def test_a_tiny_reward_model_learns_a_synthetic_preference(tokenizer, tmp_path):
    rm = RewardConfig(lr=3e-3, warmup_ratio=0.05, epochs=2, token_budget=3000, min_pairs=4, max_pairs=64, seed=0)
    train = encode_pairs(tokenizer, synthetic_pairs(256, seed=1), rm.max_seq_len, rm.max_response_len)
    heldout = encode_pairs(tokenizer, synthetic_pairs(64, seed=2), rm.max_seq_len, rm.max_response_len)
    model, dist, pad = tiny_reward_model(tokenizer), Dist(), tokenizer.pad_token_id
    sampler, heldout_sampler = make_sampler(rm, train, dist), make_sampler(rm, heldout, dist)
    total_steps = sampler.steps_per_epoch * rm.epochs
    optimizer = torch.optim.AdamW(model.parameters(), lr=rm.lr, betas=rm.adam_betas)
    engine = PlainEngine(model, optimizer, cosine_with_warmup(optimizer, int(rm.warmup_ratio * total_steps), total_steps),
                         grad_accum_steps=1, max_grad_norm=rm.max_grad_norm)
    before = score_heldout(model, heldout, heldout_sampler, pad, rm.beta_rm, dist).metrics(0.95)
    engine.train()
    for epoch in range(rm.epochs):
        for indices in sampler.batches(epoch):
            loss, _, _ = forward_pairs(engine, pair_batch([train[i] for i in indices], pad, "cpu"), len(indices), rm.beta_rm)
            engine.backward(loss.total)
            engine.step()
    after = score_heldout(model, heldout, heldout_sampler, pad, rm.beta_rm, dist).metrics(0.95)
    assert after["eval/accuracy"] >= 0.9 > before["eval/accuracy"]
    assert after["eval/lm_loss"] < before["eval/lm_loss"]  # the LM head learns the answers too

    # Saved and loaded back, the model gives the same scores and keeps its score statistics.
    model.score_mean, model.score_std = after["eval/score_mean"], after["eval/score_std"]
    save_reward_model(model, tokenizer, tmp_path, {"heldout_accuracy": after["eval/accuracy"]})
    loaded = load_reward_model(tmp_path, ModelConfig())
    assert (loaded.score_mean, loaded.score_std) == (model.score_mean, model.score_std)
    assert score_heldout(loaded, heldout, heldout_sampler, pad, rm.beta_rm, dist).metrics(0.95) == pytest.approx(after, abs=1e-5)
