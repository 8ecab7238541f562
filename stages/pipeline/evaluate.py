"""The eval stage: C-Eval of the SFT model and the policy (the alignment tax), the
`eval.lm_eval_tasks` through lm-evaluation-harness on both (the same delta), both models'
sampled responses to held-out eval prompts judged pairwise by each configured judge, the report
and probe frame in the stage's run, and the registry alias @champion on the policy version when
the lower bound of the net-win confidence interval of the first judge that can judge (its invalid
verdicts within `contracts.eval.max_invalid_fraction`, and with `eval.judge_accuracy_gate` its
accuracy on labelled held-out pairs above chance: stages/compute/evaluate/quality.py) is above
`eval.champion_min_lower_bound`. A run without a policy
(only SFT ran) gets C-Eval (and the lm-eval tasks) of the SFT model alone."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch

from stages.compute import loading
from stages.compute.evaluate import ceval, harness, quality, report
from stages.leaves import interrupt
from stages.leaves.config import LocalJudgeConfig, ModelConfig, PipelineConfig
from stages.leaves.dist import Dist
from stages.orchestration import run_writers, tracking
from stages.pipeline.data import corpus_texts, read_jsonl
from stages.compute.evaluate.judge import (LocalJudge, OpenAIJudge, Pair, RewardModelJudge, RewardSourceJudge, judge_pairs,
                                           tally)
from stages.compute.model_loading import frozen_lm, frozen_reward_model
from stages.compute.ppo.generation import generate
from stages.compute.ppo.setup import encode_prompts
from stages.leaves.stats import Interval
from stages.leaves.tags import CHAMPION_JUDGE_TAG, CHAMPION_TAG

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
    for name in ("policy_model", "reward_model", "final_policy_model"):
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


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    """Each answer's length in tokens, re-tokenised from its text: what the length-controlled numbers
    regress on."""
    return [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]


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
            # Each answer's length in tokens (the SFT tokenizer's, which both models share): the
            # length-controlled numbers regress on it.
            responses[f"{name}_tokens"] = token_counts(tokenizer, responses[name])
            print(f"eval: {name} answered {len(rows)} eval prompts ({time.perf_counter() - t:.0f} s)")
    return (pd.concat(answers, ignore_index=True) if answers else pd.DataFrame()), responses, seconds, lm_eval


def recorded_quality(spec, inputs: dict, level: float) -> quality.JudgeQuality | None:
    """A reward-model judge's held-out accuracy as the reward stage recorded it on the registered
    version it reads (`models:/name/version` or `models:/name@alias`); None for any other judge or model."""
    if spec.kind != "reward_model":
        return None
    uri = spec.model if spec.model is not None else inputs.get("reward_model")
    if not uri or not uri.startswith("models:/"):
        return None
    ref = uri.removeprefix("models:/").rstrip("/")
    client = tracking.client()
    if "@" in ref:
        version = client.get_model_version_by_alias(*ref.split("@"))
    elif "/" in ref:
        version = client.get_model_version(*ref.split("/"))
    else:
        return None  # a logged model, not a registered version: no reward-stage tags
    return quality.recorded(spec.name, version.tags, level)


def judge_all(cfg: PipelineConfig, inputs: dict, pairs: list[Pair], device: str,
              stop_point=lambda where: None, known: dict[str, quality.JudgeQuality] | None = None
              ) -> tuple[pd.DataFrame, dict[str, quality.JudgeQuality]]:
    """Every configured judge on the pairs (its first `prompts` of them): one row per judged pair;
    and each judge's accuracy on labelled held-out pairs (recorded, else measured on the control pairs)."""
    judged, qualities = [], {}
    labelled = Path(inputs["splits_dir"]) / f"{quality.CONTROL_SPLIT}.jsonl"
    control = quality.control_pairs(read_jsonl(labelled) if labelled.exists() else [], cfg.eval.judge_control_pairs)
    for spec in cfg.eval.judges:
        stop_point(f"before judge {spec.name}")
        t = time.perf_counter()
        judge = make_judge(spec, cfg, inputs, device)
        qualities[spec.name] = ((known or {}).get(spec.name) or recorded_quality(spec, inputs, cfg.statistics.ci_level)
                                or quality.measured(judge, control, cfg.statistics.ci_level))
        frame = judge_pairs(judge, pairs[: spec.max_prompts] if spec.max_prompts else pairs)
        judged.append(frame.assign(split=cfg.eval.split, judge_kind=spec.kind))
        print(f"eval: judge {spec.name}: accuracy {qualities[spec.name].accuracy_text()}; "
              f"{frame['verdict'].value_counts().to_dict()} ({time.perf_counter() - t:.0f} s)")
    return pd.concat(judged, ignore_index=True), qualities


