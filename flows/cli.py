"""`rlhf` command line: run the pipeline (no server needed), serve its deployments (alone, or with
a Prefect and an MLflow server: up/down), list and compare runs, show the config."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

import yaml
from filelock import FileLock

from flows import services
from flows.config_doc import REFERENCE_COMMAND, config_reference, explain
from flows.supervise import SUPERVISED, die_with_the_supervisor, supervise
from stages.compute.loading import DataError, ModelError, locate
from stages.leaves import allocator, interrupt
from stages.leaves.config import ConfigError, rlhf_home
from stages.leaves.tags import DESCRIPTION_TAG, FAILED_STAGE_TAG
from stages.orchestration import lineage, plan, registry, runs, tracking, tracking_queue
from stages.orchestration.config_loading import load_config
from stages.orchestration.plan import TRAINING_STAGES
from stages.pipeline.data import own_source_config, own_sources


def _env_defaults() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's ephemeral API server can take over its default wait to start on a busy 2-core box.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    # Runs land where `rlhf up`'s UIs show them: its servers while they run (unless the shell names
    # others), else Prefect's ephemeral API on the same database and MLflow's SQLite store.
    os.environ.setdefault("PREFECT_HOME", services.prefect_home())
    if "PREFECT_API_URL" not in os.environ and "MLFLOW_TRACKING_URI" not in os.environ:
        os.environ.update(services.running_env())


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, help="a preset name in infra/presets (tiny, demo) or a YAML file "
                                                       "(default: demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set sft.lr=2e-5 (repeatable)")


@contextlib.contextmanager
def _quiet_expected_errors(kinds: tuple[type[BaseException], ...]):
    """Prefect logs a failing task's or flow's exception with its traceback. For bad data and
    failed contracts the one-line message is the whole story: drop the traceback from the log
    records of the errors in `kinds`, and cut short those that name one (the caller says the rest)."""

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


def _open_stores() -> None:
    """Open the Prefect database (the ephemeral API server creates or migrates it as it starts)
    and the MLflow SQLite store, each under a file lock: two `rlhf run`s started at once on a
    fresh home would otherwise both create the same tables ("table ... already exists")."""
    from prefect.client.orchestration import get_client  # deferred, as all of Prefect here: seconds to load
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME


    if not PREFECT_API_URL.value():
        home = Path(PREFECT_HOME.value())
        home.mkdir(parents=True, exist_ok=True)
        with FileLock(str(home / "ephemeral-server.lock")):
            get_client(sync_client=True)  # starts this process's ephemeral API server, used by the flow
    uri = tracking.tracking_uri()
    if uri.startswith("sqlite:///"):
        mlflow_client = tracking.client()  # makes the database's folder
        with FileLock(uri.removeprefix("sqlite:///") + ".lock"):
            mlflow_client.search_experiments(max_results=1)


@contextlib.contextmanager
def _stop_on_signals():
    """While the flow runs here: SIGINT/SIGTERM ask the running stage to stop at its next step
    boundary (stages/leaves/interrupt.py); the previous handlers come back afterwards."""


    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    interrupt.install_handlers()
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _check_runs_exist(args: argparse.Namespace) -> None:
    """--from-run and --resume name pipeline runs of the store: a wrong id is a one-line error
    before any stage starts."""
    from mlflow.exceptions import MlflowException  # deferred, as MLflow below: only where a store is read


    for flag, run_id in (("--from-run", args.from_run), ("--resume", args.resume)):
        if not run_id or run_id == "latest":
            continue
        try:
            tracking.client().get_run(run_id)
        except MlflowException:
            raise ConfigError(f"{flag} {run_id}: no such run in the MLflow store {tracking.tracking_uri()} "
                              f"(`rlhf runs` lists the pipeline runs)") from None


def _recorded_failure(cfg, resume: str | None, state) -> str | None:
    """How the pipeline run of this `rlhf run` failed, as its flow recorded it in MLflow (its
    description: the stage, the reason, the fix); None where no stage's failure was recorded."""
    if resume:
        run = tracking.client().get_run(resume)
    elif state is not None:
        try:
            run = lineage.pipeline_run_of_flow_run(cfg.experiment, str(state.state_details.flow_run_id))
        except LookupError:
            return None
    else:
        return None
    if run.info.status != "FAILED" or FAILED_STAGE_TAG not in run.data.tags:
        return None
    return "\n".join(run.data.tags[DESCRIPTION_TAG].split("\n\n"))


