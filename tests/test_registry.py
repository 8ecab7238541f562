"""The stage registry is the one list of stages: the flow, cache keys, gates and `rlhf runs` follow
it (infra/prefect.yaml: tests/test_orchestration.py); a stage added in a test runs through the
real flow with nothing else edited."""

from __future__ import annotations

import pytest

from stages.leaves.config import CriticRollouts, PPOConfig
from stages.orchestration import lineage, registry, runs, tracking
from stages.orchestration.config_loading import load_config
from stages.orchestration.registry import Stage


def _hash(stage: str, overrides: list[str]) -> str:
    return registry.get(stage).config_hash(load_config("tiny", overrides))


def test_ppo_only_settings_do_not_change_the_critics_cache_key():
    """`--set ppo.iterations=200 --from-run <id>` reuses the critic: it does not read that field. The
    critic's PPO settings (`critic_ppo`, what its trainer receives) are the same object, so nothing
    outside the key reaches the critic."""
    cfg = load_config("tiny")
    for ppo_only in ("ppo.iterations=200", "ppo.actor_lr=1e-6", "ppo.eval_every=2", "ppo.ptx_coef=0.1",
                     "ppo.kl_coef=0.2", "ppo.whiten_advantages=false", "ppo.rollout_batch_size=64"):
        assert _hash("critic", [ppo_only]) == _hash("critic", []), ppo_only
        assert _hash("ppo", [ppo_only]) != _hash("ppo", []), ppo_only
        assert load_config("tiny", [ppo_only]).critic_ppo() == cfg.critic_ppo(), ppo_only
    for read_by_critic in ("ppo.gamma=0.9", "ppo.preset=vanilla", "ppo.generation.max_new_tokens=7", "critic.lr=1e-4",
                           "ppo.reward=char_fraction:a", "ppo.value_clip_eps=0.3"):
        assert _hash("critic", [read_by_critic]) != _hash("critic", []), read_by_critic
        assert load_config("tiny", [read_by_critic]).critic_ppo() != cfg.critic_ppo(), read_by_critic
    assert _hash("critic", ["reward.lr=1e-4"]) != _hash("critic", [])  # an input's section


def test_the_critics_ppo_settings_are_its_cache_key():
    """Every field of `CriticRollouts` is in the critic's cache key and reaches the PPO settings its
    trainer receives; every other PPO field the trainer reads is the default, whatever `ppo` says."""
    cfg = load_config("tiny")
    key = registry.get("critic").config
    assert {f"ppo.{name}" for name in CriticRollouts.model_fields} == {name for name in key if name.startswith("ppo")}
    critic_ppo = cfg.critic_ppo()
    for name in CriticRollouts.model_fields:
        assert getattr(critic_ppo, name) == getattr(cfg.ppo, name), name
    own = {"rollout_batch_size", "minibatch_size", "critic_lr", "critic_weight_decay", "max_grad_norm", "adam_betas",
           "seed", "max_nonfinite_steps", "ppo_epochs"}
    for name in set(PPOConfig.model_fields) - set(CriticRollouts.model_fields) - own:
        assert getattr(critic_ppo, name) == getattr(PPOConfig(), name), name


def test_a_whole_section_hashes_as_before():
    """Stages that depend on whole sections keep their cache keys across this change."""
    import hashlib
    import json

    cfg = load_config("tiny")
    dump = cfg.model_dump(mode="json")
    old = {name: dump[name] for name in ("model", "data", "sft")}
    expected = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert registry.get("sft").config_hash(cfg) == expected


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
    recorded = lineage.recorded_stages(tracking.client().get_run(pipeline_run_id))
    assert set(recorded) == {"data", "toy"} and recorded["toy"][0] == "ran"
    outputs = lineage.stage_outputs(recorded["toy"][1])
    rows = str(load_config("tiny").data.splits.sft)
    assert outputs["toy_rows"] == rows
    views = {view.stage: view for view in runs.stage_views(tracking.client().get_run(pipeline_run_id))}
    assert [view.stage for view in views.values()] == ["data", "toy"]
    assert views["toy"].headline() == {"toy/sft_rows": float(rows)}


def test_every_stage_returns_the_outputs_its_entry_declares(full_run):
    recorded = lineage.recorded_stages(tracking.client().get_run(full_run))
    assert set(recorded) == set(registry.pipeline_names())
    for name, (_, stage_run_id) in recorded.items():
        spec = registry.get(name)
        assert set(lineage.stage_outputs(stage_run_id)) == {spec.run_output, *spec.outputs}, name
