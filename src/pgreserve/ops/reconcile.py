"""`pgreserve reconcile`: prove the stock accounting, bucket by bucket.

Per bucket it reads on_hand, free, the pool rows, the held units (and which of
them belong to live, active reservations), and the movement ledger: claimed
units (sale), restored units (restore) and the sum of every on_hand change
(count + adjust + sale), and it checks every rule invariant_violations_v1 checks
(each has its drift kinds, INVARIANT_RULES). Every drift is reported; nothing is
bulk-reset. Only drifts with a safe repair through the service's own functions are repaired,
and only with --repair; each repair is logged. With --freeze every bucket with
a drift is frozen (no new holds; claims, releases and expiry go on) and stays
frozen until an operator unfreezes it: the evidence is kept as it is.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from ..db import schema as schemas
from ..db.connect import connect
from ..db.database import Op, tagged
from ..db.queries import queries
from ..errors import UnknownTenant

log = logging.getLogger("pgreserve.reconcile")

REPAIR = Op("reconcile", "repair", "cli/reconcile")
FREEZE = Op("reconcile", "freeze", "cli/reconcile")
FROZEN_BY = "pgreserve reconcile --freeze"

# Each rule of invariant_violations_v1 (sql/functions/stock.sql) and the drift kinds
# reconcile reports it as, on the same bucket: reconcile checks all of them.
INVARIANT_RULES: dict[str, frozenset[str]] = {
    "accounting": frozenset({"overcommitted", "accounting"}),
    "negative": frozenset({"negative"}),
    "safety_in_pool": frozenset({"safety_in_pool"}),
    "backorder": frozenset({"backorder_mismatch"}),
    "pool_on_row_bucket": frozenset({"pool_on_row_bucket"}),
    "ledger": frozenset({"ledger_mismatch"}),
    "finished_but_held": frozenset({"finished_but_held"}),
    "restore_count": frozenset({"restore_count"}),
}


@dataclass
class BucketBook:
    tenant_id: int
    bucket_id: int
    sku: str
    location: str
    strategy: str
    on_hand: int
    free: int
    shortfall: int
    pool: int
    held: int
    active_held: int
    claimed: int
    restored: int
    ledger_on_hand: int
    safety_stock: int
    backorder_held: int  # backordered units of held lines: held, not on hand
    backorder_owed: int  # backordered units claimed and not yet received
    held_backordered: int  # the backordered units of the bucket's held lines
    reserved: int  # held units of lines not yet past their expiry


@dataclass(frozen=True)
class Drift:
    kind: str
    tenant_id: int
    bucket: str | None
    detail: str
    repairable: bool = False
    bucket_id: int | None = None  # the drifted bucket, when it exists


@dataclass
class Reconciliation:
    books: list[BucketBook] = field(default_factory=list)
    drifts: list[Drift] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    frozen: list[dict[str, Any]] = field(default_factory=list)
    overdue_cut: datetime | None = None  # a hold that expired by then was overdue

    def as_json(self) -> dict[str, Any]:
        return {"ok": not self.drifts, "buckets": [asdict(b) for b in self.books],
                "drifts": [asdict(d) for d in self.drifts], "repaired": self.repaired,
                "frozen": self.frozen}


def reconcile(dsn: str, *, tenant: int | None = None, grace_s: float = 60.0,
              repair: bool = False, freeze: bool = False,
              schema: str | None = None) -> Reconciliation:
    """Check every bucket (of one tenant, or all); with repair, fix what is safe, re-check;
    with freeze, freeze every bucket that still has a drift. `schema`: the
    installation's (default PGRESERVE_SCHEMA, else pgreserve)."""
    where = schemas.resolve(schema)
    result = _check(dsn, tenant, grace_s, where)
    if repair and any(d.repairable for d in result.drifts):
        done = _repair(dsn, result, where, tenant)
        result = _check(dsn, tenant, grace_s, where)
        result.repaired = done
    if freeze:
        result.frozen = _freeze(dsn, result, where)
    return result


