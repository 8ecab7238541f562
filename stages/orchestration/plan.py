"""`rlhf plan`: predicted peak memory per device of each training stage, before any model loads.

From the resolved config and the model's shape alone (its config.json, never its weights), each
stage's roles (PPO: actor and critic trained, reference and reward model frozen) get their bytes
per device by component:

- model states (`model_states`): weights, the fp32 master copy, gradients and AdamW's two fp32
  moments, as our engines hold them (stages/compute/training.py) — the plain PyTorch engine, or DeepSpeed
  partitioning them over the ranks by ZeRO stage (Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", §5: 16Ψ bytes per model for mixed
  precision Adam; ZeRO-1 partitions the optimiser states, ZeRO-2 also the gradients, ZeRO-3 also
  the parameters) and moving them to the host with `offload_optimizer` / `offload_param`;
- activations kept for the backward pass (`layer_activation_bytes`): Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", §4.1, counted tensor by tensor
  for a Llama decoder layer as transformers runs it (RMSNorm, grouped-query attention through SDPA
  with a padding mask, SwiGLU MLP, no dropout) in our dtype; with gradient checkpointing, each
  layer's input plus one layer recomputed in the backward pass (their §4.2 "full recomputation");
- attention scores where the padding-free forward keeps them (bf16 on a CPU: `attention_score_bytes`);
- logits: [tokens × vocabulary] in the compute dtype and their gradient, at every position under
  transformers' forward (SFT, PPO-ptx: `logit_bytes_per_token`), at the predicting positions only
  where we pick them (PPO's policy, the reward model's LM term: `picked_logit_bytes_per_token`);
  `stages.leaves.logprobs` does its fp32 work a few rows at a time — for small models with big
  vocabularies often the largest term;
- the generation KV cache: 2 · layers · kv heads · head dim · (prompt + new tokens) · batch · bytes;
- on a CPU, the Llama decoder's packed copy of the actor's weights (`packed_weight_bytes`: bf16 in
  oneDNN's layout, or fp32 for MKL on an Intel CPU), held while it samples.

A stage's peak per device is its model states plus the largest of its phases' transient memory
(PPO's rollout — KV cache, the reference's and reward model's forward — and its training step
never overlap). Every count is a formula of the config: `Plan.table()` prints them, and
`bench/plan_vs_measured.py` compares them with the peak memory of real runs.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from stages.compute import loading
from stages.leaves.config import REPO_ROOT, ConfigError, ModelConfig, PipelineConfig
from stages.orchestration import registry
from stages.orchestration.config_loading import deepspeed_config_path
from stages.orchestration.launch import hostfile_slots, in_process, stage_device

GiB = 1024**3
ARCHITECTURES_DIR = REPO_ROOT / "infra" / "architectures"
# The stages that train: each runs on the lifecycle, which resumes it from its checkpoint.
TRAINING_STAGES = tuple(s.name for s in registry.STAGES.values() if s.resumes)
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py) for what a ZeRO config leaves unset or
# "auto" (DeepSpeed drops "auto" keys): the ZeRO-3 sub-group its step converts to fp32 at a time, the
# gradient bucket it reduces from, the parameters it gathers ahead, and how far ahead in a step's
# module trace a gathered parameter's next use keeps it gathered. Elements, not bytes.
DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000
DEEPSPEED_PREFETCH_BUCKET_SIZE = 50_000_000
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000


class PlanError(ConfigError):
    """The plan cannot be made (no readable model config); the message says what to pass."""


# -- the model's shape ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Architecture:
    """A decoder-only transformer's shape: what the memory formulas read (from a config.json)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int | None = None
    source: str = ""
    model_type: str = "llama"  # config.json's model_type: which fast path (stages/compute/models) runs it

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values): kv heads × head dim."""
        return self.num_key_value_heads * self.head_size

    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attention = h * self.num_attention_heads * self.head_size * 2 + 2 * h * self.kv_size  # q, o; k, v
        return attention + 3 * h * i + 2 * h  # gate, up, down; two RMSNorm weights

    def lora_params(self, rank: int, targets: str | list[str]) -> int:
        """Parameters of LoRA adapters of `rank` (A: r × in, B: out × r) on the decoder layers' linear
        layers named in `targets` (`all-linear`: all seven; the LM head never gets one)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_attention_heads * self.head_size, self.kv_size
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        names = shapes if targets == "all-linear" else [t for t in ([targets] if isinstance(targets, str) else targets)
                                                        if t in shapes]
        return self.num_hidden_layers * sum(rank * sum(shapes[name]) for name in names)

    def params(self) -> int:
        """Parameters of the causal LM (Ψ): embeddings, layers, final norm, LM head unless tied."""
        embeddings = self.vocab_size * self.hidden_size
        return (embeddings * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * self.layer_params()
                + self.hidden_size)

    def largest_module_params(self) -> int:
        """Parameters of the largest single module, as DeepSpeed's `model_to_params` counts it
        (ZeRO-3 gathers one module's parameters at a time)."""
        h = self.hidden_size
        return max(self.vocab_size * h, h * self.intermediate_size, h * self.num_attention_heads * self.head_size)

    @classmethod
    def from_config(cls, values: dict, source: str) -> Architecture:
        values = values.get("text_config", values)  # multimodal configs nest the language model's
        try:
            heads = int(values["num_attention_heads"])
            return cls(hidden_size=int(values["hidden_size"]), num_hidden_layers=int(values["num_hidden_layers"]),
                       num_attention_heads=heads,
                       num_key_value_heads=int(values.get("num_key_value_heads") or heads),
                       intermediate_size=int(values["intermediate_size"]), vocab_size=int(values["vocab_size"]),
                       # transformers' Llama default; a config that ties says so
                       tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
                       head_dim=values.get("head_dim"), source=source,
                       model_type=str(values.get("model_type", "llama")))
        except KeyError as err:
            raise PlanError(f"{source}: no {err.args[0]} in the model config; pass --architecture with a config.json "
                            f"(hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
                            f"intermediate_size, vocab_size, tie_word_embeddings)") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PlanError(f"{path}: not a readable config.json ({err})") from None


