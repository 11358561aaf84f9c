"""`pgreserve bench flash-sale`: run the benchmark and show what it measured.

The integrator registers the group in pgreserve.cli with `main.add_command(bench)`.
The benchmark's own libraries (histograms, plots) come with the `bench` extra;
this module imports them only when a bench command runs, so the service's CLI
loads without them and the bench says what to install.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..db import migrate as migrations
from ..db.embedded import EmbeddedServer
from ..errors import InvalidRequest
from ..schema_cli import schema_option
from .http import HttpTarget
from .scenario import MAX_BUYERS, MAX_PROCESSES, MAX_UNITS, Scenario

if TYPE_CHECKING:
    from .durability import Durability
    from .results import RunResult
    from .runner import BeforeCheck

# The `bench` extra of pyproject.toml: import name -> distribution.
BENCH_EXTRA_MODULES = {"hdrh": "hdrhistogram", "matplotlib": "matplotlib"}


def require_bench_extra() -> None:
    """Fail with what to install when a module of the `bench` extra is missing."""
    missing = []
    for module, distribution in BENCH_EXTRA_MODULES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(distribution)
    if missing:
        raise click.ClickException(
            f"the benchmark needs {', '.join(missing)}, which come with the bench extra: "
            "pip install 'pgreserve[bench]'")


@click.group()
def bench() -> None:
    """Benchmarks (they need the bench extra: pip install 'pgreserve[bench]')."""
    require_bench_extra()


@contextmanager
def _database(url: str | None, durable: bool) -> Iterator[tuple[str, str, Path | None]]:
    """Yield (dsn, where, data directory): the given URL (no data directory known), or a
    fresh embedded server in a temporary directory."""
    if url:
        yield url, "external database", None
        return
    root = Path(tempfile.mkdtemp(prefix="pgreserve-bench-"))
    server = EmbeddedServer(root / "data",
                            extra_settings={"synchronous_commit": "on" if durable else "off"})
    try:
        yield server.start(), f"embedded PostgreSQL in {root}", root / "data"
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _durability(dsn: str, data_dir: Path | None, durable: bool, err: Console, *,
                service_sessions: bool = False) -> Durability:
    """Read back from the server whether its commits are durable; warn when --durable
    was asked and they are not (the run goes on, recorded as not durable)."""
    from .durability import read_durability

    found = read_durability(dsn, durable=durable, data_dir=data_dir,
                            service_sessions=service_sessions)
    if durable and found.reasons:
        err.print("[bold yellow]warning: --durable was asked, but this run's commits are "
                  "not durable: " + "; ".join(found.reasons)
                  + ". Its figures are not those of durable commits (recorded as "
                  "\"durable\": false).[/]")
    return found


def _output_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file's path, refused before the run when it cannot be written: its
    directory missing or not writable, or the path a directory."""
    if value is None:
        return None
    path = Path(value)
    parent = path.parent
    if not parent.is_dir():
        raise click.BadParameter(f"directory {str(parent)!r} does not exist", ctx, param)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise click.BadParameter(f"directory {str(parent)!r} is not writable", ctx, param)
    if path.is_dir():
        raise click.BadParameter(f"{value!r} is a directory", ctx, param)
    if path.exists() and not os.access(path, os.W_OK):
        raise click.BadParameter(f"{value!r} is not writable", ctx, param)
    return value


def _write(option: str, path: str, write: Callable[[], None], err: Console) -> None:
    """Write an output file; an OSError is a one-line error naming the option, not a
    traceback after the whole run."""
    try:
        write()
    except OSError as exc:
        raise click.ClickException(f"could not write {option} {path}: "
                                   f"{exc.strerror or exc}") from None
    err.print(f"wrote {path}")


def _run_options(f: Any) -> Any:
    """--durable, --json and --database-url, as `bench server` and `bench http` take them."""
    for option in reversed([
            click.option("--durable/--no-durable", default=True, show_default=True,
                         help="synchronous_commit on (durable commits) or off."),
            click.option("--json", "json_path", type=click.Path(dir_okay=False),
                         default=None, callback=_output_path,
                         help="Write every figure to this JSON file."),
            click.option("--database-url", envvar="PGRESERVE_BENCH_DATABASE_URL",
                         default=None, help="Run against this PostgreSQL instead of a "
                                            "fresh embedded server."),
            schema_option]):
        f = option(f)
    return f


