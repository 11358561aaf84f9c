"""What the suite needs beyond its Python packages, said up front and counted at the end.

Some tests need a program from a Debian package (`.ci/run` installs them). Where one
is missing those tests skip, with the reason this module gives them. The report
header names every missing program, what skips without it and the package that
brings it; the terminal summary ends with the number of skipped tests per reason.
tests/conftest.py imports the hooks.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Tool:
    """A program some tests need, the Debian package that has it and what skips without it."""

    name: str
    package: str
    needed_by: str
    extra_paths: tuple[str, ...] = ()

    def path(self) -> str | None:
        found = shutil.which(self.name)
        if found:
            return found
        return next((p for p in self.extra_paths if Path(p).exists()), None)

    @property
    def reason(self) -> str:
        return (f"{self.name} is not installed (Debian package {self.package}: "
                f"apt-get install {self.package}; .ci/run installs it)")


TOOLS: dict[str, Tool] = {t.name: t for t in (
    Tool("pgbouncer", "pgbouncer",
         "every API test's [pgbouncer] variant and tests/test_ops_pgbouncer.py",
         extra_paths=("/usr/sbin/pgbouncer",)),
    Tool("chromium", "chromium", "the /ops page rendered in headless Chromium "
         "(tests/test_ops_page.py)"),
    Tool("redis-server", "redis-server", "the legacy Redis hold store and the rollout "
         "modes (tests/test_rollout.py)", extra_paths=("/usr/bin/redis-server",)),
    Tool("wrk", "wrk", "`pgreserve bench http` run end to end (tests/test_bench_http.py)",
         extra_paths=("/usr/bin/wrk",)),
)}


def hidden() -> set[str]:
    """Tools PGRESERVE_TEST_HIDE_TOOLS (comma-separated) says to treat as missing: a run
    that shows what a machine without them skips."""
    return {t.strip() for t in os.environ.get("PGRESERVE_TEST_HIDE_TOOLS", "").split(",")
            if t.strip()}


def find(name: str) -> str | None:
    """The path of tool `name`, or None when it is not installed (or hidden)."""
    tool = TOOLS[name]
    if name in hidden():
        return None
    if name == "chromium":
        return tool.path() or shutil.which("chromium-browser")
    return tool.path()


def require(name: str) -> str:
    """The path of tool `name`; skips the calling test (with the standard reason) if missing."""
    found = find(name)
    if found is None:
        pytest.skip(TOOLS[name].reason)
    return found


def missing() -> list[Tool]:
    return [t for t in TOOLS.values() if find(t.name) is None]


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = []
    bin_dir = os.environ.get("PGRESERVE_TEST_PG_BIN")
    if bin_dir:
        lines.append(f"database: PostgreSQL from {bin_dir} (PGRESERVE_TEST_PG_BIN); only the "
                     "tests that use the session's server (pg_server) run")
    else:
        lines.append("database: the embedded PostgreSQL 18 (set PGRESERVE_TEST_PG_BIN="
                     "/usr/lib/postgresql/NN/bin to test another installed server)")
    gone = missing()
    if not gone:
        lines.append("optional programs: all installed (" + ", ".join(TOOLS) + ")")
    for tool in gone:
        lines.append(f"WILL SKIP: {tool.needed_by}: {tool.reason}")
    return lines


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    counts = Counter(_skip_reason(r) for r in skipped if isinstance(r, pytest.TestReport))
    if not counts:
        return
    terminalreporter.section("skipped tests per reason")
    for reason, n in counts.most_common():
        terminalreporter.write_line(f"{n:>5} skipped: {reason}")
