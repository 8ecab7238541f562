"""`rlhf` command line: run the pipeline (no server needed), serve deployments, show config."""

from __future__ import annotations

import argparse
import os
import sys

import yaml


def _env_defaults() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="demo", help="a preset name in infra/presets (tiny, demo) or a YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set sft.lr=2e-5 (repeatable)")


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    parser = argparse.ArgumentParser(prog="rlhf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the pipeline on the embedded defaults (no server needed)")
    _config_args(run)
    run.add_argument("--stages", default=None, help="comma-separated subset of stages (default: all)")
    run.add_argument("--from-run", default=None, help="pipeline run id (or 'latest') whose outputs feed skipped stages")

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
        cfg = load_config(args.preset, args.overrides)  # fail fast, before Prefect starts
        stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
        if stages is None or "data" in stages:
            from stages.sources import data_dir, resolve_local

            resolve_local(cfg.data.pairs, data_dir(cfg.data))
        from flows.rlhf import rlhf
        from stages import tracking

        run_id = rlhf(preset=args.preset, overrides=args.overrides, stages=stages, from_run=args.from_run)
        print(f"\nPipeline run {run_id} finished.\nMLflow store: {tracking.tracking_uri()}\n"
              f"Open it with: mlflow ui --backend-store-uri {tracking.tracking_uri()}")
        return 0
    except (ConfigError, DataError) as err:
        print(f"rlhf: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
