"""`pgreserve up` (what `make run` runs), end to end in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from procs import Running, running

BIN = Path(sys.executable).parent / "pgreserve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_up_tenant_create_reserve_and_sigterm() -> None:
    """up serves the API on an embedded database and the ops listener on its own port
    (the operations paths are 404 on the API's); tenant create joins it; each request is
    a JSON log line without the API key; SIGTERM exits 0."""
    root = Path(tempfile.mkdtemp(prefix="pgr-"))  # short: the socket lives in the data dir
    data = str(root / "data")
    port, ops_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGRESERVE_")}
    try:
        with running([str(BIN), "up", "--data-dir", data, "--port", str(port), "--ops-port",
                      str(ops_port), "--log-format", "json"], env=env, wait_s=120) as up:
            _serve_and_stop(up, data, env, port, ops_port)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _serve_and_stop(up: Running, data: str, env: dict[str, str], port: int,
                    ops_port: int) -> None:
    """The checks of test_up_tenant_create_reserve_and_sigterm on the running `up`."""
    lines = up.lines
    assert any(f"http://127.0.0.1:{port}" in x for x in lines)
    assert any("tenant create" in x for x in lines)
    created = subprocess.run([str(BIN), "tenant", "create", "shop", "--json",
                              "--data-dir", data], capture_output=True, text=True,
                             env=env, timeout=120, check=True)
    doc = json.loads(created.stdout)
    assert doc["tenant"] == "shop" and doc["api_key"].startswith("pgr_")
    headers = {"Authorization": f"Bearer {doc['api_key']}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers,
                      timeout=30) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.put("/v1/stock/wh/sku-1", json={"on_hand": 5}).status_code == 201
        resp = client.post("/v1/reservations", headers={"Idempotency-Key": "order-1"},
                           json={"lines": [{"sku": "sku-1", "location": "wh",
                                            "quantity": 2}]})
        assert resp.status_code == 201 and resp.json()["status"] == "active"
        for path in ("/metrics", "/ops", "/ops.json"):
            assert client.get(path).status_code == 404, path
            assert httpx.get(f"http://127.0.0.1:{ops_port}{path}",
                             timeout=30).status_code == 200, path
    up.stop()
    assert any("stopped cleanly" in x for x in lines)
    assert any(f"http://127.0.0.1:{ops_port}/ops" in x for x in lines)
    logged = [json.loads(x) for x in lines if x.startswith('{"ts"')]
    assert any(x.get("route") == "/v1/reservations" and x.get("status") == 201
               and x.get("request_key") == "order-1" for x in logged), lines
    assert doc["api_key"] not in "".join(lines)


def test_two_migrates_at_once_on_a_new_data_directory() -> None:
    """Two `pgreserve migrate` started together on a data directory that does not exist
    yet both succeed (one creates and tunes the server, the other joins it); before, both
    tuned and restarted it, and one failed with a traceback."""
    root = Path(tempfile.mkdtemp(prefix="pgr-"))
    data = str(root / "data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGRESERVE_")}
    try:
        procs = [subprocess.Popen([str(BIN), "migrate", "--data-dir", data], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for _ in range(2)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert not any("Traceback" in out for out in outs), outs
    finally:
        pid_file = root / "data" / "postmaster.pid"
        if pid_file.exists():  # a server left running: stop it (SIGTERM, smart shutdown)
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        shutil.rmtree(root, ignore_errors=True)