def _up(args: argparse.Namespace) -> int:
    try:
        state = services.up(args.preset, args.host, args.prefect_port, args.mlflow_port, args.artifacts, args.timeout)
    except services.ServicesError as err:
        print(f"rlhf: {err}", file=sys.stderr)
        return 1
    env = state["env"]
    print(f"Prefect UI    {state['urls']['prefect']}\n"
          f"MLflow UI     {state['urls']['mlflow']}   (artifacts: {state['artifacts']})\n"
          f"Deployments   {state['urls']['serve']}   (rlhf serve --preset {state['preset']})\n"
          f"Logs          {services.state_dir()}/*.log\n\n"
          f"export PREFECT_API_URL={env['PREFECT_API_URL']} MLFLOW_TRACKING_URI={env['MLFLOW_TRACKING_URI']}\n"
          f"{services.command('prefect')} deployment run rlhf/full --watch\n"
          f"{services.command('rlhf')} down   # stops them")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException  # deferred: MLflow

    run_a, run_b = args.runs
    png = Path(args.png or f"rlhf-compare-{run_a[:8]}-{run_b[:8]}.png")
    try:
        table = runs.compare(run_a, run_b, png)
    except MlflowException as err:
        print(f"rlhf: {err.message}", file=sys.stderr)
        return 2
    print(table)
    print(f"\nPPO curves: {png}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException  # deferred: MLflow, for the commands that read a store

    from stages.orchestration import study_records as studies  # deferred: as MLflow above

    try:
        text = studies.study_report(args.study_run)
    except (MlflowException, ValueError) as err:
        print(f"rlhf: {getattr(err, 'message', err)}", file=sys.stderr)
        return 2
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def _parse_arms(specs: list[str]) -> dict[str, dict]:
    """`--arm 'NAME={ppo.actor_lr: 1.0e-4}'` (repeatable) → {NAME: overrides}."""

    arms: dict[str, dict] = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        try:
            overrides = yaml.safe_load(text) if sep else None
        except yaml.YAMLError as err:
            raise ConfigError(f"--arm {spec!r}: the overrides after '=' are not YAML ({err})") from None
        if not name.strip() or not isinstance(overrides, dict):
            raise ConfigError(f"--arm {spec!r}: write NAME={{key: value, ...}}, e.g. --arm 'vanilla lr x50="
                              f"{{ppo.preset: vanilla, ppo.actor_lr: 1.0e-4}}'")
        arms[name.strip()] = overrides
    return arms


def _stopped(err: Exception, gate_report: str) -> int:
    """The exit code of a flow (`rlhf run`, `rlhf study`) that stopped on request at a step boundary
    (Prefect's CancelledRun: 130; the flow said how to resume) or at a failed gate (ContractError: 2;
    `gate_report` says where its report is, `{run_id}` its MLflow run); the error said on stderr."""
    from data_contracts import ContractError  # deferred: Great Expectations

    if isinstance(err, ContractError):
        print(f"rlhf: {err}\n{gate_report.format(run_id=err.report.run_id)}", file=sys.stderr)
        return 2
    print(f"rlhf: {err}", file=sys.stderr)
    return 130


def _study(args: argparse.Namespace) -> int:
    if args.resume and (args.preset or args.overrides):
        raise ConfigError(f"--resume {args.resume}: a resumed study keeps the config it started with; leave out "
                          f"--preset/--set (--arm adds an arm)")
    args.preset = args.preset or "study"
    new_arms = _parse_arms(args.arms)
    if not args.resume:
        load_config(args.preset, args.overrides)  # fail fast, before Prefect starts
    from prefect.exceptions import CancelledRun  # deferred: Prefect

    from data_contracts import ContractError  # deferred: Great Expectations and Prefect load only for a run
    from flows.study import study  # deferred: Prefect

    _open_stores()
    expected = (ContractError, ConfigError, tracking_queue.TrackingUnavailable)
    try:
        with _quiet_expected_errors(expected), _stop_on_signals():
            study_id = study(preset=args.preset, overrides=args.overrides, resume=args.resume, new_arms=new_arms)
    except (CancelledRun, ContractError) as err:
        return _stopped(err, "The gate's report is in MLflow run {run_id} under contracts/; continue the study with: "
                             f"{services.command('rlhf')} study --resume <study run id> (printed above)")

    folder = rlhf_home() / "studies" / study_id
    print(f"\nStudy run {study_id} finished.\n\n{(folder / 'study.md').read_text()}\nFigure: {folder / 'study.png'} "
          f"(and in MLflow run {study_id}, artifacts study/)\nContinue or repeat it: {services.command('rlhf')} study --resume {study_id}")
    return 0


def _precision_line(cfg) -> str:
    """What model.precision resolves to on this machine (a YAML comment)."""
    import torch  # deferred: torch only for the precision line

    from stages.leaves import precision  # deferred: imports torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return (f"# model.precision {cfg.model.precision} resolves to {precision.resolve(cfg.model.precision, device)} "
            f"on this machine ({precision.describe(device)})")