def architecture_file(spec: str) -> Path:
    """--architecture: a config.json, a folder holding one, or a name in infra/architectures."""
    for path in (Path(spec).expanduser(), ARCHITECTURES_DIR / f"{spec}.json"):
        if path.is_dir() and (path / "config.json").exists():
            return path / "config.json"
        if path.is_file():
            return path
    names = ", ".join(sorted(p.stem for p in ARCHITECTURES_DIR.glob("*.json")))
    raise PlanError(f"--architecture {spec}: neither a config.json, a folder with one, nor a name in "
                    f"{ARCHITECTURES_DIR} ({names})")


def read_architecture(model: ModelConfig, explicit: str | None = None) -> Architecture:
    """The model's shape from its config alone: an explicit config.json, the random Llama's
    settings, a GGUF file's metadata (or its de-quantised copy's config.json when the cache has
    it), a local folder's config.json, or a hub model's config.json in the local hub cache."""
    if explicit:
        path = architecture_file(explicit)
        return Architecture.from_config(_read_json(path), str(path))
    spec = model.name_or_path
    if spec.startswith("random:"):
        init = model.random_init
        # the BPE tokenizer's vocabulary is at most bpe_vocab_size (loading._random_llama: len(tokenizer))
        return Architecture(init.hidden_size, init.num_hidden_layers, init.num_attention_heads,
                            init.num_key_value_heads, init.intermediate_size, model.bpe_vocab_size,
                            tie_word_embeddings=True, source=f"{spec} (model.random_init, model.bpe_vocab_size)")
    gguf = loading.gguf_path(model)
    if gguf is not None:
        cached = loading.cache_dir() / loading.gguf_cache_key(gguf) / "config.json"
        if cached.exists():
            return Architecture.from_config(_read_json(cached), str(cached))
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # deferred: imports torch

        # the metadata only: return_tensors=False reads no tensor
        values = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
        return Architecture.from_config(values, f"{gguf} (GGUF metadata)")
    local = Path(spec).expanduser()
    if local.is_dir():
        return Architecture.from_config(_read_json(local / "config.json"), str(local / "config.json"))
    from huggingface_hub import try_to_load_from_cache  # deferred: only for a hub model

    found = try_to_load_from_cache(spec, "config.json")
    if isinstance(found, str):
        return Architecture.from_config(_read_json(Path(found)), found)
    raise PlanError(f"model {spec}: no config.json without a download (not a local folder, not in the hub cache); "
                    f"pass --architecture with its config.json")


# -- how a stage runs ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Sharding:
    """How a trained model's states are held: our plain engine (`zero=None`), or DeepSpeed's ZeRO
    stage over `world_size` ranks, with its optimizer (and ZeRO-3 parameter) offload to the host."""

    world_size: int = 1
    zero: int | None = None
    offload_optimizer: bool = False
    offload_param: bool = False
    sub_group_size: int = DEEPSPEED_SUB_GROUP_SIZE
    reduce_bucket_size: int = DEEPSPEED_REDUCE_BUCKET_SIZE
    prefetch_bucket_size: int = DEEPSPEED_PREFETCH_BUCKET_SIZE
    max_reuse_distance: int = DEEPSPEED_MAX_REUSE_DISTANCE

    def describe(self) -> str:
        if self.zero is None:
            return "PyTorch" if self.world_size == 1 else f"PyTorch × {self.world_size}"
        offload = [n for n, on in (("optimizer", self.offload_optimizer), ("params", self.offload_param)) if on]
        return f"ZeRO-{self.zero} × {self.world_size}" + (f", offload {'+'.join(offload)}" if offload else "")


