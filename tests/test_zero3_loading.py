"""Under ZeRO-3 every model is built partitioned (`stages.compute.model_loading`): on two DeepSpeed CPU
ranks over gloo, the frozen reference and reward model as ZeRO-3 inference engines (with and
without `launch.offload_params`) give the plain models' log-probs and scores on the same batch, and
no rank holds a whole copy of a trained or a frozen model: each weight is a partition
(`ds_numel` elements in all, about half of them on each rank, none outside its module's forward).

The ranks run this module's `rank_main` under torchrun; each writes what it computed, and the test
compares them here."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages.compute.loading import load_tokenizer
from stages.compute.model_loading import frozen_lm, frozen_reward_model, trained_lm
from stages.compute.ppo.experience import response_logits
from stages.compute.ppo.generation import generate
from stages.compute.ppo.sampling import left_pad
from stages.compute.training import adamw, clip_grad_norm, make_engine, trained_model
from stages.leaves.config import LaunchConfig
from stages.leaves.dist import Dist
from stages.leaves.logprobs import token_logprobs
from stages.orchestration.config_loading import load_config
from stages.orchestration.launch import free_port, resolve_deepspeed_config

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2
# Both sides compute in fp32; the ranks' gathered weights are the checkpoint's, so only the order of
# a few reductions may differ.
RTOL, ATOL = 1e-5, 1e-6


def batch(tokenizer, prompts: list[list[int]]):
    """Eight prompts with six more tokens each, left-padded: (sequences, attention mask, prompt width)."""
    rows = [p[:12] + [(7 * i + k) % 500 + 5 for k in range(6)] for i, p in enumerate(prompts[:8])]
    ids, mask = left_pad(rows, tokenizer.pad_token_id, "cpu")
    return ids, mask, ids.shape[1] - 6


def frozen_outputs(model_dir: str, rm_dir: str, model_cfg, dist, ids, mask, width) -> dict:
    """The reference's log-probs of the last six tokens (as PPO takes them: `response_logits`) and
    the reward model's scores, by the models `stages.compute.model_loading` loads for `dist` (None: plain)."""
    reference, _ = frozen_lm(model_dir, model_cfg, "cpu", dist)
    reward_model = frozen_reward_model(rm_dir, model_cfg, "cpu", dist)
    with torch.no_grad():
        logits = response_logits(reference, ids, mask, width)
        logprobs = token_logprobs(logits.float(), ids[:, width:], 1.0)
        scores, _ = reward_model(input_ids=ids, attention_mask=mask)
    return {"logprobs": logprobs, "scores": scores.float(), "models": (reference, reward_model)}


def partition_shares(model) -> list[tuple[str, int, int, int]]:
    """(name, whole size ds_numel, this rank's partition size, size outside a forward) per weight."""
    return [(name, p.ds_numel, p.ds_tensor.numel(), p.numel()) for name, p in model.named_parameters()]


GREEDY = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, do_sample=False)


def rollouts_out_of_step(model_dir: str, model_cfg, dist, tokenizer, prompts: list[list[int]]) -> dict:
    """Greedy rollouts of the plain SFT model and of its ZeRO-3 copy, where rank 0's row ends at its
    first token (that token is its EOS) and rank 1's runs all eight (its EOS is no token): the
    ranks' forwards gather every layer together, so rank 0 must keep stepping until rank 1 ends."""
    plain, _ = frozen_lm(model_dir, model_cfg, "cpu")
    row = [prompts[dist.rank]]

    def greedy(model, eos_id):
        return generate(model, row, eos_id=eos_id, pad_id=tokenizer.pad_token_id, **GREEDY)

    eos = int(greedy(plain, -1).sequences[0, len(row[0])]) if dist.rank == 0 else -1
    partitioned, _ = frozen_lm(model_dir, model_cfg, "cpu", dist)
    rollouts = {"plain": greedy(plain, eos), "zero3": greedy(partitioned, eos)}
    return {name: {"sequences": r.sequences, "response_mask": r.response_mask, "width": r.prompt_width}
            for name, r in rollouts.items()}


