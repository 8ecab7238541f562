"""`model.lora`: LoRA adapters (peft) on every trained model. A step moves the adapters (and a
reward model's scalar head) only; PPO's reference is the actor with its adapters off, which gives
the SFT model's log-probs exactly; the saved model is a plain transformers model with the adapters
merged in."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.compute import model_loading
from stages.compute.loading import load_model
from stages.compute.ppo.experience import response_logits
from stages.compute.training import adamw, linear_warmup, make_engine, trained_model
from stages.leaves.rendering import collate
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import Dist
from stages.pipeline.sft import response_nll

LORA = ("model.lora.rank=4", "model.fast_path=off")


def batch_of(tiny, rows: int = 4) -> dict[str, torch.Tensor]:
    _, tokenizer, prompts = tiny
    return collate([(ids, ids) for ids in prompts[:rows]], tokenizer.pad_token_id)


def one_step(model, loss_of, lr: float = 1e-2):
    optimizer = adamw(model, lr=lr)
    engine = make_engine(model, optimizer, linear_warmup(optimizer, 0), micro_batch_size=4, grad_accum_steps=1,
                         max_grad_norm=1.0, precision="fp32", dist=Dist())
    engine.backward(loss_of(engine))
    engine.step()
    return engine


def changed(before: dict[str, torch.Tensor], model) -> set[str]:
    return {name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])}


def test_a_lora_step_moves_the_adapters_only(tiny):
    cfg = load_config("tiny", list(LORA))
    batch = batch_of(tiny)
    model = model_loading.trained_lm(tiny[0], cfg.model, "cpu")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    one_step(model, lambda m: response_nll(m, batch)[0])
    moved = changed(before, model)
    assert moved and moved <= trained and {n for n in moved if "lora_A" in n}


def test_a_lora_reward_model_trains_its_adapters_and_head_only(tiny):
    cfg = load_config("tiny", list(LORA))
    batch = batch_of(tiny)
    model = model_loading.trained_reward_model(tiny[0], cfg.model, "cpu")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    one_step(model, lambda m: m(batch["input_ids"], batch["attention_mask"])[0].sum())
    moved = changed(before, model)
    assert {"score_head.weight", "score_head.bias"} <= moved
    assert all("lora_" in name or name.startswith("score_head.") for name in moved)


def test_the_reference_is_the_actor_without_its_adapters(tiny, reward_model_dir):
    """No second copy: the reference owns no parameter, and its log-probs are the SFT model's
    exactly, however far the adapters moved."""
    cfg = load_config("tiny", [*LORA, "ppo.advantage_estimator=gae"])
    inputs = {"sft_model_dir": tiny[0], "reward_model_dir": reward_model_dir}
    _, actor, reference, _, critic, _ = model_loading.load_models(cfg, inputs, Dist())
    assert isinstance(reference, model_loading.WithoutAdapters) and list(reference.parameters()) == []
    assert any("lora_" in name for name, _ in critic.named_parameters())
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # adapters that change the outputs
    ids, mask = batch_of(tiny)["input_ids"], batch_of(tiny)["attention_mask"]
    sft = load_model(tiny[0], cfg.model).eval()
    with torch.no_grad():
        expected = response_logits(sft, ids, mask, 8)
        assert torch.equal(response_logits(reference, ids, mask, 8), expected)
        assert not torch.allclose(response_logits(actor.eval(), ids, mask, 8), expected, atol=1e-3)


def test_the_saved_lora_model_is_a_plain_transformers_model(tiny, tmp_path):
    cfg = load_config("tiny", list(LORA))
    batch = batch_of(tiny)
    model = model_loading.trained_lm(tiny[0], cfg.model, "cpu")
    engine = one_step(model, lambda m: response_nll(m, batch)[0], lr=5e-2)
    engine.module.eval()
    with torch.no_grad():
        adapted = engine.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    merged = trained_model(engine)
    assert not any(type(m).__module__.startswith("peft.") for m in merged.modules())
    merged.save_pretrained(tmp_path, safe_serialization=True)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(plain).__name__ == "LlamaForCausalLM"
    assert not any("lora" in key or "base_layer" in key for key in plain.state_dict())
    with torch.no_grad():
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, adapted, rtol=1e-4, atol=1e-4)


def test_the_adapter_is_saved_beside_the_merged_model_in_peft_format(tiny, tmp_path):
    """`save_adapter` writes the adapter a merged model was trained with, which peft loads onto the
    base model to give the merged model's outputs."""
    from peft import PeftModel

    cfg = load_config("tiny", list(LORA))
    batch = batch_of(tiny)
    model = model_loading.trained_lm(tiny[0], cfg.model, "cpu")
    merged = trained_model(one_step(model, lambda m: response_nll(m, batch)[0], lr=5e-2)).eval()
    model_loading.save_adapter(merged, tmp_path)
    base = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / model_loading.LORA_ADAPTER_DIR)).eval()
    with torch.no_grad():
        expected = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits = adapted(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_lora_pipeline_registers_plain_transformers_models(prefect_server, tmp_path, monkeypatch):
    """The tiny pipeline with LoRA on every trained model: the registered policy loads through
    mlflow.transformers as a plain transformers model (adapters merged), its adapter inside it."""
    import mlflow.transformers

    from flows.rlhf import rlhf
    from stages.orchestration import tracking

    rlhf(preset="tiny", overrides={"model.lora.rank": 4, "sft.lr": 1e-3, "reward.lr": 1e-3, "sft.max_steps": 8,
                                   "reward.max_steps": 8, "critic.max_steps": 4, "ppo.iterations": 2})
    client = tracking.client()
    # MLflow's own loader resolves `models:/` through its default tracking URI: this session's store.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.tracking_uri())
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracking.tracking_uri())
    version = max(int(v.version) for v in client.search_model_versions("name='rlhf-tiny-policy'"))
    pipeline = mlflow.transformers.load_model(f"models:/rlhf-tiny-policy/{version}")
    assert type(pipeline.model).__name__ == "LlamaForCausalLM"
    assert not any(type(m).__module__.startswith("peft.") for m in pipeline.model.modules())
    folder = tracking.download(f"models:/rlhf-tiny-policy/{version}", tmp_path)
    assert list(folder.rglob(f"{model_loading.LORA_ADAPTER_DIR}/adapter_model.safetensors"))
