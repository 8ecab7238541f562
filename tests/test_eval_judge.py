"""Pairwise judging end to end over HTTP, against an OpenAI-compatible server on loopback that
prefers the shorter answer: position swap, ties, 429 and 5xx retries, a timeout, unparseable
verdicts (retried once, then counted), the on-disk cache (a second run makes no HTTP call), key
handling; and the local chat judge on the tiny model."""

from __future__ import annotations

import pytest
import torch

from eval_helpers import SECRET, JudgeServer, tiny_lm
from stages.leaves.config import LocalJudgeConfig, OpenAIJudgeConfig, RewardModelJudgeConfig
from stages.leaves.rendering import render_prompt, render_response
from stages.compute.evaluate.judge import (
                                           JudgeError, LocalJudge, OpenAIJudge, Pair, RewardModelJudge, judge_pairs, parse_verdict, tally,
                                           )
from stages.compute.reward.model import RewardModel

KEY_ENV = "RLHF_TEST_JUDGE_KEY"
MESSAGES = [{"role": "user", "content": "How do I bake bread?"}]
# (policy answer, SFT answer, expected verdict)
CASES = [
    ("Knead, rise, bake.", "Mix flour, water, yeast and salt; knead; let it rise; bake at 230 C.", "win"),
    ("Mix flour, water, yeast and salt; knead; let it rise; bake at 230 C.", "Knead, rise, bake.", "lose"),
    ("Knead it well.", "Bake it slowly", "tie"),  # equal lengths: [[C]] in both orders
    ("FIRST: short.", "FIRST: a much longer answer.", "tie"),  # always [[A]]: the orders disagree
    ("RATE short.", "RATE a much longer answer.", "win"),  # 429 first, then judged
    ("CRASH: a much longer answer.", "CRASH: short.", "lose"),  # 500 first
    ("SLOW short.", "SLOW a much longer answer.", "win"),  # times out first
    ("GARBLE short.", "GARBLE a much longer answer.", "win"),  # no verdict, the retry has one
    ("NEVER short.", "NEVER a much longer answer.", "invalid"),  # no verdict twice: counted, not guessed
]


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)


def _judge(server, tmp_path, **overrides) -> OpenAIJudge:
    settings = {"timeout_s": 0.5, "max_retries": 2, "backoff_s": 0.01, **overrides}
    cfg = OpenAIJudgeConfig(base_url=server.base_url, api_key_env=KEY_ENV, **settings)
    return OpenAIJudge(cfg, tmp_path / "cache")


def test_parse_verdict():
    assert parse_verdict("A is clearer.\n[[A]]") == "A"
    assert parse_verdict("[[C]]") == "tie" and parse_verdict(" B. ") == "B"
    assert parse_verdict("[[A]] or maybe [[B]]") is None  # two verdicts: none
    assert parse_verdict("Both are fine.") is None and parse_verdict("") is None


def test_judge_over_http_swaps_retries_counts_and_caches(key, tmp_path):
    pairs = [Pair(row=10 + i, messages=MESSAGES, policy=p, sft=s) for i, (p, s, _) in enumerate(CASES)]
    with JudgeServer() as server:
        judged = judge_pairs(_judge(server, tmp_path), pairs)
        assert judged["verdict"].tolist() == [c[2] for c in CASES]
        assert judged["row"].tolist() == list(range(10, 19)) and (judged["judge"] == "openai").all()
        first = judged.set_index("row")
        assert (first.loc[10, "policy_first"], first.loc[10, "policy_second"]) == ("win", "win")  # A, then B
        assert (first.loc[13, "policy_first"], first.loc[13, "policy_second"]) == ("win", "lose")
        assert first.loc[17, "retried"] and first.loc[18, "retried"] and not first.loc[10, "retried"]
        assert tally(judged)["invalid"] == 1 and tally(judged)["n"] == 9
        # 9 pairs × 2 orders, less 2 from the cache (the first two pairs are each other swapped),
        # plus per order: a 429, a 500, a timeout, a retried garble, a retried never.
        assert server.calls == 16 + 2 * 5
        assert server.statuses[429] == 2 and server.statuses[500] == 2 and server.statuses["timeout"] == 2

        calls = server.calls
        again = _judge(server, tmp_path)
        assert judge_pairs(again, pairs)["verdict"].tolist() == judged["verdict"].tolist()
        assert server.calls == calls and again.http_calls == 0 and again.cache_hits == 18 + 4
    cached = list((tmp_path / "cache").rglob("*.json"))
    assert cached and all(SECRET not in path.read_text() for path in cached)


