"""uvicorn's production options and the request log's settings, each on a real `serve`."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from procs import Running, running
from test_cli import clean_env, pgr
from test_cli_up import BIN, free_port


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short temporary directory (a Unix socket path must stay under 108 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="pgr-srv-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


Serving = Running


@contextmanager
def serving(*args: str, env: dict[str, str] | None = None, stop: bool = True,
            ready: str = "Press Ctrl-C") -> Iterator[Running]:
    """`pgreserve serve --no-ops ARGS` until its banner (`ready`) is out; SIGTERM (exit 0)
    at the end unless `stop` is False (the test stops it)."""
    with running([str(BIN), "serve", "--no-ops", *args], env=env or clean_env(), ready=ready,
                 stop=stop, wait_s=120) as served:
        yield served


def api_key(dsn: str) -> str:
    created = pgr("tenant", "create", "shop", "--json", "--database-url", dsn)
    assert created.returncode == 0, created.stderr
    return str(json.loads(created.stdout)["api_key"])


def self_signed(folder: Path, password: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, encrypted with `password` (openssl CLI)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    openssl = shutil.which("openssl")
    assert openssl is not None
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert), "-passout", f"pass:{password}"],
                   check=True, capture_output=True)
    return cert, key


def test_tls_serves_https_with_an_encrypted_key(dsn: str, folder: Path) -> None:
    """With --ssl-certfile, --ssl-keyfile and the key's password (from the environment) the
    API answers over HTTPS with that certificate, plain HTTP gets no answer, and the
    password is never printed."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command (Debian package openssl)")
    cert, key = self_signed(folder, "tls-secret-77")
    port = free_port()
    env = clean_env(PGRESERVE_SSL_KEYFILE_PASSWORD="tls-secret-77")  # noqa: S106 - the test's own key
    with serving("--database-url", dsn, "--port", str(port), "--ssl-certfile", str(cert),
                 "--ssl-keyfile", str(key), env=env) as server:
        assert f"API: https://127.0.0.1:{port}" in server.output
        context = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=context) as client:
            answer = client.get(f"https://127.0.0.1:{port}/openapi.json")
            assert answer.status_code == 200 and answer.json()["info"]["title"] == "pgreserve"
            assert client.get(f"https://127.0.0.1:{port}/v1/stock/berlin/tee").status_code == 401
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5)
    assert "tls-secret-77" not in server.output


def test_unix_socket_from_the_settings_file(dsn: str, folder: Path) -> None:
    """`uds` in the --config file puts the API on that Unix socket: a request over it is
    answered, and its request-log line has no client address."""
    sock = folder / "api.sock"
    log = folder / "requests.log"
    conf = folder / "pgreserve.toml"
    conf.write_text(f"uds = {json.dumps(str(sock))}\n"
                    f"request_log_file = {json.dumps(str(log))}\n"
                    'request_log_format = "json"\n')
    key = api_key(dsn)
    with serving("--config", str(conf), "--database-url", dsn) as server:
        assert f"API: http+unix://{sock}" in server.output
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                          base_url="http://pgreserve") as client:
            put = client.put("/v1/stock/berlin/tee", json={"on_hand": 5},
                             headers={"Authorization": f"Bearer {key}"})
            assert put.status_code == 201, put.text
            assert put.json()["on_hand"] == 5
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["method"], e["status"], e["client"]) for e in lines] == [("PUT", 201, None)]


@pytest.mark.parametrize(("options", "client"), [
    ((), "127.0.0.1"),
    (("--proxy-headers", "--forwarded-allow-ips", "10.9.9.9"), "127.0.0.1"),
    (("--proxy-headers", "--forwarded-allow-ips", "127.0.0.1"), "203.0.113.7"),
    (("--proxy-headers", "--forwarded-allow-ips", "127.0.0.0/8,10.0.0.0/8"), "203.0.113.7"),
])
def test_x_forwarded_for_is_believed_only_from_allowed_proxies(
        dsn: str, folder: Path, options: tuple[str, ...], client: str) -> None:
    """The request log's client address is the X-Forwarded-For one only with
    --proxy-headers and a request from an address of --forwarded-allow-ips; otherwise
    it is the peer's own."""
    port = free_port()
    log = folder / "requests.log"
    with serving("--database-url", dsn, "--port", str(port), "--request-log-file", str(log),
                 "--log-format", "json", *options):
        answer = httpx.get(f"http://127.0.0.1:{port}/v1/stock/berlin/tee",
                           headers={"X-Forwarded-For": "203.0.113.7"})
        assert answer.status_code == 401
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["route"], e["client"]) for e in entries] == [("/v1/stock/{location}/{sku}", client)]


