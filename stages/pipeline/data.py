"""The data stage: preference rows in TRL's formats (or HH dialogues) to pairs, and seeded,
disjoint splits, written as JSONL files the training stages read (`read_jsonl`). Rendering a
prompt for a tokenizer and encoding an example are stages/leaves/rendering.py's, shared with the
engine, the reward server and the judges.

Every format becomes the same pair: `messages` (the prompt's user/assistant turns), `chosen` and
`rejected` (the two answers' text) and `prompt`, the prompt's turns in the HH form ending with an
open "\\n\\nAssistant:" (the key that keeps a prompt in one split). In an HH row both dialogues
share every turn but the last Assistant turn: the prompt is everything up to and including the
last "\\n\\nAssistant:", the answer what follows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

from stages.compute.loading import DataError, DataFiles, read_records, read_source
from stages.leaves.config import ConfigError, DataConfig, PipelineConfig
from stages.leaves.rendering import ASSISTANT, HUMAN, dialogue_text

if TYPE_CHECKING:
    import pandas as pd

_TURN = re.compile(r"\n\n(Human|Assistant):")
SPLITS = ("sft", "rm_train", "rm_eval", "ppo_prompts", "eval_prompts", "gold_rm_train", "gold_rm_eval")
# The reward model's (train, held-out) splits by `reward.pairs`: the proxy RM PPO optimises, the gold RM that judges it.
RM_SPLITS = {"proxy": ("rm_train", "rm_eval"), "gold": ("gold_rm_train", "gold_rm_eval")}


def split_dialogue(text: str) -> tuple[str, str]:
    """(prompt, response): the prompt ends with the last "\\n\\nAssistant:"."""
    cut = text.rfind(ASSISTANT)
    if cut < 0:
        raise ValueError('no "\\n\\nAssistant:" turn')
    end = cut + len(ASSISTANT)
    return text[:end], text[end:].strip()


def prompt_messages(prompt: str) -> list[dict]:
    """HH prompt text → chat messages (user/assistant turns, the final empty Assistant dropped)."""
    parts = _TURN.split(prompt)
    if parts[0].strip():
        raise ValueError("text before the first Human turn")
    messages = []
    for speaker, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    if not messages or messages[-1]["role"] != "assistant" or messages[-1]["content"]:
        raise ValueError("the prompt must end with an empty Assistant turn")
    messages.pop()
    if not messages or messages[0]["role"] != "user":
        raise ValueError("the dialogue must start with a Human turn")
    return messages


FORMAT_NAMES = {"hh": "an HH dialogue", "standard": "a standard preference row (prompt, chosen, rejected strings)",
                "conversational": "a conversational preference row", "implicit": "an implicit-prompt conversation pair"}


def row_format(record: dict) -> str:
    """TRL's rule: a `prompt` column makes the prompt explicit (messages: conversational), else the
    answers carry it (messages: implicit; strings: HH dialogues)."""
    if "prompt" in record:
        return "standard" if isinstance(record["prompt"], str) else "conversational"
    return "hh" if isinstance(record.get("chosen"), str) else "implicit"


def _text(record: dict, column: str, source: str, row) -> str:
    value = record[column]
    if not isinstance(value, str):
        raise DataError(source, row, f"column '{column}' must be a string, got {type(value).__name__}")
    try:  # a JSON escape can make a lone surrogate, which no UTF-8 split file can hold
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DataError(source, row, f"column '{column}' is not valid Unicode (a lone surrogate at {err.start})") from None
    return value


def _turns(record: dict, column: str, source: str, row) -> list[dict]:
    """A column of {role, content} messages (a list; a parquet file gives an array)."""
    value = record[column]
    if isinstance(value, (str, dict)) or not hasattr(value, "__iter__"):
        raise DataError(source, row, f"column '{column}' must be a list of {{role, content}} messages, "
                                     f"got {type(value).__name__}")
    turns = []
    for k, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DataError(source, row, f"column '{column}' message {k}: needs a string `content`")
        if message.get("role") not in ("user", "assistant"):
            raise DataError(source, row, f"column '{column}' message {k}: role {message.get('role')!r}; user and "
                                         f"assistant turns only")
        turns.append({"role": message["role"], "content": _text(message, "content", source, row).strip()})
    return turns


def _prompt_turns(turns: list[dict], what: str) -> list[dict]:
    if not turns or turns[0]["role"] != "user" or turns[-1]["role"] != "user":
        raise ValueError(f"{what} must start and end with a user turn")
    return turns


def _answer(turns: list[dict], what: str) -> str:
    if len(turns) != 1 or turns[0]["role"] != "assistant":
        raise ValueError(f"{what} must be one assistant message")
    return turns[0]["content"]


@contextlib.contextmanager
def _row_rule(source: str, row: int | None, what: str):
    """A ValueError raised inside (a parser's broken rule) becomes a DataError naming the file, the
    row and the rule: "not <what>: <rule>"; a DataError raised inside already names them."""
    try:
        yield
    except DataError:
        raise
    except ValueError as err:
        raise DataError(source, row, f"not {what}: {err}") from None


def answers(record: dict, data: DataConfig, source: str) -> tuple[list[dict], str, list[dict], str]:
    """(chosen's prompt turns, chosen answer, rejected's prompt turns, rejected answer) of one raw
    row, whatever its format; a row that cannot be read is a DataError naming file, row and rule."""
    row, columns = record.get("_row"), ", ".join(k for k in record if k != "_row")
    record = {**record, **{ours: record[theirs] for ours, theirs in data.columns.items() if theirs in record}}
    named = {ours: f"'{data.columns[ours]}' (data.columns.{ours})" if ours in data.columns else f"'{ours}'"
             for ours in ("prompt", "chosen", "rejected")}
    fmt = row_format(record) if data.format == "auto" else data.format
    for column in ("prompt", "chosen", "rejected") if fmt in ("standard", "conversational") else ("chosen", "rejected"):
        if column not in record:
            raise DataError(source, row, f"missing column {named[column]} for the {fmt} format (columns: {columns})")
    with _row_rule(source, row, FORMAT_NAMES[fmt]):
        if fmt == "hh":
            prompt, chosen = split_dialogue(_text(record, "chosen", source, row))
            rejected_prompt, rejected = split_dialogue(_text(record, "rejected", source, row))
            try:
                rejected_turns = prompt_messages(rejected_prompt)
            except ValueError:  # not the chosen's prompt, whatever it is: the "different prompts" rule
                rejected_turns = [{"role": "user", "content": rejected_prompt}]
            return prompt_messages(prompt), chosen, rejected_turns, rejected
        if fmt == "standard":  # a prompt in the HH form is read as its turns
            prompt = _text(record, "prompt", source, row)
            turns = prompt_messages(prompt) if prompt.startswith(HUMAN) else [{"role": "user", "content": prompt.strip()}]
            return (turns, _text(record, "chosen", source, row).strip(),
                    turns, _text(record, "rejected", source, row).strip())
        if fmt == "conversational":
            turns = _prompt_turns(_turns(record, "prompt", source, row), "the prompt")
            return (turns, _answer(_turns(record, "chosen", source, row), "chosen"),
                    turns, _answer(_turns(record, "rejected", source, row), "rejected"))
        chosen, rejected = _turns(record, "chosen", source, row), _turns(record, "rejected", source, row)
        chosen_answer = _answer(chosen[-1:], "chosen's last turn")
        rejected_answer = _answer(rejected[-1:], "rejected's last turn")
        return (_prompt_turns(chosen[:-1], "chosen's turns before its answer"), chosen_answer,
                _prompt_turns(rejected[:-1], "rejected's turns before its answer"), rejected_answer)


def parse_pair(record: dict, data: DataConfig, source: str) -> tuple[dict, list[str]]:
    """One raw row → a pair record and the row rules it breaks (empty list when clean)."""
    messages, chosen, rejected_messages, rejected = answers(record, data, source)
    broken = []
    if messages != rejected_messages:
        broken.append("chosen and rejected have different prompts")
    if not chosen or not rejected:
        broken.append("empty answer")
    elif chosen == rejected:
        broken.append("chosen equals rejected")
    pair = {"row": record.get("_row"), "prompt": dialogue_text(messages), "messages": messages, "chosen": chosen,
            "rejected": rejected}
    return pair, broken


# ----------------------------------------------------------------------------------------------
# Splits with sources of their own: SFT examples (TRL's SFT formats) and prompt-only sets

OWN_SOURCES = {"sft": "sft_source", "ppo_prompts": "ppo_prompts_source", "eval_prompts": "eval_prompts_source"}


def own_sources(data: DataConfig) -> dict[str, str]:
    """{split: source} for the splits that do not come from the preference pairs."""
    return {split: getattr(data, field) for split, field in OWN_SOURCES.items() if getattr(data, field)}


def _column(data: DataConfig, ours: str) -> str:
    """The file's name for our column `ours` (data.columns maps it)."""
    return data.columns.get(ours, ours)


def _user_prompt(record: dict, data: DataConfig, source: str) -> list[dict]:
    """The prompt's turns from a `prompt` column (a string, or messages) or a `messages` column."""
    row = record.get("_row")
    prompt, messages = _column(data, "prompt"), _column(data, "messages")
    if prompt in record:
        if isinstance(record[prompt], str):
            text = _text(record, prompt, source, row)
            return prompt_messages(text) if text.startswith(HUMAN) else [{"role": "user", "content": text.strip()}]
        return _prompt_turns(_turns(record, prompt, source, row), f"column '{prompt}'")
    if messages in record:
        return _prompt_turns(_turns(record, messages, source, row), f"column '{messages}'")
    columns = ", ".join(k for k in record if k != "_row")
    raise DataError(source, row, f"missing column '{prompt}' or '{messages}' for a prompt (columns: {columns})")


def parse_prompt(record: dict, data: DataConfig, source: str) -> dict:
    """A prompt-only row (PPO or evaluation prompts) → {row, prompt, messages}."""
    with _row_rule(source, record.get("_row"), "a prompt"):
        messages = _user_prompt(record, data, source)
    if not any(m["content"] for m in messages):
        raise DataError(source, record.get("_row"), "empty prompt")
    return {"row": record.get("_row"), "prompt": dialogue_text(messages), "messages": messages}


def parse_sft_example(record: dict, data: DataConfig, source: str) -> dict:
    """An SFT row → {row, prompt, messages, chosen}: TRL's `messages` (the last turn is the answer)
    or `prompt` + `completion`."""
    row = record.get("_row")
    messages, completion = _column(data, "messages"), _column(data, "completion")
    with _row_rule(source, row, "an SFT example"):
        if completion in record:
            turns = _user_prompt({k: v for k, v in record.items() if k != messages}, data, source)
            value = record[completion]
            answer = (_text(record, completion, source, row).strip() if isinstance(value, str)
                      else _answer(_turns(record, completion, source, row), f"column '{completion}'"))
        elif messages in record:
            dialogue = _turns(record, messages, source, row)
            answer = _answer(dialogue[-1:], f"the last turn of column '{messages}'")
            turns = _prompt_turns(dialogue[:-1], f"column '{messages}' before its last turn")
        else:
            columns = ", ".join(k for k in record if k != "_row")
            raise DataError(source, row, f"missing column '{messages}', or '{completion}' with a prompt, for an SFT "
                                         f"example (columns: {columns})")
    if not answer:
        raise DataError(source, row, "empty answer")
    return {"row": row, "prompt": dialogue_text(turns), "messages": turns, "chosen": answer}


PARSE_OWN = {"sft": parse_sft_example, "ppo_prompts": parse_prompt, "eval_prompts": parse_prompt}


def own_source_config(data: DataConfig) -> DataConfig:
    """The data config a split's own source is read with: a hub id's `train` split (hub_data_dir
    and hub_split belong to `pairs`)."""
    return data.model_copy(update={"hub_data_dir": None, "hub_split": "train"})


def read_own_files(data: DataConfig) -> dict[str, tuple[DataFiles, list[dict]]]:
    """{split: (its files, parsed rows)} of the splits with sources of their own."""
    out = {}
    for split, spec in own_sources(data).items():
        found, records = read_source(spec, own_source_config(data))
        if not records:
            raise DataError(found.name, None, "no rows")
        out[split] = (found, [PARSE_OWN[split](record, data, found.name) for record in records])
    return out


def read_own_sources(data: DataConfig) -> dict[str, tuple[str, list[dict]]]:
    """{split: (source, rows)} of the splits with sources of their own, parsed."""
    return {split: (found.name, rows) for split, (found, rows) in read_own_files(data).items()}


def load_pairs(cfg: PipelineConfig, records: list[dict] | None = None, source: str | None = None
               ) -> tuple[str, list[dict], list[dict]]:
    """(source, clean pairs, dropped rows with their reasons)."""
    if records is None:
        source, records = read_records(cfg.data.pairs, cfg.data)
    if not records:
        raise DataError(source, None, "no rows")
    pairs, dropped = [], []
    for record in records:
        pair, broken = parse_pair(record, cfg.data, source)
        if broken and cfg.data.drop_invalid:
            dropped.append({"row": pair["row"], "rules": broken})
        else:
            pairs.append(pair)
    return source, pairs, dropped


def make_splits(pairs: list[dict], cfg: PipelineConfig, names: tuple[str, ...] = SPLITS) -> dict[str, list[dict]]:
    """Seeded splits over distinct prompts: the same prompt never lands in two splits. `names`:
    the splits cut from the pairs (those without a source of their own)."""
    by_prompt: dict[str, dict] = {}
    for pair in pairs:
        by_prompt.setdefault(pair["prompt"], pair)  # duplicates of a prompt: keep the first row
    unique = list(by_prompt.values())
    random.Random(cfg.data.seed).shuffle(unique)
    sizes = {name: getattr(cfg.data.splits, name) for name in names}
    needed = sum(sizes.values())
    if needed > len(unique):
        raise ConfigError(
            f"data.splits ask for {needed} prompts ({sizes}) but {cfg.data.pairs} has {len(unique)} distinct ones"
        )
    splits, start = {}, 0
    for name in names:
        splits[name] = unique[start : start + sizes[name]]
        start += sizes[name]
    return splits


def add_own_splits(splits: dict[str, list[dict]], own: dict[str, tuple[str, list[dict]]], cfg: PipelineConfig
                   ) -> tuple[dict[str, list[dict]], list[dict]]:
    """The pairs' splits plus each split's own source (`own`: {split: (source, parsed rows)}),
    seeded, its size from distinct prompts that no other split holds. Returns (all splits in
    order, the own sources' rows left out, each with its source and rule)."""
    splits, left_out = dict(splits), []
    for name in (name for name in SPLITS if name in own):
        source, rows = own[name]
        taken = {row["prompt"]: split for split, split_rows in splits.items() for row in split_rows}
        distinct: dict[str, dict] = {}
        for row in rows:
            if row["prompt"] in taken:
                left_out.append({"source": source, "row": row["row"],
                                 "rules": [f"prompt already in the {taken[row['prompt']]} split"]})
            else:
                distinct.setdefault(row["prompt"], row)
        candidates = list(distinct.values())
        random.Random(cfg.data.seed).shuffle(candidates)
        size = getattr(cfg.data.splits, name)
        if size > len(candidates):
            raise ConfigError(f"data.splits.{name} asks for {size} prompts but {source} has {len(candidates)} "
                              f"distinct ones that no other split holds")
        splits[name] = candidates[:size]
    return {name: splits[name] for name in SPLITS if name in splits}, left_out


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def splits_digest(splits: dict[str, list[dict]]) -> str:
    sha = hashlib.sha256()
    for name in SPLITS:
        for row in splits.get(name, []):
            sha.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode())
    return sha.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Probe frames for the data contracts (data_contracts/): one row per source row, `row` = line number


