"""`pgreserve bench http` end to end: real wrk against the bare endpoint and `serve
--workers N`, in alternating rounds; its JSON, its figures' sums and the tenant's books."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

import toolcheck
from pgreserve.bench.cli import bench
from pgreserve.bench.wrk import Endpoint, HttpBench, Segment, _starts, run_order
from pgreserve.errors import InvalidRequest


def test_rounds_alternate_abba_and_share_a_start_between_runs_of_one_server() -> None:
    """bare, service | service, bare | bare, service: a server that runs twice in a row is
    started once, and no server is started while the other runs."""
    assert run_order(1) == [(1, "bare"), (1, "service")]
    assert run_order(3) == [(1, "bare"), (1, "service"), (2, "service"), (2, "bare"),
                            (3, "bare"), (3, "service")]
    assert _starts(run_order(3)) == [("bare", [1]), ("service", [1, 2]), ("bare", [2, 3]),
                                     ("service", [3])]


def _segment(round_: int, created: int, seconds: float, *, cpu: float | None = 1.0,
             p99: float = 10.0) -> Segment:
    return Segment(round=round_, requests=created + 1, duration_s=seconds, created=created,
                   replayed=0, rejected=0, other_status=1, socket_errors=0,
                   latency_ms={"p50": 1.0, "p90": 2.0, "p99": p99, "max": p99 * 2},
                   wrk_cpu_s=0.5, server_cpu_s=cpu, postgres_cpu_s=cpu)


def test_an_endpoint_sums_its_runs_and_the_ratio_is_of_the_sums() -> None:
    """Counts, seconds and CPU add up over the runs; latency percentiles are the largest
    of the runs; a CPU reading missing in one run makes the sum unknown; the ratio is
    of the summed rates, and each round has its own."""
    bare = Endpoint("bare", "http://b", [_segment(1, 1000, 1.0, p99=5.0),
                                         _segment(2, 3000, 1.0, p99=7.0)])
    held = Endpoint("service", "http://s", [_segment(1, 500, 1.0, cpu=None),
                                            _segment(2, 900, 1.0)])
    total = bare.total
    assert (total.created, total.requests, total.duration_s) == (4000, 4002, 2.0)
    assert total.latency_ms == {"p50": 1.0, "p90": 2.0, "p99": 7.0, "max": 14.0}
    assert total.server_cpu_s == 2.0 and total.cores(total.server_cpu_s) == 1.0
    assert held.total.server_cpu_s is None and held.total.wrk_cpu_s == 1.0
    result = HttpBench(bare, held, "row")
    assert result.ratio == pytest.approx(1400 / 4000)
    assert result.round_ratios() == [pytest.approx(0.5), pytest.approx(0.3)]
    doc = result.to_dict()
    assert [s["round"] for s in doc["service"]["segments"]] == [1, 2]
    assert doc["service"]["created_per_s"] == 700.0


def test_a_run_with_no_rounds_is_refused(dsn: str) -> None:
    import asyncio

    from pgreserve.bench.wrk import run_http_bench

    with pytest.raises(InvalidRequest, match="rounds"):
        asyncio.run(run_http_bench(dsn, strategy="row", units=10, pool_cap=10, workers=1,
                                   threads=1, connections=1, seconds=1, warmup=0,
                                   durable=True, rounds=0))


@pytest.mark.parametrize("strategy", ["row", "pool"])
def test_bench_http_runs_both_servers_in_rounds_and_the_books_balance(
        dsn: str, tmp_path: Path, strategy: str) -> None:
    """Two rounds of one second against each server, one worker each: every answer is a
    201, the service's holds are the tenant's reservations (warm-up included), each
    server's figures are the sums of its runs, and the ratio printed is the JSON's."""
    toolcheck.require("wrk")
    out = tmp_path / "http.json"
    result = CliRunner().invoke(bench, [
        "http", "--seconds", "1", "--rounds", "2", "--warmup", "1", "--workers", "1",
        "--connections", "8", "--threads", "1", "--strategy", strategy,
        "--units", "1000000", "--database-url", dsn, "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["invariants_ok"] is True and doc["violations"] == []
    assert doc["config"]["rounds"] == 2 and doc["strategy"] == strategy
    for name in ("bare", "service"):
        endpoint = doc[name]
        segments = endpoint["segments"]
        assert sorted(s["round"] for s in segments) == [1, 2]
        assert endpoint["created"] == sum(s["created"] for s in segments) > 0
        assert endpoint["duration_s"] == pytest.approx(sum(s["duration_s"] for s in segments))
        assert endpoint["other_status"] == endpoint["rejected"] == 0
        # every run sends keys of its own: none is answered from the ledger
        assert endpoint["replayed"] == 0
        assert endpoint["created"] == endpoint["requests"]
        assert endpoint["socket_errors"] == 0
        assert endpoint["server_cpu_s"] > 0 and endpoint["wrk_cpu_s"] > 0
    held = doc["service"]["created"]
    ratio = doc["service"]["created_per_s"] / doc["bare"]["created_per_s"]
    assert doc["service_holds_over_bare_requests_per_s"] == pytest.approx(ratio)
    assert len(doc["round_ratios"]) == 2
    assert f"service_holds_over_bare_requests_per_s: {ratio:.2f}" in result.output
    # the warm-up's holds are in the books too, and nothing else is
    assert doc["reservations_in_database"] > held
    with psycopg.connect(dsn) as conn:
        active = conn.execute("SELECT count(*) FROM reservation WHERE status = 'active'"
                              ).fetchone()
    assert active is not None and active[0] == doc["reservations_in_database"]


def test_answers_replayed_from_the_ledger_are_counted_apart(
        dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the same key prefix in every wrk run, the measured run sends the warm-up's
    keys again: those 201s are counted as replayed, not as holds."""
    toolcheck.require("wrk")
    monkeypatch.setattr("pgreserve.bench.wrk.run_prefix", lambda: "same-")
    out = tmp_path / "http.json"
    result = CliRunner().invoke(bench, [
        "http", "--seconds", "1", "--rounds", "1", "--warmup", "1", "--workers", "1",
        "--connections", "4", "--threads", "1", "--strategy", "row",
        "--database-url", dsn, "--json", str(out)])
    assert result.exit_code == 0, result.output
    service = json.loads(out.read_text())["service"]
    assert service["replayed"] > 0
    assert (service["created"] + service["replayed"] + service["rejected"]
            + service["other_status"]) == service["requests"]


