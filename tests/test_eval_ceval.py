"""C-Eval on the real CSVs of the hub mirror the tests read: loading, the official prompts (pinned byte
for byte), the answer letters' token ids, the prompt cap (the model's context) and the exemplars
each question got, the batched scorer on the tiny model (checked against one unpadded forward per
question), the per subject / category / overall aggregation (checked against a count by hand) and
the report's flag on a k-shot score where exemplars were dropped."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import BloomConfig, BloomForCausalLM, PreTrainedTokenizerFast

from eval_helpers import tiny_lm
from stages.compute import loading
from stages.compute.evaluate import ceval, report
from stages.compute.loading import DataError, data_dir
from stages.leaves.config import CEvalConfig
from stages.orchestration.config_loading import load_config

SUBJECTS = ["computer_network", "law", "physician", "middle_school_politics"]


@pytest.fixture(scope="module")
def data_cfg(hh_file):
    cfg = load_config("tiny").data
    if not (data_dir(cfg) / "datasets" / cfg.ceval).is_dir():
        pytest.skip(f"C-Eval ({cfg.ceval}) not found in the hub mirror {data_dir(cfg)}")
    return cfg


def test_loads_every_subject_of_the_real_csvs(data_cfg):
    val, dev = ceval.load(data_cfg)
    assert len(val) == 52 and sum(len(q) for q in val.values()) == 1346
    assert all(len(exemplars) == 5 for exemplars in dev.values())
    categories = [ceval.SUBJECTS[s][1] for s in val]
    assert [categories.count(c) for c in ceval.CATEGORIES] == [20, 10, 11, 11]
    first = val["computer_network"][0]
    assert first.row == 2 and first.answer == "C" and first.choices == ("1", "2", "3", "4")  # CSV line 2
    assert first.question.startswith("使用位填充方法")
    assert all(q.answer in "ABCD" for qs in val.values() for q in qs)


def test_subject_selection_cap_and_errors(data_cfg, tmp_path):
    val, dev = ceval.load(data_cfg, ["law", "logic"], max_per_subject=3, with_dev=False)
    assert list(val) == ["law", "logic"] and [len(q) for q in val.values()] == [3, 3] and dev == {}
    with pytest.raises(ValueError, match="unknown C-Eval subjects"):
        ceval.load(data_cfg, ["astrology"])
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "law_val.csv").write_text("id,question,A,B,C,D,answer\n0,q,a,b,c,d,E\n", encoding="utf-8")
    broken = data_cfg.model_copy(update={"ceval": str(tmp_path)})
    with pytest.raises(DataError, match=r"law_val.csv, row 2: answer 'E' is not one of A, B, C, D"):
        ceval.load(broken, ["law"], with_dev=False)


def test_prompts_follow_the_official_format(data_cfg):
    val, dev = ceval.load(data_cfg, ["computer_network"], max_per_subject=1)
    q = val["computer_network"][0]
    zero = ceval.build_prompt(q, [])
    assert zero == ("以下是中国关于计算机网络考试的单项选择题，请选出其中的正确答案。\n\n"
                    f"{q.question}\nA. 1\nB. 2\nC. 3\nD. 4\n答案：")
    five = ceval.build_prompt(q, dev["computer_network"])
    assert five.endswith(zero.split("\n\n", 1)[1]) and five.count("答案：") == 6
    assert f"答案：{dev['computer_network'][0].answer}\n\n" in five
    _, tokenizer = tiny_lm()
    full, kept = ceval.encode(tokenizer, q, dev["computer_network"], 100_000)
    assert kept == 5
    fitted, kept = ceval.encode(tokenizer, q, dev["computer_network"], len(full) - 1)  # the first four fit
    assert fitted == tokenizer(ceval.build_prompt(q, dev["computer_network"][:4]), add_special_tokens=False)["input_ids"]
    assert kept == 4
    cut, kept = ceval.encode(tokenizer, q, [], 16)
    assert len(cut) == 16 and kept == 0  # the question's end (the answer cue) stays


@pytest.mark.parametrize("shots", [0, 5])
def test_scorer_answers_every_question_and_aggregates_per_subject(data_cfg, shots):
    model, tokenizer = tiny_lm()
    val, dev = ceval.load(data_cfg, SUBJECTS, max_per_subject=6)
    answers = ceval.score(model, tokenizer, val, dev, shots, batch_size=5, max_seq_len=512)
    assert len(answers) == 24 and set(answers["predicted"]) <= set("ABCD")
    assert answers["logprob"].le(0).all() and answers["prompt_tokens"].le(512).all()

    # Batched, left-padded and sorted by length = one unpadded forward per question.
    letters = ceval.letter_ids(tokenizer)
    questions = [q for s in SUBJECTS for q in val[s]]
    for i in (0, 7, 23):
        ids, _ = ceval.encode(tokenizer, questions[i], dev[questions[i].subject][:shots], 512)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        alone = torch.log_softmax(logits.float(), -1)[letters]
        assert answers["predicted"][i] == "ABCD"[int(alone.argmax())]
        assert answers["logprob"][i] == pytest.approx(float(alone.max()), abs=1e-4)

    # Aggregation against a count by hand.
    correct: dict[str, int] = {}
    for subject, predicted, answer in zip(answers["subject"], answers["predicted"], answers["answer"]):
        correct[subject] = correct.get(subject, 0) + (predicted == answer)
    by_hand = {s: correct[s] / 6 for s in SUBJECTS}
    acc = ceval.accuracy(answers)
    assert acc["subject"] == pytest.approx(by_hand)
    assert acc["category"] == pytest.approx({"STEM": by_hand["computer_network"],
                                             "Humanities": by_hand["law"], "Other": by_hand["physician"],
                                             "Social Science": by_hand["middle_school_politics"]})
    assert acc["overall"]["all"] == pytest.approx(sum(by_hand.values()) / 4)


def _tiny_lm_with_context(positions: int):
    """The tiny preset's model (same BPE tokenizer, same seed) with `positions` positions."""
    cfg = load_config("tiny")
    _, records = loading.read_records(cfg.data.pairs, cfg.data)
    init = cfg.model.random_init.model_copy(update={"max_position_embeddings": positions})
    model_cfg = cfg.model.model_copy(update={"random_init": init})
    model_dir = loading.materialise_model(model_cfg, corpus=lambda: [r["chosen"] for r in records[:400]])
    tokenizer = loading.load_tokenizer(model_dir, model_cfg)
    model = loading.load_model(model_dir, model_cfg).eval()
    loading.align_pad_token(model, tokenizer)
    return model, tokenizer


