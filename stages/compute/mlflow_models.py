"""The MLflow model a registered model is logged as, so that MLflow itself loads and serves it
(`mlflow.transformers.load_model`, `mlflow.pyfunc.load_model`, `mlflow models serve`):

- `chat(cfg)`: the SFT and policy models, MLflow's transformers flavor with task `llm/v1/chat` (a
  text-generation pipeline). Its pyfunc (`mlflow.pyfunc.load_model`, `mlflow models serve`: OpenAI-style
  chat requests) is `stages.mlflow_chat`'s, sampling as the eval stage samples the answers it judges,
  the repetition penalty on the generated tokens only; `mlflow.transformers.load_model` gives
  transformers' plain pipeline, whose repetition penalty also lowers the prompt's tokens;
- `stages.reward.pyfunc.scorer(cfg)`: the reward model and critic, a pyfunc scoring (prompt, response).

Either way the stage's own Hugging Face folder (safetensors, tokenizer, chat template; a reward
model's score head) is the one copy of the weights inside the MLflow model, and `hf_folder` finds it
there: what every stage reads back (`tracking.download`).

A pack function `pack(folder, path, mlflow_model)` writes the MLflow model at `path` around the
saved `folder`; `run_writers.StageRun.publish_model` logs it as the run's LoggedModel and registers it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from stages.compute import loading
from stages.leaves.config import GenerationConfig, PipelineConfig
from stages.leaves.rendering import HH_CHAT_TEMPLATE

Pack = Callable[[Path, Path, object], None]  # (saved HF folder, MLflow model folder to write, mlflow.models.Model)

MLMODEL_FILE = "MLmodel"
CHAT_TASK = "llm/v1/chat"
CHAT_PYFUNC_LOADER = "stages.mlflow_chat"


def requirements(*packages: str) -> list[str]:
    """Pins of the installed `packages` for the model's requirements.txt. MLflow's default for the
    transformers flavor asks for torchvision, which a text model does not use (nor is it installed);
    a local version label (torch's `+cpu`) is dropped, as pip cannot install it from PyPI."""
    return [f"{package}=={version(package).split('+')[0]}" for package in packages]


def generation_defaults(sampling: GenerationConfig, tokenizer):
    """transformers' GenerationConfig for `sampling` (the eval stage's: what the judged answers were
    sampled with). A model saved without one gets, in a transformers text-generation pipeline, that
    pipeline's own defaults (sampling at temperature 0.7, 256 new tokens) instead of ours. Its
    repetition_penalty lowers the prompt's tokens too, except in the pyfunc (`stages.mlflow_chat`)."""
    import transformers  # deferred: transformers only where a model is packed

    # Greedy: transformers refuses to save a config with sampling flags that would not be used.
    sampled = ({"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
               if sampling.do_sample else {})
    return transformers.GenerationConfig(
        do_sample=sampling.do_sample, **sampled, repetition_penalty=sampling.repetition_penalty,
        max_new_tokens=sampling.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)


def chat(cfg: PipelineConfig) -> Pack:
    """A chat model (SFT, policy): transformers flavor, task llm/v1/chat, with `stages.mlflow_chat` as
    its pyfunc loader, generating as the eval stage sampled its judged answers (`eval.generation`)."""
    model_cfg, sampling = cfg.model, cfg.eval.generation

    def pack(folder: Path, path: Path, mlflow_model) -> None:
        import mlflow.transformers  # deferred, as transformers below: only where a chat model is packed
        from transformers import AutoTokenizer

        # MLflow 3.17's checkpoint-path route (`transformers_model=<folder>`) fails under transformers 5
        # (flavor_config.py reads `check_task(...)["impl"].__name__`, now a string): the pipeline's
        # components go in loaded, from the saved safetensors.
        model = loading.load_model(str(folder), model_cfg)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if not tokenizer.chat_template:  # a chat request renders as training rendered the prompts
            tokenizer.chat_template = HH_CHAT_TEMPLATE
        mlflow.transformers.save_model({"model": model, "tokenizer": tokenizer}, path=str(path), task=CHAT_TASK,
                                       mlflow_model=mlflow_model, pip_requirements=requirements(
                                           "torch", "transformers", "tokenizers", "safetensors", "accelerate"))
        # Its `model/` holds the weights it wrote from the loaded copy; the stage's folder goes in their
        # place, so the files the stages read back (and the contract probed) are the ones it saved.
        binary = path / mlflow_model.flavors["transformers"]["model_binary"]
        shutil.rmtree(binary)
        shutil.copytree(folder, binary)
        generation_defaults(sampling, tokenizer).save_pretrained(binary)  # our stages read none of it
        mlflow_model.flavors["python_function"]["loader_module"] = CHAT_PYFUNC_LOADER
        mlflow_model.save(str(path / MLMODEL_FILE))

    return pack


def hf_folder(root: Path) -> Path:
    """The Hugging Face folder inside a downloaded MLflow model of ours (its MLmodel says where); a
    version registered before models were MLflow models is that folder itself."""
    if not (root / MLMODEL_FILE).exists():
        return root
    from mlflow.models import Model  # deferred: MLflow only where a model is logged

    flavors = Model.load(str(root / MLMODEL_FILE)).flavors
    if "transformers" in flavors:
        return root / flavors["transformers"]["model_binary"]
    artifacts = flavors.get("python_function", {}).get("artifacts", {})
    if "model" in artifacts:
        return root / artifacts["model"]["path"]
    raise ValueError(f"{root}: an MLflow model without a Hugging Face folder (flavors: {', '.join(flavors)})")
