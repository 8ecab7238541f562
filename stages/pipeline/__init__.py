"""The stage modules, one per stage of the pipeline (stages/orchestration/registry.py lists them):
each has `run(cfg, tracker, inputs, dist) -> outputs`. No stage module imports another (the data
stage's splits, which the others read, aside): what two stages share sits in stages/compute/."""
