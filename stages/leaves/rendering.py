"""Text to tokens, one way for every stage and server: the HH "Human:/Assistant:" form of a
conversation and its chat template, a prompt rendered for a tokenizer (its chat template where it
has one), a response as the SFT and reward stages render it, an example encoded to (input_ids,
labels) with the cuts training makes, and a micro-batch padded for a forward.

A leaf module: the data stage writes a pair's `prompt` with `dialogue_text`, and the training
stages, the engine's generation probes, the reward server, the judges and the MLflow models render
and encode with the rest, so none of them needs the data stage to turn text into tokens."""

from __future__ import annotations

HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


def dialogue_text(messages: list[dict]) -> str:
    """Chat turns in the HH form, ending with an open Assistant turn."""
    return "".join(f"{HUMAN if m['role'] == 'user' else ASSISTANT} {m['content']}" for m in messages) + ASSISTANT


# `dialogue_text` as a chat template, for a chat request MLflow serves to a model whose tokenizer has
# none (stages/compute/mlflow_models.py): the prompt it renders is the one training rendered (a test checks).
HH_CHAT_TEMPLATE = ("{% for m in messages %}{{ '\\n\\nHuman:' if m['role'] == 'user' else '\\n\\nAssistant:' }} "
                    "{{ m['content'] }}{% endfor %}{{ '\\n\\nAssistant:' }}")


def render_prompt(tokenizer, messages: list[dict]) -> str:
    """The model's chat template where it has one, else the HH "Human:/Assistant:" form."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dialogue_text(messages)


def render_response(tokenizer, response: str) -> str:
    return response if getattr(tokenizer, "chat_template", None) else " " + response


def encode_example(tokenizer, messages: list[dict], response: str, max_seq_len: int, max_response_len: int,
                   ended: bool = True):
    """(input_ids, labels): labels are -100 on prompt tokens, so the loss sees the response and
    its EOS only. Long prompts lose their oldest tokens. A response whose tokens and EOS exceed
    `max_response_len` is cut to that many tokens and gets no EOS: SFT must not learn to stop
    mid-sentence, and a reward model, which reads its score at the last token, must not see a cut
    answer as finished. `ended=False`: the response never ended (a generation stopped at its
    token limit), so it gets no EOS either."""
    prompt_ids = tokenizer(render_prompt(tokenizer, messages), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(render_response(tokenizer, response), add_special_tokens=False)["input_ids"]
    if ended:
        response_ids.append(tokenizer.eos_token_id)
    response_ids = response_ids[:max_response_len]
    prompt_ids = prompt_ids[max(len(prompt_ids) - (max_seq_len - len(response_ids)), 0) :]
    return prompt_ids + response_ids, [-100] * len(prompt_ids) + response_ids


def count_cut(sequences: list[list[int]], tokenizer) -> int:
    """How many of these examples (`encode_example`'s input_ids of whole answers) had their
    response cut to fit: only those end without EOS."""
    return sum(ids[-1] != tokenizer.eos_token_id for ids in sequences)


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """Right-pad a micro-batch: {input_ids, labels, attention_mask} tensors; padded positions get
    label -100 and attention 0."""
    import torch  # deferred: the data stage renders dialogues without loading torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, labs) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(labs)] = torch.tensor(labs)
        attention[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