def _allocator_line() -> str:
    """The malloc the processes that train would start on (a YAML comment; stages/leaves/allocator.py)."""
    library = allocator.preloaded(allocator.environment(dict(os.environ)))
    return (f"# training processes run on {'TCMalloc (' + library + ')' if library else 'the system malloc'} "
            f"({allocator.VARIABLE}={os.environ.get(allocator.VARIABLE, 'auto')})")


def _plan_overrides(args: argparse.Namespace) -> list[str]:
    """--world-size / --deepspeed: the same launch for every training stage, as --set lines."""

    extra = []
    for stage in TRAINING_STAGES:
        if args.world_size is not None:
            extra.append(f"{stage}.launch.world_size={args.world_size}")
        if args.deepspeed is not None:
            extra.append(f"{stage}.launch.deepspeed={args.deepspeed}")
    return extra


def _plan(args: argparse.Namespace) -> int:
    """`rlhf plan`: the predicted memory table and whether every stage fits (exit 1 if not)."""

    args.preset = args.preset or "demo"
    cfg = load_config(args.preset, [*args.overrides, *_plan_overrides(args)])
    if args.fit_table:
        print(plan.fit_table(cfg, args.device_memory or 80.0))
        return 0
    stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
    predicted = plan.plan(cfg, stages=stages, architecture=args.architecture, device=args.device,
                          memory_gib=args.device_memory)
    print(predicted.table())
    verdict = predicted.check()
    print(f"\n{verdict.message}" if verdict.fits else f"\nrlhf plan: {verdict.message}")
    if not verdict.fits:
        print("the cheapest switches that make each stage fit:\n  " + "\n  ".join(plan.remedies(predicted, cfg)))
    return 0 if verdict.fits else 1


def _check_plan(args: argparse.Namespace, cfg, stages: list[str] | None) -> None:
    """`rlhf run`: refuse, before Prefect starts or any MLflow run exists, a config whose predicted
    peak memory does not fit a stage's device (--ignore-plan goes on). A model whose shape cannot be
    read without its weights (a hub model not in the local cache) is not planned: a note says so."""

    try:
        predicted = plan.plan(cfg, stages=stages, memory_gib=args.device_memory)
    except plan.PlanError as err:
        print(f"rlhf: no memory plan ({err})", file=sys.stderr)
        return
    verdict = predicted.check()
    if not verdict.fits:
        raise ConfigError(f"{verdict.message} (predicted peak memory; `rlhf plan` prints the table; "
                          f"--ignore-plan runs it anyway)")