def test_a_sold_out_run_says_so_and_its_books_balance(dsn: str, tmp_path: Path) -> None:
    """Too few units for the run: the holds stop at the stock, the rest are 409s, the
    bench says the SKU sold out, the books balance, and the run fails (exit 1, after
    the JSON): its measured run was mostly 409s, not holds."""
    toolcheck.require("wrk")
    out = tmp_path / "http.json"
    result = CliRunner().invoke(bench, [
        "http", "--seconds", "1", "--rounds", "1", "--warmup", "0", "--workers", "1",
        "--connections", "4", "--threads", "1", "--strategy", "row", "--units", "50",
        "--database-url", dsn, "--json", str(out)])
    assert result.exit_code == 1, result.output
    doc = json.loads(out.read_text())
    assert doc["service"]["created"] == doc["reservations_in_database"] == 50
    assert doc["service"]["rejected"] > 0 and doc["invariants_ok"] is True
    assert doc["books_check"]["ok"] is True
    assert [r["server"] for r in doc["failing_rounds"]] == ["service"]
    assert "the SKU sold out" in result.output and "non-201" in result.output


def test_the_books_check_holds_wrk_201s_against_the_reservations() -> None:
    """The 201s wrk counted (warm-ups included, replays not) must all be reservations in
    the database, and the database may hold at most one more per connection for each wrk
    run against the service (requests in flight when wrk stopped): anything else fails."""
    bare = Endpoint("bare", "http://b", [_segment(1, 1000, 1.0)])
    service = Endpoint("service", "http://s", [_segment(1, 500, 1.0), _segment(2, 400, 1.0)],
                       warmups=[_segment(1, 100, 1.0)])
    result = HttpBench(bare, service, "row", reservations=1000, connections=8)
    check = result.books_check()
    assert check["ok"] and result.ok
    assert (check["created"], check["wrk_runs"], check["in_flight_allowance"]) == (1000, 3, 24)
    for reservations, ok in ((999, False), (1024, True), (1025, False)):
        result.reservations = reservations
        assert result.books_check()["ok"] is ok and result.ok is ok, reservations
    result.reservations = 900  # the measured 201s only: the warm-up's are missing
    assert not result.ok
    assert result.to_dict()["books_check"]["ok"] is False
    assert result.to_dict()["invariants_ok"] is False


