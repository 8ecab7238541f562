"""The reward model and the critic as MLflow pyfunc models:

    mlflow.pyfunc.load_model("models:/<prefix>-reward/<version>").predict(
        pd.DataFrame({"prompt": [...], "response": [...]}))      # → a frame with a `score` column

scores each (prompt, response) exactly as `rlhf serve-reward` does (`RewardScorer`: the prompt as
given, already rendered; the response rendered as training rendered it; EOS appended unless the
optional `ended` column says the response was cut off). Loading it imports this project's `stages`
package, which must be importable (installed, or on PYTHONPATH).
"""

from __future__ import annotations

from pathlib import Path

import mlflow.pyfunc
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, Schema

from stages.compute.mlflow_models import Pack, requirements
from stages.leaves.config import ModelConfig, PipelineConfig


class ScorerModel(mlflow.pyfunc.PythonModel):
    """predict: a frame with `prompt`, `response` (and optionally `ended`, default true) → `score`."""

    def load_context(self, context) -> None:
        from stages.compute.reward.serve import RewardScorer  # deferred: torch loads in the serving process only

        settings = context.model_config
        self.scorer = RewardScorer(Path(context.artifacts["model"]), ModelConfig(**settings["model"]),
                                   int(settings["max_seq_len"]))

    def predict(self, context, model_input, params=None):
        prompts, responses = model_input["prompt"].tolist(), model_input["response"].tolist()
        ended = (model_input["ended"].fillna(True).astype(bool).tolist() if "ended" in model_input
                 else [True] * len(prompts))
        return pd.DataFrame({"score": self.scorer.scores(prompts, responses, ended)})


def scorer(cfg: PipelineConfig) -> Pack:
    """Pack a saved reward model or critic (stages.compute.reward.model's folder) as a `ScorerModel`; the
    model settings it loads with (pad token, precision, fast path) and `reward.max_seq_len`, which
    `rlhf serve-reward` reads from the preset, come from the run's config (its `model_config`)."""

    def pack(folder: Path, path: Path, mlflow_model) -> None:
        signature = ModelSignature(
            inputs=Schema([ColSpec("string", "prompt"), ColSpec("string", "response"),
                           ColSpec("boolean", "ended", required=False)]),
            outputs=Schema([ColSpec("double", "score")]))
        mlflow.pyfunc.save_model(
            str(path), python_model=ScorerModel(), artifacts={"model": str(folder)}, mlflow_model=mlflow_model,
            signature=signature,
            model_config={"model": cfg.model.model_dump(mode="json"), "max_seq_len": cfg.reward.max_seq_len},
            pip_requirements=requirements("torch", "transformers", "tokenizers", "safetensors", "pandas"))

    return pack


def scorer_pack(cfg: PipelineConfig, dist):
    """The pack a reward model or critic is published with (`scorer`), made on the main rank, the
    one that publishes; None on the others."""
    return scorer(cfg) if dist.is_main else None
