"""What every training stage shares: masked means, lr schedules, the
optimiser (fused AdamW), the engine (single-process PyTorch or DeepSpeed), gradient clipping (one
clip over several engines, ZeRO included), and greedy generation for the contract
probes. Stage modules import these from here; `stages.orchestration.launch` only launches."""

from __future__ import annotations

import math
import sys

import torch

from stages.compute.model_loading import merge_adapters
from stages.compute.models import fused
from stages.compute.models.embedding import add_gradients_in_place
from stages.leaves.dist import Dist
from stages.leaves.rendering import render_prompt


def cosine_with_warmup(optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0):
    """Linear warm-up to the peak lr, then cosine decay to `min_lr_ratio` × the peak (0: as
    transformers' schedule; the paper's SFT decays to 10 %)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def linear_warmup(optimizer, warmup_steps: int):
    """Linear warm-up to the peak lr, then constant (PPO: `ppo.warmup_ratio`)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))


class PlainEngine:
    """The slice of DeepSpeed's engine API the stages use, for single-process PyTorch.

    precision="bf16" (`stages.leaves.precision`): the model computes with bf16 weights, while `optimizer`
    keeps stepping the fp32 parameters it was built over, which become the master weights (the
    model's are their bf16 copies); each backward's gradients are added into the masters' in fp32 —
    except where the engine steps from the bf16 gradients themselves (`steps_from_bf16`: a CPU, one
    backward a step; `from_bf16_gradients=False` turns it off), updating each master and its AdamW
    moments in one compiled loop.

    A step whose gradient norm is not finite (a finite loss can overflow in the backward) updates
    nothing, as DeepSpeed's optimisers skip an overflow: the gradients are dropped, the optimiser and
    the lr schedule do not step, and `skipped_steps` counts it. The norm is the engine's own clip's,
    or the joint clip's (`clip_grad_norm` hands it over); an engine that clips nothing checks none."""

    def __init__(self, model, optimizer, scheduler, grad_accum_steps: int, max_grad_norm: float,
                 precision: str = "fp32", from_bf16_gradients: bool = True):
        self.module, self.optimizer, self.lr_scheduler = model, optimizer, scheduler
        # The engine reads .grad after each backward: the fast path may add the input embedding's
        # gradient there in place (stages.compute.models.embedding).
        add_gradients_in_place(model)
        self.grad_accum_steps, self.max_grad_norm = grad_accum_steps, max_grad_norm
        self.master = MasterWeights.of(model) if precision == "bf16" else None
        # False: always through the masters' fp32 gradients (the path torch's AdamW steps bit for bit).
        self.steps_from_bf16 = from_bf16_gradients and steps_from_bf16_gradients(self.master, optimizer, grad_accum_steps)
        # Under bf16 the masters' gradient buffers are kept from step to step (MasterWeights.accumulate):
        # made here with the optimiser's state, before any batch. A step from the bf16 gradients needs none.
        allocate_optimizer_state(optimizer, keep_gradients=self.master is not None and not self.steps_from_bf16)
        self.micro_steps = 0
        self.last_grad_norm = 0.0
        self.skipped_steps = 0
        self.joint_grad_norm: float | None = None  # set by clip_grad_norm for the next step
        self.joint_clip_coef = 1.0  # set by clip_grad_norm where the engine steps from its bf16 gradients

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum_steps == 0

    def backward(self, loss) -> None:
        (loss / self.grad_accum_steps).backward()
        if self.master is not None and not self.steps_from_bf16:
            self.master.accumulate()

    def trainable_parameters(self) -> list:
        """What the optimiser steps: the fp32 masters under bf16, else the model's parameters."""
        if self.master is not None:
            return self.master.masters
        return [p for p in self.module.parameters() if p.requires_grad]

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary() and self.steps_from_bf16:
            self.step_from_bf16_gradients()
        elif self.is_gradient_accumulation_boundary():
            if math.isinf(self.max_grad_norm):  # PPO clips actor and critic jointly (or nothing clips): no own norm
                norm, self.joint_grad_norm = self.joint_grad_norm, None
            else:
                norm = clip_with_norm([p for p in self.trainable_parameters() if p.grad is not None],
                                      self.max_grad_norm)
            self.last_grad_norm = math.nan if norm is None else norm
            skipped = norm is not None and not math.isfinite(norm)
            if skipped:
                self.skip_step(norm)
            else:
                self.optimizer.step()
                self.lr_scheduler.step()
                if self.master is not None:
                    self.master.copy_to_model()
            if self.master is not None:
                self.master.fresh = True  # its gradient buffers stay: the next backward overwrites them
            if self.master is None or skipped:  # a skipped step's gradients are dropped, as DeepSpeed drops an overflow's
                self.optimizer.zero_grad(set_to_none=True)
        self.micro_steps += 1

    def step_from_bf16_gradients(self) -> None:
        """The step `steps_from_bf16_gradients` applies to: the clip's norm from the bf16 gradients
        (the engine's own clip; a joint clip's comes from `clip_grad_norm`), then per tensor one fused
        AdamW update of the master and its moments from its bf16 gradient times the clip's
        coefficient, writing the model's bf16 copy as it goes."""
        pairs = [(master, copy) for master, copy in zip(self.master.masters, self.master.copies) if copy.grad is not None]
        if math.isinf(self.max_grad_norm):  # a joint clip (or none: norm None, coefficient 1)
            norm, coef = self.joint_grad_norm, self.joint_clip_coef
            self.joint_grad_norm, self.joint_clip_coef = None, 1.0
        else:
            norm = bf16_total_norm([copy.grad for _, copy in pairs])
            coef = min(1.0, clip_coefficient(self.max_grad_norm, norm))
        self.last_grad_norm = math.nan if norm is None else norm
        if norm is None or math.isfinite(norm):
            adamw_from_bf16_gradients(self.optimizer, pairs, coef)
            self.lr_scheduler.step()
        else:
            self.skip_step(norm)
        for _, copy in pairs:
            copy.grad = None

    def skip_step(self, norm: float) -> None:
        self.skipped_steps += 1
        print(f"gradient norm {norm}: optimiser step skipped ({self.skipped_steps} in all)", file=sys.stderr)

    def get_global_grad_norm(self) -> float:
        return self.last_grad_norm

    def train(self) -> None:
        self.module.train()

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's state dict with the fp32 master weights (checkpoints)."""
        state = self.module.state_dict()
        if self.master is not None:
            state.update(self.master.named_masters())
        return state

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        if self.master is None:
            self.module.load_state_dict(state)
        else:
            self.master.load(state)

    def restore_fp32(self):
        """The trained model in fp32 (its master weights back in place) for saving and publishing;
        the engine trains no further. Returns the model."""
        if self.master is not None:
            self.master.restore()
            self.master = None
        return self.module


