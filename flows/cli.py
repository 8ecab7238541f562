"""`rlhf` command line: run the pipeline (no server needed), serve deployments, show config."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

import yaml


def _env_defaults() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's ephemeral API server can take over its default wait to start on a busy 2-core box.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="demo", help="a preset name in infra/presets (tiny, demo) or a YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set sft.lr=2e-5 (repeatable)")


@contextlib.contextmanager
def _quiet_expected_errors(kinds: tuple[type[BaseException], ...]):
    """Prefect logs a failing task's or flow's exception with its traceback. For bad data and
    failed contracts the one-line message is the whole story: drop the traceback from those log
    records (other errors keep theirs)."""

    class Strip(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            expected = record.exc_info and isinstance(record.exc_info[1], kinds)
            text = record.getMessage()
            if expected or any(f"{k.__name__}(" in text or f"{k.__name__}:" in text for k in kinds):
                record.exc_info, record.exc_text, record.args = None, None, ()
                text = text.split("\nTraceback", 1)[0]
                record.msg = text if len(text) <= 160 else text[:160] + "…"
            return True

    strip = Strip()
    handlers = [h for name in ("prefect", "prefect.flow_runs", "prefect.task_runs", "")
                for h in logging.getLogger(name).handlers]
    for handler in handlers:
        handler.addFilter(strip)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(strip)


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    parser = argparse.ArgumentParser(prog="rlhf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the pipeline on the embedded defaults (no server needed)")
    _config_args(run)
    run.add_argument("--stages", default=None, help="comma-separated subset of stages (default: all)")
    run.add_argument("--from-run", default=None, help="pipeline run id (or 'latest') whose outputs feed skipped stages")
    run.add_argument("--resume", default=None, metavar="RUN_ID",
                     help="continue a failed or killed pipeline run: finished stages are kept, training resumes from checkpoints")
    run.add_argument("--contracts", choices=["stop", "warn"], default=None,
                     help="a failed data contract stops the flow (stop, default) or is reported (warn)")

    serve = sub.add_parser("serve", help="serve the deployments rlhf/full, rlhf/sft, ...")
    serve.add_argument("--preset", default=os.environ.get("RLHF_PRESET", "demo"))

    show = sub.add_parser("config", help="print the resolved configuration")
    _config_args(show)

    args = parser.parse_args(argv)
    from stages.config import ConfigError, load_config
    from stages.sources import DataError

    try:
        if args.command == "config":
            print(yaml.safe_dump(load_config(args.preset, args.overrides).model_dump(mode="json"), sort_keys=False))
            return 0
        if args.command == "serve":
            from prefect import serve as prefect_serve

            from flows.rlhf import deployments

            prefect_serve(*deployments(args.preset))
            return 0
        if args.contracts:
            args.overrides.append(f"contracts.mode={args.contracts}")
        cfg = load_config(args.preset, args.overrides)  # fail fast, before Prefect starts
        stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
        if stages is None or "data" in stages:
            from stages.sources import data_dir, resolve_local

            resolve_local(cfg.data.pairs, data_dir(cfg.data))
        from flows.rlhf import rlhf
        from stages import tracking

        from data_contracts import ContractError

        try:
            with _quiet_expected_errors((ContractError, DataError)):
                run_id = rlhf(preset=args.preset, overrides=args.overrides, stages=stages, from_run=args.from_run,
                              resume=args.resume)
        except ContractError as err:
            print(f"rlhf: {err}\nThe gate's report (JSON result, Data Docs) is in MLflow run {err.report.run_id} "
                  f"under contracts/.", file=sys.stderr)
            return 2
        print(f"\nPipeline run {run_id} finished.\nMLflow store: {tracking.tracking_uri()}\n"
              f"Open it with: mlflow ui --backend-store-uri {tracking.tracking_uri()}")
        return 0
    except (ConfigError, DataError) as err:
        print(f"rlhf: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