def _serve_reward(args) -> int:
    from stages.compute.reward.serve import RewardScorer, make_app, make_server, token_from_env  # deferred: imports torch

    cfg = load_config(args.preset, args.overrides)
    token = token_from_env(args.auth_env)
    if args.auth_env and not token:
        raise ConfigError(f"--auth-env {args.auth_env}: that environment variable is not set")
    # SIGTERM (a service manager's stop) ends it as Ctrl-C does: uvicorn lets the requests in flight
    # finish, then raises the signal again, and the process exits normally, so a model copied from a
    # remote store is removed (`tracking.download`).
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    folder = Path(args.model) if Path(args.model).is_dir() else tracking.download(args.model)
    limits = cfg.reward_server
    app = make_app(RewardScorer(folder, cfg.model, cfg.reward.max_seq_len, limits), limits, token)
    server = make_server(app, args.host, args.port, limits)
    print(f"reward model {args.model} at http://{args.host}:{args.port}/score (POST {{prompts, responses, ended}} → "
          f"{{scores}}; GET /health, /metrics); PPO: --set ppo.reward=http://{args.host}:{args.port}/score",
          flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="run the pipeline on the embedded defaults (no server needed)")
    _config_args(run)
    run.add_argument("--stages", default=None, help="comma-separated subset of stages (default: all)")
    run.add_argument("--from-run", default=None, help="pipeline run id (or 'latest') whose outputs feed skipped stages")
    run.add_argument("--resume", default=None, metavar="RUN_ID",
                     help="continue a failed or killed pipeline run: finished stages are kept, training resumes from checkpoints")
    run.add_argument("--contracts", choices=["stop", "warn"], default=None,
                     help="a failed data contract stops the flow (stop, default) or is reported (warn)")
    run.add_argument("--force", action="store_true",
                     help="run every stage, even those whose inputs and config match an earlier run's (skipped by default)")
    run.add_argument("--ignore-plan", action="store_true",
                     help="start even if `rlhf plan` predicts a stage does not fit its device's memory")
    run.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                     help="memory per device for the plan check (default: the GPU's, or the host's available RAM)")


def _add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="predicted peak memory per device of each training stage and role, before "
                                       "any model loads; exit 1 if a stage does not fit")
    _config_args(plan)
    plan.add_argument("--world-size", type=int, default=None, help="ranks of every training stage "
                                                                   "(<stage>.launch.world_size)")
    plan.add_argument("--deepspeed", default=None, metavar="CONFIG",
                      help="DeepSpeed config of every training stage: zero2, zero3 or a path (<stage>.launch.deepspeed)")
    plan.add_argument("--architecture", default=None, metavar="CONFIG_JSON",
                      help="the model's shape from this config.json (a file, a folder or a name in "
                           "infra/architectures, e.g. llama-2-7b) instead of model.name_or_path's")
    plan.add_argument("--device", choices=["cpu", "cuda"], default=None,
                      help="where the stages compute (default: where `rlhf run` puts them on this machine)")
    plan.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                      help="memory per device (default: the GPU's, or the host's available RAM)")
    plan.add_argument("--stages", default=None, help="comma-separated training stages (default: all)")
    plan.add_argument("--fit-table", action="store_true",
                      help="the fit table of docs/guide/memory.md: Llama 7B-70B on 1, 8, 16 GPUs of --device-memory "
                           "(default 80) GiB, the cheapest memory switches each stage needs")


def _add_study_parser(sub) -> None:
    study = sub.add_parser("study", help="PPO arms (ppo-max, vanilla, ...) on one shared chain: curves and a table "
                                         "with confidence intervals")
    _config_args(study)
    study.add_argument("--resume", default=None, metavar="STUDY_RUN_ID",
                       help="continue a stopped study: finished arms are kept, an unfinished one resumes")
    study.add_argument("--arm", dest="arms", action="append", default=[], metavar="NAME={KEY: VALUE, ...}",
                       help="one more arm (repeatable): with --resume it joins that study on the same chain, and the "
                            "figure and table are made again with it; e.g. --arm 'vanilla lr x50={ppo.preset: "
                            "vanilla, ppo.actor_lr: 1.0e-4}'")


