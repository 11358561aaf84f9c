"""Show what a run measured: a table per strategy, the JSON document, the PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .results import HELD, REJECTED, RunResult, comparison, ratios
from .scenario import Scenario


def document(scenario: Scenario, runs: list[RunResult],
             extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every figure of the run, as written by --json."""
    return {
        "runs": [run.to_dict() for run in runs],
        "ratios": ratios(runs),
        "comparison": comparison(runs),
        "config": {**scenario.to_dict(), **(extra_config or {})},
    }


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _rows(scenario: Scenario, run: RunResult) -> list[tuple[str, str, str]]:
    """(figure, value, how it is counted) of one run."""
    lat = run.latency_ms()
    climb = run.take_windows()
    db = run.db_view()
    out: list[tuple[str, str, str]] = []

    def add(label: str, value: str, note: str) -> None:
        out.append((label, value, note))

    add("requests", f"{run.requests:,}", "reserve calls sent, retries included")
    add("holds granted", f"{run.held:,}",
        f"{run.granted_units:,} units; {run.claimed:,} claimed, {run.released:,} released")
    add("rejected (sold out)", f"{run.rejected:,}", "")
    add("retries (replayed)", f"{run.retries:,}", "same request key answered from the ledger")
    add("errors", f"{run.errors:,}",
        ", ".join(f"{k} {v}" for k, v in run.error_kinds.items()) or "")
    add("reservations/s", _num(run.reservations_per_s),
        f"{run.held:,} holds in {_num(run.sellout_s, 3)} s (until the last hold)")
    add("rejections/s", _num(run.rejections_per_s),
        f"{run.rejections_after_sellout:,} rejections in "
        f"{_num(run.rejection_window_s, 3)} s after the last hold")
    for key in ("p50", "p90", "p99", "p999", "max"):
        label = "p99.9" if key == "p999" else key
        add(f"latency {label}", f"{lat[key]:.2f} ms",
            "all reserve calls (HDR histogram)" if key == "p50" else "")
    if climb["window"]:
        add("take p99 first/last", f"{_num(climb['first_p99_ms'], 2)} / "
            f"{_num(climb['last_p99_ms'], 2)} ms",
            f"windows of {climb['window']:,} holds; ratio {_num(climb['ratio'], 2)}")
    sizes = run.batch_sizes()
    batch = run.batch
    add("batch size p50/p90/p99",
        "-" if sizes is None else f"{sizes['p50']} / {sizes['p90']} / {sizes['p99']}",
        "requests per combiner batch, over requests (reserves, claims, releases)"
        + ("" if batch is None else f"; {batch.batches:,} batches, "
           f"{batch.splits} splits, {batch.busy} busy"))
    usage = run.usage.to_dict(run.held) if run.usage is not None else None
    if usage is not None:
        sell = usage["selling_window"]
        unit = "ms" if usage["cpu_source"] == "proc" else "ms exec"
        add("server CPU / hold", f"{_num(sell['server_cpu_ms_per_hold'], 3)} {unit}",
            f"until the last hold ({usage['cpu_source'] or 'unavailable'}); whole run "
            f"{_num(usage['server_cpu_ms_per_hold'], 3)}; "
            f"{_num(sell['server_cores'], 2)} cores")
        add("client CPU / hold", f"{_num(sell['client_cpu_ms_per_hold'], 3)} ms",
            f"bench processes until the last hold; whole run "
            f"{_num(usage['client_cpu_ms_per_hold'], 3)}; "
            f"{_num(sell['client_cores'], 2)} cores")
        add("WAL bytes / hold", _num(sell["wal_bytes_per_hold"], 0),
            "WAL position until the last hold; whole run (pg_stat_wal) "
            f"{_num(usage['wal_bytes_per_hold'], 0)}")
    add("pool dead tuples", f"{db.get('pool_dead_tuples_before', 'n/a')} -> "
        f"{db.get('pool_dead_tuples_after', 'n/a')}",
        "stock_unit_p* before -> after; peak "
        f"{db.get('pool_dead_tuples_peak', 'n/a')}, "
        f"{db.get('pool_rows_deleted', 'n/a')} rows deleted, "
        f"{db.get('pool_vacuums', 'n/a')} vacuums")
    if "background_refills" in db:
        add("background refills", f"{db['background_refills']:,}",
            f"{db['background_refilled_units']:,} units put in the pool by "
            "the replenisher")
    add("deadlocks / commits / rollbacks",
        f"{db.get('deadlocks', 'n/a')} / {db.get('xact_commit', 'n/a')} / "
        f"{db.get('xact_rollback', 'n/a')}",
        "pg_stat_database delta; client retried "
        f"{db.get('client_deadlocks_retried', 'n/a')} deadlocks")
    book = run.ledger
    if book is not None:
        add("sold + held + available", f"{run.claimed_units:,} + {book.held:,} + "
            f"{book.free + book.pool:,}",
            f"= {run.claimed_units + book.held + book.free + book.pool:,}; "
            f"seeded {scenario.seeded_units:,}")
    add("oversold", f"{run.oversold:,}", "units granted beyond stock; must be 0")
    failed = [name for name, ok in run.invariants().items() if not ok]
    add("invariants", "[green]ok[/]" if run.invariants_ok else "[red]FAILED[/]",
        ", ".join(failed) if failed else "conservation, no oversell, "
        "holds match, service checks")
    return out