def test_a_new_judge_model_is_asked_again(key, tmp_path):
    pairs = [Pair(row=1, messages=MESSAGES, policy=CASES[0][0], sft=CASES[0][1])]
    with JudgeServer() as server:
        judge_pairs(_judge(server, tmp_path), pairs)
        judge_pairs(_judge(server, tmp_path, model="gpt-4o"), pairs)  # another judge: another cache key
        assert server.calls == 4


def test_bad_key_fails_at_once_and_never_shows_the_key(tmp_path, monkeypatch):
    pairs = [Pair(row=1, messages=MESSAGES, policy="a", sft="b")]
    with JudgeServer(key="the-right-key") as server:
        monkeypatch.delenv(KEY_ENV, raising=False)
        with pytest.raises(JudgeError, match=f"set the environment variable {KEY_ENV}"):
            judge_pairs(_judge(server, tmp_path), pairs)
        monkeypatch.setenv(KEY_ENV, SECRET)
        with pytest.raises(JudgeError, match="HTTP 401") as err:
            judge_pairs(_judge(server, tmp_path), pairs)
        assert SECRET not in str(err.value) and "***" in str(err.value)  # the server echoed it
        assert server.statuses[401] <= 4  # no retries on 4xx: one call per conversation at most


def test_gives_up_after_max_retries(key, tmp_path):
    pairs = [Pair(row=1, messages=MESSAGES, policy="STALL a", sft="STALL bb")]
    with JudgeServer(slow_s=1.0) as server:
        with pytest.raises(JudgeError, match="ReadTimeout"):
            judge_pairs(_judge(server, tmp_path, max_retries=1), pairs)
        assert server.statuses["timeout"] == 2  # the first order: a try and one retry, then it gives up


def test_local_judge_runs_on_the_tiny_model():
    model, tokenizer = tiny_lm()
    judge = LocalJudge(LocalJudgeConfig(max_new_tokens=6, max_prompt_len=384), model, tokenizer, batch_size=4)
    pairs = [Pair(row=1, messages=MESSAGES, policy="Knead, rise, bake.", sft="Buy some."),
             Pair(row=2, messages=MESSAGES, policy="No idea.", sft="Flour, water, heat.")]
    judged = judge_pairs(judge, pairs)
    assert len(judged) == 2 and set(judged["verdict"]) <= {"win", "tie", "lose", "invalid"}
    assert all(isinstance(r, str) for r in judged["reply_policy_first"])
    # A random model writes no verdict: each such pair was asked again, then counted as invalid.
    invalid = judged[judged["verdict"] == "invalid"]
    assert invalid["retried"].all()


def test_reward_model_judge_scores_a_cut_response_without_eos():
    """The RM reads its score at the last token: a response cut at max_new_tokens never ended, and
    with an EOS appended it would score as a finished answer."""
    lm, tokenizer = tiny_lm()
    torch.manual_seed(0)
    reward_model = RewardModel(lm).eval()
    judge = RewardModelJudge(RewardModelJudgeConfig(), reward_model, tokenizer, max_seq_len=256, max_response_len=64,
                             batch_size=4)
    answer = "Knead, rise, bake."
    prompt = tokenizer(render_prompt(tokenizer, MESSAGES), add_special_tokens=False)["input_ids"]
    text = tokenizer(render_response(tokenizer, answer), add_special_tokens=False)["input_ids"]

    def score(ids):
        with torch.no_grad():
            return reward_model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0].item()

    judged = judge_pairs(judge, [Pair(row=1, messages=MESSAGES, policy=answer, sft=answer, policy_ended=False)])
    assert judged["score_policy"][0] == pytest.approx(score(prompt + text), abs=1e-5)
    assert judged["score_sft"][0] == pytest.approx(score(prompt + text + [tokenizer.eos_token_id]), abs=1e-5)