def stage_sharding(cfg: PipelineConfig, stage: str) -> Sharding:
    launch = getattr(cfg, stage).launch
    if in_process(cfg, stage):
        return Sharding(world_size=launch.world_size)
    # Ranks without a DeepSpeed config of their own run zero2 (stages.orchestration.launch.resolve_deepspeed_config).
    ds = json.loads(deepspeed_config_path(launch.deepspeed or "zero2").read_text())
    zero = ds.get("zero_optimization", {})

    def offloaded(key: str) -> bool:
        return str((zero.get(key) or {}).get("device", "none")).lower() in ("cpu", "nvme")

    def elements(key: str, default: int) -> int:
        value = zero.get(key, "auto")
        return default if value == "auto" else int(float(value))

    # The launch switches write these keys into the ranks' config (stages.orchestration.launch.resolve_deepspeed_config).
    return Sharding(world_size=launch.world_size, zero=int(zero.get("stage", 0)),
                    offload_optimizer=offloaded("offload_optimizer") or launch.offload_optimizer,
                    offload_param=offloaded("offload_param") or launch.offload_params,
                    sub_group_size=elements("sub_group_size", DEEPSPEED_SUB_GROUP_SIZE),
                    reduce_bucket_size=elements("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET_SIZE),
                    prefetch_bucket_size=elements("stage3_prefetch_bucket_size", DEEPSPEED_PREFETCH_BUCKET_SIZE),
                    max_reuse_distance=elements("stage3_max_reuse_distance", DEEPSPEED_MAX_REUSE_DISTANCE))


@dataclass
class Role:
    """One model of a stage: its bytes per device by component (`offloaded`: bytes on the host)."""

    name: str
    trained: bool
    params: int
    weights: int = 0
    master: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0  # training phase
    logits: int = 0  # training phase
    rollout: int = 0  # rollout phase: KV cache, no-grad forward passes and their logits
    offloaded: int = 0
    buffers: int = 0  # DeepSpeed's working buffers beside the model states (`deepspeed_buffers`)

    @property
    def states(self) -> int:
        return self.weights + self.master + self.grads + self.optimizer

    @property
    def resident(self) -> int:
        """What the role holds through every phase: its model states and DeepSpeed's buffers."""
        return self.states + self.buffers

    @property
    def total(self) -> int:
        return self.resident + self.activations + self.logits + self.rollout


def model_states(role: Role, precision: str, sharding: Sharding, largest_module: int) -> Role:
    """Weights, master weights, gradients and AdamW states of `role` per device, in bytes.

    Frozen: the weights in the run's precision, whole on every rank; under ZeRO-3 a ZeRO-3
    inference engine (stages/compute/model_loading.py): its partition Ψ/N, and its largest module gathered
    for that module's forward (no gradient), with offload_param the partition on the host
    (OpenRLHF's frozen reference and reward model, DeepSpeed's `offload_param`). Trained, our plain engine (stages/compute/training.py `PlainEngine`):
      fp32: weights 4Ψ, gradients 4Ψ, AdamW 8Ψ (the paper's 16Ψ);
      bf16: bf16 compute weights 2Ψ + fp32 masters 4Ψ; gradients 2Ψ bf16 (each backward's) + 4Ψ fp32
            (`MasterWeights.accumulate`); AdamW 8Ψ — 20Ψ. On a CPU with one backward a step no fp32
            gradients (`training.steps_from_bf16`, `plan_stage`): 16Ψ.
    Trained, DeepSpeed ZeRO-z over N ranks (bf16 mode: 16-bit weights and gradients, fp32
    masters, fp32 gradient partitions and AdamW states; fp32 mode: the "16-bit" copies are fp32):
      weights 2Ψ (÷N at ZeRO-3, plus the largest module gathered, 2 bytes of weights + 2 of
            gradient per parameter, as DeepSpeed's estimator);
      gradients 2Ψ (÷N at ZeRO-2/3) + fp32 partition 4Ψ/N (ZeRO-3: one sub-group at a time);
      masters 4Ψ and AdamW 8Ψ (÷N at ZeRO-1/2/3).
      ZeRO-2 bf16: 2Ψ + 18Ψ/N, DeepSpeed's `estimate_zero2_model_states_mem_needs` exactly; the
      paper's 2Ψ + 14Ψ/N has no fp32 gradient partition (fp16 with loss scaling).
    Offload: the optimizer's part (masters, AdamW, gradient partitions) lives on the host; with
    offload_param the ZeRO-3 weight partitions too (DeepSpeed's estimator: device 2Ψ at ZeRO-2, the
    gathered module at ZeRO-3)."""
    psi = role.params
    if not role.trained:
        return frozen_states(role, precision, sharding, largest_module)
    if sharding.zero is None:
        if precision == "bf16":
            return replace(role, weights=2 * psi, master=4 * psi, grads=6 * psi, optimizer=8 * psi)
        return replace(role, weights=4 * psi, grads=4 * psi, optimizer=8 * psi)
    n, zero = sharding.world_size, sharding.zero
    low = 2 if precision == "bf16" else 4  # the compute copy's bytes per parameter
    weights = low * psi // (n if zero >= 3 else 1)
    grads = low * psi // (n if zero >= 2 else 1)
    if precision == "bf16" or zero >= 1:  # DeepSpeed steps separate fp32 partitions (fp32 mode, ZeRO-0: the weights)
        master = 4 * psi // (n if zero >= 1 else 1)
        fp32_grads = 4 * (min(psi // n, sharding.sub_group_size) if zero >= 3 else psi // (n if zero >= 1 else 1))
    else:
        master = fp32_grads = 0
    fp32_grads = fp32_grads if precision == "bf16" else 0  # fp32 mode: the gradients are fp32 already
    optimizer = 8 * psi // (n if zero >= 1 else 1)
    gathered = 4 * largest_module if zero >= 3 else 0
    offloaded = 0
    if sharding.offload_optimizer:
        offloaded += master + optimizer + fp32_grads + (grads if zero >= 2 else 0)
        master = optimizer = fp32_grads = 0
        grads = grads if zero < 2 else 0
    if sharding.offload_param and zero >= 3:
        offloaded, weights = offloaded + weights, 0
    return replace(role, weights=weights + gathered, master=master, grads=grads + fp32_grads, optimizer=optimizer,
                   offloaded=offloaded)


def deepspeed_buffers(role: Role, precision: str, sharding: Sharding, largest_module: int,
                      trained_params: int | None = None) -> int:
    """Bytes per device DeepSpeed holds beside a model's states (`model_states`, as DeepSpeed's own
    estimators, counts one module gathered; these are what its config adds to that):
      the gradient bucket a trained model's gradients are reduced from (ZeRO-2 and -3 with
            `contiguous_gradients`: `reduce_bucket_size` elements in the 16-bit dtype, allocated when
            the engine starts; a model smaller than the bucket fills only its own size; with LoRA
            `trained_params`, the adapters, are all that have gradients);
      under ZeRO-3 the parameters held gathered: those fetched ahead (`stage3_prefetch_bucket_size`),
            and in a trained model every parameter whose next use in the step's module trace (its
            backward, after the forward of the layers above it and their backward) comes within
            `stage3_max_reuse_distance` elements: the last half of that distance of the forward stays
            gathered until the backward, the whole model when it is smaller than that half.
    deepspeed/runtime/zero/stage3.py (the IPG bucket), partitioned_param_coordinator.py
    (`__params_to_release`)."""
    if sharding.zero is None or sharding.zero < 2:
        return 0
    low = 2 if precision == "bf16" else 4
    psi = role.params
    bucket = low * min(trained_params or psi, sharding.reduce_bucket_size) if role.trained else 0
    if sharding.zero < 3:
        return bucket
    held = max(largest_module, sharding.max_reuse_distance // 2) if role.trained else largest_module
    gathered = min(psi, held + sharding.prefetch_bucket_size)
    return bucket + low * max(0, gathered - largest_module)


def frozen_states(role: Role, precision: str, sharding: Sharding, largest_module: int) -> Role:
    """A frozen model's weights per device (`model_states`): whole, or under ZeRO-3 partitioned with
    one module gathered at a time, the partition on the host with offload_param."""
    element = 2 if precision == "bf16" else 4
    if (sharding.zero or 0) < 3:
        return replace(role, weights=element * role.params)
    partition, gathered = element * role.params // sharding.world_size, element * largest_module
    if sharding.offload_param:
        return replace(role, weights=gathered, offloaded=partition)
    return replace(role, weights=partition + gathered)


# -- activations, logits, KV cache ----------------------------------------------------------------

def layer_activation_bytes(arch: Architecture, element: int) -> int:
    """Bytes per token one decoder layer keeps for its backward pass (Korthikanti et al. 2022 §4.1's
    method, tensor by tensor for transformers' Llama layer; `element`: 2 for bf16, 4 for fp32):
      2 RMSNorms, each: its input upcast to fp32 (4h) + the normalised and the scaled output (2·e·h);
      attention: q, and k, v repeated to all heads by `repeat_kv` (SDPA with a padding mask takes no
      GQA path) 3·e·h; SDPA's output e·h and its contiguous copy into o_proj e·h — no s² score
      matrix: SDPA's fused kernels keep only a per-row log-sum-exp;
      SwiGLU MLP: gate, up, silu(gate) and their product 4·e·I.
    For GPT-3's layer in fp16 with dropout the same count gives their 34·h (+5·a·s attention scores)."""
    h, i = arch.hidden_size, arch.intermediate_size
    norms = 2 * (4 * h + 2 * element * h)
    attention = element * (3 * h + 2 * h)
    mlp = element * 4 * i
    return norms + attention + mlp


def activation_bytes(arch: Architecture, tokens: int, element: int, checkpointing: bool) -> int:
    """Activations of one training forward over `tokens` (batch × sequence), kept for backward.
    Checkpointing (transformers' per-layer checkpoints): every layer's input (e·h per token) plus
    one layer's full activations, recomputed during its backward."""
    per_layer = layer_activation_bytes(arch, element) * tokens
    if checkpointing:
        return arch.num_hidden_layers * element * arch.hidden_size * tokens + per_layer
    return arch.num_hidden_layers * per_layer


def logit_bytes_per_token(arch: Architecture, element: int) -> int:
    """transformers' forward under a next-token loss (SFT, PPO-ptx): its logits at every position
    (e bytes), the rows of the labelled positions copied out of them for `stages.leaves.logprobs`, which
    keeps them for its backward (e), their gradient and the whole gradient (e each): 4e · V per
    token, every position counted as labelled."""
    return 4 * element * arch.vocab_size


def picked_logit_bytes_per_token(arch: Architecture, element: int) -> int:
    """The LM head on the predicting positions only (PPO's policy on the response, the reward
    model's LM term on the chosen answers' response): its output, which `stages.leaves.logprobs` keeps
    for its backward (its fp32 work is a few chunks of rows), and its gradient: 2e · V."""
    return 2 * element * arch.vocab_size


def attention_score_bytes(arch: Architecture, rows: int, length: int, element: int) -> int:
    """The attention probabilities that the padding-free forward keeps for backward where it
    computes attention as explicit products (bf16 on a CPU, `llama.attention`): layers · heads ·
    rows · length² · e — the softmax's output, which its backward and the product with the values
    read; the scores before the softmax are freed. SDPA's fused kernels keep none."""
    return arch.num_hidden_layers * arch.num_attention_heads * rows * length * length * element


def inference_bytes(arch: Architecture, rows: int, length: int, logit_positions: int, element: int) -> int:
    """A no-grad forward (reference log-probs, values, scores): one layer's working set at a time
    (its input, q, k, v, and the MLP's gate and up) and the logits over the response positions in
    the compute dtype (`stages.leaves.logprobs` reads them a few rows at a time)."""
    h, i = arch.hidden_size, arch.intermediate_size
    working = rows * length * element * (4 * h + 2 * i)
    return working + rows * logit_positions * arch.vocab_size * element


def decode_linear_shapes(arch: Architecture) -> list[tuple[int, int]]:
    """The [out × in] weights the fast decoder multiplies per token (stages/compute/models/llama.py
    `Decoder`): every layer's fused q·k·v, o, fused gate·up and down, then the LM head."""
    h, q, kv, i = arch.hidden_size, arch.num_attention_heads * arch.head_size, arch.kv_size, arch.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * arch.num_hidden_layers + [(arch.vocab_size, h)]


def packed_weight_bytes(arch: Architecture, rows: int, precision: str = "fp32") -> int:
    """The fast decoder's packed weights for `rows` sampled at once on a CPU (`PackedLinear`): in
    bf16 oneDNN's blocked layout; in fp32 MKL's packed GEMM, on Intel CPUs only, whose format pads
    each matrix (its size is not documented: ~5.6 MB at least, 2–7× the weight on SmolLM2's
    shapes). The sizes are asked of the libraries themselves, each shape once; 0 where nothing is
    packed."""
    from stages.compute.models import mkl_packing_pays  # deferred: imports torch

    if precision == "fp32" and not mkl_packing_pays():
        return 0
    return sum(_packed_bytes(shape, rows, precision) for shape in decode_linear_shapes(arch))


@functools.lru_cache(maxsize=None)
def _packed_bytes(shape: tuple[int, int], rows: int, precision: str) -> int:
    import torch  # deferred, as the import below: the plan of a config alone loads no torch

    from stages.compute.models import mkl_pack, onednn_pack  # deferred: as torch above

    if precision == "bf16":
        packed = onednn_pack(torch.zeros(shape, dtype=torch.bfloat16), rows)
    else:
        packed = mkl_pack(torch.zeros(shape), rows)
    return 0 if packed is None else packed.numel() * packed.element_size()


def kv_cache_bytes(arch: Architecture, rows: int, length: int, element: int) -> int:
    """The generation KV cache: 2 (K and V) · layers · kv heads · head dim · tokens · rows · bytes."""
    return 2 * arch.num_hidden_layers * arch.kv_size * length * rows * element


# -- the plan ------------------------------------------------------------------------------------

@dataclass
class StagePlan:
    stage: str
    device: str  # "cpu" or "cuda"
    precision: str
    sharding: Sharding
    ranks_per_host: int
    roles: list[Role]
    phases: dict[str, int]  # transient bytes per phase (training step, rollout)
    batch: str  # what sizes the transients, for the table
    advice: dict[str, str] = field(default_factory=dict)  # component → the setting that lowers it
    skipped: str | None = None

    @property
    def states(self) -> int:
        """What the stage holds through every phase: its roles' model states and DeepSpeed's buffers."""
        return sum(role.resident for role in self.roles)

    @property
    def peak(self) -> int:
        """Predicted peak bytes per device (rank)."""
        return self.states + max(self.phases.values(), default=0)

    @property
    def host_peak(self) -> int:
        """On a CPU, every rank of a host shares its memory; offloaded states live there too."""
        offloaded = sum(role.offloaded for role in self.roles)
        return (self.peak if self.device == "cpu" else 0) * self.ranks_per_host + offloaded * self.ranks_per_host

    def culprit(self) -> tuple[Role, str, int]:
        """The role and component that weigh most in the peak."""
        phase = max(self.phases, key=self.phases.get) if self.phases else None
        best = None
        for role in self.roles:
            parts = {"weights": role.weights, "master": role.master, "grads": role.grads, "optimizer": role.optimizer,
                     "buffers": role.buffers}
            if phase == "train":
                parts.update(activations=role.activations, logits=role.logits)
            elif phase == "rollout":
                parts["rollout"] = role.rollout
            for name, value in parts.items():
                if best is None or value > best[2]:
                    best = (role, name, value)
        return best

    def remedy(self) -> str:
        role, component, _ = self.culprit()
        return self.advice.get(component) or self.advice["states"]


def _ranks_per_host(cfg: PipelineConfig, stage: str) -> int:
    launch = getattr(cfg, stage).launch
    if launch.hostfile is None:
        return launch.world_size

    return max(hostfile_slots(launch.hostfile)[1].values())


def _states_advice(stage: str, sharding: Sharding) -> str:
    if sharding.zero is None or sharding.world_size == 1:
        return (f"run it on more ranks with ZeRO ({stage}.launch.world_size=N, {stage}.launch.deepspeed=zero3)"
                if sharding.zero != 3 else f"raise {stage}.launch.world_size or set "
                                           f"{stage}.launch.offload_optimizer=true")
    if sharding.zero < 3:
        return f"set {stage}.launch.deepspeed=zero3 (ZeRO-3 partitions weights too) or raise {stage}.launch.world_size"
    if not sharding.offload_optimizer:
        return f"raise {stage}.launch.world_size or set {stage}.launch.offload_optimizer=true"
    if not sharding.offload_param:
        return f"raise {stage}.launch.world_size or set {stage}.launch.offload_params=true"
    return f"raise {stage}.launch.world_size"


def lora_model_states(name: str, params: int, trained: int, precision: str, sharding: Sharding,
                      largest_module: int) -> Role:
    """A trained role with LoRA: its `params` weights frozen (ZeRO-3 partitions them with the
    engine's; the plain engine keeps their fp32 originals, to save, beside the bf16 copies), its
    `trained` parameters (the adapters, and a scalar head) with masters, gradients and moments."""
    trained_part = model_states(Role(name, True, trained), precision, sharding, 0)
    frozen = frozen_states(Role(name, False, params), precision, sharding, largest_module)
    weights = frozen.weights + (4 * params if sharding.zero is None and precision == "bf16" else 0)
    return replace(trained_part, params=params, weights=trained_part.weights + weights,
                   offloaded=trained_part.offloaded + frozen.offloaded)


def reward_batch_tokens(r) -> int:
    """Padded tokens of the reward stage's largest batch: pairs × 2 × the longest sequence. Dynamic
    batches stay within the token budget unless min_pairs forces more (stages/leaves/pair_batching.py)."""
    if r.dynamic_batching:
        return min(max(r.token_budget, r.min_pairs * 2 * r.max_seq_len), r.max_pairs * 2 * r.max_seq_len)
    return r.fixed_pairs * 2 * r.max_seq_len


@dataclass
class Planning:
    """What every stage's memory model reads: the config, the model's shape, where and in what
    precision the stage computes, and how its ranks shard the model states."""
    cfg: PipelineConfig
    stage: str
    arch: Architecture
    device: str
    resolved: str  # the precision model.precision resolves to there
    sharding: Sharding
    fast_path: bool  # the architecture's fast path runs (model.fast_path auto and one registered)

    @property
    def element(self) -> int:
        return 2 if self.resolved == "bf16" else 4

    @property
    def explicit_attention(self) -> bool:
        """`llama.attention` with gradients; a checkpointed model trains through transformers' forward
        (llama.forward_applies)."""
        return (self.fast_path and self.device == "cpu" and self.resolved == "bf16"
                and not self.cfg.model.gradient_checkpointing)

    @property
    def checkpointed(self) -> bool:
        return self.cfg.model.gradient_checkpointing  # every trained model's activations

    @property
    def adapters(self) -> int:
        """LoRA's adapter parameters (model.lora), 0 without LoRA."""
        lora = self.cfg.model.lora
        return self.arch.lora_params(lora.rank, lora.target_modules) if lora.rank else 0

    def recompute_advice(self, lower: str) -> str:
        return lower if self.checkpointed else f"set model.gradient_checkpointing=true or {lower}"

    @property
    def rm_psi(self) -> int:
        return self.arch.params() + self.arch.hidden_size + 1  # the LM and its scalar head (stages/compute/reward/model.py)

    def states(self, name: str, params: int, trained: bool) -> Role:
        """A model's states; a trained one under LoRA trains only its adapters (and any head)."""
        largest = self.arch.largest_module_params()
        if trained and self.adapters:
            adapters = self.adapters + params - self.arch.params()
            role = lora_model_states(name, params, adapters, self.resolved, self.sharding, largest)
        else:
            role, adapters = model_states(Role(name, trained, params), self.resolved, self.sharding, largest), None
        role.buffers = deepspeed_buffers(role, self.resolved, self.sharding, largest, adapters)
        return role

    def without_fp32_gradients(self, role: Role | None, grad_accum_steps: int) -> None:
        """A plain engine that steps from the bf16 gradients keeps no fp32 ones: gradients 2Ψ, not 6Ψ."""
        from stages.compute.training import steps_from_bf16  # deferred: imports torch

        if role is not None and role.trained and not self.adapters and self.sharding.zero is None and steps_from_bf16(
                self.device, self.resolved, grad_accum_steps):
            role.grads = 2 * role.params


def sft_memory(at: Planning) -> tuple[list[Role], str, dict[str, str]]:
    """SFT's actor: its states, and a micro-batch's activations and logits."""
    s, arch = at.cfg.sft, at.arch
    tokens = s.micro_batch_size * s.max_seq_len
    actor = at.states("actor", arch.params(), True)
    at.without_fp32_gradients(actor, s.grad_accum_steps)
    actor.activations = activation_bytes(arch, tokens, at.element, at.checkpointed)
    actor.logits = tokens * logit_bytes_per_token(arch, at.element)
    batch = f"{s.micro_batch_size} × {s.max_seq_len} tokens{', checkpointed' if at.checkpointed else ''}"
    advice = {"activations": at.recompute_advice("lower sft.micro_batch_size or sft.max_seq_len"),
              "logits": "lower sft.micro_batch_size or sft.max_seq_len"}
    return [actor], batch, advice


def reward_memory(at: Planning) -> tuple[list[Role], str, dict[str, str]]:
    """The reward model: its states, and its largest batch's activations and picked logits."""
    r, arch = at.cfg.reward, at.arch
    tokens = reward_batch_tokens(r)
    rm = at.states("reward model", at.rm_psi, True)
    at.without_fp32_gradients(rm, 1)
    # Explicit attention: Σ rows · length² ≤ padded tokens · max_seq_len.
    rm.activations = activation_bytes(arch, tokens, at.element, at.checkpointed) + (
        attention_score_bytes(arch, tokens, r.max_seq_len, at.element) // r.max_seq_len if at.explicit_attention else 0)
    rm.logits = tokens // 2 * picked_logit_bytes_per_token(arch, at.element)  # at most the chosen rows' positions
    batch = f"{tokens} padded tokens per batch (pairs × 2 × longest){', checkpointed' if at.checkpointed else ''}"
    budget = "reward.token_budget" if r.dynamic_batching else "reward.fixed_pairs"
    return [rm], batch, {"activations": at.recompute_advice(f"lower {budget} or reward.max_seq_len"),
                         "logits": f"lower {budget}"}


def rollout_memory(at: Planning) -> tuple[list[Role], str, dict[str, str]]:
    """PPO and critic pre-training: the actor (frozen in the critic stage), the reference, the
    reward model and the critic; a rollout's KV cache and forwards, then a minibatch's training step."""
    from stages.compute.ppo.advantages import needs_critic  # deferred: imports torch

    cfg, arch, element, p = at.cfg, at.arch, at.element, at.cfg.ppo
    train_actor = at.stage == "ppo"
    rollout_rows = p.rollout_batch_size if train_actor else cfg.critic.rollout_batch_size
    mb = p.minibatch_size if train_actor else cfg.critic.minibatch_size
    prompt, new = p.max_prompt_len, p.generation.max_new_tokens
    length = prompt + new
    actor = at.states("actor" if train_actor else "actor (frozen)", arch.params(), train_actor)
    roles = [actor]
    if train_actor and not at.adapters:  # critic pre-training's frozen policy is its own reference (stages/pipeline/critic.py);
        roles.append(at.states("reference", arch.params(), False))  # a LoRA actor's is itself without adapters
    roles.append(at.states("reward model", at.rm_psi, False))
    critic = at.states("critic", at.rm_psi, True) if needs_critic(p) else None
    at.without_fp32_gradients(actor, 1)  # PPO's engines: one backward a step (stages/compute/ppo/trainer.py)
    at.without_fp32_gradients(critic, 1)
    if critic is not None:
        roles.append(critic)
    # Rollout: the actor's KV cache while it samples, then no-grad forwards of the reference,
    # the critic and the reward model one after another; the larger of the two counts.
    kv = kv_cache_bytes(arch, rollout_rows, length, element)
    packed = (packed_weight_bytes(arch, rollout_rows, at.resolved) if at.device == "cpu" and at.fast_path
              and (at.sharding.zero or 0) < 3 else 0)
    actor.rollout = max(kv + packed + rollout_rows * arch.vocab_size * 4 * 4,  # a step's logits, fp32, sampler copies
                        inference_bytes(arch, rollout_rows, length, new, element))
    # Training step: the critic's and the actor's forward graphs (and PPO-ptx's) are all alive
    # before the first backward (stages/compute/ppo/trainer.py `optimise`).
    scores = attention_score_bytes(arch, mb, length, element) if at.explicit_attention else 0
    if critic is not None:
        critic.activations = activation_bytes(arch, mb * length, element, at.checkpointed) + scores
    if train_actor:
        actor.activations = activation_bytes(arch, mb * length, element, at.checkpointed) + scores
        actor.logits = mb * new * picked_logit_bytes_per_token(arch, element)
        if p.switches()["ptx"]:
            ptx_tokens = p.ptx_batch_size * cfg.sft.max_seq_len
            actor.activations += activation_bytes(arch, ptx_tokens, element, at.checkpointed)
            actor.logits += ptx_tokens * logit_bytes_per_token(arch, element)
    batch = (f"rollout {rollout_rows} × ({prompt} + {new}) tokens, minibatch {mb}"
             + (f", ptx {p.ptx_batch_size} × {cfg.sft.max_seq_len}" if train_actor and p.switches()["ptx"] else "")
             + (", checkpointed" if at.checkpointed else ""))
    section = at.stage
    advice = {"rollout": f"lower {section}.rollout_batch_size or ppo.generation.max_new_tokens",
              "activations": at.recompute_advice(f"lower {section}.minibatch_size"
                                                 + (" or ppo.ptx_batch_size" if train_actor else "")),
              "logits": f"lower {section}.minibatch_size" + (" or ppo.ptx_batch_size" if train_actor else "")}
    return roles, batch, advice


# Each training stage's memory model: (its roles with their sizes, its batch in words, the setting
# to change per component). A stage without one is not planned.
MEMORY_MODELS = {"sft": sft_memory, "reward": reward_memory, "critic": rollout_memory, "ppo": rollout_memory}


def plan_stage(cfg: PipelineConfig, stage: str, arch: Architecture, device: str | None = None) -> StagePlan:
    import torch  # deferred, as the imports of torch code below: the CLI imports this module without torch

    from stages.leaves import precision as precisions  # deferred: imports torch
    from stages.compute.models import FAST_PATHS  # deferred: as torch above

    if stage not in MEMORY_MODELS:
        raise ValueError(f"no memory plan for stage '{stage}'; planned: {', '.join(TRAINING_STAGES)}")
    device = device or stage_device(cfg, stage)
    if device == "cuda" and cfg.model.precision == "auto" and not torch.cuda.is_available():
        resolved = "bf16"  # planning for GPUs from a machine without one: auto is bf16 on every GPU since Ampere
    else:
        resolved = precisions.resolve(cfg.model.precision, device)
    sharding = stage_sharding(cfg, stage)
    at = Planning(cfg, stage, arch, device, resolved, sharding,
                  fast_path=cfg.model.fast_path == "auto" and arch.model_type in FAST_PATHS)
    roles, batch, advice = MEMORY_MODELS[stage](at)
    phases = {"train": sum(r.activations + r.logits for r in roles)}
    if any(r.rollout for r in roles):
        phases["rollout"] = sum(r.rollout for r in roles)
    return StagePlan(stage, device, resolved, sharding, _ranks_per_host(cfg, stage), roles, phases, batch,
                     {"states": _states_advice(stage, sharding),
                      "buffers": f"lower reduce_bucket_size or stage3_max_reuse_distance in the zero_optimization of "
                                 f"{stage}.launch.deepspeed's config", **advice},
                     registry.get(stage).skipped(cfg))


@dataclass
class Verdict:
    fits: bool
    message: str  # the first stage that does not fit: its role, sizes and the setting to change


@dataclass
class Plan:
    arch: Architecture
    stages: list[StagePlan]
    device_memory: dict[str, int]  # "cpu" / "cuda" → bytes available per device (CPU: per host)

    def verdicts(self) -> list[tuple[StagePlan, int, int]]:
        """(stage, predicted bytes, available bytes): per device on a GPU, per host on a CPU."""
        out = []
        for sp in self.stages:
            if sp.skipped:
                continue
            used = sp.host_peak if sp.device == "cpu" else sp.peak
            out.append((sp, used, self.device_memory[sp.device]))
        return out

    def check(self) -> Verdict:
        for sp, used, available in self.verdicts():
            if used > available:
                role, component, _ = sp.culprit()
                where = "host RAM" if sp.device == "cpu" else "GPU memory"
                ranks = f" ({sp.ranks_per_host} ranks on a host)" if sp.device == "cpu" and sp.ranks_per_host > 1 else ""
                return Verdict(False, f"{sp.stage} {role.name}: {gib(used)} GiB > {gib(available)} GiB of {where}"
                                      f"{ranks}, mostly its {component}: {sp.remedy()}")
        return Verdict(True, "every stage fits")

    def table(self) -> str:
        cols = ("weights", "master", "grads", "optim", "buffers", "activ", "logits", "rollout", "total")
        lines = [f"model: {self.arch.source}: Ψ = {self.arch.params() / 1e6:,.1f} M parameters, "
                 f"{self.arch.num_hidden_layers} layers, hidden {self.arch.hidden_size}, "
                 f"heads {self.arch.num_attention_heads}/{self.arch.num_key_value_heads} kv, "
                 f"MLP {self.arch.intermediate_size}, vocab {self.arch.vocab_size}"
                 f"{', tied embeddings' if self.arch.tie_word_embeddings else ''}",
                 "GiB per device; a stage's total is its model states plus its largest phase (training step or "
                 "rollout), which never overlap", ""]
        head = f"{'stage / role':<22}" + "".join(f"{c:>9}" for c in cols)
        for sp in self.stages:
            lines.append(f"{sp.stage} — {sp.device}, {sp.precision}, {sp.sharding.describe()}; {sp.batch}"
                         + (f"  [skipped: {sp.skipped}]" if sp.skipped else ""))
            lines.append(head)
            for r in sp.roles:
                values = (r.weights, r.master, r.grads, r.optimizer, r.buffers, r.activations, r.logits, r.rollout,
                          r.total)
                lines.append(f"  {r.name:<20}" + "".join(f"{gib(v):>9}" for v in values)
                             + (f"   (+{gib(r.offloaded)} GiB on the host)" if r.offloaded else ""))
            phases = ", ".join(f"{name} {gib(v)}" for name, v in sp.phases.items())
            lines.append(f"  {'per device':<20}{'':>72}{gib(sp.peak):>9}   = states {gib(sp.states)} + max({phases})")
            lines.append("")
        for sp, used, available in self.verdicts():
            where = "per host" if sp.device == "cpu" else "per GPU"
            mark = "fits" if used <= available else "DOES NOT FIT"
            lines.append(f"{sp.stage:<7} {gib(used):>9} GiB of {gib(available)} GiB {where}: {mark}")
        return "\n".join(lines)


def gib(value: int) -> str:
    return f"{value / GiB:.2f}"


def device_memory(device: str) -> int:
    """Bytes a stage may use: a CUDA device's total memory; on a CPU the host's available RAM
    (MemAvailable: what can be allocated without swapping out others)."""
    if device == "cuda":
        import torch  # deferred: only for a GPU

        return torch.cuda.get_device_properties(0).total_memory
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# The memory switches, cheapest first (what each costs a step): recomputing activations (one more
# forward per backward), ZeRO-3 (gathering every layer's weights, forward and backward), the
# optimiser on the host (its step and the gradient and weight copies over PCIe), the parameters on
# the host too (every layer's weights over PCIe, each forward and backward).
MEMORY_SWITCHES = (("model.gradient_checkpointing=true",), ("{stage}.launch.deepspeed=zero3",),
                   ("model.gradient_checkpointing=true", "{stage}.launch.deepspeed=zero3"),
                   ("{stage}.launch.offload_optimizer=true",),
                   ("model.gradient_checkpointing=true", "{stage}.launch.offload_optimizer=true"),
                   ("model.gradient_checkpointing=true", "{stage}.launch.deepspeed=zero3",
                    "{stage}.launch.offload_optimizer=true"),
                   ("model.gradient_checkpointing=true", "{stage}.launch.deepspeed=zero3",
                    "{stage}.launch.offload_optimizer=true", "{stage}.launch.offload_params=true"),
                   # LoRA last: it trains another model (adapters of rank 16, OpenRLHF's LoRA examples), not the same one
                   ("model.gradient_checkpointing=true", "model.lora.rank=16"),
                   ("model.gradient_checkpointing=true", "model.lora.rank=16", "{stage}.launch.deepspeed=zero3"),
                   ("model.gradient_checkpointing=true", "model.lora.rank=16", "{stage}.launch.deepspeed=zero3",
                    "{stage}.launch.offload_optimizer=true", "{stage}.launch.offload_params=true"))


def with_switches(cfg: PipelineConfig, switches: list[str]) -> PipelineConfig:
    """`cfg` with `--set` lines of MEMORY_SWITCHES applied (offload runs on DeepSpeed: zero2 unless set)."""
    values = cfg.model_dump(mode="json")
    for line in switches:
        path, value = line.split("=", 1)
        *sections, key = path.split(".")
        section = values
        for name in sections:
            section = section[name]
        section[key] = {"true": True}.get(value, int(value) if value.isdigit() else value)
        if key.startswith("offload") and section.get("deepspeed") is None:
            section["deepspeed"] = "zero2"
    return PipelineConfig.model_validate(values)


def cheapest_fit(cfg: PipelineConfig, stage: str, arch: Architecture, device: str, available: int) -> list[str] | None:
    """The first switches of MEMORY_SWITCHES (cheapest first) under which `stage` fits `available`
    bytes per device (per host on a CPU); [] when it fits as it is, None when none does."""
    for switches in ((), *MEMORY_SWITCHES):
        lines = [s.format(stage=stage) for s in switches]
        sp = plan_stage(with_switches(cfg, lines), stage, arch, device)
        if (sp.host_peak if sp.device == "cpu" else sp.peak) <= available:
            return lines
    return None


def remedies(predicted: Plan, cfg: PipelineConfig) -> list[str]:
    """Per stage that does not fit: the cheapest switches that make it fit (`cheapest_fit`)."""
    lines = []
    for sp, used, available in predicted.verdicts():
        if used > available:
            found = cheapest_fit(cfg, sp.stage, predicted.arch, sp.device, available)
            lines.append(f"{sp.stage}: " + (" ".join(f"--set {s}" for s in found) if found is not None
                                            else "no memory switch makes it fit: more ranks"))
    return lines


FIT_ARCHITECTURES = ("llama-2-7b", "llama-3-8b", "llama-2-13b", "llama-3-70b")
FIT_WORLD_SIZES = (1, 8, 16)


def fit_table(cfg: PipelineConfig, memory_gib: float = 80.0) -> str:
    """The markdown table of docs/guide/memory.md: for each architecture and world size (every
    training stage on that many GPUs of `memory_gib`, DeepSpeed ZeRO-2 as it starts), the cheapest
    switches (`cheapest_fit`) each stage needs. `rlhf plan --fit-table` prints it."""
    available = int(memory_gib * GiB)
    head = ["model"] + [f"{n} × {memory_gib:g} GB" for n in FIT_WORLD_SIZES]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in FIT_ARCHITECTURES:
        arch = read_architecture(cfg.model, name)
        cells = []
        for ranks in FIT_WORLD_SIZES:
            launch = [f"{stage}.launch.{key}={value}" for stage in TRAINING_STAGES
                      for key, value in (("world_size", ranks), ("deepspeed", "zero2"))]
            ranked = with_switches(cfg, launch)
            needs = {stage: cheapest_fit(ranked, stage, arch, "cuda", available) for stage in TRAINING_STAGES}
            cells.append("; ".join(f"{stage}: " + ("does not fit" if found is None else ", ".join(
                s.split(".")[-1].removesuffix("=true") for s in found) or "fits") for stage, found in needs.items()))
        rows.append(f"| {name} ({arch.params() / 1e9:.1f} B) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plan(cfg: PipelineConfig, *, stages: list[str] | None = None, architecture: str | None = None,
         device: str | None = None, memory_gib: float | None = None) -> Plan:
    """The plan of `stages` (default: every training stage): `device` forces where they compute
    (default: where `rlhf run` would put them), `memory_gib` the memory per device (default: the
    device's own, `device_memory`)."""
    arch = read_architecture(cfg.model, architecture)
    planned = [s for s in (stages or TRAINING_STAGES) if s in TRAINING_STAGES]
    plans = [plan_stage(cfg, s, arch, device) for s in planned]
    memory = {d: int(memory_gib * GiB) if memory_gib is not None else device_memory(d)
              for d in {sp.device for sp in plans}}
    return Plan(arch, plans, memory)
