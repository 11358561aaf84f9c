"""API keys: random tokens shown once, stored as their sha256."""

from __future__ import annotations

import hashlib
import secrets

PREFIX = "pgr_"


def new_key() -> str:
    """A new key: a prefix (so scanners can spot leaked keys) and 32 random bytes."""
    return PREFIX + secrets.token_urlsafe(32)


# `tenant key list` shows this many first characters of a key (its prefix and
# 8 random characters, 48 bits: enough to tell a tenant's keys apart, useless
# for guessing the rest).
SHOWN = len(PREFIX) + 8


def shown_prefix(key: str) -> str:
    return key[:SHOWN]


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def plausible(key: str) -> bool:
    """Cheap shape check so garbage never reaches the database."""
    return key.startswith(PREFIX) and 8 < len(key) <= 200 and key.isascii()