def raw_pairs_frame(records: list[dict], data: DataConfig, source: str) -> "pd.DataFrame":
    """Every raw row, before anything is dropped: the prompt of each answer and the answers.
    Call after `load_pairs` (which rejects rows that cannot be read as pairs at all)."""
    import pandas as pd  # deferred: pandas only for the data probes

    rows = []
    for record in records:
        messages, chosen, rejected_messages, rejected = answers(record, data, source)
        rows.append({"row": record["_row"], "prompt": dialogue_text(messages),
                     "rejected_prompt": dialogue_text(rejected_messages), "chosen": chosen, "rejected": rejected})
    return pd.DataFrame(rows, columns=["row", "prompt", "rejected_prompt", "chosen", "rejected"])


def pair_digest(prompt: str, chosen: str, rejected: str) -> str:
    """A preference pair's identity: the sha256 of its prompt and both answers."""
    return hashlib.sha256(json.dumps([prompt, chosen, rejected], ensure_ascii=False).encode()).hexdigest()


def splits_frame(splits: dict[str, list[dict]]) -> "pd.DataFrame":
    """All split rows with their split name."""
    import pandas as pd  # deferred: as above

    rows = [{"row": r["row"], "split": name, "prompt": r["prompt"], "chosen": r.get("chosen", ""),
             "rejected": r.get("rejected", "")}  # prompt-only and SFT sources have no answers to compare
            for name, split_rows in splits.items() for r in split_rows]
    return pd.DataFrame(rows, columns=["row", "split", "prompt", "chosen", "rejected"])


