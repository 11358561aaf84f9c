"""A pgreserve command run as a subprocess for a test: its output collected as it comes,
ready once a given line is out, stopped with SIGTERM (which must end it with 0)."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


class Running:
    """A running command and its output so far."""

    def __init__(self, proc: subprocess.Popen[str], lines: list[str],
                 reader: threading.Thread) -> None:
        self.proc = proc
        self.lines = lines
        self.reader = reader

    def stop(self) -> None:
        """SIGTERM, which must exit 0; returns once every line of its output is read."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, self.output
        self.reader.join(timeout=10)

    @property
    def output(self) -> str:
        return "".join(self.lines)


@contextmanager
def running(argv: Sequence[str], *, env: dict[str, str], ready: str | None = "Press Ctrl-C",
            cwd: str | Path | None = None, stop: bool = True,
            wait_s: float = 180) -> Iterator[Running]:
    """`argv` in a subprocess, yielded once a line containing `ready` is out (at once when
    `ready` is None); at the end SIGTERM, which must exit 0, unless `stop` is False (the
    test stops it). Killed if still running after that."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=cwd)
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if ready is not None and ready in line:
                up.set()
        up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if ready is not None:
            assert up.wait(wait_s) and proc.poll() is None, "".join(lines)
        done = Running(proc, lines, reader)
        yield done
        if stop and proc.poll() is None:
            done.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