def rank_main(model_dir: str, rm_dir: str, out: str) -> None:
    """One rank: the plain frozen models and the ZeRO-3 ones (without, then with parameter offload)
    on the same batch, and a trained model built under ZeRO-3; writes rank<r>.pt into `out`."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # deferred: DS_ACCELERATOR above must be set before it loads

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # as stages.orchestration.launch
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    model_cfg = load_config("tiny", ["model.precision=fp32"]).model
    tokenizer = load_tokenizer(model_dir, model_cfg)
    prompts = json.loads(Path(out, "prompts.json").read_text())
    ids, mask, width = batch(tokenizer, prompts)
    results = {"plain": frozen_outputs(model_dir, rm_dir, model_cfg, None, ids, mask, width)}
    for name, offload in (("zero3", False), ("zero3_offload", True)):
        launch = LaunchConfig(world_size=RANKS, deepspeed="zero3", offload_optimizer=offload, offload_params=offload)
        dist = Dist(rank=rank, world_size=RANKS, deepspeed_config=resolve_deepspeed_config("ppo", launch))
        results[name] = frozen_outputs(model_dir, rm_dir, model_cfg, dist, ids, mask, width)
    shares = {f"frozen_{kind}": partition_shares(model)
              for kind, model in zip(("reference", "reward_model"), results["zero3"].pop("models"))}
    shares["trained"] = partition_shares(trained_lm(model_dir, model_cfg, "cpu", dist))
    engines = [model.inference_engine for model in results["zero3_offload"].pop("models")]
    offloaded = [engine.zero_offload_param() is not None for engine in engines]
    results["plain"].pop("models")
    rollouts = rollouts_out_of_step(model_dir, model_cfg, dist, tokenizer, prompts)
    # Every weight stays partitioned, as a real model's do (DeepSpeed keeps tensors under the
    # persistence threshold, 1e5 elements by default, whole on every rank: all of the tiny model's).
    config = resolve_deepspeed_config("sft", LaunchConfig(world_size=RANKS, deepspeed="zero3"))
    config["zero_optimization"] = {**config["zero_optimization"], "stage3_param_persistence_threshold": 0}
    zero3 = Dist(rank=rank, world_size=RANKS, deepspeed_config=config)
    saved = save_after_a_step(model_dir, model_cfg, zero3, ids, mask, Path(out, "saved"))
    lora_cfg = load_config("tiny", ["model.precision=fp32", f"model.lora.rank={LORA_RANK}"]).model
    lora = lora_merged_after_a_step(model_dir, lora_cfg, zero3, ids, mask)
    clipped = clipped_under_zero3(zero3)
    torch.save({"results": results, "shares": shares, "offloaded": offloaded, "rollouts": rollouts, "saved": saved,
                "lora": lora, "clipped": clipped}, Path(out, f"rank{rank}.pt"))


def clipped_under_zero3(dist) -> dict:
    """PPO's joint clip (`clip_grad_norm`) on a ZeRO-3 engine whose weights include one smaller
    than the ranks (a scalar head's bias: one element, a padded partition on each rank): every
    weight's whole gradient before and after the clip, and the norm it returned."""
    from deepspeed.utils import safe_get_full_grad  # deferred: the ranks' module only

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    engine = make_engine(model, adamw(model, dist, lr=1e-2), None, micro_batch_size=4, grad_accum_steps=1,
                         max_grad_norm=float("inf"), precision="fp32", dist=dist)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.rank))
    engine.backward(engine(x).pow(2).sum())
    params = list(engine.module.parameters())
    before = [safe_get_full_grad(p).clone() for p in params]
    norm = clip_grad_norm([engine], max_norm=1e-3)
    after = [safe_get_full_grad(p).clone() for p in params]
    return {"before": before, "after": after, "norm": norm}


def save_after_a_step(model_dir: str, model_cfg, dist, ids, mask, out: Path) -> dict | None:
    """A ZeRO-3 engine trains the SFT model one step; every rank asks for the trained model (as a
    stage's `finish` does) and the main rank saves it as the stages do. On the main rank: the
    engine's weights gathered by DeepSpeed itself, to compare with the saved file."""
    import deepspeed  # deferred: the ranks' module only

    model = trained_lm(model_dir, model_cfg, "cpu", dist)
    optimizer = adamw(model, dist, lr=1e-2)
    engine = make_engine(model, optimizer, None, micro_batch_size=ids.shape[0], grad_accum_steps=1,
                         max_grad_norm=1.0, precision="fp32", dist=dist)
    loss = engine(input_ids=ids, attention_mask=mask, labels=ids).loss
    engine.backward(loss)
    engine.step()
    whole = trained_model(engine)
    if dist.is_main:
        whole.save_pretrained(out, safe_serialization=True)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        gathered = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return gathered if dist.is_main else None