def deciding_judge(cfg: PipelineConfig, metrics: dict[str, float],
                   qualities: dict[str, quality.JudgeQuality] | None = None) -> tuple[str | None, list[str]]:
    """(the judge whose net win decides the champion, why each other judge could not judge): the
    first judge whose invalid verdicts stay within `contracts.eval.max_invalid_fraction` (the
    `judge` contract's rule, which names the others) and, with `eval.judge_accuracy_gate`, whose
    accuracy on labelled held-out pairs lies above chance."""
    limit = cfg.contracts.eval.max_invalid_fraction
    reasons = {}
    for j in cfg.eval.judges:
        if metrics.get(f"eval/judge/{j.name}/invalid_rate", 1.0) > limit:
            reasons[j.name] = f"judge {j.name}"
        elif cfg.eval.judge_accuracy_gate and qualities is not None and not qualities[j.name].can_judge:
            reasons[j.name] = qualities[j.name].cannot_decide()
    usable = [j.name for j in cfg.eval.judges if j.name not in reasons]
    return (usable[0] if usable else None), list(reasons.values())


def champion_decision(judge: str, net_win: Interval, min_lower_bound: float) -> tuple[bool, str]:
    """(whether the policy becomes @champion, the sentence that says why): the lower bound of the
    judge's net-win interval must be above `min_lower_bound`; a point estimate above it is not enough."""
    won = net_win.low > min_lower_bound
    reason = (f"judge {judge}: net win (win − lose)/n {net_win} at {net_win.level:.0%} confidence on {net_win.n} "
              f"prompts; {'lower bound above' if won else 'lower bound not above'} {min_lower_bound:g}")
    return won, f"{'yes' if won else 'no'} ({reason})"


def judge_verdicts(cfg: PipelineConfig, judged: pd.DataFrame, qualities: dict[str, quality.JudgeQuality]
                   ) -> tuple[dict[str, float], bool, str, str]:
    """(each judge's metrics, whether the policy becomes @champion, the sentence that says why, the
    judge the verdict rests on). A judge that cannot judge gives no win or loss: with none left the
    verdict is `cannot decide` and names the first judge's accuracy."""
    metrics: dict[str, float] = {}
    intervals = {}
    for spec in cfg.eval.judges:
        own, prefix = judged[judged["judge"] == spec.name], f"eval/judge/{spec.name}"
        metrics.update({f"{prefix}/{key}": value for key, value in tally(own).items()})
        metrics.update(qualities[spec.name].metrics(prefix))
        intervals[spec.name] = report.judge_intervals(own, cfg.statistics)
        for name, interval in intervals[spec.name].items():
            metrics.update(interval.metrics(f"{prefix}/{name}"))
        corr = report.length_corr(own)
        if corr is not None:
            metrics[f"{prefix}/length_corr"] = corr
    decider, unusable = deciding_judge(cfg, metrics, qualities)
    undecided = [r for r in unusable if r.startswith("cannot decide: ")]
    invalid = [r for r in unusable if r not in undecided]
    why_not = [*undecided, *([f"{', '.join(invalid)} could not judge"] if invalid else [])]
    if decider is not None:
        won, champion = champion_decision(decider, intervals[decider]["net_win"], cfg.eval.champion_min_lower_bound)
        if not cfg.eval.judge_accuracy_gate:
            champion += f"; accuracy gate off (eval.judge_accuracy_gate), judge accuracy {qualities[decider].accuracy_text()}"
        return metrics, won, "; ".join([champion, *why_not]), decider
    if undecided:
        first = next(j.name for j in cfg.eval.judges if f"judge {j.name}" not in invalid)
        return metrics, False, f"no ({'; '.join(why_not)})", first
    return metrics, False, f"no (no judge could judge: {', '.join(invalid)})", cfg.eval.judges[0].name


def log_ceval_lineage(cfg: PipelineConfig, tracker: run_writers.StageRun) -> None:
    """Where C-Eval came from: `ceval.source`, the hub repository and revision (`ceval.repo`,
    `ceval.revision`; `mirror` for a mirror's copy), and every CSV's sha256 in `ceval_files.json`."""
    splits = ("val", "dev") if max(cfg.eval.ceval.shots, default=0) > 0 else ("val",)
    found = ceval.locate(cfg.data, cfg.eval.ceval.subjects or list(ceval.SUBJECTS), splits)
    tracker.log_params({"ceval.source": found.name, **({"ceval.repo": found.repo, "ceval.revision": found.revision}
                                                        if found.repo else {})})
    tracker.log_dict(found.digests(), "ceval_files.json")