class MasterWeights:
    """The fp32 master weights of a model that computes in bf16 (`PlainEngine`, precision bf16).

    The optimiser was built over the model's fp32 parameters; those Parameter objects are kept as
    the masters and the model gets bf16 copies in their place (tied weights stay tied). Frozen
    parameters become bf16 too; buffers (RoPE's inverse frequencies) stay as they are.

    `batched` (on a GPU): the copies between masters and model go as torch's multi-tensor
    (`_foreach_*`) ops, a few kernel launches instead of one per tensor: the host, not the GPU, bounds
    a small model's step there. On a CPU torch runs them one tensor at a
    time either way, and the loop measured faster."""

    def __init__(self, model, names: list[list[tuple[torch.nn.Module, str]]], masters: list, copies: list,
                 frozen: list[tuple[torch.nn.Module, str, torch.nn.Parameter]], batched: bool = False):
        self.model, self.names, self.masters, self.copies, self.frozen = model, names, masters, copies, frozen
        self.batched = batched
        self.fresh = True  # the next backward starts a step's gradients

    @classmethod
    def of(cls, model) -> MasterWeights:
        places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        originals: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                places.setdefault(id(param), []).append((module, name))
                originals[id(param)] = param
        names, masters, copies, frozen = [], [], [], []
        for key, param in originals.items():
            copy = torch.nn.Parameter(param.detach().to(torch.bfloat16), requires_grad=param.requires_grad)
            for module, name in places[key]:
                setattr(module, name, copy)
            if param.requires_grad:
                names.append(places[key])
                masters.append(param)
                copies.append(copy)
            else:
                frozen.extend((module, name, param) for module, name in places[key])
        return cls(model, names, masters, copies, frozen, batched=bool(masters) and masters[0].is_cuda)

    def accumulate(self) -> None:
        """Add the bf16 copies' gradients into the masters' (fp32) and free them. The masters'
        gradient tensors are kept from step to step, and a step's first backward overwrites them:
        freed and allocated anew at every step (4Ψ bytes), they made the kernel map and zero fresh
        pages each time."""
        if self.batched and self.fresh and all(c.grad is not None and m.grad is not None
                                               for m, c in zip(self.masters, self.copies)):
            torch._foreach_copy_([m.grad for m in self.masters], [c.grad for c in self.copies])
            for copy in self.copies:
                copy.grad = None
            self.fresh = False
            return
        for master, copy in zip(self.masters, self.copies):
            if copy.grad is None:
                if self.fresh:
                    master.grad = None  # none in this step (so far): the last step's must not be stepped again
                continue
            if master.grad is None:
                master.grad = copy.grad.float()
            elif self.fresh:
                master.grad.copy_(copy.grad)
            else:
                master.grad.add_(copy.grad)
            copy.grad = None
        self.fresh = False

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if self.batched:
            torch._foreach_copy_(self.copies, self.masters)
            return
        for master, copy in zip(self.masters, self.copies):
            copy.copy_(master)

    def named_masters(self) -> dict[str, torch.Tensor]:
        """Master weights by their names in the model's state dict (every name of a tied weight)."""
        paths = {id(module): path for path, module in self.model.named_modules()}
        return {f"{paths[id(module)]}.{name}".lstrip("."): master
                for places, master in zip(self.names, self.masters) for module, name in places}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor]) -> None:
        named = self.named_masters()
        for key, value in state.items():
            if key in named:
                named[key].copy_(value)
        self.model.load_state_dict({k: v for k, v in state.items() if k not in named}, strict=False)
        self.copy_to_model()

    def restore(self) -> None:
        for places, master in zip(self.names, self.masters):
            master.grad = None  # the kept gradient buffer must not outlive the engine in the published model
            for module, name in places:
                setattr(module, name, master)
        for module, name, param in self.frozen:
            setattr(module, name, param)


