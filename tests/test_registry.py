"""The stage registry is the one list of stages: the flow, cache keys, gates and `rlhf runs` follow
it (infra/prefect.yaml: tests/test_orchestration.py); a stage added in a test runs through the
real flow with nothing else edited."""

from __future__ import annotations

import pytest

from stages import registry, runs, tracking
from stages.config import load_config
from stages.registry import Stage


def test_ppo_only_settings_do_not_change_the_critics_cache_key():
    """`--set ppo.iterations=200 --from-run <id>` reuses the critic: it does not read that field."""
    cfg = load_config("tiny")
    for ppo_only in ("ppo.iterations=200", "ppo.actor_lr=1e-6", "ppo.eval_every=2", "ppo.ptx_coef=0.1"):
        assert load_config("tiny", [ppo_only]).stage_hash("critic") == cfg.stage_hash("critic"), ppo_only
        assert load_config("tiny", [ppo_only]).stage_hash("ppo") != cfg.stage_hash("ppo"), ppo_only
    for read_by_critic in ("ppo.gamma=0.9", "ppo.preset=vanilla", "ppo.generation.max_new_tokens=7", "critic.lr=1e-4",
                           "reward.lr=1e-4"):
        assert load_config("tiny", [read_by_critic]).stage_hash("critic") != cfg.stage_hash("critic"), read_by_critic


def test_a_whole_section_hashes_as_before():
    """Stages that depend on whole sections keep their cache keys across this change."""
    import hashlib
    import json

    cfg = load_config("tiny")
    dump = cfg.model_dump(mode="json")
    old = {name: dump[name] for name in ("model", "data", "sft")}
    assert cfg.stage_hash("sft") == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]


def test_an_unknown_stage_names_the_closest_one():
    with pytest.raises(KeyError, match="unknown stage 'rl'; stages: data, sft"):
        registry.get("rl")
    assert "did you mean 'critic'" in registry.unknown_stage_message(["critc"])


@pytest.fixture
def toy_stage():
    stage = registry.register(Stage("toy", "toy_stage", config=("data",), inputs=("splits",),
                                    outputs=("toy_rows",), gpu=False, deployed=False, headline=("toy/sft_rows",)),
                              after="data")
    yield stage
    registry.unregister("toy")


def test_a_stage_added_in_a_test_runs_through_the_flow(prefect_server, toy_stage):
    from flows.rlhf import rlhf

    assert registry.names()[:2] == ["data", "toy"]
    pipeline_run_id = rlhf(preset="tiny", stages=["data", "toy"])
    recorded = tracking.recorded_stages(tracking.client().get_run(pipeline_run_id))
    assert set(recorded) == {"data", "toy"} and recorded["toy"][0] == "ran"
    outputs = tracking.stage_outputs(recorded["toy"][1])
    rows = str(load_config("tiny").data.splits.sft)
    assert outputs["toy_rows"] == rows
    views = {view.stage: view for view in runs.stage_views(tracking.client().get_run(pipeline_run_id))}
    assert [view.stage for view in views.values()] == ["data", "toy"]
    assert views["toy"].headline() == {"toy/sft_rows": float(rows)}


def test_every_stage_returns_the_outputs_its_entry_declares(full_run):
    recorded = tracking.recorded_stages(tracking.client().get_run(full_run))
    assert set(recorded) == set(registry.names())
    for name, (_, stage_run_id) in recorded.items():
        spec = registry.get(name)
        assert set(tracking.stage_outputs(stage_run_id)) == {spec.run_output, *spec.outputs}, name
