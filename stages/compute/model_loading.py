"""Every stage's models, loaded in one place: a model to train (fp32 weights, which its engine keeps
as master weights under bf16; activations recomputed in the backward pass with
`model.gradient_checkpointing`), a frozen one (weights in the run's precision, eval mode, no
gradients), and PPO's set (actor, reference, reward model, critic, score function), which critic
pre-training loads too. SFT, reward, critic, PPO, eval and best-of-n load through here; no stage
reads another stage's loader.

Under ZeRO-3 (the stage's DeepSpeed config has zero stage 3) every model is built partitioned:
transformers' DeepSpeed integration (`HfDeepSpeedConfig`) makes `from_pretrained` construct it
inside `deepspeed.zero.Init` and copy the checkpoint in one module at a time, so no rank's device
holds a whole copy of any model. Frozen models then run as ZeRO-3 inference engines
(`deepspeed.initialize` without an optimiser: DeepSpeed's parameter offload gathers each module's
weights for its forward), their partitions in host memory with `launch.offload_params` — OpenRLHF's
frozen reference and reward model (openrlhf/utils/deepspeed/deepspeed_utils.py `get_eval_ds_config`,
prepared by deepspeed.py `_ds_init_eval_model`).
Without DeepSpeed, or under ZeRO-1/2, models load whole."""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from stages.compute import loading
from stages.compute.models import FAST_PATH_ATTRIBUTE, set_fast_path
from stages.compute.ppo.advantages import needs_critic
from stages.compute.ppo.experience import reward_model_scores, rule_scores
from stages.compute.ppo.external_scores import text_scores
from stages.compute.ppo.reward_shaping import RunningMoments, ScoreMode
from stages.compute.ppo.setup import initial_moments
from stages.compute.reward.model import RewardModel, load_reward_model, reward_model_from_lm
from stages.leaves import precision
from stages.leaves.config import ModelConfig, PipelineConfig, is_text_reward_source
from stages.leaves.dist import Dist


def frozen_dtype(model_cfg: ModelConfig, device: str) -> torch.dtype:
    """A frozen model's weights: the run's precision (`stages.leaves.precision`)."""
    return precision.dtype(precision.resolve(model_cfg.precision, device))


def partitions(dist: Dist | None) -> bool:
    """Whether the stage's models are built partitioned: it runs on DeepSpeed ranks under ZeRO-3."""
    return dist is not None and dist.zero_stage == 3


def zero3_config(dist: Dist, model_cfg: ModelConfig, frozen: bool) -> dict:
    """The stage's ZeRO-3 config as `zero.Init` and an inference engine read it: bf16 as the run's
    precision (as `stages.compute.training.make_engine` sets it, so the partitions are built in the dtype the
    engine trains in), a micro-batch of one (DeepSpeed's config asks for a batch size; an inference
    engine never steps). A frozen model has no optimiser: no optimiser offload; its parameters in host
    memory with `launch.offload_params` (the config's offload_param)."""
    config = copy.deepcopy(dist.deepspeed_config)
    bf16 = precision.resolve(model_cfg.precision, dist.device) == "bf16"
    config.update(bf16={**config.get("bf16", {}), "enabled": bf16}, fp16={"enabled": False},
                  train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=dist.world_size)
    if frozen:
        config["zero_optimization"].pop("offload_optimizer", None)
    return config


@contextmanager
def built_partitioned(config: dict):
    """Inside the block, transformers' `from_pretrained` builds a model under `deepspeed.zero.Init`
    with `config` and loads its checkpoint into the partitions (transformers' DeepSpeed integration,
    which reads the config through a weak reference to the `HfDeepSpeedConfig` while it lives). After
    it, models load whole again."""
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config  # deferred: ZeRO-3 ranks only

    settings = HfDeepSpeedConfig(config)
    try:
        yield settings
    finally:
        unset_hf_deepspeed_config()


