"""The flash-sale benchmark: its scenario checks, its JSON, its invariant checks and exit code."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from pgreserve.bench import Scenario, plan, run_scenario
from pgreserve.bench.cli import make_flash_sale
from pgreserve.bench.meter import ServerMeter
from pgreserve.bench.processes import split
from pgreserve.bench.runner import BeforeCheck, CheckContext
from pgreserve.db.connect import connect_async
from pgreserve.errors import InvalidRequest

RUN_FIELDS = {"strategy", "requests", "held", "rejected", "errors", "retries",
              "reservations_per_s", "rejections_per_s", "oversold", "invariants_ok",
              "latency_ms", "db"}
LATENCY_FIELDS = {"p50", "p90", "p99", "p999", "max"}
DB_FIELDS = {"pool_dead_tuples_before", "pool_dead_tuples_after", "deadlocks", "xact_commit",
             "xact_rollback"}
SMALL = ["--units", "200", "--buyers", "16", "--requests", "600", "--quiet"]


def invoke(dsn: str, tmp_path: Path, *args: str,
           hook: BeforeCheck | None = None) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(make_flash_sale(before_check=hook),
                                ["--database-url", dsn, "--json", str(out), *args])
    doc = json.loads(out.read_text()) if out.exists() else {}
    return result.exit_code, doc, result.output


def test_scenario_rejects_nonsense() -> None:
    """Shares outside [0, 1], fates adding up past 1 and unknown strategies are refused."""
    for bad in ({"hot_share": 1.5}, {"retry_rate": 1.0}, {"claim": 0.6, "release": 0.6},
                {"buyers": 0}, {"quantity": 0}, {"units": 5, "quantity": 6},
                {"strategies": ("row", "row")}, {"strategies": ("disk",)},
                {"expire_ttl_s": 0.5}, {"processes": 0}, {"buyers": 4, "processes": 5}):
        with pytest.raises(InvalidRequest):
            Scenario(**bad)


def test_plan_is_deterministic_and_follows_the_shares() -> None:
    """The same seed gives the same plan; a hot share of 1 sends everything to SKU 0."""
    scenario = Scenario(units=10, requests=500, skus=4, hot_share=0.5, retry_rate=0.2,
                        claim=0.3, release=0.3, expire=0.2)
    assert plan(scenario) == plan(scenario)
    assert plan(scenario) != plan(scenario.with_(seed=2))
    requests = plan(scenario)
    assert {r.sku for r in requests} == {0, 1, 2, 3}
    assert {r.fate for r in requests} == {"claim", "release", "expire", "keep"}
    assert any(r.retry for r in requests) and not requests[0].retry
    assert {r.sku for r in plan(scenario.with_(hot_share=1.0))} == {0}


def test_split_deals_every_request_and_buyer_once() -> None:
    """Requests go round robin to the processes, buyers as evenly as they divide."""
    requests = plan(Scenario(units=10, requests=101))
    parts = split(requests, 10, 3)
    assert [buyers for buyers, _ in parts] == [4, 3, 3]
    assert sorted(r.seq for _, reqs in parts for r in reqs) == list(range(101))
    assert [len(reqs) for _, reqs in split(requests, 2, 8)] == [51, 50]


async def test_buyers_in_several_processes_keep_the_books(dsn: str) -> None:
    """Three buyer processes, retries, claims, releases and expiries: every request is
    answered once, and every invariant holds in both strategies."""
    scenario = Scenario(units=40, requests=240, buyers=9, processes=3, retry_rate=0.2,
                        claim=0.3, release=0.3, expire=0.2, strategies=("row", "pool"),
                        pool_cap=10, replenish=False)
    seen: list[int] = []
    runs = await run_scenario(dsn, scenario, progress=lambda _s, n: seen.append(n))
    assert sum(seen) == 2 * 240
    for run in runs:
        assert run.invariants_ok, (run.strategy, run.invariants(), run.violations)
        assert sorted(x.seq for x in run.samples) == list(range(240))
        assert run.errors == 0 and run.oversold == 0
        assert run.retries > 0 and run.claimed > 0 and run.released > 0
        assert run.client_stats.get("client_connection_retried") == 0
        assert run.ledger is not None and run.ledger.restored > 0
        assert run.background_refills is None  # replenish=False: pools refill inline only


def test_http_target_takes_one_process(dsn: str, tmp_path: Path) -> None:
    """--processes is for library buyers; the HTTP target refuses more than one."""
    code, _, output = invoke(dsn, tmp_path, *SMALL, "--target", "http", "--processes", "2")
    assert code == 2 and "--processes" in output


def test_flash_sale_both_strategies_sell_exactly_the_stock(dsn: str, tmp_path: Path) -> None:
    """Demand 3x the stock: each strategy holds every unit, oversells none, and the JSON has
    every figure (each strategy runs batched, then unbatched: --batching both is the default)."""
    # (no releases: a released hold gives its unit back, and it would be sold again)
    code, doc, output = invoke(dsn, tmp_path, *SMALL, "--strategy", "all", "--release", "0")
    assert code == 0, output
    assert [run["strategy"] for run in doc["runs"]] == ["row", "row", "pool", "pool"]
    assert [run["batching"] for run in doc["runs"]] == [True, False, True, False]
    for run in doc["runs"]:
        assert run.keys() >= RUN_FIELDS
        assert run["latency_ms"].keys() >= LATENCY_FIELDS
        assert run["db"].keys() >= DB_FIELDS
        assert run["requests"] == 600
        assert run["held"] == 200
        assert run["rejected"] == 400
        assert run["errors"] == 0
        assert run["oversold"] == 0
        assert run["invariants_ok"] is True
        assert all(run["invariants"].values())
        assert run["reservations_per_s"] > 0 and run["rejections_per_s"] > 0
        assert run["latency_ms"]["p50"] <= run["latency_ms"]["p99"] <= run["latency_ms"]["max"]
    assert doc["runs"][0]["db"]["pool_dead_tuples_after"] >= 0
    assert "pool_over_row_reservations_per_s" in doc["ratios"]
    assert doc["config"]["units"] == 200
    # durable commits asked, but the test server runs with fsync off: not durable
    assert doc["config"]["durability"]["requested"] is True
    assert doc["config"]["durable"] is False
    assert "invariants" in output


async def test_mixed_lifecycle_keeps_the_books(dsn: str) -> None:
    """Retries, claims, releases and expiries over two SKUs: every invariant holds in both strategies."""
    scenario = Scenario(units=60, requests=300, buyers=8, quantity=2, skus=2, hot_share=0.7,
                        retry_rate=0.2, claim=0.3, release=0.3, expire=0.2,
                        strategies=("row", "pool"), pool_cap=20)
    runs = await run_scenario(dsn, scenario)
    for run in runs:
        assert run.invariants_ok, (run.strategy, run.invariants(), run.violations)
        assert run.oversold == 0
        assert run.errors == 0
        assert run.retries > 0 and run.claimed > 0 and run.released > 0
        assert run.requests == 300
        assert run.ledger is not None and run.ledger.restored > 0
        assert run.claimed_units + run.ledger.held + run.ledger.free + run.ledger.pool == 120
    # the pool run had the background replenisher beside its buyers, as deployed
    assert runs[0].background_refills is None and runs[1].background_refills is not None
    assert "background_refills" in runs[1].db_view()


def test_planted_drift_fails_the_run(dsn: str, tmp_path: Path) -> None:
    """A unit conjured between the run and the check makes the command exit non-zero."""

    async def plant(ctx: CheckContext) -> None:
        """Put one unit back into free stock behind the service's back."""
        async with await psycopg.AsyncConnection.connect(ctx.dsn, autocommit=True) as conn:
            await conn.execute("UPDATE stock_bucket SET free = free + 1 WHERE tenant_id = %s",
                               (ctx.tenant_id,))

    code, doc, output = invoke(dsn, tmp_path, *SMALL, "--strategy", "pool", "--batching", "on",
                               hook=plant)
    assert code != 0
    (run,) = doc["runs"]
    assert run["invariants_ok"] is False
    assert run["invariants"]["conservation"] is False
    assert run["violations"]
    assert "FAILED" in output


