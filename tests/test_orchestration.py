"""Orchestration pieces that need no server: the cache key that lets a rerun skip a stage, the
retry policy, the work-pool deployments in infra/, the multi-node launch command, `rlhf up`'s
refusals."""

from __future__ import annotations

import json
import socket

import pytest
import yaml
from prefect.states import Failed

from flows import services
from flows.rlhf import deployments, retry_on_infrastructure_errors, stage_cache_key
from stages.compute.loading import DataError
from stages.leaves.config import REPO_ROOT, ConfigError, LaunchConfig
from stages.orchestration import registry
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import StageLaunchError, rank_command

INPUTS = {"splits": "runs:/d/splits", "sft_model": "models:/rlhf-tiny-sft/1", "reward_model": "models:/rlhf-tiny-reward/1",
          "critic_model": "models:/rlhf-tiny-critic/1", "data_run": "d", "sft_run": "s"}


def _key(stage: str, cfg, inputs: dict) -> str:
    return stage_cache_key(None, {"stage": stage, "cfg": cfg, "inputs": inputs, "pipeline_run_id": "any"})


def test_a_stage_cache_key_is_its_inputs_and_the_config_it_depends_on():
    cfg, kl = load_config("tiny"), load_config("tiny", {"ppo.kl_coef": 0.1})
    # What the stage does not read (other outputs, its own outputs of an earlier run) is no part of it.
    with_policy = {**INPUTS, "policy_model": "models:/rlhf-tiny-policy/3", "ppo_run": "p"}
    assert _key("ppo", cfg, INPUTS) == _key("ppo", cfg, with_policy)
    assert _key("ppo", cfg, INPUTS) != _key("ppo", cfg, {**INPUTS, "critic_model": "models:/rlhf-tiny-critic/2"})
    assert _key("ppo", cfg, INPUTS) != _key("ppo", kl, INPUTS)
    assert _key("sft", cfg, INPUTS) == _key("sft", kl, INPUTS)  # SFT does not depend on the PPO section
    assert _key("sft", cfg, INPUTS) == _key("sft", load_config("tiny", {"orchestration.retries": 3}), INPUTS)
    assert _key("sft", cfg, INPUTS) != _key("reward", cfg, INPUTS)
    # The critic reads a few PPO fields only: a longer PPO run reuses it (tests/test_registry.py).
    assert _key("critic", cfg, INPUTS) == _key("critic", load_config("tiny", {"ppo.iterations": 200}), INPUTS)


def test_only_infrastructure_failures_are_retried():
    def retried(error: BaseException) -> bool:
        return retry_on_infrastructure_errors(None, None, Failed(data=error))

    assert retried(StageLaunchError("stage 'ppo' failed on 2 ranks (exit -9)"))
    assert retried(ConnectionError("MLflow went away"))
    assert not retried(ValueError("stage 'sft' needs splits"))
    assert not retried(DataError("pairs.jsonl", 3, "not JSON"))


def test_prefect_yaml_defines_the_served_deployments_on_a_cpu_and_a_gpu_pool():
    """infra/prefect.yaml declares exactly the registry's deployments (stages/orchestration/registry.py)."""
    declared = {d["name"]: d for d in yaml.safe_load((REPO_ROOT / "infra" / "prefect.yaml").read_text())["deployments"]}
    served = {d.name: d.parameters for d in deployments("demo")}
    assert set(declared) == set(served) == {"full"} | {s.name for s in registry.STAGES.values() if s.deployed}
    for name, deployment in declared.items():
        assert deployment["entrypoint"] == "flows/rlhf.py:rlhf" and deployment["parameters"] == served[name]
        gpu = name != "full" and registry.get(name).gpu
        assert deployment["work_pool"]["name"] == ("rlhf-gpu" if gpu else "rlhf-cpu")
    assert declared["ppo"]["work_pool"]["job_variables"]["env"]["RLHF_RESULTS"].startswith("/rlhf-home/")
    template = json.loads((REPO_ROOT / "infra" / "work-pools" / "kubernetes-gpu.json").read_text())
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert template["variables"]["properties"]["gpus"]["default"] == 1


def test_a_hostfile_starts_the_ranks_through_the_deepspeed_launcher(tmp_path):
    spec = tmp_path / "launch.json"
    cmd, local = rank_command("ppo", LaunchConfig(world_size=16, deepspeed="zero3", hostfile="hostfile.example"), spec)
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"] and cmd[-4:] == ["--no_local_rank", "--module", "stages.orchestration.launch", str(spec)]
    assert "--no_ssh_check" not in cmd and local == 8  # two hosts: ssh, 8 ranks here
    cmd, local = rank_command("sft", LaunchConfig(world_size=2, deepspeed="zero2", hostfile="hostfile.local"), spec)
    assert "--no_ssh_check" in cmd and "--master_addr=127.0.0.1" in cmd and local == 2
    with pytest.raises(ConfigError, match="world_size is 4 but hostfile .* has 2 slots"):
        rank_command("sft", LaunchConfig(world_size=4, hostfile="hostfile.local"), spec)


def test_up_refuses_a_port_in_use_and_down_with_nothing_up_stops_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_HOME", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(services.ServicesError, match=f"port {taken.getsockname()[1]} on 127.0.0.1 is in use"):
            services.up("tiny", prefect_port=taken.getsockname()[1])
    assert services.down() == []