# ----------------------------------------------------------------------------------------------
# The stage


def run(cfg: PipelineConfig, tracker, inputs: dict, dist=None) -> dict:
    """Parse, clean and split the pairs (and the splits' own sources); log the splits as artifacts
    and MLflow inputs."""
    found, records = read_source(cfg.data.pairs, cfg.data)
    source, pairs, dropped = load_pairs(cfg, records, found.name)
    own_files = read_own_files(cfg.data)
    own = {split: (files.name, rows) for split, (files, rows) in own_files.items()}
    splits = make_splits(pairs, cfg, tuple(name for name in SPLITS if name not in own))
    splits, left_out = add_own_splits(splits, own, cfg)
    # A pipeline without a gold RM has no gold splits: no empty files or inputs for them.
    splits = {name: rows for name, rows in splits.items() if rows or name not in RM_SPLITS["gold"]}
    out = tracker.workdir / "splits"
    for name, rows in splits.items():
        write_jsonl(rows, out / f"{name}.jsonl")
    write_jsonl(dropped + left_out, out / "dropped_rows.jsonl")
    digest = splits_digest(splits)
    sources_of = {name: own[name][0] if name in own else source for name in SPLITS}
    tracker.log_params({"data.source": source, "data.digest": digest, **found.lineage("data"),
                        **{f"data.source.{name}": own_source for name, (own_source, _) in own.items()},
                        **{key: value for name, (files, _) in own_files.items()
                           for key, value in files.lineage(f"data.{name}").items()}})
    tracker.log_metrics(
        {"data/rows": len(pairs) + len(dropped), "data/dropped": len(dropped), "data/distinct_prompts": len({p["prompt"] for p in pairs}),
         **({"data/left_out": len(left_out)} if own else {}),
         **{f"data/{name}": len(rows) for name, rows in splits.items()}},
        step=0,
    )
    tracker.log_artifacts(out, "splits")
    for name, rows in splits.items():
        tracker.log_input_rows(rows, name=name, source=sources_of[name], digest=digest, context=name)
    return {"splits": tracker.artifact_uri("splits"), "data_digest": digest, "data_source": source,
            "data_run": tracker.run_id, "raw_pairs_probe": tracker.log_probe(raw_pairs_frame(records, cfg.data, source), "raw_pairs"),
            "splits_probe": tracker.log_probe(splits_frame(splits), "splits")}


def corpus_texts(splits_dir: Path) -> list[str]:
    """All dialogue text of the splits written to `splits_dir` (a folder written without the gold
    splits has no files for them)."""
    return split_texts({name: read_jsonl(splits_dir / f"{name}.jsonl") if (splits_dir / f"{name}.jsonl").exists()
                        else [] for name in SPLITS})


def split_texts(splits: dict[str, list[dict]]) -> list[str]:
    """All dialogue text of the splits (what the `bpe` tokenizer of the tiny preset learns on)."""
    return [row[key] for name in SPLITS for row in splits[name] for key in ("prompt", "chosen", "rejected") if row.get(key)]