def test_long_run_reports_first_and_last_windows(dsn: str, tmp_path: Path) -> None:
    """--takes runs the pool alone and reports the p99 of the first and last windows of holds."""
    code, doc, output = invoke(dsn, tmp_path, "--takes", "300", "--window", "100",
                               "--buyers", "8", "--pool-cap", "50", "--batching", "on")
    assert code == 0, output
    (run,) = doc["runs"]
    assert run["strategy"] == "pool" and run["held"] == 300
    climb = run["take_latency_climb"]
    assert climb["window"] == 100 and climb["takes"] == 300
    assert climb["first_p99_ms"] > 0 and climb["last_p99_ms"] > 0


def test_plot_is_a_png(dsn: str, tmp_path: Path) -> None:
    """--plot writes a PNG; the progress bar path runs without error."""
    png = tmp_path / "bench.png"
    code, _, output = invoke(dsn, tmp_path, "--units", "50", "--buyers", "4", "--requests",
                             "100", "--strategy", "row", "--plot", str(png))
    assert code == 0, output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_http_target_sells_exactly_the_stock(dsn: str, tmp_path: Path) -> None:
    """--target http drives the scenario through a server it starts: same JSON fields, target
    "http" on every run, nothing oversold, every invariant kept."""
    code, doc, output = invoke(dsn, tmp_path, "--units", "30", "--buyers", "4", "--requests",
                               "90", "--retry-rate", "0.1", "--claim", "0.3", "--release", "0.2",
                               "--quiet", "--strategy", "all", "--target", "http")
    assert code == 0, output
    assert [(run["strategy"], run["batching"]) for run in doc["runs"]] == [
        ("row", True), ("row", False), ("pool", True), ("pool", False)]
    for run in doc["runs"]:
        assert run.keys() >= RUN_FIELDS and run["latency_ms"].keys() >= LATENCY_FIELDS
        assert run["target"] == "http"
        assert run["requests"] == 90 and run["errors"] == 0
        assert run["held"] >= 30 and run["retries"] > 0 and run["claimed"] > 0
        assert run["oversold"] == 0
        assert run["invariants_ok"] is True and all(run["invariants"].values())
    assert doc["config"]["target"] == "http"
    assert "target http" in output


