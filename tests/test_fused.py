"""stages.compute.models.fused: the compiled RMSNorm and SwiGLU kernels of the bf16 forward on a CPU under
autograd compute the eager modules' formulas, forward and backward, and the padding-free forward
that uses them stays as close to an fp64 reference as the model's own bf16 forward."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from stages.compute.models import fused, last_hidden_state, set_fast_path

BF16_STEP = 2.0**-7  # bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-8 of it
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]  # C++ kernels on a CPU, Triton on a GPU


@pytest.mark.parametrize("device", DEVICES)
def test_the_compiled_kernels_equal_the_eager_modules_forward_and_backward(device):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(48, eps=1e-5).to(device, torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(37, 48).to(device, torch.bfloat16).requires_grad_()
    gate, up = (torch.randn(37, 96).to(device, torch.bfloat16).requires_grad_() for _ in range(2))
    cases = {"rms_norm": (lambda: fused.fused(fused.rms_norm, x, norm.weight, norm.variance_epsilon), lambda: norm(x),
                          (x, norm.weight)),
             "swiglu": (lambda: fused.fused(fused.swiglu, gate, up), lambda: torch.nn.functional.silu(gate) * up,
                        (gate, up))}
    for name, (compiled, eager, inputs) in cases.items():
        output_grad = torch.randn(37, inputs[0].shape[1]).to(device, torch.bfloat16)
        ours, theirs = compiled(), eager()
        assert ours.dtype == theirs.dtype == torch.bfloat16
        torch.testing.assert_close(ours, theirs, atol=BF16_STEP, rtol=BF16_STEP, msg=name)
        for a, b in zip(torch.autograd.grad(ours, inputs, output_grad), torch.autograd.grad(theirs, inputs, output_grad)):
            # the weight's gradient sums 37 rows: its fp32 sum is rounded once, in a different order
            torch.testing.assert_close(a.float(), b.float(), atol=4 * BF16_STEP, rtol=2 * BF16_STEP, msg=name)
    assert not fused._failed, fused._failed
    assert {fused.rms_norm, fused.swiglu} <= set(fused._compiled)  # compiled, not the eager fallback


@pytest.mark.parametrize("device", DEVICES)
def test_they_apply_to_bf16_under_autograd_only(device):
    x = torch.ones(2, 3, dtype=torch.bfloat16, device=device)
    assert fused.applies(x) and not fused.applies(x.float())
    with torch.no_grad():
        assert not fused.applies(x)


def test_a_failed_compilation_warns_once_and_runs_the_eager_form(monkeypatch):
    def broken(function, **options):
        def compiled(*args):
            raise RuntimeError("no C++ compiler")
        return compiled

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(fused, "_failed", [])
    gate, up = torch.randn(3, 4).to(torch.bfloat16), torch.randn(3, 4).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        first = fused.fused(fused.swiglu, gate, up)
    assert torch.equal(first, fused.swiglu(gate, up))
    assert not fused.applies(gate)  # from now on, eager without trying again


@pytest.mark.parametrize("device", DEVICES)
def test_the_bf16_padding_free_forward_is_as_close_to_fp64_as_the_models_own_bf16_forward(device):
    """Its hidden states and weight gradients, against the same model in fp64: its error is within
    twice the model's own bf16 forward's (the roundings differ, not their number)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.data.uniform_(0.5, 1.5)  # not the initial ones, which any norm weight would match
    ids = torch.randint(3, 97, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    ids, mask = ids.to(device), mask.to(device)
    real = mask.bool()[..., None]
    weights = torch.randn(3, 9, 48, dtype=torch.float64, device=device) * real

    def run(dtype, fast_path):
        copy = LlamaForCausalLM(model.config).to(device, dtype)
        copy.load_state_dict(model.state_dict())
        set_fast_path(copy, fast_path)
        hidden = last_hidden_state(copy.base_model, ids, mask) * real
        grads = torch.autograd.grad((hidden.double() * weights).sum(), list(copy.base_model.parameters()))
        return [hidden.double(), *(g.double() for g in grads)]

    exact, plain, fast = run(torch.float64, "off"), run(torch.bfloat16, "off"), run(torch.bfloat16, "auto")
    for reference, theirs, ours in zip(exact, plain, fast, strict=True):
        their_error, our_error = (theirs - reference).norm(), (ours - reference).norm()
        assert our_error <= 2 * their_error + 1e-6 * reference.norm(), (our_error, their_error)
    assert not fused._failed and fused.rms_norm in fused._compiled
