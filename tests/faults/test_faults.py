"""Crash, connection-kill and hang injection under load, for both strategies at once.

The default run is short (PGRESERVE_FAULT_SECONDS, 15 s of load); `make soak
SECONDS=N` sets PGRESERVE_SOAK_SECONDS and prints the report.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from harness import FaultRun, FaultServer

pytestmark = pytest.mark.faults


def load_seconds() -> float:
    soak = os.environ.get("PGRESERVE_SOAK_SECONDS")
    if soak:
        return float(soak)
    return float(os.environ.get("PGRESERVE_FAULT_SECONDS", "15"))


@pytest.fixture
def fault_server() -> Iterator[FaultServer]:
    """A dedicated embedded server in its own temporary data directory."""
    fs = FaultServer()
    try:
        fs.start()
        fs.install()
        yield fs
    finally:
        fs.close()


@pytest.mark.timeout(0)
async def test_no_oversell_no_lost_hold_under_faults(fault_server: FaultServer) -> None:
    """Under backend kills, server crashes and timeouts, every acknowledged hold exists, nothing is held, restored or sold twice, and stock is conserved."""
    seconds = load_seconds()
    seed = int(os.environ.get("PGRESERVE_FAULT_SEED", "5"))
    run = FaultRun(fault_server, seconds, seed)
    report = await run.run()
    text = "\n".join(report.lines())
    print("\n" + text)
    if os.environ.get("PGRESERVE_SOAK_REPORT"):
        with open(os.environ["PGRESERVE_SOAK_REPORT"], "w") as fh:  # noqa: ASYNC230 - after the load
            fh.write(text + "\n")
    assert sum(report.faults.values()) > 0, text
    assert report.operations > 0, text
    assert report.violations == [], text
