"""The `rlhf-study` Prefect flow: one chain (data → SFT → reward → critic), with `study.gold` a
gold reward model on the chain's gold pairs (with `study.gold_relabels` trained first, from the
chain's data and SFT, and the proxy RM learns its labels), then PPO and evaluation once per arm (and seed of
`study.seeds`) on the chain's artifacts, each a pipeline run (a subflow of this one) nested under
the study's MLflow run; the best-of-n arms (the best-of-n stage once per seed, stages/pipeline/best_of_n.py);
at the end the study's figures and table (stages/orchestration/study_records.py).

Arms run one after another in this process. A study resumes where it stopped (`resume`: the
study's run id): a finished arm is kept, an unfinished one continues as `rlhf --resume` does (PPO
from its last checkpoint), a missing one starts. `new_arms` join a resumed study on its chain.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import CancelledRun
from prefect.states import Cancelled

from flows import services
from flows.rlhf import rlhf, run_stage
from stages.leaves.config import ConfigError, PipelineConfig, StudyConfig, rlhf_home
from stages.leaves.interrupt import StageInterrupted
from stages.orchestration import study_records as studies
from stages.orchestration import lineage, run_writers, tracking
from stages.orchestration.config_loading import load_config

BEST_OF_N_STAGE = "best_of_n"  # the registry's stage of the best-of-n arms' draws


def _arm_overrides(base: dict[str, Any] | list[str] | None, arm: dict[str, Any]) -> list[str]:
    """The study's overrides, then the arm's (as `key=value`, values in JSON, which YAML reads)."""
    if isinstance(base, dict):
        base = [f"{k}={json.dumps(v)}" for k, v in base.items()]
    return [*(base or []), *(f"{k}={json.dumps(v)}" for k, v in arm.items())]


def draw_best_of_n(study_id: str, cfg: PipelineConfig, chain: str, gold_model: str | None, seed: int) -> str:
    """The best-of-n stage for one seed, from the chain's outputs, as a pipeline run of that stage
    nested under the study's run (not an arm: its draws serve every best-of-n arm of the seed). It
    runs as every stage does (flows/rlhf.run_stage: a Prefect task under the stage's cache key, so a
    resumed study reuses draws it finished; ranks per `best_of_n.launch`); the URI of its draws."""
    seeded = cfg.model_copy(update={"ppo": cfg.ppo.model_copy(update={"seed": seed, "gold_reward_model": gold_model})})
    inputs = lineage.outputs_of(chain)
    pipeline = run_writers.PipelineRun.start(seeded, [BEST_OF_N_STAGE], from_run=chain, inputs=inputs,
                                          extra_tags={"mlflow.parentRunId": study_id})
    tracking.client().update_run(pipeline.run_id, name=f"{run_writers.study_title(cfg.preset)} · best-of-n draws, seed {seed}")
    try:
        produced = run_stage(BEST_OF_N_STAGE, seeded, pipeline, inputs, force=False)
    except StageInterrupted:
        pipeline.finish("KILLED")
        raise
    except BaseException:
        pipeline.finish("FAILED")
        raise
    pipeline.finish("FINISHED")
    return produced["best_of_n_draws"]


def best_of_n(study_id: str, cfg: PipelineConfig, chain: str, gold_model: str | None,
              arms: dict[str, tuple[int, int]], done: dict[str, Any]) -> None:
    """The best-of-n arms: one run of the best-of-n stage per seed serves every n; an arm finished
    before is kept."""
    for seed in dict.fromkeys(seed for _, seed in arms.values()):
        todo = {name: n for name, (n, s) in arms.items() if s == seed
                and (done.get(name) is None or done[name].info.status != "FINISHED")}
        if not todo:
            continue
        drawn = studies.read_draws(draw_best_of_n(study_id, cfg, chain, gold_model, seed))
        for name, n in todo.items():
            run_id = studies.log_best_of_n(study_id, cfg, name, n, seed, studies.best_of_n_metrics(drawn, n, cfg))
            print(f"study {study_id}: {name} (run {run_id})")


@flow(name="rlhf-study", log_prints=True)
def study(preset: str = "study", overrides: dict[str, Any] | list[str] | None = None,
          resume: str | None = None, new_arms: dict[str, dict[str, Any]] | None = None) -> str:
    """Run (or with `resume`, continue) a study, with `new_arms` besides its own; returns its MLflow
    run id."""
    new_arms = StudyConfig.checked_arms(new_arms or {})
    if resume:
        cfg, preset, overrides, arms = studies.reopen(resume)
        study_id = resume
        if clash := [name for name in new_arms if name in arms or name in (studies.CHAIN, studies.GOLD, studies.BASE)]:
            raise ConfigError(f"study {resume} already has an arm named {clash[0]!r}; give the new arm another name")
    else:
        overrides = _arm_overrides(overrides, {})
        cfg = load_config(preset, overrides)
        arms = cfg.study.all_arms()
    for name, arm in {**arms, **new_arms}.items():  # every arm's config validates before anything runs
        load_config(preset, _arm_overrides(overrides, arm))
    if resume:
        studies.running(study_id)
        arms = studies.add_arms(study_id, new_arms) if new_arms else arms
    else:
        arms = {**arms, **new_arms}
        study_id = studies.start(cfg, preset, overrides, arms)
    print(f"study {study_id}: arms {', '.join(arms)} (MLflow {tracking.tracking_uri()})")
    done = studies.arm_runs(study_id)

    def run(arm: str, stages: list[str], arm_config: dict[str, Any], from_run: str | None) -> str:
        earlier = done.get(arm)
        if earlier is not None and earlier.info.status == "FINISHED":
            print(f"study {study_id}: {arm} finished before (pipeline run {earlier.info.run_id})")
            return earlier.info.run_id
        if earlier is not None:
            print(f"study {study_id}: {arm} resumes pipeline run {earlier.info.run_id}")
            return rlhf(preset=preset, resume=earlier.info.run_id)
        return rlhf(preset=preset, overrides=_arm_overrides(overrides, arm_config), stages=stages, from_run=from_run,
                    study=study_id, arm=arm)

    try:
        if cfg.study.gold_relabels:  # the gold RM first; it labels the proxy's pairs (Gao et al.'s synthetic setting)
            base = run(studies.BASE, studies.BASE_STAGES, {}, None)
            gold = run(studies.GOLD, studies.GOLD_STAGES, studies.gold_run_overrides(cfg), base)
            gold_model = lineage.outputs_of(gold)["reward_model"]
            chain = run(studies.CHAIN, studies.RELABELLED_CHAIN_STAGES, {"reward.labels_from": gold_model}, base)
        else:
            chain = run(studies.CHAIN, studies.CHAIN_STAGES, {}, None)
            gold = run(studies.GOLD, studies.GOLD_STAGES, studies.gold_run_overrides(cfg), chain) \
                if cfg.study.gold else None
            gold_model = lineage.outputs_of(gold)["reward_model"] if gold else None
        shared = studies.gold_arm_overrides(cfg, gold_model) if gold_model else {}
        names = []
        for name, arm in arms.items():
            for seeded_name, seeded_arm in studies.seeded(name, arm, cfg.study.seeds).items():
                run(seeded_name, studies.ARM_STAGES, {**shared, **seeded_arm}, chain)
                names.append(seeded_name)
        bon = studies.best_of_n_names(cfg)
        if bon:
            best_of_n(study_id, cfg, chain, gold_model, bon, done)
            names += list(bon)
        text = studies.finish(study_id, cfg, names, rlhf_home() / "studies" / study_id)
    except (CancelledRun, StageInterrupted) as err:  # an arm or the best-of-n draws stopped on request
        tracking.client().set_terminated(study_id, status="KILLED")
        message = f"{err}. Resume the study with: {services.command('rlhf')} study --resume {study_id}"
        print(message)
        return Cancelled(message=message)
    except BaseException:
        tracking.client().set_terminated(study_id, status="FAILED")  # `--resume` it: finished arms are kept
        raise
    create_markdown_artifact(text.replace("![curves](study.png)", f"Figure: `study/study.png` in MLflow run {study_id}."),
                             key="rlhf-study", description=f"RLHF study {study_id}")
    return study_id
