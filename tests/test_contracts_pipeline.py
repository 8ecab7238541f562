"""Gates in the real flow (real Prefect server, MLflow SQLite, GX): a corrupted copy of the shared
data stops at the first gate with its row numbers, no later stage runs, registered versions of an
earlier good run are untouched, the Data Docs are in the stage's run; warn mode goes on; the CLI
ends a failed gate with one line and exit code 2."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from data_contracts import ContractError
from stages.compute.loading import DataError
from stages.orchestration import lineage, tracking

CORRUPT_EVERY = 20  # 116 of 2312 rows get rejected = chosen: 5 % > the 1 % tolerance


@pytest.fixture(scope="module")
def corrupted(hh_file, tmp_path_factory):
    path = tmp_path_factory.mktemp("corrupt") / "pairs.jsonl"
    with gzip.open(hh_file, "rt", encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    rows = []
    for i in range(10, len(lines), CORRUPT_EVERY):
        record = json.loads(lines[i])
        record["rejected"] = record["chosen"]
        lines[i] = json.dumps(record)
        rows.append(i + 1)  # line numbers
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, rows


@pytest.fixture(scope="module")
def good_run(prefect_server, hh_file):
    from flows.rlhf import rlhf

    return rlhf(preset="tiny", overrides={"sft.max_steps": 2}, stages=["data", "sft"])


def _versions(name: str) -> dict[str, dict]:
    client = tracking.client()
    return {str(mv.version): dict(mv.tags) for mv in client.search_model_versions(f"name = '{name}'")}


def test_good_run_passes_both_gates(good_run):
    children = {run.data.tags["rlhf.stage"]: run for run in lineage.stage_runs(good_run)}
    assert children["data"].data.tags["rlhf.contract"] == "passed"
    assert children["data"].data.tags["rlhf.contract.raw_pairs"] == "passed"
    assert children["sft"].data.tags["rlhf.contract"] == "passed"
    outputs = lineage.outputs_of(good_run)
    name, version = outputs["sft_model"].removeprefix("models:/").split("/")
    assert _versions(name)[version]["rlhf.contract"] == "passed"
    probe = tracking.download(outputs["sft_probe"])
    import pandas as pd

    frame = pd.read_parquet(probe)
    assert len(frame) == 8 and {"response_tokens", "ended_with_eos", "perplexity_after"} <= set(frame.columns)


def test_corrupted_data_stops_at_the_first_gate(good_run, corrupted):
    from flows.rlhf import rlhf

    path, bad_rows = corrupted
    before = _versions("rlhf-tiny-sft")
    client = tracking.client()
    exp = client.get_experiment_by_name("rlhf").experiment_id
    known = {r.info.run_id for r in client.search_runs([exp], filter_string="tags.`rlhf.kind` = 'pipeline'")}
    with pytest.raises(ContractError) as err:
        rlhf(preset="tiny", overrides={"data.pairs": str(path)}, stages=["data", "sft"])
    message = str(err.value)
    assert "suite 'raw_pairs'" in message and "expect_select_column_values_to_be_unique_within_record" in message
    assert f"{len(bad_rows)} of 2312 rows unexpected" in message
    assert all(f"row {row}:" in message for row in bad_rows[:5])

    (failed,) = [r for r in client.search_runs([exp], filter_string="tags.`rlhf.kind` = 'pipeline'")
                 if r.info.run_id not in known]
    assert failed.info.status == "FAILED"
    children = lineage.stage_runs(failed.info.run_id)
    assert [r.data.tags["rlhf.stage"] for r in children] == ["data"]  # SFT never started
    data_run = children[0]
    assert data_run.data.tags["rlhf.contract"] == "failed"
    assert lineage.outputs_of(failed.info.run_id) == {}  # nothing feeds a later --from-run
    assert _versions("rlhf-tiny-sft") == before  # earlier registered versions untouched
    docs = tracking.download(f"runs:/{data_run.info.run_id}/contracts/data_docs/raw_pairs")
    html = next((docs / "validations").rglob("*.html")).read_text()
    assert "Failed" in html and "unique across columns" in html
    assert f"{len(bad_rows)} unexpected values found" in html
    summary = tracking.download(f"runs:/{data_run.info.run_id}/contracts/data_gate.md").read_text()
    assert "raw_pairs" in summary  # the gate's summary under a name that says what it is


def test_warn_mode_reports_and_goes_on(prefect_server, corrupted):
    from flows.rlhf import rlhf

    path, _ = corrupted
    run_id = rlhf(preset="tiny", overrides={"data.pairs": str(path), "contracts.mode": "warn"}, stages=["data"])
    assert tracking.client().get_run(run_id).info.status == "FINISHED"
    (data_run,) = lineage.stage_runs(run_id)
    assert data_run.data.tags["rlhf.contract"] == "failed" and data_run.data.tags["rlhf.contract_mode"] == "warn"
    assert "splits" in lineage.outputs_of(run_id)


def test_bad_file_inside_the_flow_is_a_data_error(prefect_server, tmp_path):
    from flows.rlhf import rlhf

    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b'{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": "\\n\\nHuman: a\\n\\nAssistant: c"}\n\xff\n')
    with pytest.raises(DataError, match="row 2: not UTF-8"):
        rlhf(preset="tiny", overrides={"data.pairs": str(path)}, stages=["data"])


def test_cli_ends_a_failed_gate_with_one_line(corrupted):
    path, bad_rows = corrupted
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "tiny", "--stages", "data",
                          "--set", f"data.pairs={path}"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("rlhf: ")]
    assert len(lines) == 1 and "suite 'raw_pairs'" in lines[0] and f"row {bad_rows[0]}:" in lines[0]
    assert all(len(line) < 400 for line in out.stderr.splitlines() if not line.startswith("rlhf: "))
