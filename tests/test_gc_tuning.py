"""The serving processes' garbage collector: frozen startup heap, a larger young generation.

Each check that sets the collector runs in a Python process of its own: the test
process keeps its own settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pgreserve.http.gc_tuning import DEFAULT_GC_THRESHOLD, GC_THRESHOLD_ENV, gc_threshold
from procs import running
from test_cli import clean_env, pgr, short_dir
from test_cli_up import free_port

__all__ = ["short_dir"]  # a fixture of test_cli

PROBE = ("import gc, json\n{setup}\n"
         "print(json.dumps([gc.get_threshold(), gc.get_freeze_count()]))\n")


def _python_defaults() -> tuple[int, ...]:
    done = subprocess.run([sys.executable, "-c", "import gc; print(*gc.get_threshold())"],
                          capture_output=True, text=True, check=True, timeout=60)
    return tuple(int(v) for v in done.stdout.split())


PYTHON_DEFAULTS = _python_defaults()  # a fresh interpreter's thresholds

def probe(setup: str, **env: str) -> tuple[list[int], int]:
    """gc's threshold and frozen object count after `setup` ran in a new process."""
    done = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup)],
                          capture_output=True, text=True, check=True, timeout=120,
                          env={**os.environ, **env})
    threshold, frozen = json.loads(done.stdout.strip().splitlines()[-1])
    return threshold, frozen


@pytest.mark.parametrize(("value", "expected"), [
    (None, DEFAULT_GC_THRESHOLD), ("", DEFAULT_GC_THRESHOLD), (" OFF ", None),
    ("700,10,10", (700, 10, 10)), ("20000, 20, 5", (20000, 20, 5))])
def test_the_setting_is_read(value: str | None, expected: tuple[int, int, int] | None) -> None:
    assert gc_threshold(value) == expected


@pytest.mark.parametrize("value", ["10000", "1,2,3,4", "0,10,10", "-5,10,10", "a,b,c",
                                   "1.5,10,10", "99999999,10,10", "\u00b2,10,10",
                                   "\u0661\u0660,10,10"])
def test_a_malformed_setting_is_refused_with_its_name(value: str) -> None:
    with pytest.raises(ValueError, match=f"{GC_THRESHOLD_ENV} must be 'off' or three integers "
                                         "from 1 to 10,000,000"):
        gc_threshold(value)


def test_a_worker_factory_freezes_its_heap_and_raises_the_threshold() -> None:
    """`serve --workers N` builds each process's app with app_from_env: after it, the
    startup heap is frozen and a young collection waits for 10,000 objects."""
    setup = "from pgreserve.http.app import app_from_env\napp_from_env()"
    dsn = "host=/nonexistent dbname=none"  # the pool opens at startup, not here
    threshold, frozen = probe(setup, PGRESERVE_DATABASE_URL=dsn)
    assert tuple(threshold) == DEFAULT_GC_THRESHOLD
    assert frozen > 10_000  # modules, the app, its routes and models
    threshold, frozen = probe(setup, PGRESERVE_DATABASE_URL=dsn, **{GC_THRESHOLD_ENV: "off"})
    assert tuple(threshold) == PYTHON_DEFAULTS and frozen == 0
    threshold, _ = probe(setup, PGRESERVE_DATABASE_URL=dsn, **{GC_THRESHOLD_ENV: "5000,5,5"})
    assert tuple(threshold) == (5000, 5, 5)


def test_the_bare_benchmark_endpoint_is_set_up_the_same_way() -> None:
    """bench http's bare endpoint runs with the service workers' collector settings."""
    threshold, frozen = probe("from pgreserve.bench.bare import create_app\ncreate_app()")
    assert tuple(threshold) == DEFAULT_GC_THRESHOLD and frozen > 0


def test_create_app_leaves_the_host_process_collector_alone() -> None:
    """A host application that builds pgreserve's app keeps its own settings."""
    setup = "from pgreserve.http.app import create_app\ncreate_app('host=/nonexistent')"
    threshold, frozen = probe(setup)
    assert tuple(threshold) == PYTHON_DEFAULTS and frozen == 0


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_malformed_setting_stops_the_server_before_anything_starts(
        tmp_path: Path, command: str) -> None:
    """`up` / `serve` with a malformed PGRESERVE_GC_THRESHOLD exit 1 with one line naming
    it, no traceback, and create nothing."""
    result = pgr(command, "--data-dir", str(tmp_path / "data"), "--port", str(free_port()),
                 cwd=tmp_path, env={**clean_env(), GC_THRESHOLD_ENV: "lots"})
    assert result.returncode == 1, result.stderr
    assert GC_THRESHOLD_ENV in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_bench_http_refuses_a_malformed_setting_before_starting_a_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both servers of `bench http` read PGRESERVE_GC_THRESHOLD: a malformed value is one
    line and exit 1 before any database or server starts (their workers would crash)."""
    from click.testing import CliRunner

    from pgreserve.bench.cli import bench

    monkeypatch.setenv(GC_THRESHOLD_ENV, "lots")
    result = CliRunner().invoke(bench, ["http", "--seconds", "1"])
    assert result.exit_code == 1, result.output
    assert GC_THRESHOLD_ENV in result.output and "embedded PostgreSQL" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


# The command line, run by a Python that prints its collector's settings as it exits.
AT_EXIT = ("import atexit, gc, json, sys\n"
           "atexit.register(lambda: print('GC ' + json.dumps([gc.get_threshold(), "
           "gc.get_freeze_count()]), flush=True))\n"
           "from pgreserve.cli import main\n"
           "sys.argv[0] = 'pgreserve'\n"
           "main()\n")


def served_collector(args: list[str], **env: str) -> tuple[tuple[int, ...], int]:
    """gc's threshold and frozen count of a `pgreserve ARGS` process that served until
    SIGTERM (read as it exits)."""
    with running([sys.executable, "-c", AT_EXIT, *args, "--port", str(free_port()),
                  "--ops-port", str(free_port())], env=clean_env(**env)) as served:
        assert "Press Ctrl-C" in served.output
    line = next(line for line in served.lines if line.startswith("GC "))
    threshold, frozen = json.loads(line[3:])
    return tuple(threshold), frozen


def test_serve_with_one_process_sets_up_its_collector(dsn: str) -> None:
    """`serve` (one process: the API and the ops listener in this event loop) freezes
    its startup heap and raises the threshold once it serves; `off` keeps Python's."""
    threshold, frozen = served_collector(["serve", "--database-url", dsn])
    assert threshold == DEFAULT_GC_THRESHOLD and frozen > 10_000
    threshold, frozen = served_collector(["serve", "--database-url", dsn],
                                         **{GC_THRESHOLD_ENV: "off"})
    assert threshold == PYTHON_DEFAULTS and frozen == 0


def test_up_sets_up_its_collector(short_dir: Path) -> None:
    """`up` (embedded database, API and workers in one process) does the same."""
    threshold, frozen = served_collector(["up", "--data-dir", str(short_dir / "data")],
                                         **{GC_THRESHOLD_ENV: "4000,8,8"})
    assert threshold == (4000, 8, 8) and frozen > 10_000
