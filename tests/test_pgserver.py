"""The session's server is the PostgreSQL the run asked for."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psycopg

from conftest import EXTERNAL_PG_BIN


def test_the_session_server_is_the_requested_postgresql(dsn: str) -> None:
    """With PGRESERVE_TEST_PG_BIN the tests' databases live on that installation's server
    (same major version as its postgres binary); without it, on the embedded 18."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
    assert row is not None
    major = row[0] // 10000
    if EXTERNAL_PG_BIN is None:
        assert major == 18
    else:
        out = subprocess.run([str(Path(EXTERNAL_PG_BIN) / "postgres"), "--version"],
                             capture_output=True, text=True, check=True).stdout
        assert out.split()[-1].split(".")[0] == str(major), out