def render(console: Console, scenario: Scenario, runs: list[RunResult]) -> None:
    """One table per strategy, a value column per batching mode, then the ratios."""
    for strategy in dict.fromkeys(r.strategy for r in runs):
        group = [r for r in runs if r.strategy == strategy]
        table = Table(title=f"flash sale, strategy {strategy}, target {group[0].target}",
                      show_header=True, title_justify="left")
        table.add_column("figure")
        for run in group:
            table.add_column(run.mode, justify="right")
        table.add_column("how it is counted (first column)" if len(group) > 1
                         else "how it is counted")
        columns = [_rows(scenario, run) for run in group]
        values = [{label: value for label, value, _ in col} for col in columns]
        for label, _, note in columns[0]:
            table.add_row(label, *(v.get(label, "n/a") for v in values), note)
        console.print(table)
        for run in group:
            for violation in run.violations[:10]:
                console.print(f"  [red]violation[/] {run.label}: {violation}")
    compared = [c for c in comparison(runs) if "batched" in c and "unbatched" in c]
    if compared:
        table = Table(title="batched (on) vs unbatched (off)", title_justify="left")
        # on = batched, off = unbatched; sold-out/s and its ratio are the batched run's
        for name in ("strategy", "holds/s on", "off", "on÷off", "sold-out/s",
                     "÷ holds on", "p99 ms on", "off", "batch p50/90/99"):
            table.add_column(name, justify="left" if name == "strategy" else "right")
        for c in compared:
            on, off, sizes = c["batched"], c["unbatched"], c["batched"]["batch_sizes"]
            table.add_row(c["strategy"], _num(on["reservations_per_s"]),
                          _num(off["reservations_per_s"]),
                          _num(c["batched_over_unbatched_reservations_per_s"], 2),
                          _num(on["rejections_per_s"]),
                          _num(c["rejections_over_batched_reservations_per_s"], 2),
                          f"{on['p99_ms']:.2f}", f"{off['p99_ms']:.2f}",
                          "-" if sizes is None else
                          f"{sizes['p50']} / {sizes['p90']} / {sizes['p99']}")
        console.print(table)
    figures = ratios(runs)
    if figures:
        console.print("[bold]ratios[/]")
        for name, value in figures.items():
            console.print(f"  {name}: {_num(value, 2)}")


def write_plot(path: str | Path, runs: list[RunResult]) -> None:
    """PNG: latency over time (left) and the latency distribution (right), per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (over_time, dist) = plt.subplots(1, 2, figsize=(13, 5))
    for run in runs:
        for outcome, marker in ((HELD, "."), (REJECTED, "x")):
            points = [s for s in run.samples if s.outcome == outcome]
            if points:
                over_time.scatter([s.start for s in points], [s.latency_ms for s in points],
                                  s=2, marker=marker, alpha=0.4,
                                  label=f"{run.label} {outcome}")
        hist = run.histogram()
        if hist.get_total_count():
            xs, ys = [], []
            for item in hist.get_percentile_iterator(5):
                p = min(item.percentile_level_iterated_to, 99.9999)
                xs.append(1.0 / (1.0 - p / 100.0))
                ys.append(item.value_iterated_to / 1000.0)
            dist.plot(xs, ys, label=run.label)
    over_time.set_xlabel("time since start (s)")
    over_time.set_ylabel("reserve latency (ms)")
    over_time.set_yscale("log")
    over_time.set_title("latency over time")
    over_time.legend(markerscale=5, fontsize=8)
    dist.set_xscale("log")
    dist.set_yscale("log")
    ticks = [2, 10, 100, 1000, 10000]
    dist.set_xticks(ticks, ["50%", "90%", "99%", "99.9%", "99.99%"])
    dist.set_xlabel("percentile")
    dist.set_ylabel("latency (ms)")
    dist.set_title("latency distribution (HDR)")
    dist.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
