"""Holds stages/reward/pyfunc.py alone: registered reward models pickle its ScorerModel by this
module path, so it keeps it. The reward model itself is stages/compute/reward/."""