@torch.no_grad()
def allocate_optimizer_state(optimizer, keep_gradients: bool) -> None:
    """Make the optimiser's per-parameter state (AdamW's two moments: 8 bytes a parameter) now, by
    torch's own code: one step on zero gradients at lr 0, which moves no weight, then the state's
    step counts back to 0, so the first real step is stepped as the first (the same numbers as a
    fresh optimiser's: tests/test_precision.py). Made lazily at the first step instead, the state took
    the memory the first batch's activations had just freed, and the second batch's activations
    were mapped and zeroed anew: a PPO iteration on the demo model faulted in 1.5 GiB of fresh pages
    in its second iteration. `keep_gradients`: leave the zero gradients as the
    parameters' gradient buffers, else free them. Left as they are: no optimiser, one that has
    state already (resumed from a checkpoint), parameters that hold gradients already."""
    if optimizer is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params or any(optimizer.state.get(p) or p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
    if not keep_gradients:
        for p in params:
            p.grad = None


def steps_from_bf16(device: str, precision: str, grad_accum_steps: int) -> bool:
    """Whether a plain (not DeepSpeed) engine with these settings steps from the bf16 gradients
    themselves (`adamw_from_bf16_gradients`) instead of its usual passes: copy each gradient into
    the master's fp32 buffer, take the clip's norm, scale, step torch's fused AdamW, copy each master
    back to bf16 — five passes over the gradients and weights where two do (the clip's norm over
    bf16 gradients, then one fused update per tensor), and no fp32 gradients kept (4 bytes a parameter). Where:
    a CPU (a GPU has torch's multi-tensor kernels, `MasterWeights.batched`), bf16, and one backward a
    step (accumulated micro-batches add in fp32). `stages.orchestration.plan` counts memory by it."""
    return device == "cpu" and precision == "bf16" and grad_accum_steps == 1


def steps_from_bf16_gradients(master: MasterWeights | None, optimizer, grad_accum_steps: int) -> bool:
    """`steps_from_bf16` for an engine's masters and optimiser: torch's AdamW with one parameter
    group, no amsgrad, no maximize and a float lr."""
    if master is None or not master.masters:
        return False
    if not steps_from_bf16(master.masters[0].device.type, "bf16", grad_accum_steps):
        return False
    if type(optimizer) is not torch.optim.AdamW or len(optimizer.param_groups) != 1:
        return False
    group = optimizer.param_groups[0]
    return not group["amsgrad"] and not group["maximize"] and not torch.is_tensor(group["lr"])


def adamw_update(p, g, m, v, p16, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bias_correction2_sqrt,
                 eps, coef) -> None:
    """torch's AdamW step (decoupled weight decay; the formulas of its fused kernel) of one fp32
    master `p` with moments `m`, `v`, from gradient `g` (bf16) times the clip's coefficient `coef`,
    in place; `p16` (the model's bf16 copy) ← p. decay = 1 − lr·λ, step_size = lr / (1 − β₁ᵗ),
    bias_correction2_sqrt = √(1 − β₂ᵗ): worked out in float64 by the caller, as torch does (made
    from fp32 β's here, m and v came out 3× less exact than torch's). The scalars are 0-dim tensors,
    so one compiled kernel serves every value."""
    g = g.float() * coef
    p.mul_(decay)
    m.lerp_(g, one_minus_beta1)
    v.mul_(beta2).addcmul_(g, g, value=one_minus_beta2)
    p.sub_(step_size * m / (v.sqrt() / bias_correction2_sqrt + eps))
    p16.copy_(p)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as a 2-D tensor of its first dimension's rows (a 1-D tensor: one row), for norms by rows."""
    return t.reshape(t.shape[0] if t.dim() > 1 else 1, -1)


def squares_by_row(g: torch.Tensor) -> torch.Tensor:
    """Σ g² of each row of a 2-D tensor, in fp32."""
    return g.float().pow(2).sum(-1)


def bf16_total_norm(gradients: list) -> float:
    """`total_norm` of bf16 gradients, by rows too, without an fp32 copy of them: each row's sum of
    squares in fp32 in one compiled loop (torch's eager norm of bf16 rows in fp32 took twice as long)."""
    if not gradients:
        return 0.0
    sums = [fused.compiled(squares_by_row, as_rows(g)) for g in gradients]
    return float(torch.cat(sums).sum().sqrt())


@torch.no_grad()
def adamw_from_bf16_gradients(optimizer, pairs: list, coef: float) -> None:
    """One step of `optimizer` (torch's AdamW, its state made: allocate_optimizer_state) over the
    (fp32 master, bf16 copy) pairs from the copies' gradients times `coef`, each tensor in one
    compiled loop (`adamw_update`); the state stays torch's (exp_avg, exp_avg_sq, step), so a
    checkpoint resumes either way."""
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    scalars: dict[float, list[torch.Tensor]] = {}  # by step count: one, unless a tensor missed a step's gradient

    for master, copy in pairs:
        state = optimizer.state[master]
        state["step"] += 1
        t = float(state["step"])
        if t not in scalars:
            lr = group["lr"]
            scalars[t] = [torch.tensor(x, dtype=torch.float32) for x in (
                1 - lr * group["weight_decay"], 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** t),
                math.sqrt(1 - beta2 ** t), group["eps"], coef)]
        # Plain tensors, not Parameters: torch.compile fixes a Parameter's shape (a kernel per shape).
        fused.compiled(adamw_update, master.detach(), copy.grad, state["exp_avg"], state["exp_avg_sq"], copy.detach(),
                       *scalars[t])


