"""The gate: run a handoff's suites on the stage's probe frames with an ephemeral GX context,
store the JSON validation result and the Data Docs HTML in the stage's MLflow run, tag the run
(and the model version it registered) `rlhf.contract=passed|failed`, and raise `ContractError`
on failure when `contracts.mode` is `stop`.

No Prefect here: the flow calls `check_handoff` from a plain task and publishes `report.markdown()`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from data_contracts.suites import GROUPED, SUITES, derive
from stages.leaves.config import PipelineConfig
from stages.leaves.tags import CONTRACT_TAG
from stages.orchestration import registry, tracking

ARTIFACT_DIR = "contracts"


class ContractError(RuntimeError):
    """A data contract failed; the message names the suite, rule, column, count and example rows."""

    def __init__(self, report: GateReport):
        self.report = report
        super().__init__(report.message())


@dataclass
class Failure:
    rule: str  # expectation type
    column: str | None
    unexpected_count: int | None
    element_count: int | None
    examples: list[dict]  # {"row": line number in the source file, column: value, ...}
    detail: str = ""  # observed value, threshold or the exception GX reported

    def describe(self) -> str:
        where = f" on column '{self.column}'" if self.column else ""
        count = ""
        if self.unexpected_count is not None:
            count = f": {self.unexpected_count} of {self.element_count} rows unexpected"
        text = f"{self.rule}{where}{count}"
        if self.detail:
            text += f" ({self.detail})"
        if self.examples:
            text += "; e.g. " + "; ".join(_example(e) for e in self.examples)
        return text


@dataclass
class SuiteReport:
    suite: str
    success: bool
    statistics: dict
    failures: list[Failure] = field(default_factory=list)
    result: dict = field(default_factory=dict, repr=False)  # the GX validation result as JSON
    group: str | None = None  # a `GROUPED` suite's name: this report is one group's (`suite` names the group)


@dataclass
class GateReport:
    stage: str
    mode: str
    suites: list[SuiteReport]
    run_id: str | None = None

    @property
    def success(self) -> bool:
        """Every suite passed; of a grouped suite (one judge each), at least one group."""
        groups: dict[str, list[bool]] = {}
        for s in self.suites:
            if s.group is None and not s.success:
                return False
            if s.group is not None:
                groups.setdefault(s.group, []).append(s.success)
        return all(any(passed) for passed in groups.values())

    def message(self) -> str:
        failed = [s for s in self.suites if not s.success]
        if not failed:
            return f"contract gate after '{self.stage}': passed ({', '.join(s.suite for s in self.suites)})"
        parts = []
        for s in failed:
            rules = " | ".join(f.describe() for f in s.failures)
            parts.append(f"suite '{s.suite}' failed: {rules}")
        verdict = "passed, but " if self.success else ""
        return f"contract gate after '{self.stage}': {verdict}" + " || ".join(parts)

    def markdown(self) -> str:
        lines = [f"# Contract gate after `{self.stage}`: {'passed' if self.success else 'FAILED'}", "",
                 f"Mode `{self.mode}`; MLflow run `{self.run_id}`, artifacts under `{ARTIFACT_DIR}/`.", "",
                 "| suite | result | expectations passed |", "|---|---|---|"]
        for s in self.suites:
            st = s.statistics
            lines.append(f"| {s.suite} | {'passed' if s.success else '**failed**'} | "
                         f"{st.get('successful_expectations', 0)}/{st.get('evaluated_expectations', 0)} |")
        for s in self.suites:
            for f in s.failures:
                lines += ["", f"- **{s.suite}**: {f.describe()}"]
        return "\n".join(lines) + "\n"


def _example(values: dict) -> str:
    row = values.get("row")
    rest = ", ".join(f"{k}={_short(v)}" for k, v in values.items() if k != "row")
    return f"row {row}: {rest}" if rest else f"row {row}"


def _short(value: Any, width: int = 60) -> str:
    text = repr(_plain(value))
    return text if len(text) <= width else text[: width - 1] + "…'"


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers, floats to 6 digits: `0.0259067`, not `np.float64(0.025906735751295335)`."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    return float(f"{value:.6g}") if isinstance(value, float) else value


def _exception_message(info: Any) -> str:
    """The first exception message in GX's (possibly nested) exception_info."""
    if isinstance(info, dict):
        if info.get("raised_exception") and info.get("exception_message"):
            return str(info["exception_message"]).splitlines()[0]
        for value in info.values():
            found = _exception_message(value)
            if found:
                return found
    return ""


