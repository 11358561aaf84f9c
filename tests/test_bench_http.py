"""`pgreserve bench http` end to end: real wrk against the bare endpoint and `serve
--workers N`, in alternating rounds; its JSON, its figures' sums and the tenant's books."""

from __future__ import annotations

import json
from pathlib import Path

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
    bench says the SKU sold out and still exits 0 with balanced books."""
    toolcheck.require("wrk")
    out = tmp_path / "http.json"
    result = CliRunner().invoke(bench, [
        "http", "--seconds", "1", "--rounds", "1", "--warmup", "0", "--workers", "1",
        "--connections", "4", "--threads", "1", "--strategy", "row", "--units", "50",
        "--database-url", dsn, "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["service"]["created"] == doc["reservations_in_database"] == 50
    assert doc["service"]["rejected"] > 0 and doc["invariants_ok"] is True
    assert "the SKU sold out" in result.output