def test_rounds_with_over_one_percent_non_201_or_socket_errors_are_named() -> None:
    """Non-201 answers (409s included, replays not) plus socket errors over 1% of a
    round's requests, on either server, name that round; 1% itself passes."""
    fine = _segment(1, 1000, 1.0)  # 1 other status of 1,001 requests
    busy = Segment(round=2, requests=1000, duration_s=1.0, created=40, replayed=0,
                   rejected=0, other_status=960, socket_errors=3,
                   latency_ms={"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0},
                   wrk_cpu_s=0.5)
    edge = Segment(round=1, requests=1000, duration_s=1.0, created=985, replayed=5,
                   rejected=4, other_status=4, socket_errors=2,
                   latency_ms={"p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0},
                   wrk_cpu_s=0.5)
    result = HttpBench(Endpoint("bare", "http://b", [fine, edge]),
                       Endpoint("service", "http://s", [fine, busy]), "row")
    assert result.failing_rounds() == [{
        "server": "service", "round": 2, "requests": 1000, "non_201": 960,
        "rejected": 0, "other_status": 960, "socket_errors": 3}]
    assert result.to_dict()["failing_rounds"] == result.failing_rounds()


def test_the_service_environment_is_recorded_with_its_secrets_masked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pgreserve.bench.wrk import service_environment

    for name in [n for n in os.environ if n.startswith("PGRESERVE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PGRESERVE_TENANT_MAX_IN_FLIGHT", "2")
    monkeypatch.setenv("PGRESERVE_API_KEY_CACHE_SECONDS", "2")
    monkeypatch.setenv("PGRESERVE_BENCH_DATABASE_URL", "postgresql://u:hunter2@db/x")
    monkeypatch.setenv("PGRESERVE_SOME_PASSWORD", "hunter2")
    monkeypatch.setenv("PGRESERVE_SIGNING_SECRET", "hunter2")
    monkeypatch.setenv("PGRESERVE_ADMIN_KEY", "hunter2")
    monkeypatch.setenv("OTHER_SETTING", "1")
    assert service_environment() == {
        "PGRESERVE_ADMIN_KEY": "***",
        "PGRESERVE_API_KEY_CACHE_SECONDS": "2",  # a duration, no secret
        "PGRESERVE_BENCH_DATABASE_URL": "postgresql://u:***@db/x",
        "PGRESERVE_SIGNING_SECRET": "***",
        "PGRESERVE_SOME_PASSWORD": "***",
        "PGRESERVE_TENANT_MAX_IN_FLIGHT": "2"}


def test_a_service_that_mostly_fails_fails_the_run(
        dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A service answering almost every request 429 (a tenant in-flight limit of 1,
    inherited from the environment): a warning naming the counts, exit 1 after the JSON,
    which records the setting the service ran with and gives no ratio."""
    toolcheck.require("wrk")
    monkeypatch.setenv("PGRESERVE_TENANT_MAX_IN_FLIGHT", "1")
    out = tmp_path / "http.json"
    result = CliRunner().invoke(bench, [
        "http", "--seconds", "1", "--rounds", "1", "--warmup", "0", "--workers", "1",
        "--connections", "16", "--threads", "1", "--strategy", "row",
        "--database-url", dsn, "--json", str(out)])
    doc = json.loads(out.read_text())
    service = doc["service"]
    assert service["other_status"] > service["created"]  # mostly 429s
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert "non-201" in said and f"{service['other_status']:,}" in said
    assert doc["failing_rounds"] and doc["failing_rounds"][0]["server"] == "service"
    assert doc["config"]["service_environment"]["PGRESERVE_TENANT_MAX_IN_FLIGHT"] == "1"
    assert doc["books_check"]["ok"] is True  # the books still balance
    # no ratio from a run that does not measure holds
    assert doc["service_holds_over_bare_requests_per_s"] is None
    assert doc["round_ratios"] == [None]
    assert "service_holds_over_bare_requests_per_s: n/a" in result.output


def test_holds_wrk_counted_that_the_database_lacks_fail_the_run(
        dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The books check compares wrk's 201s with the database: fewer reservations than
    wrk was answered holds fails the run (exit 1), named like the other checks. (Up to
    4 connections x 2 wrk runs of reservations may be requests in flight that wrk never
    saw answered, so 9 are taken away: at least one 201 then has no reservation.)"""
    toolcheck.require("wrk")
    import dataclasses

    from pgreserve.bench.runner import read_ledger as real

    async def some_lost(db: Any, tenant: int) -> Any:
        book = await real(db, tenant)
        return dataclasses.replace(book, reservations=book.reservations - 9)

    monkeypatch.setattr("pgreserve.bench.wrk.read_ledger", some_lost)
    out = tmp_path / "http.json"
    result = CliRunner().invoke(bench, [
        "http", "--seconds", "1", "--rounds", "1", "--warmup", "1", "--workers", "1",
        "--connections", "4", "--threads", "1", "--strategy", "row",
        "--database-url", dsn, "--json", str(out)])
    doc = json.loads(out.read_text())
    assert result.exit_code == 1, result.output
    assert doc["books_check"]["ok"] is False and doc["invariants_ok"] is False
    assert doc["books_check"]["created"] == doc["service"]["created"] + sum(
        w["created"] for w in doc["service"]["warmups"])
    assert "books" in result.output and "invariants failed" in result.output
