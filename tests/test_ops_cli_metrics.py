"""The ops CLI views, and /metrics aggregated across processes (PROMETHEUS_MULTIPROC_DIR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from click.testing import CliRunner

from pgreserve.cli import main

WRITER = """
from pgreserve.ops.metrics import OpsMetrics
m = OpsMetrics()
m.operation("claim", "ok", 0.01)
m.operation("reserve", "held", 0.02)
"""

READER = """
from pgreserve.ops.metrics import OpsMetrics
print(OpsMetrics().render().decode())
"""


def test_metrics_add_up_across_processes() -> None:
    """With PROMETHEUS_MULTIPROC_DIR set, /metrics' renderer sums the counters and
    histograms written by every process (as under `serve --workers N`)."""
    with tempfile.TemporaryDirectory(prefix="pgreserve-metrics-") as path:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": path}
        for _ in range(2):
            subprocess.run([sys.executable, "-c", WRITER], env=env, check=True, timeout=60)
        assert len(list(Path(path).iterdir())) >= 2
        text = subprocess.run([sys.executable, "-c", READER], env=env, check=True,
                              timeout=60, capture_output=True).stdout.decode()
    assert "pgreserve_claims_total 2.0" in text
    assert 'pgreserve_reservations_total{outcome="held"} 2.0' in text
    assert 'pgreserve_operation_seconds_count{operation="reserve"} 2.0' in text


def test_ops_holdtime_and_bloat_views(dsn: str) -> None:
    """`pgreserve ops holdtime` samples pg_stat_activity and `ops bloat` lists the 16
    pool partitions, both as JSON."""
    runner = CliRunner()
    out = runner.invoke(main, ["ops", "holdtime", "--seconds", "1", "--json",
                               "--database-url", dsn])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["samples"] == 1 and "oldest_xact" in doc
    out = runner.invoke(main, ["ops", "bloat", "--json", "--database-url", dsn])
    assert out.exit_code == 0, out.output
    assert len(json.loads(out.output)["partitions"]) == 16


READER_WITH_COLLECTOR = """
from prometheus_client.core import GaugeMetricFamily
from pgreserve.ops.metrics import OpsMetrics

class Bouncer:
    def collect(self):
        yield GaugeMetricFamily("pgreserve_test_extra_clients", "an extra collector", value=3)

m = OpsMetrics()
m.register(Bouncer())
print(m.render().decode())
"""


def test_registered_collectors_are_exposed_beside_every_process_values() -> None:
    """A collector added with OpsMetrics.register (how the ops listener takes extra
    figures) is in /metrics' text, in multiprocess mode too, beside the workers' sums."""
    with tempfile.TemporaryDirectory(prefix="pgreserve-metrics-") as path:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": path}
        subprocess.run([sys.executable, "-c", WRITER], env=env, check=True, timeout=60)
        text = subprocess.run([sys.executable, "-c", READER_WITH_COLLECTOR], env=env,
                              check=True, timeout=60, capture_output=True).stdout.decode()
        single = subprocess.run([sys.executable, "-c", READER_WITH_COLLECTOR],
                                env={k: v for k, v in env.items()
                                     if k != "PROMETHEUS_MULTIPROC_DIR"},
                                check=True, timeout=60, capture_output=True).stdout.decode()
    assert "pgreserve_test_extra_clients 3.0" in text
    assert "pgreserve_claims_total 1.0" in text
    assert "pgreserve_test_extra_clients 3.0" in single


def test_ops_bloat_warns_of_a_high_partition_no_vacuum_reached(dsn: str) -> None:
    """`ops bloat` looks once, so it cannot see how long a partition has been high: a
    partition of dead tuples only, on which no vacuum ran (autovacuum off), is a
    warning, with its state in the human output too; once vacuumed, it is not. Before,
    the command could never warn: its fresh monitor needed to see one high for 300 s."""
    import asyncio

    import psycopg

    from pgreserve import Database, ReservationService

    with psycopg.connect(dsn, autocommit=True) as conn:
        for n in range(16):
            conn.execute(f"ALTER TABLE stock_unit_p{n} SET (autovacuum_enabled = false)")

    async def seed() -> int:
        async with Database(dsn, max_size=2) as db:
            svc = ReservationService(db)
            shop = await svc.create_tenant("bloaty")
            await svc.set_stock(shop.id, "hot", "wh", 300, strategy="pool", pool_cap=300)
            return shop.id

    tenant = asyncio.run(seed())
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM stock_unit WHERE tenant_id = %s", (tenant,))
        conn.execute("SELECT pg_stat_force_next_flush()")
    result = CliRunner().invoke(main, ["ops", "bloat", "--json", "--database-url", dsn])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    [bloated] = [p for p in doc["partitions"] if p["dead"] >= 300]
    assert bloated["state"] == "warning" and doc["warnings"] == [bloated["partition"]]
    human = CliRunner().invoke(main, ["ops", "bloat", "--database-url", dsn])
    [line] = [x for x in human.output.splitlines() if x.startswith(bloated["partition"] + " ")]
    assert " warning " in line, line
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"VACUUM {bloated['partition']}")
        conn.execute("SELECT pg_stat_force_next_flush()")
    again = json.loads(CliRunner().invoke(
        main, ["ops", "bloat", "--json", "--database-url", dsn]).output)
    assert again["warnings"] == []
