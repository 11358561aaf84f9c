"""`make test` on a machine without the optional Debian programs says so up front and
counts the skips per reason at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import toolcheck

ROOT = Path(__file__).resolve().parent.parent


def test_a_run_without_the_optional_programs_says_what_skips_and_counts_it() -> None:
    """With pgbouncer, chromium and redis-server missing, the header names each, what skips
    and its Debian package, and the summary counts 3 pgbouncer, 1 chromium and 1
    redis-server skips."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGRESERVE_")}
    env["PATH"] = str(Path(sys.executable).parent)  # no pgbouncer, chromium, wrk, redis
    env["PGRESERVE_TEST_HIDE_TOOLS"] = "pgbouncer,chromium,redis-server"  # /usr/sbin too
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
         "tests/test_ops_pgbouncer.py",
         "tests/test_ops_page.py::test_ops_page_in_chromium_shows_the_database_figures",
         "tests/test_rollout.py::test_legacy_keys_are_namespaced_per_tenant"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    header, _, rest = text.partition("collected ")
    assert ("WILL SKIP: every API test's [pgbouncer] variant and tests/test_ops_pgbouncer.py: "
            "pgbouncer is not installed (Debian package pgbouncer: apt-get install pgbouncer"
            in header), text
    assert "WILL SKIP: the /ops page rendered in headless Chromium" in header
    assert "apt-get install chromium" in header
    assert "WILL SKIP: the legacy Redis hold store" in header
    assert "apt-get install redis-server" in header
    summary = rest.partition("skipped tests per reason")[2]
    assert f"    3 skipped: {toolcheck.TOOLS['pgbouncer'].reason}" in summary, text
    assert f"    1 skipped: {toolcheck.TOOLS['chromium'].reason}" in summary, text
    assert f"    1 skipped: {toolcheck.TOOLS['redis-server'].reason}" in summary, text
    assert " 5 skipped" in text.strip().splitlines()[-1]

