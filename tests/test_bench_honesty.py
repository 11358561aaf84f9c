"""The bench reports no figure from a run that failed, records what the service ran
with, and refuses bad options by their own names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pgreserve.bench.cli import bench
from pgreserve.bench.results import ERROR, HELD, REJECTED, Ledger, RunResult, Sample, ratios
from pgreserve.bench.scenario import Scenario
from pgreserve.bench.wrk import Endpoint, HttpBench, Segment


def _seg(round_: int, *, requests: int, created: int, rejected: int = 0,
         other: int = 0) -> Segment:
    return Segment(round=round_, requests=requests, duration_s=1.0, created=created,
                   replayed=0, rejected=rejected, other_status=other, socket_errors=0,
                   latency_ms={"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0},
                   wrk_cpu_s=0.1, server_cpu_s=0.5, postgres_cpu_s=0.2)


def test_http_ratio_is_not_a_number_when_the_service_side_failed() -> None:
    """The service answered 99% 429/503 (its round is in failing_rounds: its figures do
    not measure holds): no ratio, for the run or the round."""
    bare = Endpoint("bare", "http://b", [_seg(1, requests=10_000, created=10_000)])
    service = Endpoint("service", "http://s", [_seg(1, requests=10_000, created=100,
                                                    other=9_900)])
    result = HttpBench(bare, service, "row")
    assert result.failing_rounds()  # the bench knows this side failed
    assert result.ratio is None, f"ratio reported anyway: {result.ratio}"
    assert result.round_ratios() == [None]
    assert result.to_dict()["service_holds_over_bare_requests_per_s"] is None


def test_http_ratio_is_not_a_number_when_the_bare_side_failed() -> None:
    """The bare endpoint failing half its requests would inflate the ratio twice over."""
    bare = Endpoint("bare", "http://b", [_seg(1, requests=10_000, created=5_000, other=5_000)])
    service = Endpoint("service", "http://s", [_seg(1, requests=4_000, created=4_000)])
    result = HttpBench(bare, service, "row")
    assert [r["server"] for r in result.failing_rounds()] == ["bare"]
    assert result.ratio is None, f"ratio reported anyway: {result.ratio}"


def _run(batching: bool, holds: int, errors: int, rejected: int, window: float,
         violations: list[str] | None = None) -> RunResult:
    scenario = Scenario(units=holds, requests=holds + errors + rejected,
                        strategies=("row",), batching=(True, False))
    samples = [Sample(i, 0.0, window * (i + 1) / holds, HELD, 1) for i in range(holds)]
    samples += [Sample(holds + i, 0.0, window, ERROR, 0) for i in range(errors)]
    samples += [Sample(holds + errors + i, window, window + 0.1, REJECTED, 0)
                for i in range(rejected)]
    run = RunResult("row", scenario, samples, window + 0.1, batching=batching)
    run.ledger = Ledger(on_hand=holds, free=0, pool=0, held=holds, restored=0,
                        reservations=holds, shortfall=0)
    run.violations = violations or []
    return run


def test_flash_sale_ratio_is_not_a_number_when_a_run_failed_its_invariants() -> None:
    on = _run(True, 100, 0, 200, 1.0)
    off = _run(False, 100, 0, 200, 10.0, violations=["sku-0@wh-1 conservation: drift"])
    assert on.invariants_ok and not off.invariants_ok
    got = ratios([on, off])["row_batched_over_unbatched_reservations_per_s"]
    assert got is None, f"batched/unbatched reported from a failed run: {got}"


def test_flash_sale_run_that_mostly_errored_gives_no_ratio() -> None:
    """9 of 10 unbatched reserves raised (Busy, lock timeouts) and nothing committed for
    them: the books balance, but the run does not measure holds (over 1% errors, as
    `bench http` counts a failed run), so no ratio uses it."""
    on = _run(True, 100, 0, 200, 1.0)
    off = _run(False, 100, 2_700, 200, 10.0)
    assert off.invariants_ok and not off.measures and on.measures
    got = ratios([on, off])
    assert got["row_batched_over_unbatched_reservations_per_s"] is None
    assert got["row_batched_rejections_over_reservations_per_s"] is not None


@pytest.mark.parametrize(("option", "value"), [("--takes", "0"), ("--buyers", "251"),
                                              ("--expire-ttl", "0.5")])
def test_a_refusal_names_the_option_given(option: str, value: str) -> None:
    result = CliRunner().invoke(bench, ["flash-sale", option, value])
    assert result.exit_code == 2
    assert option in result.output, result.output


def test_pool_dead_tuple_peak_is_not_below_the_after_value(dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    result = CliRunner().invoke(bench, [
        "flash-sale", "--strategy", "pool", "--batching", "on", "--units", "300",
        "--buyers", "8", "--processes", "1", "--quiet", "--database-url", dsn,
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    db = json.loads(out.read_text())["runs"][0]["db"]
    assert db["pool_dead_tuples_peak"] >= db["pool_dead_tuples_after"], db


def test_recorded_service_environment_is_what_the_service_ran_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The service runs with --no-request-log, which wins over PGRESERVE_REQUEST_LOG: the
    variable is recorded as not applied, and the flag is among the service's flags."""
    from pgreserve.bench.wrk import SERVICE_FLAGS, service_argv, service_environment

    monkeypatch.setenv("PGRESERVE_REQUEST_LOG", "true")
    recorded = service_environment()["PGRESERVE_REQUEST_LOG"]
    assert recorded.startswith("true (not applied to the service"), recorded
    assert "--no-request-log" in SERVICE_FLAGS
    assert "--no-request-log" in service_argv("postgresql://x", 1, 1)
