"""Great Expectations suites, one per handoff between stages, and the gate that runs them.

Depends on `stages/` (the probe data frames stages produce); nothing in `stages/` imports this,
and nothing here imports Prefect.
"""

from data_contracts.gate import ContractError, GateReport, check_handoff, gate, validate
from data_contracts.suites import SUITES

__all__ = ["SUITES", "ContractError", "GateReport", "check_handoff", "gate", "validate"]
