"""The garbage collector of the processes that serve the API (`tune_gc`)."""

from __future__ import annotations

import gc
import os

from ..errors import InvalidRequest

# The serving processes' cyclic garbage collector (`tune_gc`).
GC_THRESHOLD_ENV = "PGRESERVE_GC_THRESHOLD"
DEFAULT_GC_THRESHOLD = (10_000, 10, 10)
MAX_THRESHOLD = 10_000_000


def gc_threshold(value: str | None) -> tuple[int, int, int] | None:
    """PGRESERVE_GC_THRESHOLD's value: three positive integers ("10000,10,10", the
    default when unset or empty), or "off" (None: Python's own collector settings)."""
    text = (value or "").strip().lower()
    if not text:
        return DEFAULT_GC_THRESHOLD
    if text == "off":
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isascii() and p.isdecimal() and 0 < int(p) <= MAX_THRESHOLD
                                  for p in parts):
        raise InvalidRequest(f"{GC_THRESHOLD_ENV} must be 'off' or three integers from 1 "
                             f"to {MAX_THRESHOLD:,} such as '10000,10,10', not {value!r}",
                             field=GC_THRESHOLD_ENV)
    return int(parts[0]), int(parts[1]), int(parts[2])


def threshold_from_env() -> tuple[int, int, int] | None:
    """gc_threshold of this process's PGRESERVE_GC_THRESHOLD (InvalidRequest when
    malformed): the servers check it before they start anything."""
    return gc_threshold(os.environ.get(GC_THRESHOLD_ENV))


def tune_gc() -> tuple[int, int, int] | None:
    """Set up a serving process's garbage collector; call it once the app is built.

    Everything alive now (modules, the app, its routes and models) is frozen out of
    the collector's scans (`gc.freeze`), and a young collection waits for 10,000
    new container objects instead of 700. The requests in flight keep more than
    700 objects alive between them, so under load Python's defaults ran a
    collection every few dozen requests, and a scan of the whole heap now and
    then, that found no garbage: a request leaves no cycles behind. That was
    about a sixth of a worker's CPU per reserve (docs/benchmarks.md). Only the processes pgreserve
    starts itself call this (`up`, `serve` and its workers), never `create_app`:
    a host application keeps its own settings. PGRESERVE_GC_THRESHOLD=off leaves
    Python's defaults; a malformed value raises InvalidRequest naming it.
    """
    threshold = threshold_from_env()
    if threshold is not None:
        gc.collect()  # what is garbage already is freed, not frozen for good
        gc.freeze()
        gc.set_threshold(*threshold)
    return threshold
