"""Loggers turned down for the length of a load run, then put back as they were.

A load run breaks connections on purpose and the pool logs each; its report says
what matters. Turning the loggers down at import instead would silence them for
every test collected beside it (tests/conftest.py checks that none is left so)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

WATCHED = ("pgreserve", "psycopg")


@contextmanager
def quiet_loggers(*names: str, level: int = logging.CRITICAL) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in names or WATCHED]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, was in zip(loggers, before, strict=True):
            lg.setLevel(was)