def _add_service_parsers(sub) -> None:
    """serve, up, down and serve-reward: the long-running services."""
    serve = sub.add_parser("serve", help="serve the deployments rlhf/full, rlhf/sft, ...")
    serve.add_argument("--preset", default=os.environ.get("RLHF_PRESET", "demo"))

    up = sub.add_parser("up", help="start a Prefect server, an MLflow server and `rlhf serve` in the background")
    up.add_argument("--preset", default=os.environ.get("RLHF_PRESET", "demo"), help="preset of the served deployments")
    up.add_argument("--host", default="127.0.0.1", help="the interface the servers listen on (default: loopback only)")
    up.add_argument("--prefect-port", type=int, default=4200)
    up.add_argument("--mlflow-port", type=int, default=5000)
    up.add_argument("--artifacts", default=None, metavar="DIR_OR_S3_URI",
                    help="MLflow artifact store: a folder or s3://bucket/prefix (default: mlartifacts/ in the RLHF home)")
    up.add_argument("--timeout", type=float, default=300, help="seconds to wait for each service to answer")
    sub.add_parser("down", help="stop what `rlhf up` started")

    serve_reward = sub.add_parser("serve-reward", help="serve a reward model over HTTP (the API of ppo.reward=http://…)")
    serve_reward.add_argument("--model", required=True,
                              help="a registered reward model (models:/<prefix>-reward/<version>), a runs:/ URI or a folder")
    serve_reward.add_argument("--preset", default=os.environ.get("RLHF_PRESET", "demo"),
                              help="preset whose model settings (pad token, precision) and reward.max_seq_len apply")
    serve_reward.add_argument("--host", default="127.0.0.1", help="interface (default: loopback only)")
    serve_reward.add_argument("--port", type=int, default=8765)
    serve_reward.add_argument("--auth-env", default=None, metavar="VAR",
                              help="require `Authorization: Bearer $VAR` (the token is read from the environment)")
    serve_reward.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                              help="override a config value, e.g. --set reward_server.queue_rows=512 (the "
                                   "reward_server section: batching and limits; repeatable)")


def _add_record_parsers(sub) -> None:
    """runs, compare and report: what MLflow recorded."""
    runs_command = sub.add_parser("runs", help="list pipeline runs: stages, status, headline metrics")
    runs_command.add_argument("--experiment", default="rlhf")
    runs_command.add_argument("--preset", default=None, help="only runs of this preset")
    runs_command.add_argument("--limit", type=int, default=10)

    compare = sub.add_parser("compare", help="compare two pipeline runs: headline table, PNG of the PPO curves")
    compare.add_argument("runs", nargs=2, metavar="RUN", help="pipeline run ids")
    compare.add_argument("--png", default=None, help="where to write the curves (default: rlhf-compare-<A>-<B>.png)")

    report = sub.add_parser("report", help="a study's table as Markdown, from its runs in MLflow")
    report.add_argument("study_run", metavar="STUDY_RUN", help="the study's MLflow run id")
    report.add_argument("--out", default=None, help="also write it to this file")


def _add_config_parser(sub) -> None:
    show = sub.add_parser("config", help="print the resolved configuration")
    _config_args(show)
    show.add_argument("--explain", action="store_true",
                      help="one line per field: value, the default where the preset or --set changed it, and the "
                           "description with the value's source (paper section, MOSS/TRL value or our reason)")
    show.add_argument("--markdown", action="store_true",
                      help=f"with --explain: the reference of every field (type, typed default, description) as "
                           f"markdown, whatever the preset: `{REFERENCE_COMMAND}`")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run_parser, _add_plan_parser, _add_study_parser, _add_service_parsers, _add_record_parsers,
                _add_config_parser):
        add(sub)
    return parser


