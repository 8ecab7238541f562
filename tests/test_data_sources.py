"""Splits with sources of their own (`data.sft_source`, `data.ppo_prompts_source`,
`data.eval_prompts_source`): SFT on an instruction/chat set in TRL's SFT formats (`messages`, or
`prompt` + `completion`), PPO and evaluation on prompt-only sets. Each format of the same rows gives
the same split; a prompt another split holds is left out and reported; a bad row names file, row
and rule; and the tiny pipeline runs through the real flow on all three sources at once."""

from __future__ import annotations

import json

import pytest

from data_contracts import validate
from stages.leaves.config import ConfigError, DataConfig
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config
from stages.pipeline.data import (add_own_splits, load_pairs, make_splits, parse_prompt, parse_sft_example, read_jsonl,
                                  read_own_sources, splits_frame)
from stages.compute.loading import DataError


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# One clean pair (stages.pipeline.data's record) → an SFT row (its prompt and chosen answer) in each of TRL's
# SFT formats, and a prompt-only row in each prompt format.
SFT_FORMATS = {
    "messages": lambda p: {"messages": p["messages"] + _assistant(p["chosen"])},
    "prompt-completion": lambda p: {"prompt": p["prompt"], "completion": p["chosen"]},
    "conversational prompt-completion": lambda p: {"prompt": p["messages"], "completion": _assistant(p["chosen"])},
    "mapped": lambda p: {"instruction": p["prompt"], "output": p["chosen"]},
}
PROMPT_FORMATS = {
    "hh string": lambda p: {"prompt": p["prompt"]},
    "prompt messages": lambda p: {"prompt": p["messages"]},
    "messages": lambda p: {"messages": p["messages"], "id": p["row"]},
}


@pytest.fixture(scope="module")
def pairs(hh_file):
    _, pairs, _ = load_pairs(load_config("tiny", [f"data.pairs={hh_file}"]))
    return pairs


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("name", list(SFT_FORMATS))
def test_every_sft_format_gives_the_pairs_prompt_and_chosen_answer(pairs, name):
    data = DataConfig(columns={"prompt": "instruction", "completion": "output"} if name == "mapped" else {})
    for pair in pairs[:50]:
        got = parse_sft_example({**SFT_FORMATS[name](pair), "_row": 7}, data, "f")
        assert got == {"row": 7, "prompt": pair["prompt"], "messages": pair["messages"], "chosen": pair["chosen"]}


@pytest.mark.parametrize("name", list(PROMPT_FORMATS))
def test_every_prompt_format_gives_the_pairs_prompt(pairs, name):
    for pair in pairs[:50]:
        got = parse_prompt({**PROMPT_FORMATS[name](pair), "_row": 3}, DataConfig(), "f")
        assert got == {"row": 3, "prompt": pair["prompt"], "messages": pair["messages"]}


DIALOGUE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "ok?"}]


@pytest.mark.parametrize("parse,record,error", [
    (parse_sft_example, {"messages": DIALOGUE}, r"f, row 4: not an SFT example: the last turn of column 'messages' "
                                                r"must be one assistant message"),
    (parse_sft_example, {"text": "hello"}, r"f, row 4: missing column 'messages', or 'completion' with a prompt, for "
                                           r"an SFT example \(columns: text\)"),
    (parse_sft_example, {"completion": "a"}, r"f, row 4: missing column 'prompt' or 'messages' for a prompt"),
    (parse_sft_example, {"prompt": "q", "completion": "  "}, r"f, row 4: empty answer"),
    (parse_prompt, {"messages": DIALOGUE[:2]}, r"f, row 4: not a prompt: column 'messages' must start and end with "
                                               r"a user turn"),
    (parse_prompt, {"question": "q"}, r"f, row 4: missing column 'prompt' or 'messages' for a prompt "
                                      r"\(columns: question\)"),
    (parse_prompt, {"prompt": 3}, r"f, row 4: column 'prompt' must be a list of \{role, content\} messages, got int"),
])
def test_a_bad_row_of_a_split_source_names_file_row_and_rule(parse, record, error):
    with pytest.raises(DataError, match=error) as caught:
        parse({**record, "_row": 4}, DataConfig(), "f")
    assert str(caught.value).count("row 4") == 1  # the location once, not once per layer


