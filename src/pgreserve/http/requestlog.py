"""One log line per request, written off the event loop.

The request path only appends a tuple to a queue; a daemon thread formats the
line (text or JSON) and writes it. What a line holds is chosen here, not by
the caller: the route template (never the raw path or the query), the tenant
id, the Idempotency-Key, the outcome, the status, the duration and the error
class. Never the Authorization header, an API key or a body.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

FORMATS = ("text", "json")

# (unix time, method, route, status, outcome, tenant id, request key, seconds, error class,
#  client address: the peer's, or the one a trusted proxy forwarded)
Entry = tuple[float, str, str, int, str, int | None, str | None, float, str | None,
              str | None]

# How long the writer waits after a write before it looks at the queue again.
PAUSE_S = 0.02

# Idempotency-Keys are at most 200 characters (longer ones are refused); a
# refused one is logged cut to this length.
KEY_CHARS = 200


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def format_text(e: Entry) -> str:
    t, method, route, status, outcome, tenant, key, seconds, error, client = e
    # The key is the client's string: quoted as JSON, so it cannot forge a field or a line.
    return (f"{_iso(t)} request method={method} route={route} status={status}"
            f" outcome={outcome} tenant_id={'-' if tenant is None else tenant}"
            f" request_key={'-' if key is None else json.dumps(key)}"
            f" duration_seconds={seconds:.6f} error_class={error or '-'}"
            f" client={client or '-'}")


def format_json(e: Entry) -> str:
    t, method, route, status, outcome, tenant, key, seconds, error, client = e
    return json.dumps({"ts": _iso(t), "event": "request", "method": method, "route": route,
                       "status": status, "outcome": outcome, "tenant_id": tenant,
                       "request_key": key, "duration_seconds": round(seconds, 6),
                       "error_class": error, "client": client}, separators=(",", ":"))


def outcome_of(status: int, replayed: bool) -> str:
    """The request's outcome class: ok, replayed (a stored answer), refused (4xx), failed."""
    if replayed:
        return "replayed"
    if status < 400:
        return "ok"
    return "refused" if status < 500 else "failed"


# At most this many bytes per write: what POSIX writes to a pipe in one piece (PIPE_BUF).
CHUNK = 4096


def chunks(lines: list[str]) -> Iterator[str]:
    """The lines, newline-ended, joined into strings of at most CHUNK bytes in UTF-8 (a
    longer line alone in its own)."""
    part: list[str] = []
    size = 0
    for line in lines:
        n = (len(line) if line.isascii()
             else len(line.encode("utf-8", "backslashreplace"))) + 1
        if part and size + n > CHUNK:
            yield "".join(part)
            part, size = [], 0
        part.append(line + "\n")
        size += n
    if part:
        yield "".join(part)


class RequestLog:
    """A queue of entries and the thread that writes them to `stream` (stderr by default).

    With `owns_stream` (a file the settings named) close() closes the stream too."""

    def __init__(self, fmt: str = "text", stream: IO[str] | None = None,
                 max_pending: int = 100_000, *, owns_stream: bool = False,
                 pause: float = PAUSE_S) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"log format must be one of {FORMATS}, not {fmt!r}")
        self.format = format_json if fmt == "json" else format_text
        self.stream = stream
        self.owns_stream = owns_stream
        self.pause = pause  # between two writes: lines wait at most about this long
        # Bounded: when the writer cannot keep up, lines are dropped (and counted)
        # rather than requests slowed or memory grown.
        self.queue: queue.Queue[Entry | threading.Event | None] = queue.Queue(max_pending)
        self.dropped = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def emit(self, entry: Entry) -> None:
        if self._thread is None:
            self._start()
        try:
            self.queue.put_nowait(entry)
        except queue.Full:
            self.dropped += 1

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="pgreserve-request-log",
                                                daemon=True)
                self._thread.start()

    def _write(self) -> None:
        """Write what is queued, then pause: a busy process's lines go out a pause's
        worth at a time, a few kilobytes per write and flush (_put), instead of waking
        this thread, taking the interpreter lock and calling write and flush once per
        request."""
        while True:
            items = [self.queue.get()]
            while True:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            lines: list[str] = []
            for item in items:
                if item is None:
                    self._put(lines)
                    return
                if isinstance(item, threading.Event):
                    self._put(lines)  # every line emitted before it is out
                    lines = []
                    item.set()
                    continue
                try:
                    lines.append(self.format(item))
                except Exception:
                    logging.getLogger(__name__).debug("request log line lost", exc_info=True)
            self._put(lines)
            time.sleep(self.pause)

    def _put(self, lines: list[str]) -> None:
        """Write `lines` in chunks of whole lines of at most CHUNK bytes, each flushed
        on its own: one write each, which a pipe (and an O_APPEND file) takes whole,
        so the lines of several processes sharing the stream never mix. A chunk that
        fails is lost alone; nothing here ends the writer thread (chunks() measures
        any string)."""
        stream = self.stream or sys.stderr
        for chunk in chunks(lines):
            try:
                stream.write(chunk)
                stream.flush()
            except Exception:
                logging.getLogger(__name__).debug("request log lines lost", exc_info=True)

    def flush(self, timeout: float = 10.0) -> None:
        """Return once every line emitted so far is written."""
        if self._thread is None:
            return
        done = threading.Event()
        self.queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        if self._thread is not None:
            self.flush()
            self.queue.put(None)
            self._thread.join(10)
            self._thread = None
        if self.owns_stream and self.stream is not None:
            self.stream.close()


def from_env() -> RequestLog | None:
    """PGRESERVE_REQUEST_LOG (on unless 0/off/false), PGRESERVE_LOG_FORMAT (text|json),
    PGRESERVE_REQUEST_LOG_FORMAT and PGRESERVE_REQUEST_LOG_FILE (appended to; default
    stderr), as `serve --workers N` hands them to its worker processes (their logging
    too). Each process appends whole lines, so several can share one file."""
    fmt = os.environ.get("PGRESERVE_LOG_FORMAT", "text") or "text"
    configure_logging(fmt)
    if os.environ.get("PGRESERVE_REQUEST_LOG", "1").lower() in ("0", "off", "false", "no"):
        return None
    path = os.environ.get("PGRESERVE_REQUEST_LOG_FILE") or None
    stream = None if path is None else open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by RequestLog.close
    return RequestLog(os.environ.get("PGRESERVE_REQUEST_LOG_FORMAT") or fmt, stream,
                      owns_stream=stream is not None)


class JsonFormatter(logging.Formatter):
    """The service's other log lines as JSON objects (with --log-format json)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": _iso(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, separators=(",", ":"))


def configure_logging(fmt: str) -> None:
    """Give the root logger a stderr handler (warnings and up) when it has none, and
    put its handlers on JSON lines when `fmt` is json."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if fmt == "json":
        for handler in root.handlers:
            handler.setFormatter(JsonFormatter())
