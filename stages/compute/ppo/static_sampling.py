"""The sampling loop with a static decode step, replayed as a CUDA graph (`model.cuda_graphs`).

On a GPU a decode step of a ~1B model at batch 16 is ~1,200 small kernels, and launching them
from Python takes longer than the GPU needs to read the weights once: the loop is bound by the
host, far below the memory-bandwidth bound. As in gpt-fast, the fix is to launch the whole step as
one CUDA graph: the model's forward (`StaticDecoder`: KV cache, positions and cache slot updated in
place, attention over every slot with the unwritten ones masked), the sampling (repetition
penalty, temperature, top-k, top-p: `sampling.next_tokens`) and the log-prob bookkeeping all
write into buffers that live as long as the graph, and nothing in the step reads a value back to
the host. Whether every row has ended is read every `CHECK_EVERY` tokens only; the steps after the
last row ended draw pads, and the response is cut to the columns where some row was alive, the
width the eager loop stops at.

We write this ourselves rather than `torch.compile(mode="reduce-overhead")`: compiling the decode
step costs minutes at 1B, recompiles for every new cache length, and its graph trees own the
buffers we hand back to PPO; a captured step of our own is a few hundred lines the tests can hold
to the eager loop's numbers.

Captured once per (batch, prompt width, new tokens, sampling settings): `prepare` pads the prompts
to a width bucket (`stages.compute.models.shapes.bucket`), so PPO's rollouts of one batch size share a
few graphs. The samplers live on the actor (`SAMPLERS_ATTRIBUTE`); a training step changes the
weights in place, and `StaticDecoder.refresh` copies them into the stacked weights before each
rollout; a weight moved to new storage makes a new capture. On a CPU (tests) the same step runs
uncaptured.
"""

from __future__ import annotations

import torch

from stages.compute.models.shapes import bucket
from stages.compute.ppo.sampling import Rollout, left_pad, next_tokens
from stages.leaves.logprobs import token_logprobs

CHECK_EVERY = 8  # replays between reads of "every row has ended": one host synchronisation per this many tokens
SAMPLERS_ATTRIBUTE = "rlhf_static_samplers"
KEPT_SAMPLERS = 4  # the most recent shapes kept captured; each holds its own KV cache
WIDTH_QUANTUM = 16  # prompt widths above it round up to its multiples: few shapes, little padding read
BATCH_QUANTUM = 64


