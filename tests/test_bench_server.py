"""`pgreserve bench server`: the flash sale sent by pgbench, with its counts checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pgreserve.bench import server
from pgreserve.bench.cli import bench
from pgreserve.errors import InvalidRequest


def test_plan_rounds_to_whole_rounds_per_client() -> None:
    assert server.plan(5000, 15000, 64) == (4992, 9984)
    assert server.plan(64, 64, 8) == (64, 0)
    with pytest.raises(InvalidRequest, match="at least the number of clients"):
        server.plan(7, 100, 8)
    with pytest.raises(InvalidRequest, match="clients must be at least 1"):
        server.plan(7, 100, 0)


def test_report_without_figures_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="pgbench gave no transactions, tps"):
        server.parse_report("connection to server failed")


def test_both_strategies_hold_exactly_the_stock_then_refuse(dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "server.json"
    result = CliRunner().invoke(bench, ["server", "--database-url", dsn, "--units", "64",
                                        "--requests", "192", "--clients", "8",
                                        "--pool-cap", "16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [r["strategy"] for r in doc["runs"]] == ["row", "pool"]
    for run in doc["runs"]:
        assert (run["held"], run["rejected"]) == (64, 128)
        assert run["invariants_ok"] and all(run["invariants"].values())
        assert run["hold_phase"]["transactions"] == 64
        assert run["sold_out_phase"]["transactions"] == 128
        assert run["reservations_per_s"] > 0 and run["rejections_per_s"] > 0
    assert set(doc["ratios"]) == {"pool_over_row_reservations_per_s",
                                  "row_rejections_over_reservations_per_s",
                                  "pool_rejections_over_reservations_per_s"}
    assert "pool_over_row_reservations_per_s: " in result.output


def test_a_bad_database_url_is_an_error_not_a_result(tmp_path: Path) -> None:
    result = CliRunner().invoke(bench, ["server", "--database-url",
                                        "postgresql://nobody@127.0.0.1:1/none",
                                        "--units", "8", "--clients", "8"])
    assert result.exit_code != 0