LORA_RANK = 4
LORA_TARGET = "model.layers.0.self_attn.q_proj"  # a projection `model.lora.target_modules` (all-linear) adapts


def lora_merged_after_a_step(model_dir: str, model_cfg, dist, ids, mask) -> dict | None:
    """A model with LoRA adapters (`model.lora`) trains one step under ZeRO-3 and every rank asks
    for the trained model. On the main rank: the class of what came back, its modules that are
    still peft's, its state dict, and `LORA_TARGET`'s base weight, adapters (gathered by DeepSpeed
    before the merge) and peft's scale."""
    import deepspeed  # deferred: the ranks' module only

    model = trained_lm(model_dir, model_cfg, "cpu", dist)
    engine = make_engine(model, adamw(model, dist, lr=1e-2), None, micro_batch_size=ids.shape[0], grad_accum_steps=1,
                         max_grad_norm=1.0, precision="fp32", dist=dist)
    engine.backward(engine(input_ids=ids, attention_mask=mask, labels=ids).loss)
    engine.step()
    layer = engine.module.get_submodule(LORA_TARGET)
    parts = {"base": layer.get_base_layer().weight, "A": layer.lora_A["default"].weight,
             "B": layer.lora_B["default"].weight}
    with deepspeed.zero.GatheredParameters(list(parts.values()), modifier_rank=None):
        adapted = {key: p.detach().clone() for key, p in parts.items()}
    whole = trained_model(engine)  # collective
    if not dist.is_main:
        return None
    return {"class": type(whole), "peft_modules": [name for name, m in whole.named_modules()
                                                   if type(m).__module__.startswith("peft.")],
            "state": {name: t.detach().clone() for name, t in whole.state_dict().items()},
            "scaling": layer.scaling["default"], "alpha": model_cfg.lora.alpha, **adapted}


@pytest.fixture(scope="module")
def ranks(tiny, reward_model_dir, tmp_path_factory) -> list[dict]:
    """What each of two ranks computed."""
    model_dir, _, prompts = tiny
    out = tmp_path_factory.mktemp("zero3")
    (out / "prompts.json").write_text(json.dumps(prompts[:8]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}", f"--master_port={free_port()}",
           __file__, str(model_dir), reward_model_dir, str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as err:  # a collective one rank never joins waits for ever
        raise AssertionError(f"the ranks did not finish: {(err.stderr or b'')[-3000:]!r}") from None
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [{**torch.load(out / f"rank{r}.pt", weights_only=False), "out": str(out)} for r in range(RANKS)]


@pytest.mark.parametrize("mode", ["zero3", "zero3_offload"])
def test_frozen_zero3_inference_engines_give_the_plain_models_numbers(ranks, mode):
    for rank in ranks:
        plain, partitioned = rank["results"]["plain"], rank["results"][mode]
        torch.testing.assert_close(partitioned["logprobs"], plain["logprobs"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(partitioned["scores"], plain["scores"], rtol=RTOL, atol=ATOL)
    # the numbers say something: the scores differ between rows, the log-probs are a model's, not 0
    assert ranks[0]["results"]["plain"]["scores"].std() > 0
    assert ranks[0]["results"]["plain"]["logprobs"].abs().min() > 0
    assert all(all(rank["offloaded"]) for rank in ranks)  # the offload run's engines offload their partitions


@pytest.mark.parametrize("model", ["trained", "frozen_reference", "frozen_reward_model"])
def test_no_rank_holds_a_whole_model_under_zero3(ranks, model):
    """Every weight is partitioned from the start: outside a forward a rank holds no element of the
    whole tensor (numel 0), only its partition, and the two ranks' partitions are the weight once
    (DeepSpeed pads each to equal size: at most one element short per rank)."""
    per_rank = [rank["shares"][model] for rank in ranks]
    assert per_rank[0], "no parameters"
    whole = sum(numel for _, numel, _, _ in per_rank[0])
    held = [sum(local for _, _, local, _ in shares) for shares in per_rank]
    for shares in per_rank:
        for name, numel, local, visible in shares:
            assert visible == 0, f"{name}: {visible} elements outside the partition"
            assert numel / RANKS <= local <= numel / RANKS + 1, (name, numel, local)
    assert max(held) <= whole / RANKS + len(per_rank[0]), (held, whole)


def test_zero3_ranks_sample_in_step_until_every_rank_has_ended(ranks):
    """Rank 0's row ends at its first token, rank 1's runs on: both finish, each with the plain
    model's tokens, rank 0 padding after its EOS while rank 1 samples."""
    lengths = []
    for rank in ranks:
        plain, partitioned = rank["rollouts"]["plain"], rank["rollouts"]["zero3"]
        mask = partitioned["response_mask"].bool()
        assert mask.sum() == plain["response_mask"].sum()
        response = partitioned["sequences"][0, partitioned["width"]:][mask[0]]
        assert response.tolist() == plain["sequences"][0, plain["width"]:][plain["response_mask"][0].bool()].tolist()
        lengths.append((int(mask.sum()), mask.shape[1]))
    assert lengths == [(1, GREEDY["max_new_tokens"]), (GREEDY["max_new_tokens"],) * 2]


def test_the_joint_clip_scales_every_zero3_gradient_even_one_smaller_than_the_ranks(ranks):
    """g ← g · max_norm/‖g‖ on every weight, the one-element bias too, on both ranks."""
    for rank in ranks:
        clipped = rank["clipped"]
        norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in clipped["before"]])))
        assert clipped["norm"] == pytest.approx(norm, rel=1e-5) and norm > 1e-3
        assert [g.numel() for g in clipped["before"]][-1] == 1
        for before, after in zip(clipped["before"], clipped["after"]):
            torch.testing.assert_close(after, before * (1e-3 / (norm + 1e-6)), rtol=1e-5, atol=1e-9)


