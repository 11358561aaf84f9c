"""The randomized race checker (marker `race`), once per starting strategy.

The default run is PGRESERVE_RACE_SECONDS=15 s of load per strategy; `make race
SECONDS=N` runs it longer. PGRESERVE_RACE_SEED picks the random choices (printed).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from race_checker import RaceRun, RaceServer

pytestmark = pytest.mark.race


def load_seconds() -> float:
    return float(os.environ.get("PGRESERVE_RACE_SECONDS", "15"))


def race_seed() -> int:
    raw = os.environ.get("PGRESERVE_RACE_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(1, 10**6)


@pytest.fixture(scope="module")
def race_server() -> Iterator[RaceServer]:
    """A server of its own (synchronous_commit on) that the run may crash."""
    rs = RaceServer()
    try:
        rs.start()
        rs.install()
        yield rs
    finally:
        rs.close()


@pytest.mark.timeout(0)
@pytest.mark.parametrize("strategy", ["row", "pool"])
async def test_every_answer_is_exact_and_durable_under_races(
        race_server: RaceServer, strategy: str) -> None:
    """Under racing buyers, paused takes, recounts, forced corrections, strategy switches, sweeps and a crash: books balance, no stored rejection or hold is false, and every acknowledged answer survives."""
    seed = race_seed()
    print(f"\nPGRESERVE_RACE_SEED={seed} PGRESERVE_RACE_SECONDS={load_seconds():g}")
    dsn = race_server.new_database(f"race_{strategy}_{seed}")
    report = await RaceRun(race_server, dsn, strategy, load_seconds(), seed).run()
    text = "\n".join(report.lines())
    print(text)
    if os.environ.get("PGRESERVE_RACE_REPORT"):
        with open(os.environ["PGRESERVE_RACE_REPORT"], "a") as fh:  # noqa: ASYNC230 - after the load
            fh.write(text + "\n")
    assert report.attempts, text
    assert report.rejections_judged > 0 and report.holds_judged > 0, text
    assert dict(report.violations) == {}, text