def test_library_target_is_the_default(dsn: str, tmp_path: Path) -> None:
    """Without --target the buyers use the library, and each run says so."""
    code, doc, output = invoke(dsn, tmp_path, "--units", "10", "--buyers", "2", "--requests",
                               "20", "--quiet", "--strategy", "row")
    assert code == 0, output
    assert [run["target"] for run in doc["runs"]] == ["library", "library"]
    assert doc["config"]["target"] == "library"


async def test_http_target_against_a_running_service(dsn: str) -> None:
    """--url/--api-key: the buyers use the given service and key; a tenant with stock is refused."""
    from pgreserve import Database, ReservationService
    from pgreserve.bench.http import HttpTarget, local_service

    async with Database(dsn, max_size=1) as db:
        _, key = await ReservationService(db).create_tenant_with_key("shop")
    scenario = Scenario(units=20, requests=60, buyers=3, strategies=("pool",), pool_cap=8)
    async with local_service(dsn, pool_size=3) as url:
        target = HttpTarget(url=url, api_key=key)
        [run] = await run_scenario(dsn, scenario, http=target)
        assert run.target == "http" and run.held == 20 and run.rejected == 40
        assert run.oversold == 0 and run.invariants_ok
        with pytest.raises(InvalidRequest, match="already has stock"):
            await run_scenario(dsn, scenario, http=target)


def test_batching_both_runs_each_strategy_batched_and_unbatched(dsn: str, tmp_path: Path) -> None:
    """--batching both: two runs per strategy, batched first, each with its batch sizes
    (none when unbatched), server CPU and WAL per hold; the ratios and the comparison name
    both modes. --batching off runs only the unbatched path. No speed is asserted."""
    small = ["--units", "30", "--buyers", "4", "--requests", "90", "--quiet"]
    code, doc, output = invoke(dsn, tmp_path, *small, "--strategy", "all", "--batching", "both")
    assert code == 0, output
    assert [(r["strategy"], r["batching"]) for r in doc["runs"]] == [
        ("row", True), ("row", False), ("pool", True), ("pool", False)]
    assert doc["config"]["claim"] == 0.9 and doc["config"]["release"] == 0.05
    assert doc["config"]["batching"] == [True, False]
    for run in doc["runs"]:
        assert run.keys() >= RUN_FIELDS and run["invariants_ok"] is True
        assert run["held"] >= 30 and run["claimed"] > 0  # released units sell again
        resources = run["resources"]
        assert resources["cpu_source"] in ("proc", "pg_stat_statements", None)
        assert resources["wal_bytes"] > 0 and resources["wal_bytes_per_hold"] > 0
        assert {"server_cpu_ms_per_hold", "wal_bytes_per_hold", "server_cores",
                "client_cores"} <= resources["selling_window"].keys()
        if run["batching"]:
            sizes = run["batch_sizes"]
            assert 1 <= sizes["p50"] <= sizes["p90"] <= sizes["p99"] <= sizes["max"] <= 4
            assert run["batches"]["requests"] >= run["held"]
        else:
            assert run["batch_sizes"] is None and run["batches"] is None
    for strategy in ("row", "pool"):
        assert f"{strategy}_batched_over_unbatched_reservations_per_s" in doc["ratios"]
        assert f"{strategy}_batched_over_unbatched_p99_latency" in doc["ratios"]
        assert f"{strategy}_batched_rejections_over_reservations_per_s" in doc["ratios"]
    assert [c["strategy"] for c in doc["comparison"]] == ["row", "pool"]
    assert all({"batched", "unbatched"} <= c.keys() for c in doc["comparison"])
    assert "batched" in output and "unbatched" in output

    code, doc, output = invoke(dsn, tmp_path, *small, "--strategy", "row", "--batching", "off")
    assert code == 0, output
    assert [(r["strategy"], r["batching"]) for r in doc["runs"]] == [("row", False)]