def test_a_model_trained_under_zero3_is_saved_whole(ranks, tmp_path_factory):
    """The saved model holds every weight whole, with the values the engine trained (DeepSpeed's
    own gather of the partitions), not a rank's empty view of them."""
    from safetensors.torch import load_file

    gathered = ranks[0]["saved"]
    folder = Path(ranks[0]["out"], "saved")
    saved = {}
    for file in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(file))
    assert gathered and saved
    for name, tensor in gathered.items():
        if name not in saved:  # a tied weight is saved once
            continue
        assert saved[name].shape == tensor.shape, (name, saved[name].shape, tensor.shape)
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)
    assert set(saved) <= set(gathered) and len(saved) >= len(gathered) - 1


def test_a_lora_model_trained_under_zero3_is_saved_as_a_plain_model_with_its_adapters_merged(ranks):
    """Under ZeRO-3 the trained LoRA model comes back whole, as a plain transformers model: no peft
    layer left, no adapter weight in its state dict, and each adapted weight is the engine's base
    weight plus peft's update, (B @ A) · alpha/rank, with the adapters the step trained."""
    from transformers import LlamaForCausalLM

    lora = ranks[0]["lora"]
    assert ranks[1]["lora"] is None
    assert lora["class"] is LlamaForCausalLM
    assert lora["peft_modules"] == []
    state = lora["state"]
    assert not [name for name in state if "lora_" in name or "base_layer" in name]
    assert set(ranks[0]["saved"]) <= set(state)  # the plain model's weights, by their plain names
    assert lora["scaling"] == pytest.approx(lora["alpha"] / LORA_RANK)  # peft's scale: alpha / rank
    base, a, b = lora["base"], lora["A"], lora["B"]
    assert a.shape == (LORA_RANK, base.shape[1]) and b.shape == (base.shape[0], LORA_RANK)
    assert b.abs().max() > 0  # peft starts B at zero: the step moved it, so the merge adds something
    merged = state[LORA_TARGET + ".weight"]
    assert merged.shape == base.shape
    torch.testing.assert_close(merged, base + (b @ a) * lora["scaling"], rtol=RTOL, atol=ATOL)
    assert not torch.equal(merged, base)
    for name, tensor in state.items():
        assert tensor.numel() > 0, f"{name}: empty (a rank's view of a partition)"


if __name__ == "__main__":
    rank_main(*sys.argv[1:4])
