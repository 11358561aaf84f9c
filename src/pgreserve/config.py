"""Where the database is: an external URL, or the embedded server of a data directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from .db.embedded import EmbeddedServer


@contextmanager
def database_url(url: str | None, data_dir: str | None) -> Iterator[str]:
    """Yield a DSN: `url` (or PGRESERVE_DATABASE_URL) if given, else the embedded server's."""
    url = url or os.environ.get("PGRESERVE_DATABASE_URL")
    if url:
        yield url
        return
    server = EmbeddedServer(data_dir)
    dsn = server.start()
    try:
        yield dsn
    finally:
        server.stop()
