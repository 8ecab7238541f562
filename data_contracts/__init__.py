"""Great Expectations suites, one per handoff between stages, and the gate that runs them.

Depends on `stages/` (the probe data frames stages produce); nothing in `stages/` imports this.
"""
