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
