"""Bad input gets a typed error with a clear message and writes nothing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from conftest import table_counts
from pgreserve import AllocatedLine, ReservationService, Tenant
from pgreserve.errors import (
    InvalidRequest,
    PgReserveError,
    ReservationNotFound,
    TenantNameTaken,
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
        service.webhooks(999),
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


async def test_a_tenant_name_in_use_is_tenant_name_taken(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """create_tenant (and create_tenant_with_key) with a name another tenant has:
    TenantNameTaken naming it, nothing written (it was the driver's UniqueViolation)."""
    before = table_counts(dsn)
    with pytest.raises(TenantNameTaken, match="already exists"):
        await service.create_tenant(tenant.name)
    with pytest.raises(TenantNameTaken, match="already exists"):
        await service.create_tenant_with_key(tenant.name)
    assert table_counts(dsn) == before


@pytest.mark.parametrize("if_match", [3.5, 2.0, object(), b"\x01", True])
async def test_an_if_match_that_is_no_version_is_invalid_request(
        service: ReservationService, tenant: Tenant, dsn: str, if_match: Any) -> None:
    """if_match is a version, versions or "*": anything else is InvalidRequest naming
    it, nothing written (a float was a TypeError; bytes were read as versions)."""
    await service.set_stock(tenant.id, "s", "w", 5)
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest) as got:
        await service.set_stock(tenant.id, "s", "w", 4, if_match=if_match)
    assert got.value.details.get("field") == "if_match"
    with pytest.raises(InvalidRequest):
        await service.adjust_stock(tenant.id, "k", "s", "w", 1, if_match=if_match)
    assert table_counts(dsn) == before


@pytest.mark.parametrize("flag", ["false", "no", 1, 1.0, [0], None])
async def test_a_force_that_is_not_true_or_false_is_refused_not_taken_as_true(
        service: ReservationService, tenant: Tenant, dsn: str, flag: Any) -> None:
    """force and create_only are True or False: "false" was taken as true, so a count
    was forced below the held units and a shortfall written."""
    await service.set_stock(tenant.id, "s", "w", 5)
    assert (await service.reserve(tenant.id, "r", [("s", "w", 4)])).held
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest, match="force must be true or false"):
        await service.set_stock(tenant.id, "s", "w", 0, force=flag)
    with pytest.raises(InvalidRequest, match="force must be true or false"):
        await service.adjust_stock(tenant.id, "a", "s", "w", -5, force=flag)
    with pytest.raises(InvalidRequest, match="create_only must be true or false"):
        await service.set_stock(tenant.id, "new", "w", 1, create_only=flag)
    assert table_counts(dsn) == before
    stock = await service.get_stock(tenant.id, "s", "w")
    assert (stock.on_hand, stock.shortfall) == (5, 0)


async def test_split_false_on_a_line_naming_its_location_changes_nothing(
        service: ReservationService, tenant: Tenant, dsn: str) -> None:
    """docs/api.md: `"split": false` (the default) changes nothing on a line that names
    a location, with or without an allocated line beside it; `true` there is refused."""
    await service.set_stock(tenant.id, "s", "w", 10)
    await service.set_stock(tenant.id, "c", "w", 10)
    line = {"sku": "s", "location": "w", "quantity": 1, "split": False}
    assert (await service.reserve(tenant.id, "mixed", [line, AllocatedLine("c", 1)])).held
    assert (await service.reserve(tenant.id, "alone", [line])).held
    before = table_counts(dsn)
    carts: list[list[Any]] = [[{**line, "split": True}],
                              [{**line, "split": True}, AllocatedLine("c", 1)]]
    for i, cart in enumerate(carts):
        with pytest.raises(InvalidRequest, match="split applies only"):
            await service.reserve(tenant.id, f"split-{i}", cart)
    assert table_counts(dsn) == before


BAD_CALLS: list[tuple[str, Any]] = [
    ("events after a string", lambda s, t: s.events(t, after="abc")),
    ("events after a 1-tuple", lambda s, t: s.events(t, after=(1,))),
    ("events after an int", lambda s, t: s.events(t, after=5)),
    ("events after a list of 3", lambda s, t: s.events(t, after=[1, 2, 3])),
    ("invariant_violations of a string", lambda s, t: s.invariant_violations("abc")),
    ("refill of strings", lambda s, t: s.refill("x", "y")),
    ("refill of a tenant past bigint", lambda s, t: s.refill(2**70, 1)),
    ("refill_candidates of strings", lambda s, t: s.refill_candidates("x", "y")),
    ("refill_candidates with a negative limit", lambda s, t: s.refill_candidates(0.5, -1)),
    ("refill_candidates with low water 2", lambda s, t: s.refill_candidates(2.0, 10)),
    ("purge keeping past the timestamp range",
     lambda s, t: s.purge_request_keys(timedelta(days=999_999_999))),
    ("tenant_for_api_key of None", lambda s, t: s.tenant_for_api_key(None)),
    ("tenants_for_api_key_hashes of None", lambda s, t: s.tenants_for_api_key_hashes(None)),
    ("tenants_for_api_key_hashes of strings",
     lambda s, t: s.tenants_for_api_key_hashes(["abc"])),
    ("list_stock with an int for skus", lambda s, t: s.list_stock(t, skus=5)),
]


@pytest.mark.parametrize(("label", "call"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
async def test_bad_input_to_a_public_method_is_invalid_request(
        service: ReservationService, tenant: Tenant, dsn: str, label: str, call: Any) -> None:
    """Bad input to the workers' and admins' methods is InvalidRequest with a message and
    writes nothing (it was a ValueError, TypeError or AttributeError, a driver error, or
    for refill(2**70, 1) DatabaseNotMigrated telling the caller to migrate)."""
    before = table_counts(dsn)
    with pytest.raises(InvalidRequest):
        await call(service, tenant.id)
    assert table_counts(dsn) == before


async def test_the_same_inputs_in_their_other_usual_shapes_are_accepted(
        service: ReservationService, tenant: Tenant) -> None:
    """The checks above refuse what is malformed, not the usual other shapes: an events
    cursor as a list (read back from JSON), key hashes as bytearray, a large page."""
    page = await service.events(tenant.id)
    assert (await service.events(tenant.id, after=list(page.cursor))).events == ()
    mutable: Any = bytearray(32)
    assert await service.tenants_for_api_key_hashes([mutable]) == {}
    assert await service.refill_candidates(0.5, 1_000_000) == []