def _failures(result: dict, max_examples: int) -> list[Failure]:
    out = []
    for item in result["results"]:
        if item["success"]:
            continue
        config, res = item["expectation_config"], item.get("result") or {}
        kwargs = config.get("kwargs", {})
        column = kwargs.get("column") or (
            ",".join(kwargs["column_list"]) if "column_list" in kwargs else
            f"{kwargs['column_A']},{kwargs['column_B']}" if "column_A" in kwargs else None)
        examples = list(res.get("partial_unexpected_index_list") or [])[:max_examples]
        detail_parts = []
        if "observed_value" in res:
            detail_parts.append(f"observed {_plain(res['observed_value'])!r}")
        bounds = {k: kwargs[k] for k in ("min_value", "max_value", "value", "value_set", "mostly") if k in kwargs}
        if bounds:
            detail_parts.append(", ".join(f"{k}={v!r}" for k, v in bounds.items()))
        error = _exception_message(item.get("exception_info"))
        if error:
            detail_parts.append(f"error: {error}")
        out.append(Failure(rule=config["type"], column=column, unexpected_count=res.get("unexpected_count"),
                           element_count=res.get("element_count"), examples=examples,
                           detail="; ".join(detail_parts)))
    # Missing columns first: they explain every other failure on that column.
    out.sort(key=lambda f: f.rule != "expect_column_to_exist")
    return out


def _context():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx  # deferred: seconds to load, and only after GX_ANALYTICS_ENABLED is set

    for name in ("great_expectations", "great_expectations.data_context.types.base"):  # "created temporary directory…"
        logging.getLogger(name).setLevel(logging.WARNING)
    from great_expectations.data_context.types.base import ProgressBarsConfig  # deferred: as gx above

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    return context


def validate(suite: str, frame: pd.DataFrame, cfg: PipelineConfig, docs_dir: Path | None = None) -> SuiteReport:
    """Run one suite on a frame (ephemeral GX context); with docs_dir, build Data Docs there."""
    import great_expectations as gx  # deferred: as above

    context = _context()
    if docs_dir is not None:
        context.add_data_docs_site("rlhf", {
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        })
    batch = context.data_sources.add_pandas("rlhf").add_dataframe_asset(suite).add_batch_definition_whole_dataframe("probe")
    expectation_suite = context.suites.add(gx.ExpectationSuite(name=suite))
    for expectation in SUITES[suite](cfg):
        expectation_suite.add_expectation(expectation)
    definition = context.validation_definitions.add(gx.ValidationDefinition(name=suite, data=batch, suite=expectation_suite))
    index = ["row"] if "row" in frame.columns else []
    result_format = {"result_format": "SUMMARY", "unexpected_index_column_names": index,
                     "partial_unexpected_count": max(20, cfg.contracts.max_examples)}
    # Our site only: the ephemeral context's default `local_site` lives in a temp folder of its own
    # that nothing removes (4 MB of pages and fonts a suite, left behind on every gate).
    actions = [gx.checkpoint.UpdateDataDocsAction(name="data_docs", site_names=["rlhf"])] if docs_dir is not None else []
    checkpoint = context.checkpoints.add(gx.Checkpoint(name=suite, validation_definitions=[definition],
                                                       actions=actions, result_format=result_format))
    run = checkpoint.run(batch_parameters={"dataframe": derive(suite, frame)})
    result = next(iter(run.run_results.values())).to_json_dict()
    return SuiteReport(suite=suite, success=bool(result["success"]), statistics=result["statistics"],
                       failures=_failures(result, cfg.contracts.max_examples), result=result)