def test_http_bench_without_wrk_fails_cleanly(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench http` with no wrk on PATH says what to install and exits 1, no traceback."""
    from pgreserve.bench.cli import bench

    monkeypatch.setenv("PATH", str(tmp_path))
    result = CliRunner().invoke(bench, ["http", "--seconds", "1"])
    assert result.exit_code == 1
    assert "wrk is not on PATH" in result.output and "apt-get install wrk" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output


def _rated_run(strategy: str, batching: bool, held_per_s: float) -> Any:
    """A run of 10 holds at `held_per_s`, then 10 sold-out answers (no database; its
    books as such a run leaves them)."""
    from pgreserve.bench.results import HELD, REJECTED, Ledger, RunResult, Sample

    scenario = Scenario(units=10, requests=20, strategies=("row", "pool"),
                        batching=(batching,))
    samples = [Sample(i, 0.0, (i + 1) / held_per_s, HELD, 1) for i in range(10)]
    samples += [Sample(10 + i, 0.0, 10 / held_per_s + (i + 1) * 0.001, REJECTED, 0)
                for i in range(10)]
    run = RunResult(strategy, scenario, samples, 1.0, batching=batching)
    run.ledger = Ledger(on_hand=10, free=0, pool=0, held=10, restored=0, reservations=10,
                        shortfall=0)
    assert run.invariants_ok
    return run


def test_pool_over_row_names_the_mode_it_compares() -> None:
    """`pool_over_row_reservations_per_s` is the batched runs' ratio and nothing else:
    with only unbatched runs (--batching off) it is absent and the ratio is under
    `pool_over_row_unbatched_reservations_per_s`; with both, each has its own name."""
    from pgreserve.bench.results import ratios

    off = ratios([_rated_run("row", False, 100.0), _rated_run("pool", False, 300.0)])
    assert "pool_over_row_reservations_per_s" not in off
    assert off["pool_over_row_unbatched_reservations_per_s"] == pytest.approx(3.0, rel=1e-3)
    both = ratios([_rated_run("row", True, 100.0), _rated_run("row", False, 50.0),
                   _rated_run("pool", True, 200.0), _rated_run("pool", False, 200.0)])
    assert both["pool_over_row_reservations_per_s"] == pytest.approx(2.0, rel=1e-3)
    assert both["pool_over_row_unbatched_reservations_per_s"] == pytest.approx(4.0, rel=1e-3)


def test_default_processes_fit_the_cpus_this_process_may_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default --processes is one per CPU the bench may run on (its affinity, not the
    host's count), at most the cap of 32 and at most --buyers: on a 48-CPU host the
    default sale no longer fails on an option it was never given."""
    from pgreserve.bench import cli
    from pgreserve.bench.scenario import MAX_PROCESSES

    monkeypatch.setattr(os, "cpu_count", lambda: 48)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(48)), raising=False)
    assert cli.default_processes(64) == MAX_PROCESSES == 32
    assert cli.default_processes(5) == 5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 7})  # taskset, cgroups
    assert cli.default_processes(64) == 3

    def unavailable(pid: int) -> set[int]:
        raise OSError("no affinity here")

    monkeypatch.setattr(os, "sched_getaffinity", unavailable)
    assert cli.default_processes(64) == 32
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert cli.default_processes(64) == 1

    # the whole command with its defaults: the options are accepted, whatever the
    # (here unreachable) database then does
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(48)))
    result = CliRunner().invoke(make_flash_sale(), [
        "--quiet", "--database-url", "postgresql://nobody@127.0.0.1:1/none"])
    assert "processes must be" not in result.output, result.output
    assert "at most 32" in CliRunner().invoke(make_flash_sale(), ["--help"]).output


@pytest.mark.parametrize(("command", "option"), [
    (["flash-sale"], "--json"), (["flash-sale"], "--plot"), (["server"], "--json"),
    (["http", "--seconds", "1"], "--json")])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(
        tmp_path: Path, command: list[str], option: str) -> None:
    """--json or --plot in a directory that does not exist, or that is not writable, is a
    usage error naming the option, before anything runs (the database URL here leads
    nowhere: the run would fail otherwise)."""
    from pgreserve.bench.cli import bench

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    for target in (tmp_path / "missing-dir" / "out", locked / "out"):
        if target.parent == locked and os.access(locked, os.W_OK):
            continue  # root writes anywhere
        result = CliRunner().invoke(bench, [
            *command, "--database-url", "postgresql://nobody@127.0.0.1:1/none",
            option, str(target)])
        assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
        assert option in result.output and str(target.parent) in result.output


def test_a_failed_write_of_the_json_is_an_error_not_a_traceback(
        dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory was fine before the run and the write fails after it (disk full,
    removed meanwhile): one error line, exit 1, no traceback."""
    from pgreserve.bench import report

    def full(path: Any, doc: Any) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(report, "write_json", full)
    code, _, output = invoke(dsn, tmp_path, "--units", "5", "--buyers", "1",
                             "--requests", "5", "--strategy", "row", "--batching", "on",
                             "--quiet")
    assert code == 1, output
    assert "--json" in output and "No space left on device" in output
    assert "Traceback" not in output


def test_the_filesystem_of_a_path_is_its_longest_mount_point(tmp_path: Path) -> None:
    """/proc/self/mounts read by the longest mount point containing the path (the later
    one when mounted over another; escaped spaces read back); None without a table."""
    from pgreserve.bench.durability import filesystem_of

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\n"
                      "tmpfs /scratch tmpfs rw 0 0\n"
                      "/dev/vdb /scratch/disk xfs rw 0 0\n"
                      "tmpfs /scratchx tmpfs rw 0 0\n"
                      "/dev/vdc /srv/my\\040data btrfs rw 0 0\n"
                      "/dev/vdd /srv/my\\040data ext4 rw 0 0\n")
    assert filesystem_of("/scratch/pgreserve-bench-1/data", mounts) == "tmpfs"
    assert filesystem_of("/scratch", mounts) == "tmpfs"
    assert filesystem_of("/scratch/disk/data", mounts) == "xfs"
    assert filesystem_of("/scratchdata", mounts) == "ext4"  # /scratch is no prefix of it
    assert filesystem_of("/srv/my data/pg", mounts) == "ext4"
    assert filesystem_of("/srv/my", mounts) == "ext4"
    assert filesystem_of("/scratch", tmp_path / "no-such-table") is None


def test_durability_is_read_back_from_the_server(dsn: str, tmp_path: Path) -> None:
    """The test server runs with fsync, full_page_writes and synchronous_commit off: a run
    asked to be durable says why it is not; a data directory on tmpfs is one more
    reason; a running service's sessions are judged by the server's default."""
    from pgreserve.bench.durability import read_durability

    found = read_durability(dsn, durable=True, data_dir=None)
    assert (found.fsync, found.full_page_writes) == ("off", "off")
    assert found.synchronous_commit == "on"  # the bench's own sessions set it
    assert found.synchronous_commit_default == "off"
    assert found.durable is False and len(found.reasons) == 2
    service = read_durability(dsn, durable=True, data_dir=None, service_sessions=True)
    assert any("synchronous_commit is off" in r for r in service.reasons)
    shm = Path("/dev/shm")  # noqa: S108 - only read: is it tmpfs here
    if shm.is_dir() and os.access(shm, os.W_OK):
        from pgreserve.bench.durability import filesystem_of

        if filesystem_of(shm) == "tmpfs":
            on_tmpfs = read_durability(dsn, durable=True, data_dir=shm)
            assert on_tmpfs.filesystem == "tmpfs"
            assert any("on tmpfs" in r for r in on_tmpfs.reasons)
    relaxed = read_durability(dsn, durable=False, data_dir=None)
    assert relaxed.durable is False and relaxed.synchronous_commit == "off"


def test_a_run_asked_durable_on_a_server_that_is_not_says_so(dsn: str, tmp_path: Path) -> None:
    """--durable (the default) against a server with fsync off: the run goes on, warns,
    and its JSON records what the server said and "durable": false."""
    code, doc, output = invoke(dsn, tmp_path, "--units", "5", "--buyers", "1",
                               "--requests", "5", "--strategy", "row", "--batching", "on",
                               "--quiet")
    assert code == 0, output
    said = " ".join(output.split())  # the console wraps its lines
    assert "not durable" in said and "fsync is off" in said
    config = doc["config"]
    assert config["durable"] is False
    assert config["durability"]["requested"] is True
    assert config["durability"]["fsync"] == "off"
    assert config["durability"]["full_page_writes"] == "off"
    assert config["durability"]["synchronous_commit"] == "on"
    assert config["durability"]["data_directory"] is None  # an external database


def test_the_docs_say_where_batched_and_unbatched_are_compared() -> None:
    """docs/benchmarks.md names the two places batched and unbatched p99 are measured
    (flash-sale through the library, and --target http, whose server takes the run's
    setting), and that `bench http` is not one: `serve` has no unbatched mode and the
    bench starts it with none."""
    from pgreserve.bench.wrk import service_argv
    from pgreserve.cli import main

    text = " ".join((Path(__file__).parent.parent / "docs" / "benchmarks.md")
                    .read_text().split())
    assert ("only in `bench flash-sale`, through the library (`--target library`, the "
            "default) and through `--target http`") in text
    assert "`bench http` starts `pgreserve serve`, which always batches" in text
    assert not any("batch" in arg for arg in service_argv("postgresql://x/y", 1, 1))
    assert "batch" not in CliRunner().invoke(main, ["serve", "--help"]).output.lower()


async def test_statement_time_fallback_counts_each_statement_once(dsn: str) -> None:
    """The CPU fallback (`cpu_source: pg_stat_statements`, used when /proc does not show
    the server) sums the top-level statements' time of this database: with track = all
    (what the embedded server and doctor ask for) a function's own statements are
    listed beside its call, and summing them too read 0.3 s of execution as 0.6 s."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        track = await (await conn.execute("SHOW pg_stat_statements.track")).fetchone()
        assert track is not None and track[0] == "all"
        await conn.execute("CREATE OR REPLACE FUNCTION public.bench_nap() RETURNS void "
                           "LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.3); END $$")
    meter = ServerMeter(await connect_async(dsn), None, True)
    assert meter.source == "pg_stat_statements"
    try:
        before = await meter.read()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute("SELECT public.bench_nap()")
        after = await meter.read()
    finally:
        await meter.close()
    assert before.server_cpu_s is not None and after.server_cpu_s is not None
    spent = after.server_cpu_s - before.server_cpu_s
    # one 0.3 s call: the figure must be about 0.3 s, not twice that
    assert 0.25 < spent < 0.45, f"0.3 s of statement time counted as {spent:.3f} s"


def test_takes_long_run_is_a_pool_bucket_as_documented(dsn: str, tmp_path: Path) -> None:
    """`--takes N` is N single-unit holds on one pool bucket (docs/benchmarks.md,
    --help): with --strategy row it ran a row bucket without a word; it is refused
    now (exit 2), and --strategy pool runs the pool."""
    out = tmp_path / "b.json"
    result = CliRunner().invoke(make_flash_sale(), [
        "--database-url", dsn, "--json", str(out), "--takes", "20", "--window", "5",
        "--buyers", "2", "--batching", "on", "--strategy", "row", "--quiet"])
    doc = json.loads(out.read_text()) if out.exists() else {}
    assert result.exit_code == 2 and "--takes" in result.output, (result.output, doc)


def test_an_unmeasured_client_retry_count_is_not_printed_as_zero() -> None:
    """A run whose buyers' retry counters were not read (--target http: the Database
    is the API server's, and the JSON has no client_* figure) says n/a in the table,
    not a 0 nobody measured."""
    from collections import Counter

    from pgreserve.bench.report import _rows
    from pgreserve.bench.results import HELD, RunResult, Sample
    from pgreserve.bench.scenario import Scenario

    scenario = Scenario(units=1, requests=1, buyers=1)
    run = RunResult("row", scenario, [Sample(0, 0.0, 0.01, HELD, 1)], 0.02,
                    error_kinds=Counter(), target="http")
    assert "client_deadlocks_retried" not in run.to_dict()["db"]  # not measured
    (note,) = [n for label, _, n in _rows(scenario, run)
               if label == "deadlocks / commits / rollbacks"]
    assert "retried n/a deadlocks" in note, note
