"""The eval stage: C-Eval of the SFT model and the policy (the alignment tax), the
`eval.lm_eval_tasks` through lm-evaluation-harness on both (the same delta), both models'
sampled responses to held-out eval prompts judged pairwise by each configured judge, the report
and probe frame in the stage's run, and the registry alias @champion on the policy version when
the lower bound of the net-win confidence interval of the first judge that can judge (its invalid
verdicts within `contracts.eval.max_invalid_fraction`) is above `eval.champion_min_lower_bound`. A run without a policy
(only SFT ran) gets C-Eval (and the lm-eval tasks) of the SFT model alone."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch

from stages import interrupt, loading, tracking
from stages.config import LocalJudgeConfig, ModelConfig, PipelineConfig
from stages.data import corpus_texts, read_jsonl
from stages.evaluate import ceval, harness, report
from stages.evaluate.judge import (LocalJudge, OpenAIJudge, Pair, RewardModelJudge, RewardSourceJudge, judge_pairs,
                                   tally)
from stages.launch import Dist
from stages.model_loading import frozen_lm, frozen_reward_model
from stages.ppo.generation import generate
from stages.ppo.stage import encode_prompts
from stages.stats import Interval

CHAMPION_ALIAS = "champion"


def judge_model_config(cfg: PipelineConfig, judge: LocalJudgeConfig) -> ModelConfig:
    """The local judge's model: the pipeline's base model unless the judge names another."""
    return cfg.model if judge.model is None else cfg.model.model_copy(update={"name_or_path": judge.model, "tokenizer": None})


def reward_model_folder(spec: str, downloads: Path) -> Path:
    """A local folder of the reward model a judge names: a model or artifact URI (models:/, runs:/,
    s3://, file:) fetched as every input is, a local folder where it is, else a hub name."""
    if "://" in spec or spec.startswith(("models:/", "runs:/", "file:")):
        return tracking.download(spec, downloads)
    local = Path(spec).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download  # deferred: only for a judge model named by its hub id

    return Path(snapshot_download(repo_id=spec))


def prepare(cfg: PipelineConfig, inputs: dict, downloads: Path) -> dict:
    """Local copies of the splits and of every model the evaluation reads."""
    splits_dir = tracking.download(inputs["splits"], downloads)
    local = {"splits_dir": str(splits_dir), "sft_model_dir": str(tracking.download(inputs["sft_model"], downloads))}
    for name in ("policy_model", "reward_model"):
        if inputs.get(name):
            local[f"{name}_dir"] = str(tracking.download(inputs[name], downloads))
    if inputs.get("policy_model"):
        for judge in cfg.eval.judges:
            if judge.kind == "reward_model" and judge.model is not None:
                local[f"judge_{judge.name}_dir"] = str(reward_model_folder(judge.model, downloads))
            if judge.kind == "local":
                local[f"judge_{judge.name}_dir"] = loading.materialise_model(
                    judge_model_config(cfg, judge), corpus=lambda: corpus_texts(splits_dir))
    return local


def respond(model, tokenizer, rows: list[dict], cfg: PipelineConfig, device: str) -> tuple[list[str], list[bool]]:
    """Sampled responses (eval.generation: nucleus sampling, temperature, repetition penalty):
    (texts, whether each ended with EOS rather than at the token limit)."""
    ev = cfg.eval
    torch.manual_seed(ev.seed)  # both models sample from the same random stream
    prompts = encode_prompts(tokenizer, rows, ev.max_prompt_len)
    out, ended = [], []
    for start in range(0, len(prompts), ev.generation_batch_size):
        rollout = generate(model, prompts[start : start + ev.generation_batch_size], eos_id=tokenizer.eos_token_id,
                           pad_id=tokenizer.pad_token_id, device=device, **ev.generation.model_dump())
        responses = rollout.sequences[:, rollout.prompt_width :]
        out += [text.strip() for text in tokenizer.batch_decode(responses, skip_special_tokens=True)]
        ended += rollout.ended_with_eos.tolist()
    return out, ended


def make_judge(spec, cfg: PipelineConfig, inputs: dict, device: str):
    if spec.kind == "openai":
        return OpenAIJudge(spec, loading.cache_dir() / "judge")
    if spec.kind == "local":
        model, tokenizer = frozen_lm(inputs[f"judge_{spec.name}_dir"], judge_model_config(cfg, spec), device)
        return LocalJudge(spec, model, tokenizer, cfg.eval.generation_batch_size)
    if spec.kind == "reward_source":
        return RewardSourceJudge(spec, loading.load_tokenizer(inputs["sft_model_dir"], cfg.model),
                                 cfg.eval.judges.index(spec))
    if spec.model is not None:
        folder = inputs[f"judge_{spec.name}_dir"]
    elif "reward_model_dir" in inputs:
        folder = inputs["reward_model_dir"]
    else:
        raise ValueError(f"judge '{spec.name}' needs the run's reward model (reward_model), and this run has none; "
                         f"or name one in eval.judges[{cfg.eval.judges.index(spec)}].model")
    reward_model = frozen_reward_model(folder, cfg.model, device)
    return RewardModelJudge(spec, reward_model, loading.load_tokenizer(folder, cfg.model), cfg.reward.max_seq_len,
                            cfg.reward.max_response_len, cfg.eval.generation_batch_size)


def probe_frame(answers: pd.DataFrame, judged: pd.DataFrame) -> pd.DataFrame:
    """The eval contract's frame: one row per C-Eval answer and per judged pair (`row`: the line
    in the C-Eval CSV or in the HH file)."""
    ceval_rows = answers.rename(columns={"logprob": "score"}).assign(kind="ceval")
    judge_rows = judged.assign(kind="judge")
    columns = ["row", "kind", "model", "shots", "subject", "answer", "predicted", "score", "split", "judge",
               "judge_kind", "verdict", "score_policy", "score_sft"]
    parts = [f for f in (ceval_rows, judge_rows) if len(f)]
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()  # nothing scored: the gate says so
    return frame.reindex(columns=columns).astype({"shots": "Int64", "score": float, "score_policy": float,
                                                  "score_sft": float})


def score_and_answer(cfg: PipelineConfig, models: dict[str, str], rows: list[dict], answering: bool,
                     device: str, stop_point=lambda where: None, tasks=None
                     ) -> tuple[pd.DataFrame, dict[str, list[str]], float, dict[str, dict]]:
    """C-Eval answers of each model, its lm-eval results (with `tasks`, the TaskManager of
    `eval.lm_eval_tasks`), and (answering) its responses to the eval prompts; each model is loaded
    once for all. Returns (answers, responses by model and `<model>_ended` flags, C-Eval seconds,
    lm-eval's results by model). `stop_point(where)` is called between the parts (a stop request
    ends there)."""
    ev = cfg.eval
    val, dev = ceval.load(cfg.data, ev.ceval.subjects, ev.ceval.max_questions_per_subject,
                          with_dev=max(ev.ceval.shots, default=0) > 0)
    answers, responses, seconds, lm_eval = [], {}, 0.0, {}
    for name, model_dir in models.items():
        model, tokenizer = frozen_lm(model_dir, cfg.model, device)
        for shots in ev.ceval.shots:
            stop_point(f"before C-Eval {shots}-shot of {name}")
            t = time.perf_counter()
            answers.append(ceval.score(model, tokenizer, val, dev, shots, ev.ceval.batch_size, ev.ceval.max_seq_len)
                           .assign(model=name, shots=shots))
            seconds += time.perf_counter() - t
            short = int((answers[-1]["exemplars"] < shots).sum())
            print(f"eval: C-Eval {shots}-shot, {name}: {ceval.accuracy(answers[-1])['overall']['all']:.3f} "
                  f"({len(answers[-1])} questions{f', {short} with fewer than {shots} exemplars' if short else ''}, "
                  f"{time.perf_counter() - t:.0f} s)")
        if tasks is not None:
            stop_point(f"before lm-eval on {name}")
            t = time.perf_counter()
            lm_eval[name] = harness.evaluate(model, tokenizer, tasks, ev)
            print(f"eval: lm-eval {', '.join(ev.lm_eval_tasks)}, {name} ({time.perf_counter() - t:.0f} s)")
        if answering:
            stop_point(f"before {name} answered the eval prompts")
            t = time.perf_counter()
            responses[name], responses[f"{name}_ended"] = respond(model, tokenizer, rows, cfg, device)
            print(f"eval: {name} answered {len(rows)} eval prompts ({time.perf_counter() - t:.0f} s)")
    return (pd.concat(answers, ignore_index=True) if answers else pd.DataFrame()), responses, seconds, lm_eval


def judge_all(cfg: PipelineConfig, inputs: dict, pairs: list[Pair], device: str,
              stop_point=lambda where: None) -> pd.DataFrame:
    """Every configured judge on the pairs (its first `prompts` of them): one row per judged pair."""
    judged = []
    for spec in cfg.eval.judges:
        stop_point(f"before judge {spec.name}")
        t = time.perf_counter()
        judge = make_judge(spec, cfg, inputs, device)
        frame = judge_pairs(judge, pairs[: spec.max_prompts] if spec.max_prompts else pairs)
        judged.append(frame.assign(split=cfg.eval.split, judge_kind=spec.kind))
        print(f"eval: judge {spec.name}: {frame['verdict'].value_counts().to_dict()} ({time.perf_counter() - t:.0f} s)")
    return pd.concat(judged, ignore_index=True)


def deciding_judge(cfg: PipelineConfig, metrics: dict[str, float]) -> tuple[str | None, list[str]]:
    """(the judge whose net win decides the champion, the judges that could not judge): the first
    judge whose invalid verdicts stay within `contracts.eval.max_invalid_fraction` (the `judge`
    contract's rule, which names the others)."""
    limit = cfg.contracts.eval.max_invalid_fraction
    usable = [j.name for j in cfg.eval.judges if metrics.get(f"eval/judge/{j.name}/invalid_rate", 1.0) <= limit]
    unusable = [f"judge {j.name}" for j in cfg.eval.judges if j.name not in usable]
    return (usable[0] if usable else None), unusable


def champion_decision(judge: str, net_win: Interval, min_lower_bound: float) -> tuple[bool, str]:
    """(whether the policy becomes @champion, the sentence that says why): the lower bound of the
    judge's net-win interval must be above `min_lower_bound`; a point estimate above it is not enough."""
    won = net_win.low > min_lower_bound
    reason = (f"judge {judge}: net win (win − lose)/n {net_win} at {net_win.level:.0%} confidence on {net_win.n} "
              f"prompts; {'lower bound above' if won else 'lower bound not above'} {min_lower_bound:g}")
    return won, f"{'yes' if won else 'no'} ({reason})"


def run(cfg: PipelineConfig, tracker: tracking.StageRun, inputs: dict, dist: Dist) -> dict:
    ev = cfg.eval
    started = time.perf_counter()
    models = {"sft": inputs["sft_model_dir"]}
    if inputs.get("policy_model_dir"):
        models["policy"] = inputs["policy_model_dir"]
    judging = "policy" in models and bool(ev.judges)
    tracker.log_params({"eval": ev.model_dump(mode="json"), "eval.sft_model": inputs["sft_model"],
                        "eval.policy_model": inputs.get("policy_model", "none: C-Eval of the SFT model only"),
                        "eval.reward_model": inputs.get("reward_model", "none")})

    rows = read_jsonl(Path(inputs["splits_dir"]) / "eval_prompts.jsonl")[: ev.heldout_prompts]
    def stop_point(where: str) -> None:  # the evaluation keeps nothing partial: a resumed run starts it over
        interrupt.stop_point(dist, "eval", where)

    # Unknown lm-eval task names stop the stage here, before any model loads.
    tasks = harness.task_manager(ev) if ev.lm_eval_tasks else None
    answers, responses, ceval_seconds, lm_eval = score_and_answer(cfg, models, rows, judging, dist.device,
                                                                  stop_point, tasks)
    judged = pd.DataFrame()
    if judging:
        pairs = [Pair(r["row"], r["messages"], p, s, policy_ended=p_ended, sft_ended=s_ended)
                 for r, p, s, p_ended, s_ended in zip(rows, responses["policy"], responses["sft"],
                                                      responses["policy_ended"], responses["sft_ended"])]
        judged = judge_all(cfg, inputs, pairs, dist.device, stop_point)

    # Metrics and the champion decision.
    metrics: dict[str, float] = {}
    ceval_table = shortfall = None
    if len(answers):
        groups = answers.groupby(["shots", "model"])
        ceval_table = report.ceval_table({key: ceval.accuracy(group) for key, group in groups})
        shortfall = report.exemplar_shortfall(answers)
        metrics.update(report.ceval_metrics(ceval_table, shortfall))
        metrics["eval/ceval_questions_per_s"] = len(answers) / max(ceval_seconds, 1e-9)
    lm_eval_table = None
    if lm_eval:
        lm_eval_table = report.lm_eval_table({name: harness.scores(results) for name, results in lm_eval.items()})
        metrics.update(report.lm_eval_metrics(lm_eval_table))
    judge_table, champion = None, "no policy"
    if len(judged):
        judge_table = report.judge_table(judged, cfg.statistics)
        intervals = {}
        for spec in ev.judges:
            own = judged[judged["judge"] == spec.name]
            for key, value in tally(own).items():
                metrics[f"eval/judge/{spec.name}/{key}"] = value
            intervals[spec.name] = report.judge_intervals(own, cfg.statistics)
            for name, interval in intervals[spec.name].items():
                metrics.update(interval.metrics(f"eval/judge/{spec.name}/{name}"))
        decider, unusable = deciding_judge(cfg, metrics)
        if decider is None:
            won, champion = False, f"no (no judge could judge: {', '.join(unusable)})"
        else:
            won, champion = champion_decision(decider, intervals[decider]["net_win"], ev.champion_min_lower_bound)
            if unusable:
                champion += f"; {', '.join(unusable)} could not judge"
        metrics["eval/champion"] = float(won)
        if won:
            tracker.set_model_alias(inputs["policy_model"], CHAMPION_ALIAS)
    metrics["eval/seconds"] = time.perf_counter() - started
    tracker.log_metrics(metrics, step=0)
    tracker.set_tags({"rlhf.champion": champion})

    # The report, its tables and plots, and the contract's probe frame.
    out = tracker.workdir / "report"
    out.mkdir(parents=True, exist_ok=True)
    if ceval_table is not None:
        ceval_table.to_csv(out / "ceval.csv", index=False)
        answers.to_csv(out / "ceval_answers.csv", index=False)
        report.ceval_chart(ceval_table, out / "ceval.png")
    if judge_table is not None:
        judge_table.to_csv(out / "judges.csv", index=False)
        judged.to_json(out / "judgements.jsonl", orient="records", lines=True, force_ascii=False)
        pd.DataFrame({"row": [r["row"] for r in rows], **responses}).to_json(
            out / "responses.jsonl", orient="records", lines=True, force_ascii=False)
        report.judge_chart(judge_table, out / "judges.png")
    if lm_eval_table is not None:
        lm_eval_table.to_csv(out / "lm_eval.csv", index=False)
        for name, results in lm_eval.items():
            harness.write(results, out / "lm_eval", name)
    model_uris = {"sft": inputs["sft_model"], **({"policy": inputs["policy_model"]} if "policy" in models else {})}
    markdown = report.markdown(
        run_id=tracker.run_id, models=model_uris, ceval=ceval_table, shortfall=shortfall, judges=judge_table,
        champion=champion, questions_per_s=metrics.get("eval/ceval_questions_per_s", 0.0), lm_eval=lm_eval_table,
        lm_eval_version=harness.version() if lm_eval else "")
    (out / "report.md").write_text(markdown)
    (out / "report.html").write_text(report.html(markdown, out))
    report_uri = tracker.artifact_location("report/report.md")
    (out / "summary.md").write_text(report.summary(run_id=tracker.run_id, report_uri=report_uri, ceval=ceval_table,
                                                   shortfall=shortfall, judges=judge_table, champion=champion,
                                                   lm_eval=lm_eval_table))
    tracker.log_artifacts(out, "report")
    return {"eval_run": tracker.run_id, "eval_probe": tracker.log_probe(probe_frame(answers, judged), "eval_probe"),
            "eval_report": tracker.artifact_uri("report/report.md"),
            "eval_summary": tracker.artifact_uri("report/summary.md")}
