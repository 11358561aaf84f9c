"""Crash, connection-kill and hang injection under load, for both strategies at once.

The default run is short (PGRESERVE_FAULT_SECONDS, 15 s of load); `make soak
SECONDS=N` sets PGRESERVE_SOAK_SECONDS and prints the report.
PGRESERVE_SOAK_DEFECT plants a defect (see harness.DEFECTS) the audit must catch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from harness import ALL_KINDS_AFTER_S, DEFECTS, FaultRun, FaultServer, planted_defects

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
    """Under every kind of fault, with the whole service in the load, every acknowledged answer holds in the database, nothing is held, restored or sold twice, and the books match the movement ledger."""
    seconds = load_seconds()
    seed = int(os.environ.get("PGRESERVE_FAULT_SEED", "5"))
    run = FaultRun(fault_server, seconds, seed, planted_defects())
    report = await run.run()
    text = "\n".join(report.lines())
    print("\n" + text)
    if os.environ.get("PGRESERVE_SOAK_REPORT"):
        with open(os.environ["PGRESERVE_SOAK_REPORT"], "w") as fh:  # noqa: ASYNC230 - after the load
            fh.write(text + "\n")
    assert sum(report.faults.values()) > 0, text
    assert report.operations > 0, text
    if seconds >= ALL_KINDS_AFTER_S:
        assert report.silent_kinds == [], text
    assert report.violations == [], text


@pytest.mark.timeout(0)
@pytest.mark.parametrize(("defect", "evidence"), [
    ("drop-ack", "that no client asked for"),
    ("phantom-unit", "books: "),
])
async def test_planted_defect_is_caught(fault_server: FaultServer, defect: str,
                                        evidence: str) -> None:
    """A soak with a planted defect (a forgotten acknowledgement, a unit without a movement) fails its audit, with the evidence named."""
    assert defect in DEFECTS
    run = FaultRun(fault_server, 3.0, 7, (defect,))
    report = await run.run()
    text = "\n".join(report.lines())
    assert any(evidence in v for v in report.violations), text
