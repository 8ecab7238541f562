"""The pyfunc side of a chat model (SFT, policy): what `mlflow.pyfunc.load_model` and `mlflow models
serve` run. It is MLflow's own transformers pyfunc (llm/v1/chat requests and answers) over a
text-generation pipeline whose repetition penalty lowers the tokens generated so far only, as the
eval stage samples the answers it judges and PPO its rollouts (`stages.compute.ppo.generation`; paper §6.1
and MOSS-RLHF penalise generated tokens only). transformers' own penalty, the generation config's
`repetition_penalty`, also lowers every token of the prompt.

Our code rather than MLflow's alone: the transformers flavor stores generation settings, and no
setting restricts the penalty to the response; transformers' processor does take a prompt length
(`prompt_ignore_length`), which only a call that knows the prompt can give, i.e. the pipeline's
forward. `mlflow.transformers.load_model` gives transformers' plain pipeline, whose penalty counts
the prompt. Loading imports this project's `stages` package, which must be importable (installed,
or on PYTHONPATH), as for the reward model's pyfunc.
"""

from __future__ import annotations

from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TextGenerationPipeline


class ResponsePenaltyPipeline(TextGenerationPipeline):
    """transformers' text-generation pipeline with the repetition penalty on the response's tokens.
    Its processor replaces the one `generate` makes from the generation config, in the same place of
    the processor list (before temperature, top-k and top-p, as `stages.compute.ppo.sampling.next_tokens`)."""

    def _forward(self, model_inputs, **generate_kwargs):
        config = generate_kwargs.get("generation_config") or self.model.generation_config
        penalty = generate_kwargs.get("repetition_penalty", config.repetition_penalty)
        if penalty is not None and penalty != 1.0:
            prompt_width = model_inputs["input_ids"].shape[1]
            processors = LogitsProcessorList(generate_kwargs.get("logits_processor") or [])
            processors.append(RepetitionPenaltyLogitsProcessor(float(penalty), prompt_ignore_length=prompt_width))
            generate_kwargs = {**generate_kwargs, "logits_processor": processors}
        return super()._forward(model_inputs, **generate_kwargs)


def _load_pyfunc(path, model_config=None):
    """MLflow's pyfunc loader protocol (the MLmodel's `python_function.loader_module` is this module)."""
    import mlflow.transformers  # deferred: MLflow's transformers flavor imports transformers

    wrapper = mlflow.transformers._load_pyfunc(path, model_config)
    plain = wrapper.pipeline
    wrapper.pipeline = ResponsePenaltyPipeline(model=plain.model, tokenizer=plain.tokenizer, device=plain.device)
    return wrapper
