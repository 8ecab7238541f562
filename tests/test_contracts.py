"""The GX suites (real Great Expectations, ephemeral context): a passing input and failing inputs
per suite, on the shared HH file's real dirty rows and on made-up faults; and the gate's
MLflow side (JSON result, Data Docs HTML, tags) on a real SQLite store."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from data_contracts import ContractError, gate, validate
from stages.compute.loading import DataError, read_records
from stages.orchestration import tracking
from stages.orchestration.config_loading import load_config
from stages.pipeline.data import load_pairs, make_splits, raw_pairs_frame, splits_frame

DIALOGUE = "\n\nHuman: question {i}?\n\nAssistant: {answer}"


def _cfg(hh_file=None, *overrides):
    return load_config("tiny", [*([f"data.pairs={hh_file}"] if hh_file else []), *overrides])


def _raw(hh_file, cfg):
    source, records = read_records(cfg.data.pairs, cfg.data)
    _, pairs, dropped = load_pairs(cfg, records, source)
    return raw_pairs_frame(records, cfg.data, "f"), pairs, dropped


def _rules(report) -> dict[str, object]:
    return {f.rule: f for f in report.failures}


def _write_jsonl(path, rows, raw_lines=()):
    with open(path, "wb") as handle:
        for row in rows:
            handle.write((json.dumps(row) + "\n").encode())
        for line in raw_lines:
            handle.write(line)
    return path


def _pairs(n, **faults):
    """n clean HH pairs; faults: {index: "same" | "empty" | "prompt" | "dup"}."""
    rows = []
    for i in range(n):
        chosen, rejected = DIALOGUE.format(i=i, answer=f"good {i}"), DIALOGUE.format(i=i, answer=f"bad {i}")
        kind = faults.get(str(i))
        if kind == "same":
            rejected = chosen
        elif kind == "empty":
            chosen = DIALOGUE.format(i=i, answer="")
        elif kind == "prompt":
            rejected = DIALOGUE.format(i=f"other {i}", answer=f"bad {i}")
        elif kind == "dup":
            chosen, rejected = DIALOGUE.format(i=0, answer=f"good {i}"), DIALOGUE.format(i=0, answer=f"bad {i}")
        rows.append({"chosen": chosen, "rejected": rejected})
    return rows


# -- raw pairs ---------------------------------------------------------------------------------


def test_raw_pairs_pass_on_the_shared_file_within_tolerance(hh_file):
    cfg = _cfg(hh_file)
    frame, _, dropped = _raw(hh_file, cfg)
    assert len(frame) == 2312 and len(dropped) == 9
    report = validate("raw_pairs", frame, cfg)
    assert report.success, [f.describe() for f in report.failures]


def test_raw_pairs_without_drop_invalid_fail_on_every_real_dirty_row(hh_file):
    cfg = _cfg(hh_file, "data.drop_invalid=false")
    frame, _, _ = _raw(hh_file, cfg)
    _, _, dropped = load_pairs(_cfg(hh_file))  # what the data stage would drop: the 9 dirty rows
    report = validate("raw_pairs", frame, cfg)
    assert not report.success
    rules = _rules(report)
    empty = rules["expect_column_value_lengths_to_be_between"]
    empty_rows = {r["row"] for r in dropped if "empty answer" in r["rules"]}
    assert empty.column == "chosen" and {e["row"] for e in empty.examples} <= empty_rows and empty.examples
    prompts = rules["expect_column_pair_values_to_be_equal"]
    assert prompts.unexpected_count == 5
    named = {e["row"] for f in report.failures if f.rule != "expect_column_values_to_be_unique" for e in f.examples}
    assert named and named <= {r["row"] for r in dropped}


def test_raw_pairs_fail_when_dirtier_than_the_tolerance(tmp_path):
    path = _write_jsonl(tmp_path / "pairs.jsonl", _pairs(50, **{"3": "same", "7": "empty", "9": "prompt"}))
    cfg = _cfg(path)
    frame, pairs, dropped = _raw(path, cfg)
    assert [r["row"] for r in dropped] == [4, 8, 10]  # still dropped by the data stage
    report = validate("raw_pairs", frame, cfg)  # 1 of 50 rows per rule = 2 % > 1 %
    assert not report.success
    rules = _rules(report)
    assert [e["row"] for e in rules["expect_select_column_values_to_be_unique_within_record"].examples] == [4]
    assert [e["row"] for e in rules["expect_column_value_lengths_to_be_between"].examples] == [8]
    assert [e["row"] for e in rules["expect_column_pair_values_to_be_equal"].examples] == [10]
    # A looser tolerance lets the same file through (its dirty rows are dropped and listed).
    assert validate("raw_pairs", frame, _cfg(path, "contracts.raw_pairs.max_invalid_fraction=0.05")).success


def test_raw_pairs_report_duplicated_prompts(tmp_path):
    path = _write_jsonl(tmp_path / "pairs.jsonl", _pairs(40, **{"5": "dup", "6": "dup"}))
    cfg = _cfg(path)
    report = validate("raw_pairs", _raw(path, cfg)[0], cfg)
    dup = _rules(report)["expect_column_values_to_be_unique"]
    assert dup.column == "prompt" and dup.unexpected_count == 3
    assert sorted(e["row"] for e in dup.examples) == [1, 6, 7]
    assert "row 6" in ContractError(_report(report)).args[0]


def test_raw_pairs_missing_column_is_named_first():
    frame = pd.DataFrame({"row": [1, 2], "prompt": ["a", "b"], "rejected_prompt": ["a", "b"], "chosen": ["x", "y"]})
    report = validate("raw_pairs", frame, _cfg())
    assert not report.success
    first = report.failures[0]
    assert first.rule == "expect_column_to_exist" and first.column == "rejected"


@pytest.mark.parametrize("content, message", [
    (b'{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": "\\n\\nHuman: a\\n\\nAssistant: c"}\n{not json\n',
     r"row 2: not valid JSON"),
    (b'{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b"}\n', r"row 1: missing column 'rejected'"),
    (b'{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": "\\n\\nHuman: a\\n\\nAssistant: c"}\n\xff\xfe\n',
     r"row 2: not UTF-8"),
])
def test_unreadable_raw_input_fails_early_with_the_row(tmp_path, content, message):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_pairs(_cfg(path))
    with pytest.raises(DataError, match="file not found"):
        load_pairs(_cfg(tmp_path / "missing.jsonl"))


# -- splits ------------------------------------------------------------------------------------


def test_splits_pass_on_the_shared_file(hh_file):
    cfg = _cfg(hh_file)
    _, pairs, _ = _raw(hh_file, cfg)
    assert validate("splits", splits_frame(make_splits(pairs, cfg)), cfg).success


def test_splits_fail_on_prompt_leakage_and_dirty_rows(hh_file):
    cfg = _cfg(hh_file)
    _, pairs, _ = _raw(hh_file, cfg)
    splits = make_splits(pairs, cfg)
    leaked = splits["sft"][0]
    splits["eval_prompts"] = [leaked, *splits["eval_prompts"][1:]]  # same prompt in sft and eval
    same = dict(splits["rm_train"][0], rejected=splits["rm_train"][0]["chosen"])
    splits["rm_train"] = [same, *splits["rm_train"][1:]]
    report = validate("splits", splits_frame(splits), cfg)
    rules = _rules(report)
    leak = rules["expect_column_values_to_be_unique"]
    assert leak.unexpected_count == 2 and {e["row"] for e in leak.examples} == {leaked["row"]}
    assert [e["row"] for e in rules["expect_select_column_values_to_be_unique_within_record"].examples] == [same["row"]]


def test_the_gold_reward_models_pairs_are_disjoint_from_the_proxys(hh_file):
    cfg = _cfg(hh_file, "data.splits.gold_rm_train=16", "data.splits.gold_rm_eval=8")
    _, pairs, _ = _raw(hh_file, cfg)
    splits = make_splits(pairs, cfg)
    assert validate("splits", splits_frame(splits), cfg).success
    planted = splits["rm_train"][3]  # a pair the proxy RM trains on, planted among the gold RM's
    splits["gold_rm_train"] = [*splits["gold_rm_train"][:-1], planted]
    report = validate("splits", splits_frame(splits), cfg)
    (overlap,) = [f for f in report.failures if f.column == "pair_digest"]
    assert not report.success and overlap.rule == "expect_column_values_to_be_unique"
    assert overlap.unexpected_count == 2 and {e["row"] for e in overlap.examples} == {planted["row"]}


def test_splits_fail_on_wrong_sizes(hh_file):
    cfg = _cfg(hh_file)
    _, pairs, _ = _raw(hh_file, cfg)
    frame = splits_frame(make_splits(pairs, cfg))
    report = validate("splits", frame[frame["split"] != "ppo_prompts"], cfg)
    assert {"expect_table_row_count_to_equal", "expect_column_distinct_values_to_equal_set"} <= set(_rules(report))


# -- SFT ---------------------------------------------------------------------------------------


def _sft_probe(n=8, eos=True, tokens=20, before=50.0, after=20.0, loss=2.5):
    return pd.DataFrame({"row": range(101, 101 + n), "response": ["ok"] * n, "response_tokens": [tokens] * n,
                         "ended_with_eos": [eos] * n, "perplexity_before": before, "perplexity_after": after,
                         "final_train_loss": loss})


def test_sft_contract_passes_a_sane_probe():
    assert validate("sft", _sft_probe(), load_config("demo")).success


def test_sft_contract_fails_on_nan_loss_and_no_perplexity_drop():
    report = validate("sft", _sft_probe(loss=math.nan, after=60.0), load_config("demo"))
    rules = _rules(report)
    assert rules["expect_column_values_to_not_be_null"].column == "final_train_loss"
    assert rules["expect_column_pair_values_a_to_be_greater_than_b"].unexpected_count == 8


def test_sft_contract_fails_on_missing_eos_and_runaway_length():
    cfg = load_config("demo")
    probe = _sft_probe(eos=False, tokens=cfg.sft.probe_max_new_tokens)
    rules = _rules(validate("sft", probe, cfg))
    eos = rules["expect_column_values_to_be_in_set"]
    assert eos.column == "ended_with_eos" and eos.unexpected_count == 8 and eos.examples[0]["row"] == 101
    assert "expect_column_mean_to_be_between" in rules
    # The tiny preset's random model is judged on loss and perplexity only.
    assert validate("sft", probe, load_config("tiny")).success


# -- the gate: MLflow artifacts, tags, stop and warn -------------------------------------------


def _report(suite_report):
    from data_contracts.gate import GateReport

    return GateReport(stage="test", mode="stop", suites=[suite_report])


def test_gate_logs_result_and_data_docs_and_raises_in_stop_mode(tmp_path):
    client = tracking.client()
    run = client.create_run(tracking.experiment_id(client, "contracts-test"))
    path = _write_jsonl(tmp_path / "pairs.jsonl", _pairs(20, **{"2": "same"}))
    cfg = _cfg(path)
    frame = _raw(path, cfg)[0]
    with pytest.raises(ContractError) as err:
        gate("data", {"raw_pairs": frame}, cfg, mlflow_client=client, run_id=run.info.run_id)
    message = str(err.value)
    assert "suite 'raw_pairs'" in message and "expect_select_column_values_to_be_unique_within_record" in message
    assert "column 'chosen,rejected'" in message and "1 of 20 rows unexpected" in message and "row 3:" in message
    tags = client.get_run(run.info.run_id).data.tags
    assert tags["rlhf.contract"] == "failed" and tags["rlhf.contract.raw_pairs"] == "failed"
    files = {f.path for f in client.list_artifacts(run.info.run_id, "contracts")}
    assert {"contracts/raw_pairs.validation.json", "contracts/data_docs"} <= files
    local = tracking.download(f"runs:/{run.info.run_id}/contracts")
    result = json.loads((local / "raw_pairs.validation.json").read_text())
    assert result["success"] is False and result["statistics"]["unsuccessful_expectations"] == 1
    pages = list((local / "data_docs" / "raw_pairs" / "validations").rglob("*.html"))
    assert len(pages) == 1
    html = pages[0].read_text()
    assert "raw_pairs" in html and "Failed" in html
    assert (local / "data_docs" / "raw_pairs" / "index.html").exists()

    warn = load_config("tiny", [f"data.pairs={path}", "contracts.mode=warn"])
    run2 = client.create_run(tracking.experiment_id(client, "contracts-test"))
    report = gate("data", {"raw_pairs": frame}, warn, mlflow_client=client, run_id=run2.info.run_id)
    assert not report.success and "row 3" in report.message() and "| raw_pairs | **failed** |" in report.markdown()
    assert client.get_run(run2.info.run_id).data.tags["rlhf.contract_mode"] == "warn"