def _config(args: argparse.Namespace) -> int:
    """`rlhf config`: the resolved config (or, with --explain --markdown, the reference of every field)."""
    if args.markdown:
        if not args.explain or args.preset or args.overrides:
            raise ConfigError(f"--markdown: the reference of the typed defaults; give it with --explain and "
                              f"without --preset/--set ({REFERENCE_COMMAND})")
        sys.stdout.write(config_reference())
        return 0
    args.preset = args.preset or "demo"
    cfg = load_config(args.preset, args.overrides)
    print(explain(cfg, args.preset, args.overrides) if args.explain
          else yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    print(_precision_line(cfg))
    print(_allocator_line())
    return 0


def _serve(args: argparse.Namespace) -> int:
    from prefect import serve as prefect_serve  # deferred: Prefect

    from flows.rlhf import deployments  # deferred: Prefect

    prefect_serve(*deployments(args.preset))
    return 0


def _down(args: argparse.Namespace) -> int:
    stopped = services.down()
    print(f"stopped {', '.join(stopped)}" if stopped else "nothing to stop")
    return 0


def _runs(args: argparse.Namespace) -> int:
    print(runs.format_runs(lineage.pipeline_runs(args.experiment, args.preset, max_results=args.limit)))
    return 0


def _run(args: argparse.Namespace) -> int:
    """`rlhf run`: the config and the data checked, the memory planned, then the flow."""
    if args.contracts:
        args.overrides.append(f"contracts.mode={args.contracts}")
    if args.resume and (args.preset or args.overrides):
        raise ConfigError(f"--resume {args.resume}: a resumed run keeps the config it started with; leave out "
                          f"--preset/--set/--contracts, or start a new run (--from-run {args.resume})")
    args.preset = args.preset or "demo"
    cfg = load_config(args.preset, args.overrides)  # fail fast, before Prefect starts
    stages = [s.strip() for s in args.stages.split(",")] if args.stages else None

    unknown = [name for name in stages or () if name not in registry.STAGES]
    if unknown:
        raise ConfigError(f"--stages: {registry.unknown_stage_message(unknown)}")
    if not args.resume and (stages is None or "data" in stages):
        locate(cfg.data.pairs, cfg.data)  # a hub data set is downloaded here, before Prefect starts
        for spec in own_sources(cfg.data).values():
            locate(spec, own_source_config(cfg.data))
    if not args.resume and not args.ignore_plan:  # a resumed run keeps its recorded config: planned then
        _check_plan(args, cfg, stages)
    from flows.rlhf import rlhf  # deferred: Prefect

    from data_contracts import ContractError  # deferred: Great Expectations

    from prefect.exceptions import CancelledRun  # deferred: Prefect

    from stages.compute.ppo.external_scores import RewardServerUnavailable  # deferred: imports torch

    state = None
    try:
        # Every error's traceback stays out of Prefect's log lines here: a stage's failure ends
        # in its stage, reason and fix (the traceback is in MLflow), anything else in Python's.
        # The errors named are the expected ones, whose log lines are cut short too.
        expected = (ContractError, DataError, ModelError, tracking_queue.TrackingUnavailable, RewardServerUnavailable)
        with _quiet_expected_errors((*expected, Exception)), _stop_on_signals():
            _open_stores()
            _check_runs_exist(args)
            state = rlhf(preset=args.preset, overrides=args.overrides, stages=stages, from_run=args.from_run,
                         resume=args.resume, force=args.force, return_state=True)
            run_id = state.result()
    except (CancelledRun, ContractError) as err:
        return _stopped(err, "The gate's report (JSON result, Data Docs) is in MLflow run {run_id} under contracts/.")
    except (tracking_queue.TrackingUnavailable, RewardServerUnavailable) as err:
        print(f"rlhf: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        failure = None if isinstance(err, (ConfigError, DataError)) else _recorded_failure(cfg, args.resume, state)
        if failure is None:
            raise
        # The run is over: Prefect's note that its temporary API server stops (at exit) would
        # otherwise follow the failure's last line.
        logging.getLogger("prefect").setLevel(logging.WARNING)
        print(failure, file=sys.stderr)
        return 1

    print(f"\n{runs.ending(run_id).text}\n\nMLflow store: {tracking.tracking_uri()}\n"
          f"Open it with: {services.command('mlflow')} ui --backend-store-uri {tracking.tracking_uri()}")
    return 0


COMMANDS = {"run": _run, "plan": _plan, "study": _study, "serve": _serve, "up": _up, "down": _down,
            "serve-reward": _serve_reward, "runs": _runs, "compare": _compare, "report": _report, "config": _config}


def _console_start() -> int | None:
    """The console command's own process: `run` and `study` under the supervisor, `serve` on the
    allocator its flow runs inherit. An exit code where this process is done, else None."""
    # A run that seems stuck: `kill -USR1 <pid>` prints where each of its threads is, and goes on.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if sys.argv[1:2] in (["run"], ["study"]):
            if os.environ.get(SUPERVISED) != "1":
                return supervise(sys.argv[1:])  # the console command: stoppable with Ctrl-C (above)
            die_with_the_supervisor()
        if sys.argv[1:2] == ["serve"] and (env := allocator.environment(dict(os.environ))) != os.environ:
            # The flow runs it serves inherit this process's allocator, chosen at its start.
            os.execve(sys.executable, [sys.executable, "-m", "flows.cli", *sys.argv[1:]], env)
    except allocator.AllocatorError as err:
        print(f"rlhf: {err}", file=sys.stderr)
        return 2
    return None


def main(argv: list[str] | None = None) -> int:
    # argv None: the console command (not a caller's main([...]), whose stderr may be no file)
    if argv is None and (code := _console_start()) is not None:
        return code
    _env_defaults()
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, DataError, allocator.AllocatorError) as err:
        print(f"rlhf: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