def _sentencepiece_style_tokenizer():
    """A Unigram tokenizer with SentencePiece's dummy prefix: a bare "A" is the piece "▁A", while
    after "：" (as after the prompt's "答案：") the letter is the plain piece "A"."""
    vocab = [("<unk>", 0.0), ("<pad>", 0.0), ("▁", -3.0), ("▁：", -1.0), ("：", -2.0), ("答", -2.0), ("案", -2.0)]
    vocab += [(f"▁{letter}", -1.0) for letter in "ABCD"] + [(letter, -2.0) for letter in "ABCD"]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


def _prompt_len(tokenizer, q, exemplars) -> int:
    return len(tokenizer(ceval.build_prompt(q, exemplars), add_special_tokens=False)["input_ids"])


def test_ceval_prompt_format_pinned(data_cfg):
    """The official C-Eval template, byte for byte, at 0 and 1 shot: lm-evaluation-harness 0.4.13
    given this template builds identical prompts, so a change here breaks that agreement."""
    val, dev = ceval.load(data_cfg, ["computer_network"], max_per_subject=1)
    q, exemplar = val["computer_network"][0], dev["computer_network"][0]
    header = "以下是中国关于计算机网络考试的单项选择题，请选出其中的正确答案。\n\n"
    question = ("使用位填充方法，以01111110为位首flag，数据为011011111111111111110010，求问传送时要添加几个0____\n"
                "A. 1\nB. 2\nC. 3\nD. 4\n答案：")
    shot = "下列设备属于资源子网的是____。\nA. 计算机软件\nB. 网桥\nC. 交换机\nD. 路由器\n答案：A\n\n"
    assert ceval.build_prompt(q, []) == header + question
    assert ceval.build_prompt(q, [exemplar]) == header + shot + question


def test_ceval_letter_token_follows_fullwidth_colon(data_cfg):
    """The answer letter is scored as the token that follows "答案：", not a bare letter's token
    (which a SentencePiece tokenizer gives a dummy prefix, "▁A", never seen after "：")."""
    tokenizer = _sentencepiece_style_tokenizer()
    assert tokenizer("A", add_special_tokens=False)["input_ids"] == tokenizer.convert_tokens_to_ids(["▁A"])
    letters = ceval.letter_ids(tokenizer)
    assert letters == tokenizer.convert_tokens_to_ids(list("ABCD"))
    val, _ = ceval.load(data_cfg, ["computer_network"], max_per_subject=1)
    prompt = ceval.build_prompt(val["computer_network"][0], [])
    cue = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for letter, letter_id in zip("ABCD", letters):
        assert tokenizer(prompt + letter, add_special_tokens=False)["input_ids"] == cue + [letter_id]
    _, tiny = tiny_lm()  # byte-level BPE: the same ids either way
    assert ceval.letter_ids(tiny) == [tiny(letter, add_special_tokens=False)["input_ids"][0] for letter in "ABCD"]


