"""Evaluation (paper §6): C-Eval (ceval.py), the lm-evaluation-harness tasks (harness.py), pairwise
judging (judge.py), the reward model's held-out quality (quality.py) and the report (report.py).
The stage that runs them is stages/pipeline/evaluate.py."""
