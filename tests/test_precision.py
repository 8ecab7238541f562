"""model.precision: its resolution, and bf16 training with fp32 master weights (PlainEngine)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from stages.compute.loading import load_model
from stages.compute.losses import shifted_nll
from stages.leaves import precision
from stages.leaves.config import ConfigError
from stages.leaves.rendering import collate
from stages.orchestration.config_loading import load_config
from stages.compute.training import (MasterWeights, PlainEngine, adamw, bf16_total_norm, clip_grad_norm,
                                     clip_with_norm, linear_warmup, trained_model)
from ppo_helpers import make_trainer


def test_auto_is_bf16_exactly_where_the_device_multiplies_bf16_natively(monkeypatch):
    for flags, expected in [((), "fp32"), (("avx512_bf16",), "bf16"), (("amx_bf16", "avx512_bf16"), "bf16")]:
        monkeypatch.setattr(precision, "cpu_bf16_flags", lambda flags=flags: flags)
        assert precision.resolve("auto", "cpu") == expected
        assert precision.resolve("fp32", "cpu") == "fp32" and precision.resolve("bf16", "cpu") == "bf16"
        assert ("without" in precision.describe("cpu")) == (not flags)


def test_the_cpu_flags_are_read_from_proc_cpuinfo():
    text = open("/proc/cpuinfo").read()
    flags = next(line for line in text.splitlines() if line.startswith("flags")).split(":")[1].split()
    assert precision.cpu_bf16_flags() == tuple(f for f in precision.BF16_CPU_FLAGS if f in flags)


def test_old_precision_keys_are_gone():
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config("tiny", ["model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="ppo.autocast"):
        load_config("tiny", ["ppo.autocast=bf16"])
    assert load_config("tiny", ["model.precision=bf16"]).model.precision == "bf16"


def test_frozen_models_load_bf16_weights_with_fp32_rope(tiny):
    folder, _, _ = tiny
    model = load_model(folder, load_config("tiny").model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # RoPE's inverse frequencies stay fp32: in bf16, position 500's angle would be off by radians.
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def _engine(tiny, mode: str, accum: int = 1, from_bf16_gradients: bool = True) -> PlainEngine:
    """An engine on the tiny model; in bf16 with one batch a step it steps from the bf16 gradients
    (training.steps_from_bf16_gradients) unless told not to, else through the masters' fp32 gradients."""
    folder, _, _ = tiny
    torch.manual_seed(0)
    model = load_model(folder, load_config("tiny").model)
    optimizer = adamw(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    return PlainEngine(model, optimizer, linear_warmup(optimizer, 0), accum, 1.0, mode, from_bf16_gradients)


def _batch(tiny, rows: slice):
    _, _, prompts = tiny
    return collate([(p, p) for p in prompts[rows]], pad_id=0)


def _train(engine: PlainEngine, batches) -> list[float]:
    losses = []
    for batch in batches:
        logits = engine.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll, tokens = shifted_nll(logits, batch["labels"])
        loss = nll / tokens
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_the_optimiser_state_is_made_with_the_engine_and_steps_as_a_fresh_optimisers(tiny, mode):
    """The engine makes AdamW's state before the first batch (allocate_optimizer_state), and its
    training gives the same weights, bit for bit, as a fresh optimiser that makes its state at the
    first step: the zero-lr step moved nothing and the step counts start again from 0. In bf16 the
    engine steps through torch's AdamW, as the reference does (from_bf16_gradients False; the step
    from the bf16 gradients: test_adamw_from_bf16_gradients_is_torchs_adamw)."""
    folder, _, _ = tiny
    torch.manual_seed(0)
    model = load_model(folder, load_config("tiny").model)
    optimizer = adamw(model, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)  # AdamW's decay must not move at lr 0
    engine = PlainEngine(model, optimizer, linear_warmup(optimizer, 0), 1, 1.0, mode, from_bf16_gradients=False)
    masters = engine.trainable_parameters()
    assert all(set(engine.optimizer.state[m]) >= {"step", "exp_avg", "exp_avg_sq"} for m in masters)
    assert all((m.grad is not None) == (mode == "bf16") for m in masters)  # bf16 keeps its gradient buffers
    batches = [_batch(tiny, slice(i * 4, i * 4 + 4)) for i in range(3)]
    _train(engine, batches)

    torch.manual_seed(0)
    model = load_model(folder, load_config("tiny").model)
    lazy = MasterWeights.of(model) if mode == "bf16" else None
    params = lazy.masters if lazy else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    assert not optimizer.state
    scheduler = linear_warmup(optimizer, 0)
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll, tokens = shifted_nll(logits, batch["labels"])
        (nll / tokens).backward()
        if lazy:
            lazy.accumulate()
        clip_with_norm([p for p in params if p.grad is not None], 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if lazy:
            lazy.copy_to_model()
            lazy.fresh = True
    for ours, theirs in zip(masters, params, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("accum", [1, 2])
def test_batched_master_copies_step_as_the_per_tensor_ones(tiny, accum):
    """MasterWeights.batched (a GPU's multi-tensor copies, here forced on a CPU) trains the same
    weights, bit for bit, as the per-tensor loop; with two micro-batches a step, the second
    backward's gradients add into the masters' through the loop."""
    batches = [_batch(tiny, slice(i * 4, i * 4 + 4)) for i in range(4)]
    engines = {}
    for batched in (False, True):
        engine = _engine(tiny, "bf16", accum, from_bf16_gradients=False)
        engine.master.batched = batched
        _train(engine, batches)
        engines[batched] = engine
    plain, batched = engines[False].master, engines[True].master
    assert not plain.batched and batched.batched
    for a, b in zip(plain.masters + plain.copies, batched.masters + batched.copies, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(plain.masters[0], _engine(tiny, "bf16").master.masters[0])  # it trained


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("max_grad_norm", [1e-3, 1e3])
@pytest.mark.parametrize("clip", ["own", "joint"])
def test_adamw_from_bf16_gradients_is_torchs_adamw(monkeypatch, compiled, max_grad_norm, clip):
    """A bf16 engine with one backward a step steps from the bf16 gradients
    (training.steps_from_bf16_gradients): the clip's norm, the masters, AdamW's moments and step
    counts after four steps (lr warming up, weight decay, clipping every step or never) are torch's
    fused AdamW's after torch's clip, on fp32 copies of the same gradients, to fp32 rounding: the two
    compute the same formulas in another order (the compiled kernel's order is inductor's), so each
    tensor to 1e-6 of its largest element. `clip` own: the engine's clip;
    joint: one clip over two engines (PPO's actor and critic, `clip_grad_norm`). `compiled` False:
    the eager form (fused kernels off, or compiling failed)."""
    from stages.compute.models import fused

    monkeypatch.setattr(fused, "enabled", compiled)
    torch.manual_seed(0)
    engines, lazies, optimizers, schedules = [], [], [], []
    for _ in range(2 if clip == "joint" else 1):
        model = torch.nn.Sequential(torch.nn.Linear(48, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 7))
        reference = copy.deepcopy(model)
        optimizer = adamw(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        engines.append(PlainEngine(model, optimizer, linear_warmup(optimizer, 3), 1,
                                   math.inf if clip == "joint" else max_grad_norm, "bf16"))
        lazies.append(MasterWeights.of(reference))
        optimizers.append(torch.optim.AdamW(lazies[-1].masters, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True))
        schedules.append(linear_warmup(optimizers[-1], 3))
    assert all(e.steps_from_bf16 and all(m.grad is None for m in e.trainable_parameters()) for e in engines)
    inputs = torch.randn(4, 16, 48, dtype=torch.bfloat16)
    for x in inputs:
        for engine, lazy in zip(engines, lazies):
            engine.backward(engine.module(x).float().pow(2).mean())
            for c, ours in zip(lazy.copies, engine.master.copies):  # the same bf16 gradients on the reference's side
                c.grad = ours.grad.clone()
            lazy.accumulate()
        norm = clip_grad_norm(engines, max_grad_norm) if clip == "joint" else None
        expected = clip_with_norm([m for lazy in lazies for m in lazy.masters], max_grad_norm)
        for engine, lazy, theirs, schedule in zip(engines, lazies, optimizers, schedules):
            engine.step()
            theirs.step()
            schedule.step()
            lazy.copy_to_model()
            lazy.fresh = True
            assert engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-6)
            assert all(c.grad is None for c in engine.master.copies)
            for ours, reference_master in zip(engine.master.masters, lazy.masters, strict=True):
                torch.testing.assert_close(ours, reference_master, rtol=1e-6, atol=1e-7)
                for key in ("exp_avg", "exp_avg_sq"):  # to 1e-6 of the tensor's largest: an element near 0 is a
                    a, b = engine.optimizer.state[ours][key], theirs.state[reference_master][key]  # difference of two
                    assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())  # (lerp), not its own scale
                assert float(engine.optimizer.state[ours]["step"]) == float(theirs.state[reference_master]["step"])
            for c, m in zip(engine.master.copies, engine.master.masters):
                assert torch.equal(c, m.detach().to(torch.bfloat16))  # the model's weights: the masters rounded
        if norm is not None:
            assert norm == pytest.approx(expected, rel=1e-6)
    assert all(float(e.optimizer.state[e.master.masters[0]]["step"]) == len(inputs) for e in engines)


def test_the_norm_of_bf16_gradients_is_the_fp64_norm():
    torch.manual_seed(0)
    gradients = [torch.randn(4096, 576).bfloat16() * 1e-3, torch.randn(576).bfloat16(), torch.randn(7, 3, 5).bfloat16()]
    exact = torch.cat([g.double().flatten() for g in gradients]).norm().item()
    assert abs(bf16_total_norm(gradients) - exact) <= 1e-6 * exact


def test_bf16_engine_computes_in_bf16_and_steps_fp32_masters(tiny):
    engine = _engine(tiny, "bf16")
    model = engine.module
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    masters = engine.trainable_parameters()
    assert masters and {m.dtype for m in masters} == {torch.float32}
    before = [m.detach().clone() for m in masters]
    _train(engine, [_batch(tiny, slice(0, 8))])
    assert any(not torch.equal(b, m) for b, m in zip(before, masters))
    # The model's weights are the masters rounded to bf16.
    for bf16_copy, master in zip(engine.master.copies, masters):
        assert torch.equal(bf16_copy, master.detach().to(torch.bfloat16))
    # Tied weights (the tiny Llama ties its embeddings to the LM head, if it does) stay one tensor.
    if model.config.tie_word_embeddings:
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight


def test_bf16_training_follows_fp32_training(tiny):
    batches = [_batch(tiny, slice(i * 8, i * 8 + 8)) for i in range(4)]
    fp32, bf16 = _train(_engine(tiny, "fp32"), batches), _train(_engine(tiny, "bf16"), batches)
    assert all(math.isfinite(x) for x in bf16)
    # bf16 carries 8 significant bits: ~0.4 % per rounding; the losses agree to 2 %.
    for a, b in zip(fp32, bf16):
        assert b == pytest.approx(a, rel=0.02)
    assert bf16[-1] < bf16[0]


def test_gradients_accumulate_in_fp32(tiny):
    engine = _engine(tiny, "bf16", accum=2)
    batches = [_batch(tiny, slice(0, 4)), _batch(tiny, slice(4, 8))]
    expected = None
    for batch in batches:
        logits = engine.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll, tokens = shifted_nll(logits, batch["labels"])
        loss = nll / tokens
        engine.backward(loss)
        grads = [m.grad.clone() for m in engine.trainable_parameters()]
        assert {g.dtype for g in grads} == {torch.float32}
        if expected is None:
            expected = grads
        engine.step()  # the first is not a boundary: nothing is stepped or zeroed
    assert all(bf16_copy.grad is None for bf16_copy in engine.master.copies)
    # After the boundary step the next backward starts afresh: its gradients, not a sum with the
    # last step's (the masters' gradient buffers are kept and overwritten).
    model = engine.module
    logits = model(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"]).logits
    nll, tokens = shifted_nll(logits, batches[0]["labels"])
    (nll / tokens / 2).backward(retain_graph=True)  # the same scaling as engine.backward with 2 accumulation steps
    alone = [bf16_copy.grad.float() for bf16_copy in engine.master.copies]
    for bf16_copy in engine.master.copies:
        bf16_copy.grad = None
    engine.backward(nll / tokens)
    for master, expected_grad in zip(engine.trainable_parameters(), alone):
        torch.testing.assert_close(master.grad, expected_grad)


@pytest.mark.parametrize("from_bf16_gradients", [False, True])
def test_a_parameter_without_a_gradient_in_a_step_is_not_stepped_with_the_last_steps(tiny, from_bf16_gradients):
    """The bf16 engine keeps its fp32 gradient buffers from step to step: a parameter that gets no
    gradient in a step must not be stepped with the previous step's (AdamW skips a parameter
    whose gradient is None, as after the fp32 engine's zero_grad). The same holds where the engine
    steps from the bf16 gradients."""
    engine = _engine(tiny, "bf16", from_bf16_gradients=from_bf16_gradients)
    assert engine.steps_from_bf16 == from_bf16_gradients
    _train(engine, [_batch(tiny, slice(0, 8))])
    embedding = engine.module.get_input_embeddings().weight
    frozen_out = [bf16_copy for bf16_copy in engine.master.copies if bf16_copy is not embedding]
    masters = dict(zip(map(id, engine.master.copies), engine.trainable_parameters()))
    for bf16_copy in frozen_out:  # this step's backward reaches the embedding only
        bf16_copy.requires_grad_(False)
    before = {id(bf16_copy): masters[id(bf16_copy)].detach().clone() for bf16_copy in frozen_out}
    _train(engine, [_batch(tiny, slice(8, 16))])
    for bf16_copy in frozen_out:
        assert torch.equal(masters[id(bf16_copy)], before[id(bf16_copy)]), "stepped with a stale gradient"
    if not engine.steps_from_bf16:  # a step from the bf16 gradients keeps no fp32 buffers
        assert masters[id(embedding)].grad is not None


def test_the_restored_fp32_model_holds_no_gradient_buffers(tiny):
    """The bf16 engine keeps its fp32 gradient buffers between steps; the model it hands back for
    saving (restore_fp32) must not carry them on (4 bytes per parameter for as long as it lives)."""
    engine = _engine(tiny, "bf16", from_bf16_gradients=False)
    _train(engine, [_batch(tiny, slice(0, 8))])
    assert any(m.grad is not None for m in engine.trainable_parameters())
    model = engine.restore_fp32()
    assert all(p.grad is None for p in model.parameters())


def test_checkpoint_weights_are_the_masters_and_restore_fp32_gives_them_back(tiny):
    engine = _engine(tiny, "bf16")
    _train(engine, [_batch(tiny, slice(0, 8))])
    weights = engine.weights()
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float32}
    other = _engine(tiny, "bf16")
    other.load_weights(weights)
    for a, b in zip(other.trainable_parameters(), engine.trainable_parameters()):
        assert torch.equal(a, b)
    model = trained_model(engine)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = model.state_dict()
    for name, value in weights.items():
        assert torch.equal(state[name], value), name


def test_rlhf_config_says_what_precision_resolves_to_here():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "flows.cli", "config", "--preset", "tiny", "--set",
                          "model.precision=auto"], capture_output=True, text=True, check=True).stdout
    assert (f"# model.precision auto resolves to {precision.resolve('auto', 'cpu')} on this machine "
            f"({precision.describe('cpu')})") in out


def test_ppo_logs_the_rollout_training_logprob_mismatch_small_in_fp32_and_bounded_in_bf16(tiny):
    diffs = {}
    for mode in ("fp32", "bf16"):
        trainer = make_trainer(tiny, f"model.precision={mode}")
        diffs[mode] = [trainer.step()["val/logprob_diff"] for _ in range(3)]
    print("val/logprob_diff", diffs)
    assert max(diffs["fp32"]) < 1e-4  # the same weights and numbers: only kernel order differs
    assert max(diffs["bf16"]) < 0.01  # bf16's 8 mantissa bits through sampling and training forwards
    assert min(diffs["bf16"]) > max(diffs["fp32"])


def test_bf16_ppo_raises_a_rule_reward_as_fp32_does(tiny):
    finals = {}
    for mode in ("fp32", "bf16"):
        trainer = make_trainer(tiny, f"model.precision={mode}")
        assert {p.dtype for p in trainer.reference.parameters()} == {precision.dtype(mode)}
        scores = [trainer.step()["objective/scores"] for _ in range(30)]
        assert all(math.isfinite(s) for s in scores)
        finals[mode] = (sum(scores[:5]) / 5, sum(scores[-5:]) / 5)
    print("first and last 5 iterations' mean score", finals)
    (fp32_first, fp32_last), (bf16_first, bf16_last) = finals["fp32"], finals["bf16"]
    assert bf16_last > bf16_first + 0.05
    # Within a third of fp32's gain of each other (the band is stated, not fitted).
    assert abs(bf16_last - fp32_last) < (fp32_last - fp32_first) / 3


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_the_clipped_gradient_norm_of_a_large_gradient_is_the_fp64_norm_to_fp32_precision(device):
    """The norm that clips (and that the stages log as grad_norm), of one 4.7M-element gradient
    (SmolLM2's embedding has 28M): within 1e-5 of the fp64 norm. On a CPU torch's get_total_norm,
    summing the whole tensor's squares into one fp32 accumulator per thread, was off by ~1e-4; a
    GPU takes torch's multi-tensor norm (training.total_norm)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(8192, 576, device=device))
    weight.grad = torch.randn(8192, 576, device=device) * 1e-3
    exact = weight.grad.double().norm().item()
    norm = clip_with_norm([weight], max_norm=1.0)
    assert abs(norm - exact) <= 1e-5 * exact
