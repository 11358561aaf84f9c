"""Which addresses a webhook may be sent to: public ones only, unless allowed.

A tenant must not make the service POST to its own network (the database, an
admin port, a cloud metadata address): loopback, private, link-local,
multicast, unspecified, reserved and other non-global addresses are refused,
IPv4 and IPv6 alike (an IPv4 address inside IPv6, as ::ffff:127.0.0.1, 6to4,
Teredo or NAT64, is judged as the IPv4 address). The URL is checked when it is
registered (its host, or every address its name resolves to) and the delivery
worker checks the addresses it is about to connect to again (a name may
resolve elsewhere later). `PGRESERVE_WEBHOOK_ALLOW_PRIVATE=1` (or the
`allow_private` options) allows them, for local development and tests.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import socket
import time
from urllib.parse import urlsplit

from .db.database import current_deadline
from .errors import WebhookUrlRefused

ALLOW_PRIVATE_ENV = "PGRESERVE_WEBHOOK_ALLOW_PRIVATE"
RESOLVE_TIMEOUT_S = 5.0

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def allow_private_default() -> bool:
    """The setting of PGRESERVE_WEBHOOK_ALLOW_PRIVATE (1, true or yes: allowed)."""
    return os.environ.get(ALLOW_PRIVATE_ENV, "").strip().lower() in ("1", "true", "yes")


def refusal(address: IPAddress) -> str | None:
    """Why a webhook may not go to `address` ("a loopback address", ...), or None."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        return refusal(embedded)
    for test, what in ((address.is_unspecified, "an unspecified"),
                       (address.is_loopback, "a loopback"),
                       (address.is_link_local, "a link-local"),
                       (address.is_multicast, "a multicast"),
                       (address.is_private, "a private"),
                       (address.is_reserved, "a reserved"),
                       (not address.is_global, "a non-public")):
        if test:
            return f"{what} address"
    return None


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def host_of(url: str) -> str:
    """The URL's host as it would be connected to (brackets of an IPv6 literal removed)."""
    host = urlsplit(url).hostname
    if not host:
        raise WebhookUrlRefused("url has no host", field="url")
    return host


def literal(host: str) -> IPAddress | None:
    """The address when `host` is an IP literal, else None (a name).

    Legacy numeric IPv4 forms (2130706433, 0x7f.1, 127.1) count as the address
    the system's inet_aton makes of them. A trailing dot (the root of a fully
    qualified name: `127.0.0.1.`) does not change the address."""
    if host.endswith(".") and not host.endswith(".."):
        host = host[:-1]
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        pass
    if _NUMERIC.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


_NUMERIC = re.compile(r"[0-9A-Fa-fXx.]+")


def check_addresses(host: str, addresses: list[str]) -> None:
    """Raise WebhookUrlRefused when any address `host` resolved to is refused."""
    for text in addresses:
        found = literal(text)
        why = "not an IP address" if found is None else refusal(found)
        if why is not None:
            raise WebhookUrlRefused(
                f"webhook host {host!r} resolves to {text}, {why}; only public addresses "
                f"are allowed (set {ALLOW_PRIVATE_ENV}=1 for local development)", field="url")


def resolve_timeout() -> float:
    """How long a registration waits for the resolver: RESOLVE_TIMEOUT_S, and under a
    request deadline at most half the time left, so the registration itself still has
    time to be written (a name that did not resolve in time is accepted, as one that
    does not resolve: the delivery worker checks it before every connection)."""
    end = current_deadline()
    if end is None:
        return RESOLVE_TIMEOUT_S
    return max(0.0, min(RESOLVE_TIMEOUT_S, (end - time.monotonic()) / 2))


async def check_url(url: str, *, allow_private: bool) -> None:
    """Refuse a webhook URL whose host is, or resolves to, a refused address.

    A name that does not resolve now is accepted (it may be set up later); the
    delivery worker checks what it resolves to before every connection."""
    if allow_private:
        return
    host = host_of(url)
    found = literal(host)
    if found is not None:
        why = refusal(found)
        if why is not None:
            raise WebhookUrlRefused(
                f"webhook host {host} is {why}; only public addresses are allowed "
                f"(set {ALLOW_PRIVATE_ENV}=1 for local development)", field="url")
        return
    try:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
            resolve_timeout())
    except (OSError, TimeoutError, UnicodeError):
        infos = []
    if not infos:
        name = host.rstrip(".").lower()
        if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always loopback
            raise WebhookUrlRefused(f"webhook host {host!r} is a loopback name", field="url")
        return
    check_addresses(host, [str(info[4][0]) for info in infos])
