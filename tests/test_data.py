import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from stages.compute.loading import DataError, read_records
from stages.leaves.config import ConfigError, DataConfig
from stages.leaves.rendering import count_cut, encode_example, render_prompt, render_response
from stages.orchestration.config_loading import load_config
from stages.pipeline.data import SPLITS, load_pairs, make_splits, parse_pair, prompt_messages, split_dialogue

DIALOGUE = "\n\nHuman: hi there\n\nAssistant: hello!\n\nHuman: how are you?\n\nAssistant: fine, thanks"


def test_split_dialogue_and_messages():
    prompt, response = split_dialogue(DIALOGUE)
    assert prompt.endswith("\n\nAssistant:") and response == "fine, thanks"
    assert prompt_messages(prompt) == [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello!"},
        {"role": "user", "content": "how are you?"},
    ]


def test_parse_pair_flags_row_rules():
    clean, broken = parse_pair({"_row": 3, "chosen": DIALOGUE, "rejected": DIALOGUE.replace("fine", "bad")}, DataConfig(), "f")
    assert broken == [] and clean["chosen"] == "fine, thanks" and clean["row"] == 3
    _, broken = parse_pair({"_row": 4, "chosen": DIALOGUE, "rejected": DIALOGUE}, DataConfig(), "f")
    assert broken == ["chosen equals rejected"]
    _, broken = parse_pair({"_row": 5, "chosen": DIALOGUE, "rejected": "\n\nHuman: other\n\nAssistant: x"}, DataConfig(), "f")
    assert broken == ["chosen and rejected have different prompts"]
    _, broken = parse_pair({"_row": 6, "chosen": DIALOGUE + "\n\nHuman: q\n\nAssistant:", "rejected": DIALOGUE + "\n\nHuman: q\n\nAssistant: a"}, DataConfig(), "f")
    assert broken == ["empty answer"]
    with pytest.raises(DataError, match=r"f, row 7: missing column 'rejected'"):
        parse_pair({"_row": 7, "chosen": DIALOGUE}, DataConfig(), "f")
    with pytest.raises(DataError, match=r"row 8: not an HH dialogue"):
        parse_pair({"_row": 8, "chosen": "no turns here", "rejected": "x"}, DataConfig(), "f")


def test_shared_hh_file_parses_with_its_known_dirty_rows(hh_file):
    cfg = load_config("tiny", [f"data.pairs={hh_file}"])
    source, pairs, dropped = load_pairs(cfg)
    assert source == str(hh_file.resolve())
    assert len(pairs) + len(dropped) == 2312
    reasons = [rule for row in dropped for rule in row["rules"]]
    assert reasons.count("chosen and rejected have different prompts") == 5
    assert reasons.count("empty answer") == 4
    assert all(p["messages"][0]["role"] == "user" and p["chosen"] and p["rejected"] for p in pairs)
    # Rows keep their line numbers in the source file.
    assert {row["row"] for row in dropped} <= set(range(1, 2313))
    with gzip.open(hh_file, "rt") as handle:
        lines = handle.readlines()
    first = dropped[0]["row"]
    raw = json.loads(lines[first - 1])
    assert split_dialogue(raw["chosen"])[1] == "" or split_dialogue(raw["rejected"])[1] == "" \
        or split_dialogue(raw["chosen"])[0] != split_dialogue(raw["rejected"])[0]


def test_splits_are_disjoint_sized_and_reproducible(hh_file):
    cfg = load_config("tiny", [f"data.pairs={hh_file}"])
    _, pairs, _ = load_pairs(cfg)
    splits = make_splits(pairs, cfg)
    sizes = cfg.data.splits.model_dump()
    assert {name: len(rows) for name, rows in splits.items()} == sizes
    prompts = [{row["prompt"] for row in splits[name]} for name in SPLITS]
    for i in range(len(SPLITS)):
        assert len(prompts[i]) == sizes[SPLITS[i]]  # no prompt twice inside a split
        for j in range(i + 1, len(SPLITS)):
            assert not prompts[i] & prompts[j], (SPLITS[i], SPLITS[j])
    again = make_splits(pairs, cfg)
    assert again == splits
    other = make_splits(pairs, load_config("tiny", [f"data.pairs={hh_file}", "data.seed=1"]))
    assert [r["row"] for r in other["sft"]] != [r["row"] for r in splits["sft"]]


