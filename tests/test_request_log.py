"""The request log's writer: lines in order, written in bursts, none lost at flush or close."""

from __future__ import annotations

import io
import json
import threading
import time

from pgreserve.http.requestlog import RequestLog


class CountingStream(io.StringIO):
    """A stream that counts its writes and flushes (from the writer thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.flushes = 0
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.writes += 1
            return super().write(text)

    def flush(self) -> None:
        with self._lock:
            self.flushes += 1
        super().flush()


def entry(n: int) -> tuple:  # type: ignore[type-arg]
    return (1_700_000_000.0 + n, "POST", "/v1/reservations", 201, "ok", 1, f"key-{n}",
            0.001, None, "127.0.0.1")


def keys_written(stream: io.StringIO) -> list[str]:
    return [json.loads(line)["request_key"] for line in stream.getvalue().splitlines()]


def test_a_burst_of_lines_is_written_in_order_with_a_few_writes_not_one_per_line() -> None:
    stream = CountingStream()
    log = RequestLog("json", stream=stream)
    try:
        for n in range(2000):
            log.emit(entry(n))
        log.flush()
        assert keys_written(stream) == [f"key-{n}" for n in range(2000)]
        # a write and a flush per 4 KB of lines (about 18 of these), where writing line
        # by line took 2,000 of each
        assert stream.writes <= 200 and stream.flushes <= 200, (stream.writes, stream.flushes)
    finally:
        log.close()


def test_flush_returns_once_every_earlier_line_is_out_and_close_writes_the_rest() -> None:
    stream = CountingStream()
    log = RequestLog("text", stream=stream, pause=0.2)
    log.emit(entry(1))
    log.flush()
    assert 'request_key="key-1"' in stream.getvalue()
    for n in range(2, 50):
        log.emit(entry(n))
    log.close()  # the writer is pausing: close still waits for these lines
    text = stream.getvalue()
    assert all(f'request_key="key-{n}"' in text for n in range(1, 50))
    assert text.count("\n") == 49


def test_an_entry_that_cannot_be_formatted_loses_only_its_own_line() -> None:
    stream = CountingStream()
    log = RequestLog("json", stream=stream)
    try:
        log.emit(entry(1))
        log.emit(("not", "an", "entry"))  # type: ignore[arg-type]
        log.emit(entry(3))
        log.flush()
        assert keys_written(stream) == ["key-1", "key-3"]
    finally:
        log.close()


def test_each_write_is_whole_lines_of_at_most_a_pipe_buffer() -> None:
    """Several worker processes share one stderr (a pipe) or one file: a write a pipe
    takes in one piece (at most 4096 bytes) of whole lines keeps their lines apart."""
    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.parts: list[str] = []

        def write(self, text: str) -> int:
            self.parts.append(text)
            return super().write(text)

    stream = Writes()
    log = RequestLog("json", stream=stream)
    try:
        for n in range(3000):
            log.emit(entry(n))
        log.emit((1_700_000_000.0, "POST", "/v1/reservations", 201, "ok", 1, "k" * 200 + "é",
                  0.001, None, "127.0.0.1"))
        log.flush()
    finally:
        log.close()
    assert keys_written(stream)[:3000] == [f"key-{n}" for n in range(3000)]
    assert len(stream.parts) < 3001
    for part in stream.parts:
        assert part.endswith("\n")
        assert len(part.encode()) <= 4096, len(part.encode())


def test_a_line_the_writer_cannot_encode_loses_only_itself() -> None:
    """A line holding a lone surrogate (a str field from a library caller or another
    ASGI server; sys.stderr writes it backslash-escaped) is measured and written
    without ending the writer thread: the lines after it are written, and flush()
    returns at once."""
    stream = io.StringIO()
    log = RequestLog("text", stream=stream)
    try:
        log.emit((1_700_000_000.0, "POST", "/v1/reservations", 201, "ok", 1, "a", 0.001,
                  None, "10.0.0.1\udc80"))
        log.emit((1_700_000_000.0, "POST", "/v1/reservations", 201, "ok", 1, "b", 0.001,
                  None, "10.0.0.2"))
        log.flush(timeout=2.0)
        log.emit((1_700_000_001.0, "POST", "/v1/reservations", 201, "ok", 1, "c", 0.001,
                  None, "10.0.0.3"))
        started = time.monotonic()
        log.flush(timeout=2.0)
        took = time.monotonic() - started
    finally:
        log.close()
    text = stream.getvalue()
    assert 'request_key="b"' in text and 'request_key="c"' in text, text
    assert took < 1.0, f"flush() waited {took:.1f} s: the writer thread is dead"