def loaded(dist: Dist | None, model_cfg: ModelConfig, frozen: bool):
    """The context models load in: partitioned under ZeRO-3 (`built_partitioned`), else whole."""
    return built_partitioned(zero3_config(dist, model_cfg, frozen)) if partitions(dist) else nullcontext()


def inference_engine(model, dist: Dist, model_cfg: ModelConfig):
    """A partitioned frozen model as a ZeRO-3 inference engine (`deepspeed.initialize` without an
    optimiser, DeepSpeed's `DeepSpeedZeRoOffload`): every module gathers its weights for its own
    forward and frees them after. Returns the module (what the stages call), which keeps its engine."""
    import deepspeed  # deferred: only DeepSpeed's ranks load it

    engine, *_ = deepspeed.initialize(model=model, config=zero3_config(dist, model_cfg, frozen=True))
    module = engine.module
    object.__setattr__(module, "inference_engine", engine)  # not a submodule: the engine holds the module
    return module


def freeze(model, device: str, dist: Dist | None = None, model_cfg: ModelConfig | None = None):
    """`model` on `device`, in eval mode, with no gradients; under ZeRO-3 a ZeRO-3 inference engine's
    module (`inference_engine`)."""
    if partitions(dist):
        model = inference_engine(model.requires_grad_(False), dist, model_cfg)
        return model.eval().requires_grad_(False)
    return model.to(device).eval().requires_grad_(False)


def checkpoint_activations(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (transformers' checkpointing;
    the non-reentrant form, which also holds when the inputs need no gradient: frozen embeddings).
    A reward model or critic checkpoints its LM. transformers 5 renamed the switch; 4.x has only the
    old name."""
    lm = model.lm if isinstance(model, RewardModel) else model
    options = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def add_lora(model, model_cfg: ModelConfig) -> None:
    """LoRA adapters (`model.lora`) on a causal LM or a reward model's LM, in place: the model stays
    the same transformers class, its chosen linear layers wrapped by peft's; every weight but the
    adapters' (and a reward model's scalar head) frozen. The fast path reads the linear layers'
    weights itself, so a model with adapters takes transformers' forward."""
    from peft import LoraConfig, inject_adapter_in_model  # deferred: peft only for a LoRA run

    lora = model_cfg.lora
    lm = model.lm if isinstance(model, RewardModel) else model
    settings = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules)
    inject_adapter_in_model(settings, lm)
    lm.lora_settings = settings  # saved with the adapter (`save_adapter`)
    set_fast_path(lm, "off")


def lora_layers(model) -> list:
    from peft.tuners.lora import LoraLayer  # deferred: as in add_lora

    return [module for module in model.modules() if isinstance(module, LoraLayer)]


