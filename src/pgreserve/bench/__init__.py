"""The flash-sale benchmark: many concurrent buyers against one or more buckets.

scenario: what to run (validated, frozen) and the deterministic request plan;
runner:   seeds a fresh tenant, drives the buyers through the library API and
          checks the invariants afterwards;
results:  what one run measured, and the figures derived from it;
report:   the result table, the JSON document and the PNG plot;
cli:      the `bench flash-sale` command.
"""

from .results import RunResult
from .runner import run_scenario, run_strategy
from .scenario import PlannedRequest, Scenario, plan

__all__ = ["PlannedRequest", "RunResult", "Scenario", "plan", "run_scenario", "run_strategy"]
