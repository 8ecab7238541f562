"""C-Eval val by the official C-Eval protocol: the official prompt, 0- or k-shot with the
subject's first k dev exemplars; the answer is the argmax of the next-token log-probability over
A/B/C/D (the letters as tokenised after "答案："); accuracy per subject, per category (the mean of
its subjects, as C-Eval's leaderboard) and overall (the mean of all subjects). A prompt longer than
the cap (by default the model's context) keeps fewer exemplars; each answer records how many."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from stages.compute.loading import DataError, DataFiles, data_dir, hub_files, read_records, resolve_local
from stages.compute.models import last_hidden_state
from stages.compute.ppo.sampling import left_pad
from stages.leaves.config import DataConfig

LETTERS = "ABCD"
CATEGORIES = ("STEM", "Social Science", "Humanities", "Other")

# The official subject → (Chinese name used in the prompt, category) table (C-Eval's subject_mapping.json).
SUBJECTS: dict[str, tuple[str, str]] = {
    "computer_network": ("计算机网络", "STEM"),
    "operating_system": ("操作系统", "STEM"),
    "computer_architecture": ("计算机组成", "STEM"),
    "college_programming": ("大学编程", "STEM"),
    "college_physics": ("大学物理", "STEM"),
    "college_chemistry": ("大学化学", "STEM"),
    "advanced_mathematics": ("高等数学", "STEM"),
    "probability_and_statistics": ("概率统计", "STEM"),
    "discrete_mathematics": ("离散数学", "STEM"),
    "electrical_engineer": ("注册电气工程师", "STEM"),
    "metrology_engineer": ("注册计量师", "STEM"),
    "high_school_mathematics": ("高中数学", "STEM"),
    "high_school_physics": ("高中物理", "STEM"),
    "high_school_chemistry": ("高中化学", "STEM"),
    "high_school_biology": ("高中生物", "STEM"),
    "middle_school_mathematics": ("初中数学", "STEM"),
    "middle_school_biology": ("初中生物", "STEM"),
    "middle_school_physics": ("初中物理", "STEM"),
    "middle_school_chemistry": ("初中化学", "STEM"),
    "veterinary_medicine": ("兽医学", "STEM"),
    "college_economics": ("大学经济学", "Social Science"),
    "business_administration": ("工商管理", "Social Science"),
    "marxism": ("马克思主义基本原理", "Social Science"),
    "mao_zedong_thought": ("毛泽东思想和中国特色社会主义理论体系概论", "Social Science"),
    "education_science": ("教育学", "Social Science"),
    "teacher_qualification": ("教师资格", "Social Science"),
    "high_school_politics": ("高中政治", "Social Science"),
    "high_school_geography": ("高中地理", "Social Science"),
    "middle_school_politics": ("初中政治", "Social Science"),
    "middle_school_geography": ("初中地理", "Social Science"),
    "modern_chinese_history": ("近代史纲要", "Humanities"),
    "ideological_and_moral_cultivation": ("思想道德修养与法律基础", "Humanities"),
    "logic": ("逻辑学", "Humanities"),
    "law": ("法学", "Humanities"),
    "chinese_language_and_literature": ("中国语言文学", "Humanities"),
    "art_studies": ("艺术学", "Humanities"),
    "professional_tour_guide": ("导游资格", "Humanities"),
    "legal_professional": ("法律职业资格", "Humanities"),
    "high_school_chinese": ("高中语文", "Humanities"),
    "high_school_history": ("高中历史", "Humanities"),
    "middle_school_history": ("初中历史", "Humanities"),
    "civil_servant": ("公务员", "Other"),
    "sports_science": ("体育学", "Other"),
    "plant_protection": ("植物保护", "Other"),
    "basic_medicine": ("基础医学", "Other"),
    "clinical_medicine": ("临床医学", "Other"),
    "urban_and_rural_planner": ("注册城乡规划师", "Other"),
    "accountant": ("注册会计师", "Other"),
    "fire_engineer": ("注册消防工程师", "Other"),
    "environmental_impact_assessment_engineer": ("环境影响评价工程师", "Other"),
    "tax_accountant": ("税务师", "Other"),
    "physician": ("医师资格", "Other"),
}


@dataclass
class Question:
    subject: str
    row: int  # line in the source CSV (row 1 is the header)
    question: str
    choices: tuple[str, str, str, str]
    answer: str


def _questions(subject: str, source: str, records: list[dict]) -> list[Question]:
    out = []
    for record in records:
        missing = [c for c in ("question", *LETTERS, "answer") if c not in record]
        if missing:
            raise DataError(source, record["_row"], f"missing column(s) {', '.join(missing)}")
        answer = str(record["answer"]).strip()
        if answer not in LETTERS:
            raise DataError(source, record["_row"], f"answer {answer!r} is not one of A, B, C, D")
        out.append(Question(subject, record["_row"], str(record["question"]),
                            tuple(str(record[letter]) for letter in LETTERS), answer))
    return out


def _read_split(folder: Path, subject: str, split: str, cfg: DataConfig) -> list[Question]:
    path = folder / split / f"{subject}_{split}.csv"
    if not path.exists():
        raise DataError(str(path), None, "file not found")
    source, records = read_records(str(path), cfg)
    return _questions(subject, source, records)


def locate(cfg: DataConfig, subjects: list[str], splits: tuple[str, ...]) -> DataFiles:
    """The CSVs of `subjects` × `splits` (`<split>/<subject>_<split>.csv`, C-Eval's layout on the hub
    and in a local folder): `cfg.ceval` is a local folder, or a hub id read from the offline mirror
    or the hub (only these files are downloaded)."""
    paths = [f"{split}/{subject}_{split}.csv" for split in splits for subject in subjects]
    folder = resolve_local(cfg.ceval, data_dir(cfg))
    if folder is not None:
        return DataFiles(str(folder.resolve()), folder, tuple(p for p in paths if (folder / p).exists()))
    return hub_files(cfg.ceval, paths, cfg, f"splits {', '.join(splits)} of {len(subjects)} subjects")


def load(cfg: DataConfig, subjects: list[str] | None = None, max_per_subject: int | None = None,
         with_dev: bool = True) -> tuple[dict[str, list[Question]], dict[str, list[Question]]]:
    """(val questions, dev exemplars) per subject, from `cfg.ceval` (a folder or a hub data set)."""
    names = subjects or list(SUBJECTS)
    unknown = [s for s in names if s not in SUBJECTS]
    if unknown:
        raise ValueError(f"unknown C-Eval subjects {unknown}; subjects: {', '.join(SUBJECTS)}")
    folder = locate(cfg, names, ("val", "dev") if with_dev else ("val",)).folder
    val = {s: _read_split(folder, s, "val", cfg)[:max_per_subject] for s in names}
    dev = {s: _read_split(folder, s, "dev", cfg) for s in names} if with_dev else {}
    return val, dev


def _format(q: Question, with_answer: bool) -> str:
    text = q.question + "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, q.choices)) + "\n答案："
    return f"{text}{q.answer}\n\n" if with_answer else text


def build_prompt(q: Question, exemplars: list[Question]) -> str:
    """The official C-Eval prompt: a header naming the exam, the exemplars with their answers,
    the question; the next token is the answer letter."""
    header = f"以下是中国关于{SUBJECTS[q.subject][0]}考试的单项选择题，请选出其中的正确答案。\n\n"
    return header + "".join(_format(e, True) for e in exemplars) + _format(q, False)


def letter_ids(tokenizer) -> list[int]:
    """The answer letters' token ids as they follow the prompt's "答案：": the last id of "：A" and
    so on. A SentencePiece tokenizer gives a bare "A" a dummy prefix ("▁A"), a token that never
    follows "：" and so is not the answer the model would write."""
    cue = tokenizer("：", add_special_tokens=False)["input_ids"]
    ids = [tokenizer("：" + letter, add_special_tokens=False)["input_ids"] for letter in LETTERS]
    if any(i[:-1] != cue for i in ids) or len({i[-1] for i in ids}) != 4:
        raise ValueError(f"C-Eval needs A, B, C, D to be one token each after '：' ({cue}); "
                         f"this tokenizer gives {ids}")
    return [i[-1] for i in ids]


def context_length(model, tokenizer) -> int:
    """The model's context, the default prompt cap: its config's `max_position_embeddings`, else the
    tokenizer's `model_max_length` unless that is transformers' "no limit" placeholder."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions:
        return int(positions)
    if tokenizer.model_max_length < 10**9:
        return int(tokenizer.model_max_length)
    raise ValueError("neither the model's config nor its tokenizer states a context length; set eval.ceval.max_seq_len")


