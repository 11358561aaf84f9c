"""`pgreserve rollout report / plan / status`: what the comparison table says."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from ..db.database import Database, Op
from ..db.queries import queries

OP_REPORT = Op("admin", "rollout_report", "cli/rollout")


@dataclass(frozen=True)
class TenantReport:
    tenant_id: int
    tenant: str
    compared: int
    agreed: int
    errors: int
    legacy_p50_ms: float | None
    legacy_p99_ms: float | None
    pgreserve_p50_ms: float | None
    pgreserve_p99_ms: float | None

    @property
    def agreement(self) -> float | None:
        return self.agreed / self.compared if self.compared else None


@dataclass(frozen=True)
class Disagreement:
    tenant_id: int
    tenant: str
    at: datetime
    mode: str
    operation: str
    request_key: str
    legacy: dict[str, Any]
    pgreserve: dict[str, Any]
    legacy_ms: float
    pgreserve_ms: float


@dataclass(frozen=True)
class PlanRow:
    tenant_id: int
    tenant: str
    mode: str
    traffic: int
    compared: int
    agreed: int

    @property
    def agreement(self) -> float | None:
        return self.agreed / self.compared if self.compared else None


@dataclass(frozen=True)
class StatusRow:
    tenant_id: int
    tenant: str
    mode: str
    changed_at: datetime | None
    changed_by: str | None


def _f(value: Any) -> float | None:
    return None if value is None else float(value)


async def report(db: Database, tenant: int | None = None,
                 limit: int = 20) -> tuple[list[TenantReport], list[Disagreement]]:
    """Per tenant: counts, agreement, latency p50 / p99 per side; the latest disagreements."""
    summary = [TenantReport(int(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[8]), _f(r[4]),
                            _f(r[5]), _f(r[6]), _f(r[7]))
               for r in await db.fetch(queries["rollout_report_summary"], {"tenant": tenant},
                                       op=OP_REPORT)]
    latest = [Disagreement(int(r[0]), str(r[1]), r[2], str(r[3]), str(r[4]), str(r[5]), r[6],
                           r[7], float(r[8]), float(r[9]))
              for r in await db.fetch(queries["rollout_report_disagreements"],
                                      {"tenant": tenant, "limit": limit}, op=OP_REPORT)]
    return summary, latest


async def plan(db: Database) -> list[PlanRow]:
    """Tenants from the smallest traffic to the largest, with mode and agreement."""
    return [PlanRow(int(r[0]), str(r[1]), str(r[2]), int(r[3]), int(r[4]), int(r[5]))
            for r in await db.fetch(queries["rollout_plan_list"], (), op=OP_REPORT)]


async def status(db: Database) -> list[StatusRow]:
    return [StatusRow(int(r[0]), str(r[1]), str(r[2]), r[3], r[4])
            for r in await db.fetch(queries["rollout_status_list"], (), op=OP_REPORT)]


def as_json(row: Any) -> dict[str, Any]:
    doc = asdict(row)
    if hasattr(row, "agreement"):
        doc["agreement"] = row.agreement
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in doc.items()}