class StaticSampler:
    """The sampling loop on a `StaticDecoder` of one shape, its step captured as a CUDA graph
    (`graph=True`, a CUDA device) or run eagerly on the same buffers."""

    def __init__(self, decoder_class, model, batch: int, width: int, max_new_tokens: int, vocab: int, *,
                 eos_id: int, pad_id: int, temperature: float, top_p: float, top_k: int,
                 repetition_penalty: float, do_sample: bool, graph: bool):
        self.steps = max(max_new_tokens, 1)
        self.decoder = decoder_class(model, batch, width, self.steps)
        self.weight_addresses = addresses(model)
        self.eos_id, self.pad_id, self.temperature = eos_id, pad_id, temperature
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                             do_sample=do_sample)
        device = self.decoder.bias.device
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.ended = torch.zeros(batch, dtype=torch.bool, device=device)
        self.generated = (torch.zeros(batch, vocab, dtype=torch.bool, device=device)
                          if repetition_penalty != 1.0 else None)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, self.steps, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, self.steps, dtype=torch.float32, device=device)
        self.model_logprobs = torch.zeros_like(self.logprobs) if temperature != 1.0 else self.logprobs
        self.alive = torch.zeros(batch, self.steps, dtype=torch.bool, device=device)
        self.graph = None
        self.capture = graph

    def _record(self, logits: torch.Tensor) -> None:
        """Sample one token per row from [B, vocab] logits and write it, its log-probs and whether the
        row was alive into column `column`: the eager loop's body, on the static buffers."""
        logits = logits.float()
        token = next_tokens(logits, self.generated, **self.sampling)
        token = torch.where(self.ended, torch.full_like(token, self.pad_id), token)
        alive = ~self.ended
        self.alive.index_copy_(1, self.column, alive[:, None])
        self.tokens.index_copy_(1, self.column, token[:, None])
        self.logprobs.index_copy_(1, self.column, token_logprobs(logits, token, self.temperature)[:, None])
        if self.model_logprobs is not self.logprobs:
            self.model_logprobs.index_copy_(1, self.column, token_logprobs(logits, token, 1.0)[:, None])
        self.ended.logical_or_(token == self.eos_id)
        if self.generated is not None:  # a row's token counts as generated only while the row is alive
            seen = self.generated.gather(1, token[:, None])
            self.generated.scatter_(1, token[:, None], seen | alive[:, None])
        self.token.copy_(token)
        self.column.add_(1)

    def _step(self) -> None:
        self._record(self.decoder.step(self.token))

    def _state(self) -> list[torch.Tensor]:
        """The buffers a step changes that a warm-up step must leave as they were: the outputs too,
        whose columns past the last real step would count as alive (the KV cache's slots are
        written again by the real steps before the bias lets anything read them)."""
        state = [self.token, self.ended, self.column, self.decoder.positions, self.decoder.slot, self.decoder.bias,
                 self.tokens, self.logprobs, self.model_logprobs, self.alive]
        return state + ([self.generated] if self.generated is not None else [])

    def _capture(self) -> None:
        """Warm up on a side stream (the allocator and cuBLAS set up outside the capture), restore the
        state and the RNG the warm-up consumed, then capture one step."""
        saved = [t.clone() for t in self._state()]
        rng = torch.cuda.get_rng_state()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        for buffer, value in zip(self._state(), saved):
            buffer.copy_(value)
        torch.cuda.set_rng_state(rng)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def run(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sample responses to left-padded prompts of this sampler's shape: [B, columns] tokens,
        log-probs (at T and at T = 1), alive mask, and [B] ended, `columns` where the eager loop stops."""
        for buffer in (self.ended, self.column, self.alive, self.logprobs, self.model_logprobs):
            buffer.zero_()
        self.tokens.fill_(self.pad_id)
        if self.generated is not None:
            self.generated.zero_()
        self._record(self.decoder.start(prompt_ids, prompt_mask))
        if self.capture and self.graph is None and self.steps > 1:
            self._capture()
        for done in range(1, self.steps):
            if (done - 1) % CHECK_EVERY == 0 and bool(self.ended.all()):
                break
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
        columns = int(self.alive.any(dim=0).sum())  # alive only shrinks: the steps up to the last row's end
        return {"tokens": self.tokens[:, :columns], "logprobs": self.logprobs[:, :columns],
                "model_logprobs": self.model_logprobs[:, :columns], "alive": self.alive[:, :columns],
                "ended": self.ended}


def addresses(model) -> tuple[int, ...]:
    """Where the model's weights live: a captured graph reads them there."""
    return tuple(p.data_ptr() for p in model.parameters())


def sample(decoder_class, actor, prompts: list[list[int]], *, eos_id: int, pad_id: int, max_new_tokens: int,
           temperature: float, top_p: float, top_k: int, repetition_penalty: float, do_sample: bool, device: str,
           graph: bool) -> Rollout:
    """`generation.generate`'s rollout from a `StaticSampler`: the prompts left-padded to a width
    bucket, the batch padded to a batch bucket with copies of the first prompt (on a graph; dropped
    afterwards). Call under inference mode."""
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    if graph:
        width, batch = bucket(width, quantum=WIDTH_QUANTUM), bucket(batch, quantum=BATCH_QUANTUM)
    padded = list(prompts) + [prompts[0]] * (batch - len(prompts))
    prompt_ids, prompt_mask = left_pad(padded, pad_id, device, width=width)
    vocab = actor.get_output_embeddings().weight.shape[0]
    key = (batch, width, max_new_tokens, eos_id, pad_id, temperature, top_p, top_k, repetition_penalty, do_sample,
           graph)
    samplers = actor.__dict__.setdefault(SAMPLERS_ATTRIBUTE, {}) if graph else {}
    sampler = samplers.pop(key, None)
    if sampler is not None and sampler.weight_addresses != addresses(actor):
        sampler = None  # a weight moved: the graph would read its old storage
    if sampler is None:
        sampler = StaticSampler(decoder_class, actor, batch, width, max_new_tokens, vocab, eos_id=eos_id,
                                pad_id=pad_id, temperature=temperature, top_p=top_p, top_k=top_k,
                                repetition_penalty=repetition_penalty, do_sample=do_sample, graph=graph)
    else:
        sampler.decoder.refresh()
    samplers[key] = sampler  # the most recent last
    for stale in list(samplers)[:-KEPT_SAMPLERS]:
        del samplers[stale]
    out = sampler.run(prompt_ids, prompt_mask)
    rows = len(prompts)
    alive, response = out["alive"][:rows], out["tokens"][:rows]
    columns = int(alive.any(dim=0).sum())  # the padded rows may have run longer than the real ones
    alive, response = alive[:, :columns], response[:, :columns]
    logprobs = out["logprobs"][:rows, :columns] * alive
    model_logprobs = out["model_logprobs"][:rows, :columns] * alive
    prompt_ids, prompt_mask = prompt_ids[:rows], prompt_mask[:rows]
    return Rollout(sequences=torch.cat([prompt_ids, response], dim=1),
                   attention_mask=torch.cat([prompt_mask, alive.long()], dim=1), prompt_width=width,
                   response_mask=alive.float(), ended_with_eos=out["ended"][:rows].clone(), logprobs=logprobs,
                   model_logprobs=model_logprobs if temperature != 1.0 else logprobs)