def _control(chosen: str, rejected: str, n: int) -> list[Pair]:
    """n labelled pairs: the chosen answer in the policy's place, as stages/compute/evaluate/quality.py builds them."""
    return [Pair(row=100 + i, messages=[{"role": "user", "content": f"Question {i}?"}], policy=f"{chosen} {i}",
                 sft=f"{rejected} {i}") for i in range(n)]


def test_a_chat_judge_at_chance_on_labelled_pairs_cannot_decide_and_one_that_tells_them_apart_can(key, tmp_path):
    """The loopback judge prefers the shorter answer: where the chosen answer is the shorter, it is
    right on all 24 control pairs (Wilson's interval above 0.5); a judge that always names the first
    position ties every pair in the two orders, 0.5, and its interval includes chance."""
    from stages.compute.evaluate import quality

    with JudgeServer() as server:
        right = quality.measured(_judge(server, tmp_path), _control("Short.", "A much longer answer.", 24), 0.95)
        biased = quality.measured(_judge(server, tmp_path), _control("FIRST short.", "FIRST a longer one.", 24), 0.95)
    assert right.accuracy.estimate == 1.0 and right.accuracy.low > 0.8 and right.can_judge
    assert biased.accuracy.estimate == 0.5 and biased.accuracy.low < 0.5 < biased.accuracy.high
    assert not biased.can_judge
    low, high = biased.accuracy.low, biased.accuracy.high
    assert biased.cannot_decide() == (f"cannot decide: openai's accuracy 0.500 [{low:.3f}, {high:.3f}] on 24 held-out "
                                      f"pairs includes chance")
    assert biased.metrics("eval/judge/openai") == {
        "eval/judge/openai/can_judge": 0.0, "eval/judge/openai/accuracy": 0.5, "eval/judge/openai/accuracy_ci_low": low,
        "eval/judge/openai/accuracy_ci_high": high, "eval/judge/openai/accuracy_pairs": 24.0}


def test_a_reward_models_recorded_accuracy_is_read_from_its_version_tags():
    """The reward stage's tags: accuracy, its interval and the pair count (the demo's RM: 19 of 32);
    without the interval bounds Wilson's at the level asked; without the pair count none at all."""
    from stages.compute.evaluate import quality

    tags = {"rlhf.heldout_accuracy": "0.5938", "rlhf.heldout_accuracy_ci_low": "0.4226",
            "rlhf.heldout_accuracy_ci_high": "0.7448", "rlhf.heldout_pairs": "32"}
    demo = quality.recorded("reward_model", tags, 0.95)
    assert (demo.accuracy.estimate, demo.accuracy.low, demo.accuracy.high, demo.accuracy.n) == (0.5938, 0.4226, 0.7448, 32)
    assert not demo.can_judge
    assert demo.cannot_decide() == ("cannot decide: reward_model's accuracy 0.594 [0.423, 0.745] on 32 held-out pairs "
                                    "includes chance")
    wilson = quality.recorded("reward_model", {"rlhf.heldout_accuracy": "0.5938", "rlhf.heldout_pairs": "32"}, 0.95)
    assert wilson.accuracy.low == pytest.approx(0.4226, abs=1e-3) and wilson.accuracy.high == pytest.approx(0.7448, abs=1e-3)
    assert quality.recorded("reward_model", {"rlhf.heldout_accuracy": "0.5938"}, 0.95) is None