def adamw(model, dist: Dist | None = None, **options):
    """AdamW with the fused kernel: torch's default on CPU updates one tensor at a time, several
    times slower on a model's hundreds of tensors. Where the ranks' DeepSpeed config offloads the
    optimiser (`launch.offload_optimizer`): DeepSpeed's CPU Adam in its AdamW mode, the optimiser
    ZeRO-Offload steps on the host (DeepSpeed refuses another there unless told to, and torch's
    steps the host's fp32 partitions several times slower)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if dist is not None and dist.offloads_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # deferred: as in make_engine; builds its op once (g++)

        return DeepSpeedCPUAdam(params, adamw_mode=True, **options)
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **options)


def make_engine(model, optimizer, scheduler, *, micro_batch_size: int, grad_accum_steps: int,
                max_grad_norm: float, precision: str, dist: Dist):
    """The engine that trains `model` (fp32 weights; `optimizer` built over them) in `precision`
    (resolved, `stages.leaves.precision.resolve`): `PlainEngine`, or DeepSpeed's with its bf16 mode (which
    keeps fp32 master weights in its optimiser) when the stage runs on DeepSpeed ranks."""
    if dist.deepspeed_config is None:
        return PlainEngine(model, optimizer, scheduler, grad_accum_steps, max_grad_norm, precision)
    import deepspeed  # deferred: only DeepSpeed's ranks load it (seconds, and its CPU ops build)

    config = dict(dist.deepspeed_config)
    config.update(
        bf16={**config.get("bf16", {}), "enabled": precision == "bf16"},
        fp16={"enabled": False},
        communication_data_type="fp32",  # gradients are reduced in fp32 (bf16 sums lose low bits)
        train_micro_batch_size_per_gpu=micro_batch_size,
        gradient_accumulation_steps=grad_accum_steps,
        train_batch_size=micro_batch_size * grad_accum_steps * dist.world_size,
        gradient_clipping=0.0 if math.isinf(max_grad_norm) else max_grad_norm,  # DeepSpeed: 0 = no clipping
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def trained_model(engine):
    """The model an engine trained, for saving, on the main rank (None on the others): in fp32 with
    its master weights under bf16 (`PlainEngine.restore_fp32`; the engine trains no further);
    DeepSpeed's module as it is (bf16 weights under its bf16 mode). LoRA adapters (`model.lora`) are
    merged into their layers: a plain transformers model. Every rank calls it: under ZeRO-3 each
    rank holds a partition of every weight, and gathering them is a collective."""
    if isinstance(engine, PlainEngine):
        model = engine.restore_fp32()
    elif engine.zero_optimization_partition_weights():
        model = gathered_whole(engine)
    else:
        model = engine.module if torch.distributed.get_rank() == 0 else None
    if model is not None:
        merge_adapters(model)
    return model


ENGINE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def gathered_whole(engine):
    """A ZeRO-3 engine's module with every weight whole, on the main rank's CPU, apart from the
    engine (which goes on partitioned: PPO rolls back and saves again); None on the other ranks.
    The weights come from DeepSpeed's consolidated state dict (one layer gathered at a time, shared
    weights kept shared: what transformers' Trainer saves under ZeRO-3); the module's structure
    from a copy of the partitioned one (LoRA layers and a reward model's head included) without
    DeepSpeed's hooks, which would gather partitions this copy does not have."""
    import copy  # deferred: only a ZeRO-3 save copies a module

    state = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank must call it
    if state is None:  # not the main rank
        return None
    module = engine.module
    stashed = {(m, name): getattr(m, name) for m in module.modules() for name in ENGINE_HOOKS if hasattr(m, name)}
    try:
        for (m, name), hooks in stashed.items():
            setattr(m, name, type(hooks)())
        whole = copy.deepcopy(module)  # its parameters: empty, as the partitioned module shows them
    finally:
        for (m, name), hooks in stashed.items():
            setattr(m, name, hooks)
    for name, param in whole.named_parameters(remove_duplicate=False):  # a tied weight: one tensor, set twice
        param.data = state[name]
    return whole


def total_norm(tensors: list) -> torch.Tensor:
    """‖(t₁, t₂, …)‖₂ over all elements, in fp32: the norm of every row's norm. torch's norm of a
    whole tensor (`get_total_norm`, `clip_grad_norm_`) sums its squares into one fp32 accumulator per
    thread, whose rounding error grows with the tensor (SmolLM2's 28M-element embedding gradient:
    1.6e-3 of the norm; tests/test_precision.py bounds ours); a row's sum is short,
    and the rows' norms are few. On a GPU a norm's sum is a tree of partial sums already, so each
    tensor's norm comes from torch's multi-tensor norm: a few kernel launches, not two per tensor."""
    if tensors and tensors[0].is_cuda:
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, dtype=torch.float32)))
    norms = [torch.linalg.vector_norm(as_rows(t), dim=1, dtype=torch.float32) for t in tensors]
    return torch.linalg.vector_norm(torch.cat(norms)) if norms else torch.zeros(())


