"""The flash-sale benchmark: many concurrent buyers against one or more buckets.

scenario: what to run (validated, frozen) and the deterministic request plan;
buyers:   the buyers' calls (reserve, then claim or release) and the run loop;
processes: the same buyers spread over several processes;
runner:   seeds a fresh tenant, drives the buyers through the library API and
          checks the invariants afterwards;
results:  what one run measured, and the figures derived from it;
report:   the result table, the JSON document and the PNG plot;
cli:      the `bench flash-sale` and `bench server` commands.

The runner and the results need the `bench` extra (hdrhistogram); they are
imported on first use, so `import pgreserve.bench.cli` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .scenario import PlannedRequest, Scenario, plan

if TYPE_CHECKING:
    from .results import RunResult
    from .runner import run_scenario, run_strategy

__all__ = ["PlannedRequest", "RunResult", "Scenario", "plan", "run_scenario", "run_strategy"]


def __getattr__(name: str) -> Any:
    if name == "RunResult":
        from . import results

        return results.RunResult
    if name in ("run_scenario", "run_strategy"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
