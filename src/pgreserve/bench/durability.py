"""Whether a run's commits were durable: read back from the server the bench used.

`--durable` only sets synchronous_commit for the bench's own sessions. Whether an
acknowledged commit survives a crash also depends on the server (`fsync`,
`full_page_writes`) and, for the embedded server, on where its data directory is:
a temporary directory on tmpfs (TMPDIR or /tmp in memory) flushes to no disk. The
bench reads these after the database is up, records them in its JSON and warns
when a run asked to be durable is not; it does not refuse to run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..db.connect import connect
from ..db.queries import queries
from .runner import with_commit_mode

MOUNTS = Path("/proc/self/mounts")
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def _unescape(field_: str) -> str:
    """A mounts field as the kernel escapes it (octal: \\040 space, \\011 tab, ...)."""
    out, i = [], 0
    while i < len(field_):
        code = field_[i + 1:i + 4]
        if field_[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(field_[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def filesystem_of(path: str | os.PathLike[str], mounts: Path = MOUNTS) -> str | None:
    """The type of the filesystem `path` is on: the mount with the longest mount point
    that contains it (the last one listed, when one is mounted over another). None
    when the mount table cannot be read."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point, kind = _unescape(parts[1]), parts[2]
        inside = point == "/" or target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), kind)
    return None if best is None else best[1]


@dataclass
class Durability:
    """What the server said, and why a run asked to be durable was not."""

    requested: bool
    fsync: str
    synchronous_commit: str  # as the bench's sessions have it (--durable sets it)
    synchronous_commit_default: str  # a session without the bench's setting (a service's)
    full_page_writes: str
    data_directory: str | None = None  # the embedded server's; None for --database-url
    filesystem: str | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def durable(self) -> bool:
        return self.requested and not self.reasons

    def to_dict(self) -> dict[str, Any]:
        return {"requested": self.requested, "durable": self.durable, "fsync": self.fsync,
                "synchronous_commit": self.synchronous_commit,
                "synchronous_commit_default": self.synchronous_commit_default,
                "full_page_writes": self.full_page_writes,
                "data_directory": self.data_directory,
                "data_directory_filesystem": self.filesystem,
                "not_durable_because": list(self.reasons)}


def _settings(dsn: str) -> tuple[str, str, str]:
    with connect(dsn, application_name="pgreserve:bench-admin") \
            as conn:
        row = conn.execute(queries["durability_settings_read"]).fetchone()
    assert row is not None  # noqa: S101 - a SELECT of three settings returns a row
    return str(row[0]), str(row[1]), str(row[2])


def read_durability(dsn: str, *, durable: bool, data_dir: str | os.PathLike[str] | None,
                    service_sessions: bool = False) -> Durability:
    """Read the server's settings (and the embedded data directory's filesystem).

    `service_sessions`: the commits measured are a running service's (flash-sale
    --url), whose sessions do not take the bench's synchronous_commit: the server's
    default for a session is what is checked then."""
    fsync, default, full_page_writes = _settings(dsn)
    own = _settings(with_commit_mode(dsn, durable))[1]
    found = Durability(durable, fsync, own, default, full_page_writes)
    if data_dir is not None:
        found.data_directory = os.path.realpath(data_dir)
        found.filesystem = filesystem_of(data_dir)
    if fsync != "on":
        found.reasons.append(f"fsync is {fsync}: commits are not flushed to disk")
    if full_page_writes != "on":
        found.reasons.append(f"full_page_writes is {full_page_writes}: a crash may leave "
                             "torn pages")
    checked = default if service_sessions else own
    if checked == "off":
        whose = "the service's sessions (the server's default)" if service_sessions \
            else "the bench's sessions"
        found.reasons.append(f"synchronous_commit is off for {whose}: a commit is "
                             "acknowledged before its WAL is flushed")
    if found.filesystem in MEMORY_FILESYSTEMS:
        found.reasons.append(f"the data directory {found.data_directory} is on "
                             f"{found.filesystem} (memory): set TMPDIR to a directory on disk")
    return found
