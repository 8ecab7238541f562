"""Running and recording stages: the stage table (registry), the launcher that starts the ranks,
the memory plan, MLflow tracking, `rlhf runs` and the study records."""