def test_ceval_five_shot_keeps_all_exemplars_within_model_context(data_cfg):
    """The default prompt cap is the model's context: 5-shot prompts longer than 1024 tokens but
    within the model's 4096 positions keep all five exemplars, uncut."""
    model, tokenizer = _tiny_lm_with_context(4096)
    val, dev = ceval.load(data_cfg, ["computer_network", "physician"], max_per_subject=2)
    answers = ceval.score(model, tokenizer, val, dev, 5, batch_size=4, max_seq_len=CEvalConfig().max_seq_len)
    full = [_prompt_len(tokenizer, q, dev[s]) for s in val for q in val[s]]
    assert min(full) > 1024 and max(full) <= 4096
    assert answers["prompt_tokens"].tolist() == full
    assert answers["exemplars"].tolist() == [5] * 4

    assert ceval.context_length(model, tokenizer) == 4096
    # A config naming no context (BLOOM): the tokenizer's, unless it is transformers' placeholder.
    bloom = BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=8, n_head=2, vocab_size=len(tokenizer)))
    with pytest.raises(ValueError, match="eval.ceval.max_seq_len"):
        ceval.context_length(bloom, tokenizer)  # model_max_length is 1e30 here
    sized = copy.deepcopy(tokenizer)
    sized.model_max_length = 2048
    assert ceval.context_length(bloom, sized) == 2048


def test_ceval_records_exemplars_used_per_question(data_cfg):
    """Each answer records how many exemplars its prompt kept: the first k that fit the cap."""
    model, tokenizer = tiny_lm()
    val, dev = ceval.load(data_cfg, ["computer_network", "physician"], max_per_subject=4)
    answers = ceval.score(model, tokenizer, val, dev, 5, batch_size=4, max_seq_len=1180)
    pairs = [(q, dev[s]) for s in val for q in val[s]]
    kept = [max(k for k in range(6) if _prompt_len(tokenizer, q, shots[:k]) <= 1180) for q, shots in pairs]
    assert 5 in kept and min(kept) < 5  # some fit whole, some lost exemplars
    assert answers["exemplars"].tolist() == kept
    assert answers["prompt_tokens"].tolist() == [_prompt_len(tokenizer, q, shots[:k]) for (q, shots), k in zip(pairs, kept)]


def _scored(data_cfg, max_seq_len: int) -> pd.DataFrame:
    model, tokenizer = tiny_lm()
    val, dev = ceval.load(data_cfg, ["computer_network", "physician"], max_per_subject=4)
    return pd.concat([ceval.score(model, tokenizer, val, dev, k, 4, max_seq_len).assign(model="sft", shots=k)
                      for k in (0, 5)], ignore_index=True)


def _reports(answers: pd.DataFrame) -> tuple[dict, str, str]:
    table = report.ceval_table({key: ceval.accuracy(group) for key, group in answers.groupby(["shots", "model"])})
    shortfall = report.exemplar_shortfall(answers)
    text = report.markdown(run_id="r", models={"sft": "models:/m/1"}, ceval=table, shortfall=shortfall,
                           judges=None, champion="no policy", questions_per_s=1.0)
    short = report.summary(run_id="r", report_uri="file:///r/report.md", ceval=table, shortfall=shortfall,
                           judges=None, champion="no policy")
    return report.ceval_metrics(table, shortfall), text, short


def test_ceval_flags_dropped_exemplars(data_cfg):
    """A k-shot score where any question got fewer than k exemplars says so, in the metrics (the
    count) and in the report and summary (a visible flag); a full k-shot score has no flag."""
    answers = _scored(data_cfg, 1180)
    dropped = int((answers[answers["shots"] == 5]["exemplars"] < 5).sum())
    assert 0 < dropped < 8
    metrics, text, short = _reports(answers)
    assert metrics["eval/ceval_5shot/exemplars_dropped/sft"] == dropped
    assert "eval/ceval_0shot/exemplars_dropped/sft" not in metrics  # nothing to drop at 0 shots
    flag = f"⚠ 5-shot sft: {dropped} of 8 questions got fewer than 5 exemplars"
    assert flag in text and flag in short and "0-shot sft:" not in text

    metrics, text, short = _reports(_scored(data_cfg, 100_000))
    assert metrics["eval/ceval_5shot/exemplars_dropped/sft"] == 0
    assert "⚠" not in text and "⚠" not in short


def test_ceval_report_labels_official_protocol(data_cfg):
    """The report and its summary name the protocol the C-Eval numbers follow."""
    _, text, short = _reports(_scored(data_cfg, 100_000))
    assert "official C-Eval protocol" in text and "official C-Eval protocol" in short
