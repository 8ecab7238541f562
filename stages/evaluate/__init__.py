"""Evaluation (paper §6): C-Eval (ceval.py), pairwise judging (judge.py), the report (report.py)
and the stage that runs them (stage.py)."""