def encode(tokenizer, q: Question, exemplars: list[Question], max_seq_len: int) -> tuple[list[int], int]:
    """(prompt token ids, exemplars kept): the first k exemplars for the largest k whose prompt
    fits, so a prompt that lost exemplars is exactly the prompt of fewer shots; when even the 0-shot
    prompt is too long, its oldest tokens are cut (the question's end and the answer cue stay)."""
    for k in range(len(exemplars), -1, -1):
        ids = tokenizer(build_prompt(q, exemplars[:k]), add_special_tokens=False)["input_ids"]
        if len(ids) <= max_seq_len:
            return ids, k
    return ids[-max_seq_len:], 0


@torch.no_grad()
def answer_logprobs(model, prompts: list[list[int]], choice_ids: list[int], pad_id: int, batch_size: int) -> torch.Tensor:
    """[N, 4] next-token log-probabilities of A/B/C/D after each prompt. Batches are formed over
    prompts sorted by length (little padding); the LM head runs on the last position only."""
    was_training = model.training
    model.eval()
    out = torch.empty(len(prompts), len(choice_ids))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        ids, mask = left_pad([prompts[i] for i in rows], pad_id, model.device)
        hidden = last_hidden_state(model.base_model, ids, mask, from_position=ids.shape[1] - 1)
        logits = model.get_output_embeddings()(hidden[:, -1]).float()
        out[rows] = torch.log_softmax(logits, dim=-1)[:, choice_ids].cpu()
    model.train(was_training)
    return out


