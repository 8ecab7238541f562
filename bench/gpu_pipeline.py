"""The `gpu` preset's stages in pipeline order, each as `rlhf run` executes it, and a table of each
training stage's time and peak GPU memory against `rlhf plan`'s prediction.

`stages.orchestration.launch.execute` runs each stage as the flow does (SFT, reward, critic and PPO as DeepSpeed
ranks on the GPU; data and eval in-process) and records it in MLflow; the data-contract gates
between stages, which the Prefect flow adds, are not run (they need Great Expectations and
Prefect, which a GPU machine without network may lack): `rlhf run --preset gpu` runs them too.
Rank 0 of each training stage logs `stage/seconds` and `stage/peak_gpu_memory_gib`
(`torch.cuda.max_memory_allocated`); the table divides the latter by the plan's per-device peak.

    python3 bench/gpu_pipeline.py                       # --preset gpu; RLHF_DATA_DIR: a hub mirror (HH-RLHF)
    python3 bench/gpu_pipeline.py --set ppo.iterations=2 --table /tmp/gpu-preset.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.orchestration import lineage, plan, registry, run_writers  # noqa: E402
from stages.orchestration.config_loading import load_config  # noqa: E402
from stages.orchestration.launch import execute  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table here")
    args = parser.parse_args()
    cfg = load_config(args.preset, args.overrides)
    import torch

    # The plan's GPU prediction; its memory bound only matters for the verdict, which is not read here.
    gpu_plan = plan.plan(cfg, device="cuda", memory_gib=None if torch.cuda.is_available() else 80.0)
    predicted = {sp.stage: sp.peak for sp in gpu_plan.stages}
    names = [name for name in registry.pipeline_names() if not registry.get(name).skipped(cfg)]
    pipeline = run_writers.PipelineRun.start(cfg, names)
    outputs: dict = {}
    wall: dict[str, float] = {}
    try:
        for name in names:
            started = time.perf_counter()
            outputs.update(execute(name, cfg, pipeline.run_id, outputs))
            wall[name] = time.perf_counter() - started
            print(f"gpu_pipeline: {name} done in {wall[name]:.1f} s", flush=True)
    except BaseException:
        pipeline.finish("FAILED")
        raise
    pipeline.finish("FINISHED")
    metrics = {run.data.tags["rlhf.stage"]: run.data.metrics for run in lineage.stage_runs(pipeline.run_id)}
    lines = ["| stage | wall s (launcher) | s (rank 0) | peak GPU GiB | plan GiB | measured / plan |",
             "|---|---|---|---|---|---|"]
    for name in names:
        stage_metrics = metrics.get(name, {})
        peak = stage_metrics.get("stage/peak_gpu_memory_gib")
        planned = predicted.get(name)
        ratio = f"×{peak / (planned / plan.GiB):.2f}" if peak is not None and planned else "—"
        seconds = stage_metrics.get("stage/seconds")  # logged by DeepSpeed ranks, not by in-process stages
        lines.append(f"| {name} | {wall[name]:.1f} | {'—' if seconds is None else f'{seconds:.1f}'} | "
                     f"{'—' if peak is None else f'{peak:.2f}'} | "
                     f"{'—' if planned is None else f'{planned / plan.GiB:.2f}'} | {ratio} |")
    lines.append(f"| total | {sum(wall.values()):.1f} | | | | |")
    table = "\n".join(lines)
    print(table)
    if args.table:
        args.table.write_text(table + "\n")


if __name__ == "__main__":
    main()