def _freeze(dsn: str, found: Reconciliation, where: str) -> list[dict[str, Any]]:
    """Freeze each drifted bucket once (its drift kinds as the reason); return the freezes."""
    kinds: dict[tuple[int, int], list[Drift]] = {}
    for d in found.drifts:
        if d.bucket_id is not None:
            kinds.setdefault((d.tenant_id, d.bucket_id), []).append(d)
    frozen: list[dict[str, Any]] = []
    with connect(dsn, application_name="pgreserve:reconcile") as conn:
        for (tenant, bucket), drifts in sorted(kinds.items()):
            reason = ("reconcile found drift: "
                      + "; ".join(f"{d.kind}: {d.detail}" for d in drifts))[:1000]
            with schemas.transaction(conn, where):
                row = conn.execute(tagged(queries["freeze_set"], FREEZE),
                                   (tenant, bucket, reason, FROZEN_BY)).fetchone()
            if row is None:  # freeze_set_v1 always returns its document
                raise RuntimeError("freeze_set_v1 returned no row")
            doc: dict[str, Any] = row[0]
            log.warning("reconcile froze tenant %s bucket %s@%s: %s", tenant, doc["sku"],
                        doc["location"], reason)
            frozen.append(doc)
    return frozen


def _check(dsn: str, tenant: int | None, grace_s: float, where: str) -> Reconciliation:
    params: dict[str, Any] = {"tenant": tenant, "grace": grace_s}
    out = Reconciliation()
    with connect(dsn, application_name="pgreserve:reconcile") as conn:
        # One snapshot for every figure.
        conn.execute(queries["transaction_begin_snapshot"])
        conn.execute(schemas.search_path(where))
        if tenant is not None and conn.execute(queries["tenant_exists"],
                                               (tenant,)).fetchone() is None:
            conn.execute(queries["transaction_commit"])
            raise UnknownTenant(f"unknown tenant {tenant}: nothing to reconcile")
        cut = conn.execute(queries["reconcile_overdue_cut"], params).fetchone()
        out.overdue_cut = params["cut"] = None if cut is None else cut[0]
        out.books = [BucketBook(int(r[0]), int(r[1]), str(r[2]), str(r[3]), str(r[4]),
                                *(int(x) for x in r[5:]))
                     for r in conn.execute(queries["bucket_book_list"], params).fetchall()]
        orphans = conn.execute(queries["hold_orphan_list"], params).fetchall()
        finished = conn.execute(queries["hold_finished_list"], params).fetchall()
        overdue = conn.execute(queries["reservation_overdue_list"], params).fetchall()
        restores = conn.execute(queries["restore_count_list"], params).fetchall()
        conn.execute(queries["transaction_commit"])
    names = {(b.tenant_id, b.bucket_id): f"{b.sku}@{b.location}" for b in out.books}
    for b in out.books:
        where = names[(b.tenant_id, b.bucket_id)]
        on_hand_held = b.held - b.backorder_held  # backordered units are not on hand
        if b.pool + on_hand_held > b.on_hand:
            out.drifts.append(Drift(
                "overcommitted", b.tenant_id, where,
                f"pool {b.pool} + held {b.held} - backordered {b.backorder_held} = "
                f"{b.pool + on_hand_held} > on_hand {b.on_hand}",
                bucket_id=b.bucket_id))
        elif b.on_hand != b.free + b.pool + on_hand_held:
            out.drifts.append(Drift(
                "accounting", b.tenant_id, where,
                f"on_hand {b.on_hand} <> free {b.free} + pool {b.pool} + held {b.held} "
                f"- backordered {b.backorder_held}",
                bucket_id=b.bucket_id))
        # on_hand less what a forced correction found missing (still held, written
        # off as the holds end) and what is owed is what the movements put there
        # (invariant_violations_v1's identity)
        if b.on_hand - b.shortfall - b.backorder_owed != b.ledger_on_hand:
            out.drifts.append(Drift(
                "ledger_mismatch", b.tenant_id, where,
                f"on_hand {b.on_hand} - shortfall {b.shortfall} - backorder_owed "
                f"{b.backorder_owed} <> movement ledger (count + adjust + sale) "
                f"{b.ledger_on_hand}", bucket_id=b.bucket_id))
        # the bucket's count of backordered held units is its held lines' own
        if b.backorder_held != b.held_backordered:
            out.drifts.append(Drift(
                "backorder_mismatch", b.tenant_id, where,
                f"backorder_held {b.backorder_held} <> {b.held_backordered} backordered "
                f"in held lines", bucket_id=b.bucket_id))
        available = b.on_hand + b.backorder_held - b.reserved
        if b.on_hand < 0 or b.free < 0 or b.reserved < 0 or available < 0:
            out.drifts.append(Drift(
                "negative", b.tenant_id, where,
                f"on_hand {b.on_hand} free {b.free} reserved {b.reserved} backorder_held "
                f"{b.backorder_held} available {available} (on_hand + backorder_held - "
                f"reserved)", bucket_id=b.bucket_id))
        if b.pool > 0 and b.free < b.safety_stock:
            out.drifts.append(Drift(
                "safety_in_pool", b.tenant_id, where,
                f"{b.pool} pool units while free {b.free} < safety stock {b.safety_stock}",
                bucket_id=b.bucket_id))
        if b.strategy == "row" and b.pool > 0:
            out.drifts.append(Drift("pool_on_row_bucket", b.tenant_id, where,
                                    f"{b.pool} pool units on a row-strategy bucket",
                                    bucket_id=b.bucket_id))
    for t, rid, line, bucket, qty, no_res, no_bucket in orphans:
        what = "no reservation row" if no_res else "no stock bucket"
        out.drifts.append(Drift("orphan_hold", int(t), names.get((int(t), int(bucket))),
                                f"line {line} of reservation {rid} holds {qty} unit(s) of "
                                f"bucket {bucket}: {what}",
                                bucket_id=None if no_bucket else int(bucket)))
    for t, rid, line, bucket, qty, status in finished:
        out.drifts.append(Drift("finished_but_held", int(t), names.get((int(t), int(bucket))),
                                f"reservation {rid} is {status} but line {line} still holds "
                                f"{qty} unit(s)", bucket_id=int(bucket)))
    for t, rid, line, bucket, status, is_held, n in restores:
        want = ("none (held)" if is_held else "at most 1 (claimed)" if status == "claimed"
                else "exactly 1")
        out.drifts.append(Drift("restore_count", int(t), names.get((int(t), int(bucket))),
                                f"reservation {rid} ({status}) line {line} has {n} restore "
                                f"movement(s); want {want}", bucket_id=int(bucket)))
    for t, rid, expires_at in overdue:
        out.drifts.append(Drift("expired_but_active", int(t), None,
                                f"reservation {rid} expired at {expires_at.isoformat()} and "
                                f"is still active (is the sweeper running?)", repairable=True))
    return out


def _repair(dsn: str, found: Reconciliation, where: str, tenant: int | None) -> list[str]:
    """Expire the overdue reservations the check lists (of `tenant`, or every one;
    expired by the check's cut, its instant less the grace) through expire_due_v2, the
    sweeper's own function."""
    done: list[str] = []
    overdue = sum(1 for d in found.drifts if d.kind == "expired_but_active")
    with connect(dsn, application_name="pgreserve:reconcile") as conn:
        total = 0
        for _ in range(max(1, overdue // 500 + 2)):  # bounded: one batch more than needed
            with schemas.transaction(conn, where):
                row = conn.execute(tagged(queries["reservation_expire_overdue"], REPAIR),
                                   {"tenant": tenant, "cut": found.overdue_cut}).fetchone()
            n = int(row[0]) if row else 0
            total += n
            if n < 500:
                break
        if total:
            msg = f"expired {total} overdue reservation(s) through expire_due_v2"
            log.warning("reconcile repair: %s", msg)
            done.append(msg)
    return done
