"""API keys: random tokens shown once, stored as their sha256."""

from __future__ import annotations

import hashlib
import secrets

PREFIX = "pgr_"


def new_key() -> str:
    """A new key: a prefix (so scanners can spot leaked keys) and 32 random bytes."""
    return PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def plausible(key: str) -> bool:
    """Cheap shape check so garbage never reaches the database."""
    return key.startswith(PREFIX) and 8 < len(key) <= 200 and key.isascii()