def _keep_docs(site: Path, out: Path) -> None:
    """The HTML pages and the stylesheet of a Data Docs site (not its 4 MB of fonts)."""
    for path in site.rglob("*"):
        if path.is_file() and (path.suffix == ".html" or "styles" in path.parts or path.suffix in (".png", ".ico")
                               and "images" in path.parts and path.stat().st_size < 200_000):
            target = out / path.relative_to(site)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def gate(stage: str, frames: dict[str, pd.DataFrame], cfg: PipelineConfig, *, mlflow_client=None,
         run_id: str | None = None, model_version: str | None = None) -> GateReport:
    """Run the suites of one handoff; log results + Data Docs into `run_id`; raise on failure
    when `cfg.contracts.mode == "stop"`. frames: suite name → probe frame; a `GROUPED` suite runs
    on each group's rows apart, reported as `<suite>.<value>`."""
    reports = []
    with tempfile.TemporaryDirectory(prefix=f"gate-{stage}-") as tmp:
        tmp_path = Path(tmp)
        for name, frame in frames.items():
            column = GROUPED.get(name)
            parts = ({f"{name}.{value}": rows for value, rows in frame.groupby(column, sort=False)}
                     if column and column in frame.columns else {name: frame})
            for suite, part in parts.items():
                site = tmp_path / "site" / suite
                report = validate(name, part.reset_index(drop=True), cfg, docs_dir=site)
                report.suite, report.group = suite, name if column else None
                reports.append(report)
            if mlflow_client is not None and run_id is not None:
                result_file = tmp_path / f"{suite}.validation.json"
                result_file.write_text(json.dumps(report.result, indent=1, default=str))
                mlflow_client.log_artifact(run_id, str(result_file), ARTIFACT_DIR)
                docs = tmp_path / "docs" / suite
                _keep_docs(site, docs)
                mlflow_client.log_artifacts(run_id, str(docs), f"{ARTIFACT_DIR}/data_docs/{suite}")
    out = GateReport(stage=stage, mode=cfg.contracts.mode, suites=reports, run_id=run_id)
    if mlflow_client is not None and run_id is not None:
        status = "passed" if out.success else "failed"
        mlflow_client.set_tag(run_id, CONTRACT_TAG, status)
        mlflow_client.set_tag(run_id, f"{CONTRACT_TAG}_mode", cfg.contracts.mode)
        for s in reports:
            mlflow_client.set_tag(run_id, f"{CONTRACT_TAG}.{s.suite}", "passed" if s.success else "failed")
        if model_version and model_version.startswith("models:/"):
            name, version = model_version.removeprefix("models:/").split("/")
            mlflow_client.set_model_version_tag(name, version, CONTRACT_TAG, status)
        with tempfile.TemporaryDirectory() as tmp:  # the artifact's name: contracts/<stage>_gate.md
            summary = Path(tmp) / f"{stage}_gate.md"
            summary.write_text(out.markdown())
            mlflow_client.log_artifact(run_id, str(summary), ARTIFACT_DIR)
    if not out.success and cfg.contracts.mode == "stop":
        raise ContractError(out)
    return out


def check_handoff(stage: str, outputs: dict[str, str], cfg: PipelineConfig) -> GateReport | None:
    """The gate after `stage`, on the probe frames named in its outputs (None: no contract yet)."""
    spec = registry.get(stage)
    if not spec.contract:
        return None
    missing = [key for key in (spec.run_output, *spec.contract.values()) if key not in outputs]
    if missing:
        raise ValueError(f"contract gate after '{stage}': the stage's outputs lack {', '.join(missing)}")
    frames = {}
    for suite, key in spec.contract.items():
        with tracking.fetched(outputs[key]) as probe:
            frames[suite] = pd.read_parquet(probe)
    model = outputs.get(spec.model_output) if spec.model_output else None
    return gate(stage, frames, cfg, mlflow_client=tracking.client(), run_id=outputs[spec.run_output], model_version=model)