def test_root_path_shows_in_openapi_servers_and_docs(dsn: str) -> None:
    """With --root-path the OpenAPI document's servers and the docs page's document URL
    carry the prefix, while the routes answer the paths the proxy forwards, prefix
    stripped."""
    port = free_port()
    with serving("--database-url", dsn, "--port", str(port), "--root-path", "/reservations"):
        base = f"http://127.0.0.1:{port}"
        doc = httpx.get(f"{base}/openapi.json").json()
        assert doc["servers"] == [{"url": "/reservations"}]
        docs = httpx.get(f"{base}/docs")
        assert docs.status_code == 200 and "/reservations/openapi.json" in docs.text
        assert httpx.get(f"{base}/v1/stock/berlin/tee").status_code == 401


def test_request_log_off_and_text_to_a_file(dsn: str, folder: Path) -> None:
    """--no-request-log writes no request line; --request-log-file with
    --request-log-format text writes text lines there while other logs stay JSON."""
    port = free_port()
    with serving("--database-url", dsn, "--port", str(port), "--no-request-log") as quiet:
        assert httpx.get(f"http://127.0.0.1:{port}/v1/stock/berlin/tee").status_code == 401
    assert " request method=" not in quiet.output and '"event":"request"' not in quiet.output
    log = folder / "text.log"
    port = free_port()
    with serving("--database-url", dsn, "--port", str(port), "--request-log-file", str(log),
                 "--request-log-format", "text", "--log-format", "json") as loud:
        assert httpx.get(f"http://127.0.0.1:{port}/v1/stock/berlin/tee").status_code == 401
    line, = log.read_text().splitlines()
    assert " request method=GET route=/v1/stock/{location}/{sku} status=401 " in line
    assert line.endswith(" client=127.0.0.1")
    assert " request method=" not in loud.output


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True


def _put_head(port: int, key: str, body: bytes) -> bytes:
    return (f"PUT /v1/stock/berlin/tee HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()


def test_sigterm_lets_an_in_flight_request_finish(dsn: str) -> None:
    """A request in flight when SIGTERM arrives (its body half sent) still gets its answer
    after the server has stopped accepting connections; then the process exits 0."""
    key = api_key(dsn)
    port = free_port()
    body = json.dumps({"on_hand": 42}).encode()
    with serving("--database-url", dsn, "--port", str(port), stop=False) as server, \
            socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(_put_head(port, key, body) + body[:5])
        time.sleep(0.5)  # the headers are parsed and the app awaits the rest of the body
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not _refused(port):
            assert time.monotonic() < deadline, server.output
            time.sleep(0.1)
        assert server.proc.poll() is None  # still waiting for our request
        conn.sendall(body[5:])
        conn.settimeout(30)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 201 "), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["on_hand"] == 42
        assert server.proc.wait(timeout=60) == 0, server.output


def test_graceful_shutdown_timeout_cuts_a_stalled_request(dsn: str) -> None:
    """With --timeout-graceful-shutdown 1 a request that never completes does not hold
    the shutdown: the process exits 0 and the client gets no answer."""
    key = api_key(dsn)
    port = free_port()
    body = json.dumps({"on_hand": 42}).encode()
    with serving("--database-url", dsn, "--port", str(port), "--timeout-graceful-shutdown",
                 "1", stop=False) as server, \
            socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(_put_head(port, key, body) + body[:5])
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.output
        conn.settimeout(10)
        assert not conn.recv(65536).startswith(b"HTTP/1.1 2")


def test_workers_processes_share_the_request_log_file_and_server_options(
        dsn: str, folder: Path) -> None:
    """`serve --workers 2` hands the request log file, its format and the proxy settings to
    every process: each request is one whole JSON line there, with the forwarded client."""
    port = free_port()
    log = folder / "requests.log"
    with serving("--database-url", dsn, "--port", str(port), "--workers", "2",
                 "--request-log-file", str(log), "--request-log-format", "json",
                 "--proxy-headers", "--forwarded-allow-ips", "127.0.0.1",
                 ready="(2 processes)") as server, httpx.Client() as client:
        deadline = time.monotonic() + 60
        while _refused(port):  # the processes' shared socket is bound after the banner
            assert time.monotonic() < deadline, server.output
            time.sleep(0.2)
        for _ in range(6):
            answer = client.get(f"http://127.0.0.1:{port}/v1/stock/berlin/tee",
                                headers={"X-Forwarded-For": "198.51.100.4"})
            assert answer.status_code == 401
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["status"], e["client"]) for e in entries] == [(401, "198.51.100.4")] * 6