def answer_pairs(rows: list[dict], responses: dict[str, list], policy: str = "policy") -> list[Pair]:
    """One pair a prompt: the answer of `policy` (its `<policy>`, `<policy>_ended`, `<policy>_tokens`
    responses) against SFT's."""
    return [Pair(r["row"], r["messages"], p, s, policy_ended=p_ended, sft_ended=s_ended, policy_tokens=p_tokens,
                 sft_tokens=s_tokens)
            for r, p, s, p_ended, s_ended, p_tokens, s_tokens in zip(
                rows, responses[policy], responses["sft"], responses[f"{policy}_ended"], responses["sft_ended"],
                responses[f"{policy}_tokens"], responses["sft_tokens"])]


def judge_final_policy(cfg: PipelineConfig, inputs: dict, rows: list[dict], responses: dict[str, list], device: str,
                       qualities: dict[str, quality.JudgeQuality], stop_point=lambda where: None
                       ) -> tuple[dict[str, float], pd.DataFrame]:
    """PPO's final policy, when a breach after the registered policy's check kept it from the
    registry, judged against SFT's responses as the registered one is (the same judges, their
    accuracy already measured): every judge metric as `eval/final/judge/<name>/*`, and the judged
    pairs (model `final`)."""
    stop_point("before the final policy answered the eval prompts")
    model, tokenizer = frozen_lm(inputs["final_policy_model_dir"], cfg.model, device)
    final, final_ended = respond(model, tokenizer, rows, cfg, device)
    final_tokens = token_counts(tokenizer, final)
    del model
    answers = {**responses, "final": final, "final_ended": final_ended, "final_tokens": final_tokens}
    judged, _ = judge_all(cfg, inputs, answer_pairs(rows, answers, "final"), device, stop_point, qualities)
    metrics, _, _, _ = judge_verdicts(cfg, judged, qualities)
    metrics = {key.replace("eval/judge/", "eval/final/judge/", 1): value for key, value in metrics.items()}
    return metrics, judged.assign(model="final")


def benchmark_metrics(answers: pd.DataFrame, ceval_seconds: float, lm_eval: dict[str, dict]
                      ) -> tuple[dict[str, float], pd.DataFrame | None, pd.DataFrame | None, pd.DataFrame | None]:
    """C-Eval's and lm-eval's metrics: (metrics, C-Eval table, exemplar shortfall, lm-eval table);
    a table is None where its benchmark did not run."""
    metrics: dict[str, float] = {}
    ceval_table = shortfall = lm_eval_table = None
    if len(answers):
        groups = answers.groupby(["shots", "model"])
        ceval_table = report.ceval_table({key: ceval.accuracy(group) for key, group in groups})
        shortfall = report.exemplar_shortfall(answers)
        metrics.update(report.ceval_metrics(ceval_table, shortfall))
        metrics["eval/ceval_questions_per_s"] = len(answers) / max(ceval_seconds, 1e-9)
    if lm_eval:
        lm_eval_table = report.lm_eval_table({name: harness.scores(results) for name, results in lm_eval.items()})
        metrics.update(report.lm_eval_metrics(lm_eval_table))
    return metrics, ceval_table, shortfall, lm_eval_table


def run(cfg: PipelineConfig, tracker: run_writers.StageRun, inputs: dict, dist: Dist) -> dict:
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
    log_ceval_lineage(cfg, tracker)
    judged = pd.DataFrame()
    if judging:
        judged, qualities = judge_all(cfg, inputs, answer_pairs(rows, responses), dist.device, stop_point)

    # Metrics and the champion decision.
    metrics, ceval_table, shortfall, lm_eval_table = benchmark_metrics(answers, ceval_seconds, lm_eval)
    judge_table, champion, tags = None, "no policy", {}
    if len(judged):
        judge_table = report.judge_table(judged, cfg.statistics, qualities)
        judge_metrics, won, champion, verdict_judge = judge_verdicts(cfg, judged, qualities)
        metrics.update({**judge_metrics, "eval/champion": float(won)})
        tags[CHAMPION_JUDGE_TAG] = verdict_judge
        if won:
            tracker.set_model_alias(inputs["policy_model"], CHAMPION_ALIAS)
    if judging and inputs.get("final_policy_model_dir"):
        final_metrics, final_judged = judge_final_policy(cfg, inputs, rows, responses, dist.device,
                                                          qualities, stop_point)
        metrics.update(final_metrics)
        final_judged.to_json(tracker.workdir / "final_judgements.jsonl", orient="records", lines=True, force_ascii=False)
        tracker.log_artifact(tracker.workdir / "final_judgements.jsonl", "report")
    metrics["eval/seconds"] = time.perf_counter() - started
    tracker.log_metrics(metrics, step=0)
    tracker.set_tags({CHAMPION_TAG: champion, **tags})

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
