"""C-Eval on the real CSVs of the shared data folder: loading, the official prompts, the batched
scorer on the tiny model (checked against one unpadded forward per question) and the per
subject / category / overall aggregation (checked against a count by hand)."""

from __future__ import annotations

import pytest
import torch

from eval_helpers import tiny_lm
from stages.config import load_config
from stages.evaluate import ceval
from stages.sources import DataError, data_dir, resolve_local

SUBJECTS = ["computer_network", "law", "physician", "middle_school_politics"]


@pytest.fixture(scope="module")
def data_cfg(hh_file):
    cfg = load_config("tiny").data
    if resolve_local(cfg.ceval, data_dir(cfg)) is None:
        pytest.skip("C-Eval CSVs not found in the data folder")
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
    full = len(ceval.encode(tokenizer, q, dev["computer_network"], 100_000))
    fitted = ceval.encode(tokenizer, q, dev["computer_network"], full - 1)  # one exemplar fewer fits
    assert fitted == tokenizer(ceval.build_prompt(q, dev["computer_network"][:4]), add_special_tokens=False)["input_ids"]
    assert len(ceval.encode(tokenizer, q, [], 16)) == 16  # the question's end (the answer cue) stays


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
        ids = ceval.encode(tokenizer, questions[i], dev[questions[i].subject][:shots], 512)
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
