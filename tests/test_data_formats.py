"""TRL's preference formats (standard, conversational, implicit prompt), any column names through
`data.columns`, and HH dialogues all become the same pairs: the shared HH file converted to each
format gives the same splits, each drives the data stage (and its contracts) through the real
flow, and a row that fits no format is an error naming the file, the row and the rule."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from stages.compute.loading import DataError
from stages.leaves.config import DataConfig
from stages.orchestration import lineage, tracking
from stages.orchestration.config_loading import load_config
from stages.pipeline.data import load_pairs, make_splits, parse_pair, read_jsonl


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# One clean pair (stages.pipeline.data's record) → a row in each format, as a user's file would hold it.
CONVERT = {
    "hh": lambda p: {"chosen": f"{p['prompt']} {p['chosen']}", "rejected": f"{p['prompt']} {p['rejected']}"},
    "standard": lambda p: {"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]},
    "conversational": lambda p: {"prompt": p["messages"], "chosen": _assistant(p["chosen"]),
                                 "rejected": _assistant(p["rejected"])},
    "implicit": lambda p: {"chosen": p["messages"] + _assistant(p["chosen"]),
                           "rejected": p["messages"] + _assistant(p["rejected"])},
    "mapped": lambda p: {"question": p["prompt"], "good": p["chosen"], "bad": p["rejected"], "id": p["row"]},
}
MAPPING = ["data.columns.prompt=question", "data.columns.chosen=good", "data.columns.rejected=bad"]


@pytest.fixture(scope="module")
def files(hh_file, tmp_path_factory):
    """The first 600 clean pairs of the shared HH file, written in every format (and the
    conversational one as parquet too, where messages come back as arrays of structs)."""
    _, pairs, _ = load_pairs(load_config("tiny", [f"data.pairs={hh_file}"]))
    pairs = pairs[:600]
    folder = tmp_path_factory.mktemp("formats")
    written = {}
    for name, convert in CONVERT.items():
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(convert(p)) + "\n" for p in pairs))
        written[name] = path
    written["conversational.parquet"] = folder / "conversational.parquet"
    pd.DataFrame([CONVERT["conversational"](p) for p in pairs]).to_parquet(written["conversational.parquet"])
    return written


def _config(path, fmt: str, *overrides: str):
    explicit = [] if fmt == "auto" else [f"data.format={fmt}"]
    return load_config("tiny", [f"data.pairs={path}", *explicit, *overrides])


def _splits(cfg) -> dict:
    _, pairs, dropped = load_pairs(cfg)
    assert dropped == []
    return make_splits(pairs, cfg)


@pytest.mark.parametrize("name,fmt", [("standard", "auto"), ("conversational", "auto"), ("implicit", "auto"),
                                      ("conversational.parquet", "auto"), ("mapped", "standard"),
                                      ("implicit", "implicit"), ("hh", "hh")])
def test_every_format_of_the_same_pairs_gives_the_same_splits(files, name, fmt):
    expected = _splits(_config(files["hh"], "auto"))
    got = _splits(_config(files[name], fmt, *(MAPPING if name == "mapped" else [])))
    assert got == expected  # rows (line numbers), prompts, turns and answers, split by split


@pytest.mark.parametrize("name", ["conversational.parquet", "implicit", "mapped"])
def test_each_format_drives_the_data_stage_and_its_contracts_through_the_flow(files, prefect_server, name):
    from flows.rlhf import rlhf

    overrides = {"data": {"pairs": str(files[name]), **({"columns": {"prompt": "question", "chosen": "good",
                                                                     "rejected": "bad"}} if name == "mapped" else {})}}
    run_id = rlhf(preset="tiny", overrides=overrides, stages=["data"])
    outputs = lineage.outputs_of(run_id)
    data_run = tracking.client().get_run(outputs["data_run"])
    assert data_run.data.tags["rlhf.contract.raw_pairs"] == "passed" and data_run.data.tags["rlhf.contract.splits"] == "passed"
    written = read_jsonl(tracking.download(outputs["splits"]) / "sft.jsonl")
    assert written == _splits(_config(files["hh"], "auto"))["sft"]


DIALOGUE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "ok?"}]


@pytest.mark.parametrize("record,fmt,error", [
    ({"prompt": DIALOGUE[:2], "chosen": _assistant("a"), "rejected": _assistant("b")}, "auto",
     r"f, row 2: not a conversational preference row: the prompt must start and end with a user turn"),
    ({"prompt": DIALOGUE, "chosen": "a", "rejected": _assistant("b")}, "auto",
     r"f, row 2: column 'chosen' must be a list of \{role, content\} messages, got str"),
    ({"chosen": [{"role": "system", "content": "be nice"}, *DIALOGUE, *_assistant("a")], "rejected": DIALOGUE}, "auto",
     r"f, row 2: column 'chosen' message 0: role 'system'; user and assistant turns only"),
    ({"chosen": [*DIALOGUE, *_assistant("a")], "rejected": DIALOGUE}, "auto",
     r"f, row 2: not an implicit-prompt conversation pair: rejected's last turn must be one assistant message"),
    ({"prompt": "q", "chosen": "a"}, "auto", r"f, row 2: missing column 'rejected' for the standard format"),
    ({"question": "q", "good": "a", "worse": "b"}, "standard",
     r"f, row 2: missing column 'bad' \(data.columns.rejected\) for the standard format \(columns: question, good, worse\)"),
    ({"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: hi\n\nAssistant: b"}, "conversational",
     r"f, row 2: missing column 'prompt' for the conversational format"),
])
def test_a_row_that_fits_no_format_names_file_row_and_rule(record, fmt, error):
    data = DataConfig(format=fmt, columns={"prompt": "question", "chosen": "good", "rejected": "bad"}
                      if "question" in record else {})
    with pytest.raises(DataError, match=error) as caught:
        parse_pair({**record, "_row": 2}, data, "f")
    assert str(caught.value).count("row 2") == 1  # the location once, not once per layer


def test_row_rules_hold_in_every_format():
    """Different prompts, an empty answer, chosen = rejected: the same dropped-row rules."""
    data = DataConfig()
    _, broken = parse_pair({"_row": 1, "chosen": [*DIALOGUE, *_assistant("a")],
                            "rejected": [*DIALOGUE[:1], *_assistant("b")]}, data, "f")
    assert broken == ["chosen and rejected have different prompts"]
    _, broken = parse_pair({"_row": 1, "prompt": "q", "chosen": "same", "rejected": "same"}, data, "f")
    assert broken == ["chosen equals rejected"]
    _, broken = parse_pair({"_row": 1, "prompt": DIALOGUE, "chosen": _assistant(" "), "rejected": _assistant("b")},
                           data, "f")
    assert broken == ["empty answer"]