@contextmanager
def adapters_off(model):
    """`model` computes without its LoRA adapters (the model they were added to) inside the block."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class WithoutAdapters(torch.nn.Module):
    """A causal LM with LoRA adapters, seen with its adapters switched off: PPO's reference when the
    actor trains adapters (the SFT model, without a second copy of its weights). What the rollout
    reads of a reference: `base_model` (called for the last hidden states) and the LM head."""

    def __init__(self, model):
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: the reference owns no parameter
        setattr(self, FAST_PATH_ATTRIBUTE, "off")  # the fast path reads layers' weights, not through this view
        self.eval()

    @property
    def base_model(self):
        return WithoutAdapters(self.model.base_model)

    @property
    def config(self):
        return self.model.config

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, *args, **kwargs):
        with adapters_off(self.model):
            return self.model(*args, **kwargs)


def merge_adapters(model) -> None:
    """Fold every LoRA adapter into its layer's weight and put the plain layer back: a plain
    transformers model again (what is saved and registered). A model without adapters is left as it is."""
    if not any(type(m).__module__.startswith("peft.") for m in model.modules()):
        return  # peft is not imported for a run without LoRA
    lm = model.lm if isinstance(model, RewardModel) else model
    # The adapter as peft saves one (PeftModel.from_pretrained loads it onto the base model), kept for `save_adapter`.
    lm.lora_adapter = {"base_model.model." + name.replace(".default.", "."): p.detach().cpu().clone()
                       for name, p in lm.named_parameters() if "lora_" in name}
    layers = set(lora_layers(model))
    for name, layer in [(n, m) for n, m in model.named_modules() if m in layers]:
        layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.get_base_layer())


LORA_ADAPTER_DIR = "lora_adapter"


def save_adapter(model, folder: Path) -> None:
    """The LoRA adapter a merged model was trained with (`merge_adapters`), in peft's format, into
    `folder`/lora_adapter: it travels inside the registered model's folder, beside the merged
    weights. Nothing for a model trained without LoRA."""
    lm = model.lm if isinstance(model, RewardModel) else model
    adapter = getattr(lm, "lora_adapter", None)
    if adapter is None:
        return
    from safetensors.torch import save_file  # deferred: only for a LoRA model

    out = Path(folder) / LORA_ADAPTER_DIR
    out.mkdir(parents=True, exist_ok=True)
    lm.lora_settings.save_pretrained(str(out))
    save_file(adapter, str(out / "adapter_model.safetensors"))


def trainable(model, model_cfg: ModelConfig, device: str):
    """A model to train (fp32), on `device`: with LoRA adapters when `model.lora.rank`, checkpointed
    when `model.gradient_checkpointing`. A partitioned model's shards are where `zero.Init` put them
    (the device, or the host under `launch.offload_params`)."""
    if model_cfg.lora.rank:
        add_lora(model, model_cfg)
    if model_cfg.gradient_checkpointing:
        checkpoint_activations(model)
    if is_partitioned(model):
        whole_parameters_as_the_partitions(model)
        return model
    return model.to(device)


def whole_parameters_as_the_partitions(model) -> None:
    """DeepSpeed casts a module to its engine's dtype, except one built under `zero.Init`: the
    parameters made after it (a reward model's scalar head, LoRA adapters) take the partitions'
    dtype here, as in a model the engine partitions itself; DeepSpeed partitions them, on its
    device, when the engine starts."""
    dtype = next(p.dtype for p in model.parameters() if hasattr(p, "ds_id"))
    for p in model.parameters():
        if not hasattr(p, "ds_id") and p.is_floating_point():
            p.data = p.data.to(dtype)


def is_partitioned(model) -> bool:
    """Whether `model`'s weights are ZeRO-3 partitions (built under `zero.Init`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def trained_lm(model_dir: str, model_cfg: ModelConfig, device: str, dist: Dist | None = None):
    """The causal LM SFT trains: fp32, no KV cache in training; partitioned under ZeRO-3."""
    with loaded(dist, model_cfg, frozen=False):
        model = loading.load_model(model_dir, model_cfg)
    model = trainable(model, model_cfg, device)
    model.config.use_cache = False
    return model


def trained_reward_model(sft_dir: str, model_cfg: ModelConfig, device: str, dist: Dist | None = None) -> RewardModel:
    """A reward model to train: the SFT model with a fresh scalar head (`reward_model_from_lm`);
    its LM partitioned under ZeRO-3 (the head, hidden size + 1 weights, when the engine starts)."""
    with loaded(dist, model_cfg, frozen=False):
        model = reward_model_from_lm(sft_dir, model_cfg)
    return trainable(model, model_cfg, device)


def frozen_lm(model_dir: str, model_cfg: ModelConfig, device: str, dist: Dist | None = None):
    """(model, tokenizer) of a causal LM that only generates or scores (eval, best-of-n, critic
    pre-training's policy, PPO's reference); a ZeRO-3 inference engine's under ZeRO-3."""
    tokenizer = loading.load_tokenizer(model_dir, model_cfg)
    with loaded(dist, model_cfg, frozen=True):
        model = loading.load_model(model_dir, model_cfg, frozen_dtype(model_cfg, device))
    model = freeze(model, device, dist, model_cfg)
    loading.align_pad_token(model, tokenizer)
    return model, tokenizer


def frozen_reward_model(folder: str | Path, model_cfg: ModelConfig, device: str,
                        dist: Dist | None = None) -> RewardModel:
    """A saved reward model that only scores (PPO's, a gold one, a judge); a ZeRO-3 inference
    engine's under ZeRO-3."""
    with loaded(dist, model_cfg, frozen=True):
        model = load_reward_model(folder, model_cfg, frozen_dtype(model_cfg, device))
    return freeze(model, device, dist, model_cfg)


def load_models(cfg: PipelineConfig, inputs: dict, dist: Dist, train_actor: bool = True):
    """(tokenizer, actor, reference, reward model, critic, score_fn); frozen ones in eval mode. The
    critic is None when the advantage estimator needs none (the reward model still gives the scores,
    or with a rule reward the initial score statistics). Models to train load in fp32 (their engine
    keeps those as master weights under bf16), frozen ones in the run's precision; train_actor=False:
    the actor is frozen too (critic pre-training). Under ZeRO-3 all of them are built partitioned
    and the frozen ones run as ZeRO-3 inference engines (module docstring)."""
    sft_dir, rm_dir = inputs["sft_model_dir"], inputs["reward_model_dir"]
    tokenizer = loading.load_tokenizer(sft_dir, cfg.model)
    if train_actor:
        with loaded(dist, cfg.model, frozen=False):
            actor = loading.load_model(sft_dir, cfg.model)
        actor = trainable(actor, cfg.model, dist.device)
        loading.align_pad_token(actor, tokenizer)
    else:  # the PPO trainer switches a frozen actor between eval and train: only its mode, no gradients
        actor, _ = frozen_lm(sft_dir, cfg.model, dist.device, dist)
    if not train_actor:  # the frozen policy is its own reference (critic pre-training: no KL penalty)
        reference = actor
    elif cfg.model.lora.rank:
        reference = WithoutAdapters(actor)
    else:
        reference, _ = frozen_lm(sft_dir, cfg.model, dist.device, dist)
    reward_model = frozen_reward_model(rm_dir, cfg.model, dist.device, dist)
    critic = None
    if needs_critic(cfg.ppo):
        with loaded(dist, cfg.model, frozen=False):
            critic = load_reward_model(inputs.get("critic_model_dir", rm_dir), cfg.model)
        if "critic_model_dir" not in inputs:  # a pre-trained critic is on this scale already
            values_on_the_shaped_scale(critic, initial_moments(reward_model), cfg.ppo.switches()["score_mode"])
        critic = trainable(critic, cfg.model, dist.device)
    if cfg.ppo.reward == "rm":
        score_fn = reward_model_scores(reward_model)
    elif is_text_reward_source(cfg.ppo.reward):
        score_fn = text_scores(cfg.ppo, tokenizer, dist)
    else:
        score_fn = rule_scores(tokenizer, cfg.ppo.reward)
    return tokenizer, actor, reference, reward_model, critic, score_fn


@torch.no_grad()
def values_on_the_shaped_scale(critic, moments: RunningMoments, mode: ScoreMode) -> None:
    """The critic starts as the reward model (§5.3.3), but it predicts rewards that carry the RM's
    scores reparameterised (§5.3.1): fold that affine map, on the statistics PPO starts from, into
    its scalar head, so its first values are on the rewards' scale. Left as the RM's, the values
    sit μ/σ off their targets, and with Adam's per-parameter steps of about lr the head's bias
    cannot move that far: the rest of the network has to carry the offset."""
    if mode == "none":
        return
    head = critic.score_head
    head.weight.div_(moments.std)
    if mode == "normalise":
        head.bias.sub_(moments.mean)
    head.bias.div_(moments.std)