def test_splits_larger_than_the_data_are_a_config_error(hh_file):
    cfg = load_config("tiny", [f"data.pairs={hh_file}", "data.splits.sft=5000"])
    _, pairs, _ = load_pairs(cfg)
    with pytest.raises(ConfigError, match="distinct ones"):
        make_splits(pairs, cfg)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_bad_files_name_the_file_row_and_rule(tmp_path: Path):
    cfg = load_config("tiny").data
    good = json.dumps({"chosen": DIALOGUE, "rejected": DIALOGUE}).encode()
    with pytest.raises(DataError, match=r"file not found"):
        read_records(str(tmp_path / "missing.jsonl"), cfg)
    path = _write(tmp_path / "bad.jsonl", good + b"\n" + b"{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, row 2: not valid JSON"):
        read_records(str(path), cfg)
    path = _write(tmp_path / "latin.jsonl", good + b"\n" + good + b"\n" + b'{"chosen": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl, row 3: not UTF-8"):
        read_records(str(path), cfg)
    path = _write(tmp_path / "list.jsonl", b"[1, 2]\n")
    with pytest.raises(DataError, match=r"row 1: each line must be a JSON object"):
        read_records(str(path), cfg)


def test_parquet_csv_and_gz_read_the_same_rows(tmp_path: Path):
    rows = [{"chosen": DIALOGUE, "rejected": DIALOGUE.replace("fine", f"bad {i}")} for i in range(3)]
    cfg = load_config("tiny").data
    pd.DataFrame(rows).to_parquet(tmp_path / "p.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "p.csv", index=False)
    with gzip.open(tmp_path / "p.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    for name in ("p.parquet", "p.csv", "p.jsonl.gz"):
        _, read = read_records(str(tmp_path / name), cfg)
        assert [{k: r[k] for k in ("chosen", "rejected")} for r in read] == rows, name
    _, csv_rows = read_records(str(tmp_path / "p.csv"), cfg)
    assert [r["_row"] for r in csv_rows] == [2, 3, 4]  # line numbers: the header is line 1


def _dialogue_tokenizer():
    from stages.compute.loading import train_bpe_tokenizer
    from transformers import AutoTokenizer
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        train_bpe_tokenizer([DIALOGUE] * 20, 300, Path(tmp))
        return AutoTokenizer.from_pretrained(tmp)


def test_encode_example_masks_the_prompt():
    tok = _dialogue_tokenizer()
    messages = prompt_messages(split_dialogue(DIALOGUE)[0])
    assert render_prompt(tok, messages) == split_dialogue(DIALOGUE)[0]  # no chat template: HH form
    ids, labels = encode_example(tok, messages, "fine, thanks", max_seq_len=64, max_response_len=32)
    n_prompt = sum(1 for label in labels if label == -100)
    assert ids[n_prompt:] == labels[n_prompt:] and labels[-1] == tok.eos_token_id
    assert tok.decode(ids[n_prompt:-1]) == " fine, thanks"


def test_cut_response_gets_no_eos():
    """A response cut to fit max_response_len must not teach the model to stop mid-sentence."""
    tok = _dialogue_tokenizer()
    messages = prompt_messages(split_dialogue(DIALOGUE)[0])
    answer = "fine, thanks; and how are you on this sunny day?"
    text = tok(render_response(tok, answer), add_special_tokens=False)["input_ids"]
    assert len(text) > 4

    def response(labels):
        return [label for label in labels if label != -100]

    cut_ids, labels = encode_example(tok, messages, answer, max_seq_len=8, max_response_len=4)
    assert len(cut_ids) == 8 and response(labels) == text[:4] and tok.eos_token_id not in cut_ids
    # The response and its EOS just fit: whole, it ends with EOS.
    whole_ids, labels = encode_example(tok, messages, answer, max_seq_len=64, max_response_len=len(text) + 1)
    assert response(labels) == text + [tok.eos_token_id]
    # One token less: the text fits but its EOS does not, so it is cut and gets none.
    short_ids, labels = encode_example(tok, messages, answer, max_seq_len=64, max_response_len=len(text))
    assert response(labels) == text
    assert count_cut([cut_ids, whole_ids, short_ids], tok) == 2
    # A generated response that never ended gets no EOS even where one would fit.
    _, labels = encode_example(tok, messages, answer, max_seq_len=64, max_response_len=64, ended=False)
    assert response(labels) == text