def score(model, tokenizer, val: dict[str, list[Question]], dev: dict[str, list[Question]], shots: int,
          batch_size: int, max_seq_len: int | None = None) -> pd.DataFrame:
    """One row per question: subject, category, row, answer, predicted letter, its log-probability,
    the prompt's length and the exemplars it kept (fewer than `shots` where the prompt had to fit
    `max_seq_len`; None: the model's context)."""
    questions = [q for subject in val for q in val[subject]]
    cap = context_length(model, tokenizer) if max_seq_len is None else max_seq_len
    encoded = [encode(tokenizer, q, dev.get(q.subject, [])[:shots], cap) for q in questions]
    prompts = [ids for ids, _ in encoded]
    logprobs = answer_logprobs(model, prompts, letter_ids(tokenizer), tokenizer.pad_token_id, batch_size)
    best = logprobs.argmax(dim=1)
    return pd.DataFrame({
        "subject": [q.subject for q in questions],
        "category": [SUBJECTS[q.subject][1] for q in questions],
        "row": [q.row for q in questions],
        "answer": [q.answer for q in questions],
        "predicted": [LETTERS[i] for i in best.tolist()],
        "logprob": logprobs.gather(1, best[:, None]).squeeze(1).tolist(),
        "prompt_tokens": [len(p) for p in prompts],
        "exemplars": [k for _, k in encoded],
    })


def accuracy(answers: pd.DataFrame) -> dict[str, dict[str, float]]:
    """{"subject": {name: acc}, "category": {name: mean over its subjects}, "overall": {"all": mean over subjects}}."""
    per_subject = (answers["predicted"] == answers["answer"]).groupby(answers["subject"]).mean()
    category = per_subject.groupby(per_subject.index.map(lambda s: SUBJECTS[s][1])).mean()
    return {"subject": per_subject.to_dict(), "category": category.to_dict(), "overall": {"all": float(per_subject.mean())}}