@contextmanager
def _migrated(url: str | None, durable: bool) -> Iterator[tuple[str, str, Path | None]]:
    """_database, with the migrations applied."""
    with _database(url, durable) as (dsn, where, data_dir):
        migrations.migrate(dsn)
        yield dsn, where, data_dir


def default_processes(buyers: int) -> int:
    """One client process per CPU this process may run on (its affinity: taskset,
    cpusets; the host's count where that is unknown), at most MAX_PROCESSES and at
    most `buyers`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_PROCESSES, buyers))


def _commit_mode(durable: bool) -> str:
    return f"synchronous_commit={'on' if durable else 'off'}"


def make_flash_sale(before_check: BeforeCheck | None = None) -> click.Command:
    """Build the flash-sale command; tests pass a hook that runs between the run and the checks."""

    @click.command("flash-sale")
    @click.option("--units", type=int, default=5_000, show_default=True,
                  help="Units seeded per SKU.")
    @click.option("--buyers", type=click.IntRange(1, MAX_BUYERS), default=64,
                  show_default=True, help="Concurrent buyers, one connection each.")
    @click.option("--processes", type=int, default=None,
                  help="Client processes the buyers are spread over, each an asyncio loop, "
                       f"at most {MAX_PROCESSES} [default: one per CPU this process may run "
                       f"on for --target library, at most {MAX_PROCESSES} and at most "
                       "--buyers; 1 for --target http].")
    @click.option("--requests", "requests_", type=int, default=None,
                  help="Reserve requests in total, retries included [default: 3 x units x skus].")
    @click.option("--quantity", type=int, default=1, show_default=True, help="Units per request.")
    @click.option("--skus", type=int, default=1, show_default=True)
    @click.option("--hot-share", type=float, default=1.0, show_default=True,
                  help="Share of requests for SKU 0; the rest spread over the other SKUs.")
    @click.option("--retry-rate", type=float, default=0.0, show_default=True,
                  help="Share of requests re-sent with the buyer's previous request key.")
    @click.option("--claim", type=float, default=0.9, show_default=True,
                  help="Share of holds claimed (sold) right after they are granted.")
    @click.option("--release", type=float, default=0.05, show_default=True,
                  help="Share of holds released right after they are granted (payment "
                       "failed); the rest stay held.")
    @click.option("--expire", type=float, default=0.0, show_default=True,
                  help="Share of holds given a short TTL and left to expire.")
    @click.option("--expire-ttl", type=click.FloatRange(1.0, 3600.0), default=1.0,
                  show_default=True, help="TTL in seconds of the holds left to expire.")
    @click.option("--strategy", type=click.Choice(["row", "pool", "all"]), default="all",
                  show_default=True)
    @click.option("--batching", type=click.Choice(["on", "off", "both"]), default="both",
                  show_default=True,
                  help="The buyers' ReservationService batches one-line requests through "
                       "its per-bucket combiner (on), sends each in its own transaction "
                       "(off), or both, one run each per strategy, batched first.")
    @click.option("--pool-cap", type=int, default=1_000, show_default=True)
    @click.option("--replenish/--no-replenish", default=True, show_default=True,
                  help="Run the background pool replenisher during pool runs, as "
                       "`pgreserve worker` does (without it, pools refill only inline, "
                       "when a buyer finds them dry).")
    @click.option("--takes", type=click.IntRange(1, MAX_UNITS), default=None,
                  help="Long run: this many single-unit holds on one pool bucket; reports the "
                       "p99 of the first and the last --window holds.")
    @click.option("--window", type=int, default=10_000, show_default=True)
    @click.option("--durable/--no-durable", default=True, show_default=True,
                  help="synchronous_commit on (durable commits) or off.")
    @click.option("--seed", type=int, default=1, show_default=True)
    @click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                  callback=_output_path, help="Write every figure to this JSON file.")
    @click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
                  callback=_output_path,
                  help="Write a PNG of latency over time and its distribution.")
    @click.option("--quiet", is_flag=True, help="No progress bar.")
    @click.option("--database-url", envvar="PGRESERVE_BENCH_DATABASE_URL", default=None,
                  help="Run against this PostgreSQL instead of a fresh embedded server.")
    @schema_option
    @click.option("--target", type=click.Choice(["library", "http"]), default="library",
                  show_default=True,
                  help="library: buyers call the Python API; http: they call the HTTP API "
                       "(one aiohttp session), of a server started here or of --url.")
    @click.option("--url", default=None,
                  help="With --target http: a running service's base URL (needs --api-key "
                       "of a fresh tenant, --database-url of its database, one --strategy).")
    @click.option("--api-key", default=None, help="With --url: the API key to buy with.")
    def flash_sale(units: int, buyers: int, processes: int | None, requests_: int | None,
                   quantity: int, skus: int,
                   hot_share: float, retry_rate: float, claim: float, release: float,
                   expire: float, expire_ttl: float, strategy: str, batching: str,
                   pool_cap: int,
                   replenish: bool, takes: int | None, window: int, durable: bool, seed: int,
                   json_path: str | None, plot_path: str | None, quiet: bool,
                   database_url: str | None, target: str, url: str | None,
                   api_key: str | None) -> None:
        """Many buyers, few units: reservations/s, rejections/s, latency and the invariants."""
        from . import report

        http: HttpTarget | None = None
        if target == "http":
            if url is not None:
                if not api_key:
                    raise click.BadParameter("--url needs --api-key", param_hint="--api-key")
                if not database_url:
                    raise click.BadParameter(
                        "--url needs --database-url (the service's database: the bench "
                        "seeds the stock and checks the books there)",
                        param_hint="--database-url")
                if strategy == "all":
                    raise click.BadParameter("--url runs one strategy (row or pool) per "
                                             "fresh tenant", param_hint="--strategy")
                if batching == "off":
                    raise click.BadParameter("--url measures the running service as it is "
                                             "configured (it batches)", param_hint="--batching")
            http = HttpTarget(url=url, api_key=api_key)
        elif url is not None or api_key is not None:
            raise click.BadParameter("--url and --api-key go with --target http",
                                     param_hint="--target")
        strategies = ("row", "pool") if strategy == "all" else (strategy,)
        if processes is None:
            processes = 1 if target == "http" else default_processes(buyers)
        elif target == "http" and processes != 1:
            raise click.BadParameter("--target http runs its buyers in one process",
                                     param_hint="--processes")
        modes = {"on": (True,), "off": (False,), "both": (True, False)}[batching]
        common: dict[str, Any] = {
            "buyers": buyers, "processes": processes, "claim": claim, "release": release,
            "expire": expire, "expire_ttl_s": expire_ttl, "pool_cap": pool_cap,
            "replenish": replenish, "durable": durable, "seed": seed, "window": window,
            "strategies": strategies, "batching": modes}
        try:
            if takes is not None:
                if strategy == "row":
                    raise click.BadParameter("the long run (--takes) is one pool bucket: "
                                             "use --strategy pool (or all)",
                                             param_hint="--strategy")
                common["strategies"] = ("pool",)
                scenario = Scenario.long_run(takes, **common)
            else:
                scenario = Scenario(
                    units=units, requests=requests_ if requests_ is not None else 3 * units * skus,
                    quantity=quantity, skus=skus, hot_share=hot_share, retry_rate=retry_rate,
                    **common)
        except InvalidRequest as exc:
            raise click.BadParameter(exc.message) from None
        out = Console()
        err = Console(stderr=True)
        with _migrated(database_url, durable) as (dsn, where, data_dir):
            err.print(f"[dim]{where}; {scenario.buyers} buyers in {scenario.processes} "
                      f"process{'es' if scenario.processes > 1 else ''}, "
                      f"{scenario.requests:,} requests per run, batching {batching}, "
                      f"{_commit_mode(durable)}[/]")
            durability = _durability(dsn, data_dir, durable, err,
                                     service_sessions=http is not None
                                     and http.url is not None)
            try:
                runs = _run(dsn, scenario, quiet, err, before_check, http)
            except InvalidRequest as exc:
                raise click.ClickException(exc.message) from None
        report.render(out, scenario, runs)
        extra: dict[str, Any] = {"database": where, "target": target,
                                 "durable": durability.durable,
                                 "durability": durability.to_dict()}
        if http is not None:
            extra["api"] = http.url or "started by the bench (uvicorn, in-process, 127.0.0.1)"
        doc = report.document(scenario, runs, extra)
        if json_path:
            _write("--json", json_path, lambda: report.write_json(json_path, doc), err)
        if plot_path:
            _write("--plot", plot_path, lambda: report.write_plot(plot_path, runs), err)
        if not all(run.invariants_ok for run in runs):
            err.print("[bold red]invariants failed[/]")
            raise SystemExit(1)
        failed = [run for run in runs if not run.measures]
        for run in failed:
            err.print(f"[bold yellow]warning: the {run.strategy} {run.mode} run had "
                      f"{run.errors:,} errors in {run.requests:,} requests, over 1%: its "
                      f"rates do not measure holds, and no ratio uses them[/]")
        if failed:
            raise SystemExit(1)

    return flash_sale


def _run(dsn: str, scenario: Scenario, quiet: bool, err: Console,
         before_check: BeforeCheck | None, http: HttpTarget | None) -> list[RunResult]:
    from .runner import run_label, run_scenario, runs_of

    if quiet:
        return asyncio.run(run_scenario(dsn, scenario, before_check=before_check, http=http))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as bar:
        labels = [run_label(s, b) for s, b in runs_of(scenario, http)]
        tasks = {s: bar.add_task(f"{s:>14}", total=scenario.requests) for s in labels}
        return asyncio.run(run_scenario(
            dsn, scenario, progress=lambda s, n: bar.advance(tasks[s], n),
            before_check=before_check, http=http))


bench.add_command(make_flash_sale())


@bench.command("server")
@click.option("--units", type=int, default=5_000, show_default=True,
              help="Units of the hot SKU (rounded down to a multiple of --clients).")
@click.option("--requests", "requests_", type=int, default=15_000, show_default=True,
              help="Reserve requests in all; those beyond the units are sold-out answers.")
@click.option("--clients", type=int, default=64, show_default=True,
              help="pgbench clients, one connection each.")
@click.option("--strategy", type=click.Choice(["row", "pool", "all"]), default="all",
              show_default=True)
@click.option("--pool-cap", type=int, default=1_000, show_default=True)
@click.option("--replenish/--no-replenish", default=True, show_default=True,
              help="Run the background pool replenisher during pool runs.")
@_run_options
def server_bench(units: int, requests_: int, clients: int, strategy: str, pool_cap: int,
                 replenish: bool, durable: bool, json_path: str | None,
                 database_url: str | None) -> None:
    """The flash sale sent by pgbench (C, prepared statements): the server's own rates.

    Phase one sends exactly the units as requests (every one must hold), phase two
    the rest (every one must be a sold-out answer); exits 1 if any check fails.
    """
    from . import report
    from . import server as srv
    from .results import ratios

    strategies = ("row", "pool") if strategy == "all" else (strategy,)
    try:
        held, rejections = srv.plan(units, requests_, clients)
    except InvalidRequest as exc:
        raise click.BadParameter(exc.message) from None
    out = Console()
    err = Console(stderr=True)
    with _migrated(database_url, durable) as (dsn, where, data_dir):
        err.print(f"[dim]{where}; pgbench, {clients} clients, {held:,} holds then "
                  f"{rejections:,} sold-out requests per strategy, "
                  f"{_commit_mode(durable)}[/]")
        durability = _durability(dsn, data_dir, durable, err)
        runs = []
        for name in strategies:
            try:
                runs.append(asyncio.run(srv.run_server_bench(
                    dsn, name, units=units, requests=requests_, clients=clients,
                    pool_cap=pool_cap, replenish=replenish, durable=durable)))
            except InvalidRequest as exc:
                raise click.ClickException(exc.message) from None
    for run in runs:
        table = Table(title=f"flash sale from pgbench, strategy {run.strategy}",
                      title_justify="left")
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_column("how it is counted")
        table.add_row("holds", f"{run.held:,}", f"of {run.units:,} phase-one requests")
        table.add_row("rejected (sold out)", f"{run.rejected:,}",
                      f"of {run.rejections_sent:,} phase-two requests")
        for label, phase in (("reservations/s", run.holds), ("rejections/s", run.sold_out)):
            if phase is not None:
                table.add_row(label, f"{phase.tps:,.1f}",
                              f"pgbench tps; latency average {phase.latency_ms:.2f} ms; "
                              f"{phase.retried} retried, {phase.failed} failed")
        if run.strategy == "pool":
            table.add_row("background refills", f"{run.background_refills:,}", "")
        failed = [name for name, ok in run.invariants.items() if not ok]
        table.add_row("invariants", "[green]ok[/]" if run.invariants_ok else "[red]FAILED[/]",
                      ", ".join(failed) if failed else "counts, books, service checks")
        out.print(table)
        for violation in run.violations[:10]:
            out.print(f"  [red]violation[/] {violation}")
    figures = ratios(runs)
    out.print("[bold]ratios[/]")
    for name, value in figures.items():
        out.print(f"  {name}: {'n/a' if value is None else f'{value:.2f}'}")
    if json_path:
        doc = {"runs": [run.to_dict() for run in runs], "ratios": figures,
               "config": {"client": "pgbench (prepared)", "units": held,
                          "rejections": rejections, "clients": clients, "pool_cap": pool_cap,
                          "replenish": replenish, "durable": durability.durable,
                          "durability": durability.to_dict(), "database": where}}
        _write("--json", json_path, lambda: report.write_json(json_path, doc), err)
    if not all(run.invariants_ok for run in runs):
        err.print("[bold red]invariants failed[/]")
        raise SystemExit(1)


@bench.command("http")
@click.option("--seconds", type=click.IntRange(1, 600), default=10, show_default=True,
              help="Each measured wrk run against a server (wrk counts whole seconds).")
@click.option("--rounds", type=click.IntRange(1, 20), default=2, show_default=True,
              help="Measured runs per server, alternating: bare, service | service, bare | "
                   "... (each server's figures are the sums; an even number cancels a "
                   "steady drift of the machine).")
@click.option("--warmup", type=click.IntRange(0, 60), default=2, show_default=True,
              help="Seconds of unmeasured wrk run after each start of a server (0: none).")
@click.option("--connections", type=click.IntRange(1, 1000), default=64, show_default=True,
              help="wrk connections (concurrent buyers).")
@click.option("--threads", type=click.IntRange(1, 64), default=2, show_default=True,
              help="wrk threads.")
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True,
              help="uvicorn processes of each server (serve --workers N).")
@click.option("--strategy", type=click.Choice(["row", "pool"]), default="pool",
              show_default=True)
@click.option("--units", type=click.IntRange(1, 100_000_000), default=5_000_000,
              show_default=True,
              help="Units of the SKU: enough that the run never sells out.")
@click.option("--pool-cap", type=int, default=1_000, show_default=True)
@_run_options
def http_bench(seconds: int, rounds: int, warmup: int, connections: int, threads: int,
               workers: int, strategy: str, units: int, pool_cap: int, durable: bool,
               json_path: str | None, database_url: str | None) -> None:
    """Holds/s through `pgreserve serve --workers N`, sent by wrk, over a bare FastAPI
    endpoint's requests/s, both started the same way in this run (loopback only), measured
    in alternating rounds (bare, service | service, bare | ...).

    Every request is `POST /v1/reservations` with a one-line cart, the tenant's API key
    and a fresh Idempotency-Key; no claims. Exits 1 if the books do not balance (wrk's
    201s against the reservations in the database included), or if a measured run had
    over 1% non-201 answers (409s included) or socket errors.
    """
    from ..http.gc_tuning import threshold_from_env
    from . import report
    from .wrk import SERVICE_FLAGS, run_http_bench, service_environment, wrk_path

    try:
        threshold_from_env()  # both servers' workers read it
        wrk_path()
    except InvalidRequest as exc:
        raise click.ClickException(exc.message) from None
    out = Console()
    err = Console(stderr=True)
    with _migrated(database_url, durable) as (dsn, where, data_dir):
        err.print(f"[dim]{where}; wrk -t{threads} -c{connections} for {seconds:g} s, "
                  f"{rounds} time(s) against each server in alternating rounds (after "
                  f"{warmup:g} s of warm-up at each start), {workers} uvicorn processes each, "
                  f"strategy {strategy}, {_commit_mode(durable)}[/]")
        durability = _durability(dsn, data_dir, durable, err)
        try:
            result = asyncio.run(run_http_bench(
                dsn, strategy=strategy, units=units, pool_cap=pool_cap, workers=workers,
                threads=threads, connections=connections, seconds=seconds, warmup=warmup,
                durable=durable, rounds=rounds))
        except InvalidRequest as exc:
            raise click.ClickException(exc.message) from None
    table = Table(title=f"HTTP, wrk -t{threads} -c{connections} -d{seconds:g}s x {rounds} per "
                        f"server, POST /v1/reservations", title_justify="left")
    for name in ("server", "201/s", "requests/s", "other answers", "p50 / p99 ms (worst run)",
                 "cores: server / postgres / wrk"):
        table.add_column(name, justify="left" if name == "server" else "right")
    for endpoint in (result.bare, result.service):
        total = endpoint.total
        cores = [total.cores(c) for c in (total.server_cpu_s, total.postgres_cpu_s,
                                          total.wrk_cpu_s)]
        lat = total.latency_ms
        table.add_row(endpoint.name, f"{total.created_per_s or 0:,.0f}",
                      f"{total.requests_per_s or 0:,.0f}",
                      f"{total.rejected + total.other_status:,} non-201, "
                      f"{total.replayed:,} replayed, "
                      f"{total.socket_errors:,} socket errors",
                      f"{lat['p50']:.2f} / {lat['p99']:.2f}",
                      " / ".join("n/a" if c is None else f"{c:.2f}" for c in cores))
    out.print(table)
    refused = result.service.total.rejected
    if refused:
        out.print(f"[yellow]the SKU sold out: {refused:,} reserves were "
                  f"refused (409); raise --units for {rounds} x {seconds:g} s and the "
                  f"warm-ups[/]")
    failing = result.failing_rounds()
    for bad in failing:
        out.print(f"[bold yellow]warning: {bad['server']} round {bad['round']}: "
                  f"{bad['non_201']:,} non-201 answers ({bad['rejected']:,} 409, "
                  f"{bad['other_status']:,} other) and {bad['socket_errors']:,} socket "
                  f"errors of {bad['requests']:,} requests, over 1%: this run does not "
                  f"measure holds[/]")
    out.print(f"reservations in the database: {result.reservations:,} (warm-up included); "
              f"{result.commits:,} commits while the service ran (reads included)")
    ratio = result.ratio
    out.print("[bold]ratio[/]\n  service_holds_over_bare_requests_per_s: "
              + ("n/a" if ratio is None else f"{ratio:.2f}")
              + "  (by round: " + ", ".join("n/a" if r is None else f"{r:.2f}"
                                            for r in result.round_ratios()) + ")")
    if json_path:
        doc = {**result.to_dict(), "config": {
            "seconds": seconds, "rounds": rounds, "warmup": warmup,
            "connections": connections,
            "threads": threads, "workers": workers, "strategy": strategy, "units": units,
            "pool_cap": pool_cap, "durable": durability.durable,
            "durability": durability.to_dict(), "database": where,
            "service_environment": service_environment(),
            "service_flags": list(SERVICE_FLAGS),
            "client": "wrk (Lua: POST /v1/reservations, one-line cart, fresh Idempotency-Key)"}}
        _write("--json", json_path, lambda: report.write_json(json_path, doc), err)
    if not result.ok:
        for violation in (result.violations + result.books_violations())[:10]:
            out.print(f"  [red]violation[/] {violation}")
        err.print("[bold red]invariants failed[/]")
        raise SystemExit(1)
    if failing:
        err.print(f"[bold red]{len(failing)} measured run(s) with over 1% non-201 answers "
                  f"or socket errors[/]")
        raise SystemExit(1)