def test_own_splits_never_share_a_prompt_with_the_pairs_splits(pairs, hh_file):
    """An evaluation prompt that a training split already holds is left out (and reported), and the
    split still gets its size from the other rows."""
    cfg = load_config("tiny", [f"data.pairs={hh_file}", "data.eval_prompts_source=e.jsonl"])
    cut = make_splits(pairs, cfg, ("sft", "rm_train", "rm_eval", "ppo_prompts"))
    leaked = [cut["sft"][0], cut["ppo_prompts"][1]]
    fresh = [p for p in pairs if p["prompt"] not in {r["prompt"] for rows in cut.values() for r in rows}][:40]
    rows = [{"row": k + 1, "prompt": p["prompt"], "messages": p["messages"]} for k, p in enumerate(leaked + fresh)]
    splits, left_out = add_own_splits(cut, {"eval_prompts": ("e.jsonl", rows)}, cfg)
    assert left_out == [{"source": "e.jsonl", "row": 1, "rules": ["prompt already in the sft split"]},
                        {"source": "e.jsonl", "row": 2, "rules": ["prompt already in the ppo_prompts split"]}]
    assert len(splits["eval_prompts"]) == cfg.data.splits.eval_prompts
    assert {r["row"] for r in splits["eval_prompts"]} <= set(range(3, 43))
    assert validate("splits", splits_frame(splits), cfg).success
    with pytest.raises(ConfigError, match=r"data.splits.eval_prompts asks for 41 prompts but e.jsonl has 40 "
                                          r"distinct ones that no other split holds"):
        add_own_splits(cut, {"eval_prompts": ("e.jsonl", rows)},
                       load_config("tiny", [f"data.pairs={hh_file}", "data.splits.eval_prompts=41"]))


def test_the_splits_contract_still_judges_the_pairs_splits(pairs, hh_file, tmp_path):
    """With prompt-only splits beside them, a pair split whose rejected answer is empty still fails."""
    prompts = _write(tmp_path / "p.jsonl", [PROMPT_FORMATS["hh string"](p) for p in pairs[-100:]])
    cfg = load_config("tiny", [f"data.pairs={hh_file}", f"data.ppo_prompts_source={prompts}"])
    own = read_own_sources(cfg.data)
    splits, _ = add_own_splits(make_splits(pairs[:-100], cfg, ("sft", "rm_train", "rm_eval", "eval_prompts")), own, cfg)
    assert validate("splits", splits_frame(splits), cfg).success
    splits["rm_train"][5] = {**splits["rm_train"][5], "rejected": ""}
    result = validate("splits", splits_frame(splits), cfg)
    assert not result.success
    (failure,) = result.failures
    assert failure.rule == "expect_column_value_lengths_to_be_between" and failure.column == "rejected"
    assert [e["row"] for e in failure.examples] == [splits["rm_train"][5]["row"]]


def test_the_tiny_pipeline_runs_on_sources_of_its_own_through_the_flow(pairs, prefect_server, tmp_path):
    """SFT on a chat set (`messages`), PPO on a prompt file (plain strings), evaluation prompts from a
    third file (`prompt` messages): the splits hold those rows, every contract passes, the SFT
    held-out loss falls back to rm_eval's answers, and PPO and the eval stage run on them."""
    from flows.rlhf import rlhf

    sft_rows, ppo_rows, eval_rows = pairs[:200], pairs[200:260], pairs[260:300]
    files = {"sft_source": _write(tmp_path / "chat.jsonl", [SFT_FORMATS["messages"](p) for p in sft_rows]),
             "ppo_prompts_source": _write(tmp_path / "prompts.jsonl",
                                          [{"prompt": p["messages"][-1]["content"]} for p in ppo_rows]),
             "eval_prompts_source": _write(tmp_path / "eval.jsonl", [PROMPT_FORMATS["prompt messages"](p)
                                                                      for p in eval_rows])}
    run_id = rlhf(preset="tiny", overrides={"data": {k: str(v) for k, v in files.items()}, "sft.epochs": 1,
                                            "ppo.iterations": 2, "ppo.eval_every": 2})
    outputs = lineage.outputs_of(run_id)
    data_run = tracking.client().get_run(outputs["data_run"])
    assert data_run.data.params["data.source.sft"] == str(files["sft_source"].resolve())
    splits_dir = tracking.download(outputs["splits"])
    sft = read_jsonl(splits_dir / "sft.jsonl")
    assert len(sft) == 128 and {(r["prompt"], r["chosen"]) for r in sft} <= {(p["prompt"], p["chosen"]) for p in sft_rows}
    ppo = read_jsonl(splits_dir / "ppo_prompts.jsonl")
    assert {r["prompt"] for r in ppo} <= {f"\n\nHuman: {p['messages'][-1]['content']}\n\nAssistant:" for p in ppo_rows}
    assert "chosen" not in ppo[0]
    held_out = read_jsonl(splits_dir / "eval_prompts.jsonl")
    assert {r["prompt"] for r in held_out} <= {p["prompt"] for p in eval_rows}
    children = {run.data.tags["rlhf.stage"]: run for run in lineage.stage_runs(run_id)}
    assert {"data", "sft", "reward", "critic", "ppo", "eval"} <= set(children)
    gated = {name: run.data.tags["rlhf.contract"] for name, run in children.items() if "rlhf.contract" in run.data.tags}
    assert {"data", "sft", "critic", "ppo"} <= set(gated) and set(gated.values()) == {"passed"}
    assert children["sft"].data.metrics["eval/perplexity"] > 0  # held-out loss on rm_eval's chosen answers