def clip_coefficient(max_norm: float, norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s coefficient, before it is clamped to 1 (NaN for a NaN norm)."""
    return max_norm / (norm + 1e-6)


def clip_with_norm(params: list, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ with the norm from `total_norm`, and without its multiply by 1
    when nothing is clipped (that multiply rewrites every gradient of the step for nothing). Returns
    ‖g‖ before clipping."""
    norm = total_norm([p.grad for p in params])
    if not clip_coefficient(max_norm, float(norm)) >= 1.0:  # NaN clips as in torch
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


def clip_grad_norm(engines: list, max_norm: float) -> float:
    """One gradient-norm clip over several engines, between their backward and their step:
    g ← g · min(1, max_norm / ‖g‖), ‖g‖ over all their parameters. Returns ‖g‖ before clipping.
    The engines must not clip on their own (make_engine with max_grad_norm=inf)."""
    if all(isinstance(engine, PlainEngine) for engine in engines):
        from_bf16 = [engine for engine in engines if engine.steps_from_bf16]
        fp32 = [p for engine in engines if not engine.steps_from_bf16
                for p in engine.trainable_parameters() if p.grad is not None]
        if not from_bf16:
            norm = clip_with_norm(fp32, max_norm)
        else:  # those engines scale their bf16 gradients in their update (PlainEngine.step_from_bf16_gradients)
            bf16 = [copy.grad for engine in from_bf16 for copy in engine.master.copies if copy.grad is not None]
            fp32_norm = float(total_norm([p.grad for p in fp32])) if fp32 else 0.0
            norm = math.hypot(bf16_total_norm(bf16), fp32_norm)
            coef = clip_coefficient(max_norm, norm)
            if not coef >= 1.0 and fp32:
                torch.nn.utils.clip_grads_with_norm_(fp32, max_norm, torch.tensor(norm))
            for engine in from_bf16:
                engine.joint_clip_coef = min(1.0, coef)
        for engine in engines:  # a non-finite norm: their next step skips (PlainEngine.step)
            engine.joint_grad_norm = norm
        return norm
    # Under ZeRO a rank holds a shard of each gradient; DeepSpeed's accessors for gradients between
    # backward and step assemble a parameter's whole gradient with an all-reduce. Cost per engine
    # and step: one all-reduce of all its gradients for the norm, one more when clipping under ZeRO-1/2.
    from deepspeed.utils import (safe_get_full_grad, safe_get_local_grad, safe_set_local_grad,  # deferred: as in make_engine
                                 safe_update_full_grad_vectorized)

    groups = [[p for p in engine.module.parameters() if p.requires_grad] for engine in engines]
    norm = total_norm([safe_get_full_grad(p) for params in groups for p in params])
    coef = clip_coefficient(max_norm, float(norm))
    if not coef >= 1.0:  # a NaN norm clips too, as in torch; DeepSpeed's ZeRO and bf16 optimisers then skip the step
        for params in groups:
            if params and hasattr(params[0], "ds_id"):
                # ZeRO-3: scaling is elementwise, so each rank scales its own partition, with no
                # gather (DeepSpeed's whole-gradient update narrows past the end of a weight
                # smaller than the ranks, such as a scalar head's bias).
                for p in params:
                    safe_set_local_grad(p, safe_get_local_grad(p) * coef)
            else:  # one call per engine: DeepSpeed routes it through the first parameter's optimizer
                safe_update_full_grad_vectorized(params, lambda grad, _: grad * coef)
    return float(norm)


@torch.no_grad()
def generation_probe(model, tokenizer, rows: list[dict], max_new_tokens: int, max_prompt_len: int) -> list[dict]:
    """Greedy responses to held-out prompts: per response its length in tokens and whether it
    ended with EOS (what the SFT contract judges). One left-padded batch."""
    if not rows:
        return []
    was_training, use_cache = model.training, model.config.use_cache
    model.eval()
    model.config.use_cache = True
    sides = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"
    try:
        prompts = [render_prompt(tokenizer, r["messages"]) for r in rows]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt_len,
                          add_special_tokens=False).to(model.device)
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = sides
        model.config.use_cache = use_cache
        model.train(was_training)
    probe = []
    for row, ids in zip(rows, out[:, batch["input_ids"].shape[1]:].tolist()):
        eos = ids.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in ids else None
        tokens = ids[: eos + 1] if eos is not None else [t for t in ids if t != tokenizer.pad_token_id]
        probe.append({"row": row["row"], "response": tokenizer.decode(tokens, skip_special_tokens=True),
                      "response_tokens": len(tokens), "ended_with_eos": eos is not None})
    return probe
