"""Bad input gets a typed error with a clear message and writes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import table_counts
from pgreserve import ReservationService, Tenant
from pgreserve.errors import (
    InvalidRequest,
    PgReserveError,
    ReservationNotFound,
    UnknownStock,
    UnknownTenant,
)

LONG = "x" * 201

BAD_CARTS: list[tuple[str, Any]] = [
    ("zero quantity", [("s", "w", 0)]),
    ("negative quantity", [("s", "w", -1)]),
    ("float quantity", [("s", "w", 1.5)]),
    ("string quantity", [("s", "w", "2")]),
    ("bool quantity", [("s", "w", True)]),
    ("none quantity", [("s", "w", None)]),
    ("huge quantity", [("s", "w", 1_000_001)]),
    ("empty cart", []),
    ("101 lines", [(f"s{i}", "w", 1) for i in range(101)]),
    ("empty sku", [("", "w", 1)]),
    ("empty location", [("s", "", 1)]),
    ("long sku", [(LONG, "w", 1)]),
    ("long location", [("s", LONG, 1)]),
    ("sku not a string", [(5, "w", 1)]),
    ("same bucket twice", [("s", "w", 1), ("s", "w", 2)]),
    ("not a list", "s,w,1"),
    ("unknown field", [{"sku": "s", "location": "w", "quantity": 1, "price": 3}]),
]


@pytest.mark.parametrize(("label", "cart"), BAD_CARTS, ids=[c[0] for c in BAD_CARTS])
async def test_bad_cart_is_refused_and_writes_nothing(
        service: ReservationService, tenant: Tenant, dsn: str, label: str, cart: Any) -> None:
    """Each malformed cart raises InvalidRequest and no table changes."""
    await service.set_stock(tenant.id, "s", "w", 10)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest) as info:
        await service.reserve(tenant.id, "k", cart)
    assert info.value.message
    assert table_counts(dsn) == before


@pytest.mark.parametrize("ttl", [0, 0.5, -5, 86_401, "900", True])
async def test_ttl_out_of_range_is_refused(
        service: ReservationService, tenant: Tenant, dsn: str, ttl: Any) -> None:
    """A TTL outside 1 s..24 h (or not a duration) raises InvalidRequest, nothing written."""
    await service.set_stock(tenant.id, "s", "w", 10)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest, match="ttl"):
        await service.reserve(tenant.id, "k", [("s", "w", 1)], ttl=ttl)
    assert table_counts(dsn) == before


async def test_unknown_tenant_is_typed_and_writes_nothing(
        service: ReservationService, dsn: str) -> None:
    """Every operation on a tenant id that does not exist raises UnknownTenant."""
    before = table_counts(dsn)
    calls = [
        service.set_stock(999, "s", "w", 1),
        service.reserve(999, "k", [("s", "w", 1)]),
        service.adjust_stock(999, "k", "s", "w", 1),
        service.get_stock(999, "s", "w"),
        service.claim(999, "00000000-0000-0000-0000-000000000001"),
        service.get_reservation(999, "00000000-0000-0000-0000-000000000001"),
    ]
    for call in calls:
        with pytest.raises(UnknownTenant):
            await call
    assert table_counts(dsn) == before


async def test_unknown_bucket_differs_from_short_stock(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """Reserving a bucket the tenant lacks is UnknownStock, and writes nothing."""
    before = table_counts(dsn)
    with pytest.raises(UnknownStock):
        await service.reserve(tenant.id, "k", [("ghost", "w", 1)])
    with pytest.raises(UnknownStock):
        await service.adjust_stock(tenant.id, "k2", "ghost", "w", 5)
    assert table_counts(dsn) == before


async def test_other_tenants_reservation_looks_like_none(
        service: ReservationService, tenant: Tenant) -> None:
    """Another tenant's reservation id is answered exactly like an id that does not exist."""
    other = await service.create_tenant("other")
    await service.set_stock(tenant.id, "s", "w", 5)
    out = await service.reserve(tenant.id, "k", [("s", "w", 1)])
    assert out.reservation is not None
    rid = out.reservation.id
    missing = "00000000-0000-0000-0000-000000000000"
    for op in ("get_reservation", "claim", "release"):
        with pytest.raises(ReservationNotFound) as theirs:
            await getattr(service, op)(other.id, rid)
        with pytest.raises(ReservationNotFound) as nobody:
            await getattr(service, op)(other.id, missing)
        assert type(theirs.value) is type(nobody.value)
        assert str(theirs.value).replace(rid, "ID") == str(nobody.value).replace(missing, "ID")
    with pytest.raises(ReservationNotFound):
        await service.extend(other.id, rid, 60)
    # and the stock of the first tenant is invisible too
    with pytest.raises(UnknownStock):
        await service.get_stock(other.id, "s", "w")
    assert (await service.get_reservation(tenant.id, rid)).status.value == "active"


@pytest.mark.parametrize("bad", ["not-a-uuid", "", "1; DROP TABLE reservation"])
async def test_malformed_reservation_id_is_not_found(
        service: ReservationService, tenant: Tenant, bad: str) -> None:
    """A malformed reservation id is answered like an unknown one."""
    with pytest.raises(ReservationNotFound):
        await service.claim(tenant.id, bad)


@pytest.mark.parametrize("kwargs", [
    {"on_hand": -1}, {"on_hand": 1.0}, {"on_hand": 5, "strategy": "heap"},
    {"on_hand": 5, "pool_cap": 0},
])
async def test_bad_set_stock_is_refused(
        service: ReservationService, tenant: Tenant, dsn: str, kwargs: dict[str, Any]) -> None:
    """Negative or non-integer counts, unknown strategies and bad caps raise InvalidRequest."""
    before = table_counts(dsn)
    on_hand = kwargs.pop("on_hand")
    with pytest.raises(InvalidRequest):
        await service.set_stock(tenant.id, "s", "w", on_hand, **kwargs)
    assert table_counts(dsn) == before


def test_every_error_has_a_stable_code() -> None:
    """Each typed error class carries its own machine-readable code."""
    import pgreserve.errors as e

    classes = [c for c in vars(e).values()
               if isinstance(c, type) and issubclass(c, PgReserveError) and c is not PgReserveError]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
