"""`pgreserve doctor`: what a database has, against what this design needs.

Every finding reports the value found on the server (never the value pgreserve
would have set) and the fix. Status: ok, warn, fail; any fail is exit code 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from ..db import migrate as migrations
from ..db import migration_check
from ..db import schema as schemas
from ..db.connect import connect
from ..db.queries import queries
from ..errors import DatabaseNotMigrated, MigrationError
from .pgbouncer import read_pgbouncer

# Statements slower than this are logged (the design's slow-statement threshold).
SLOW_STATEMENT_MS = 200

# The business-process pools one API process opens (see core/service.py OPS).
API_ROLES = ("api", "stock", "reserve", "claim", "release", "extend", "admin", "ops")


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | warn | fail
    found: str
    want: str
    fix: str

    def as_json(self) -> dict[str, str]:
        return asdict(self)


def _fix(statement: str, why: str = "") -> str:
    """A fix as printed: the statement, `;`, and why as a comment."""
    return statement + ";" + (f"  -- {why}" if why else "")


# Where a session's value comes from (pg_settings.source), when it is a per-database or
# per-role value (pg_db_role_setting), the winning one first. A role's value
# (ALTER ROLE r SET) outranks the database's and ALTER SYSTEM; only a value of the
# role in this database (ALTER ROLE r IN DATABASE d SET) outranks the role's.
OVERRIDE_LEVELS = ("database user", "user", "database", "global")
OVERRIDE_NAMES = {"database user": "the role's setting in this database",
                  "user": "the role's setting", "database": "the database's setting",
                  "global": "the setting of every role"}


def _setting_name(name: str) -> sql.Composable:
    """A setting's name as an identifier (a custom one, ext.name, in two parts)."""
    return sql.Identifier(*name.split("."))


def _placed_fix(conn: psycopg.Connection[tuple[Any, ...]], name: str, statement: str,
                why: str = "", *, role_level: bool = False) -> str:
    """The fix `statement` for setting `name`, made to work where the value comes from.

    A value set per database or per role (pg_db_role_setting) outranks ALTER SYSTEM,
    and one of the role in this database outranks ALTER ROLE: those that outrank the
    fix's own level (ALTER ROLE when `role_level`, else ALTER SYSTEM) are reset
    first, so the statement's value is the one a new session gets. A value from the
    connection's options, or for ALTER SYSTEM the server's command line, is named."""
    row = conn.execute(queries["setting_source"], (name,)).fetchone()
    source = str(row[0]) if row else ""
    outranking = ("database user",) if role_level else OVERRIDE_LEVELS
    setting = _setting_name(name)
    resets: list[str] = []
    levels: list[str] = []
    for level, database, role in conn.execute(queries["setting_override_list"],
                                              {"name": name}).fetchall():
        if level not in outranking:
            continue
        if level == "database user":
            reset = sql.SQL(queries["database_role_setting_reset_fix"]).format(
                sql.Identifier(role), sql.Identifier(database), setting)
        elif level == "user":
            reset = sql.SQL(queries["role_setting_reset_fix"]).format(
                sql.Identifier(role), setting)
        elif level == "database":
            reset = sql.SQL(queries["database_setting_reset_fix"]).format(
                sql.Identifier(database), setting)
        else:
            reset = sql.SQL(queries["every_role_setting_reset_fix"]).format(setting)
        resets.append(reset.as_string(conn))
        levels.append(OVERRIDE_NAMES[level])
    notes: list[str] = []
    if resets:
        outranked = "the role's own setting" if role_level else "the server's (ALTER SYSTEM)"
        notes.append(f"set by {' and '.join(levels)}, which outranks {outranked}: "
                     "reset first")
    if source == "client":
        notes.append(f"the connection sets it (options=-c {name}=... in the database "
                     "URL, or PGOPTIONS), which outranks all of these: remove it there")
    elif source == "command line" and not role_level:
        notes.append(f"the server's command line sets it (-c {name}=...), which "
                     "outranks ALTER SYSTEM: remove it there and restart")
    if why:
        notes.append(why)
    return _fix("; ".join([*resets, statement]), "; ".join(notes))


def _ms(setting: str, unit: str | None) -> float:
    """A time setting in milliseconds (pg_settings gives value and unit)."""
    factor = {"ms": 1.0, "s": 1000.0, "min": 60000.0, None: 1.0}.get(unit, 1.0)
    return float(setting) * factor


def diagnose(dsn: str, *, pool_size: int = 10, processes: int = 1,
             extra_connections: int = 10,
             pgbouncer_admin_url: str | None = None,
             schema: str | None = None) -> list[Finding]:
    """Run every check against the database of `dsn` (and PgBouncer's admin console
    when `pgbouncer_admin_url` is given), for the installation in `schema` (default
    PGRESERVE_SCHEMA, else pgreserve)."""
    where = schemas.resolve(schema)
    out: list[Finding] = []
    if pgbouncer_admin_url:
        out.extend(diagnose_pgbouncer(pgbouncer_admin_url))
    with connect(dsn, application_name="pgreserve:doctor") as conn:
        def setting(name: str) -> tuple[str, str | None] | None:
            row = conn.execute(queries["setting_get"], (name,)).fetchone()
            return (str(row[0]), row[1]) if row else None

        def required(name: str) -> str:
            v = setting(name)
            if v is None:
                raise RuntimeError(f"the server has no setting {name}")
            return v[0]

        def scalar(query: LiteralString) -> Any:
            row = conn.execute(query).fetchone()
            if row is None:
                raise RuntimeError(f"no row from {query!r}")
            return row[0]

        # What a new session of this role gets: system, database and role settings.
        role = str(scalar(queries["role_current"]))

        v = setting("idle_in_transaction_session_timeout")
        ms = _ms(*v) if v else 0.0
        out.append(Finding(
            "idle_in_transaction_session_timeout",
            "fail" if ms == 0 else "warn" if ms > 60000 else "ok",
            "0 (disabled)" if ms == 0 else f"{ms:.0f}ms", "between 1s and 60s",
            _placed_fix(conn, "idle_in_transaction_session_timeout",
                        queries["idle_in_transaction_timeout_fix"],
                        "a forgotten transaction must not hold locks and stop vacuum")))

        for name, limit_ms, want in (("statement_timeout", 300000, "60s"),
                                     ("lock_timeout", 60000, "10s")):
            v = setting(name)
            ms = _ms(*v) if v else 0.0
            out.append(Finding(
                f"{name} (role {role})",
                "fail" if ms == 0 else "warn" if ms > limit_ms else "ok",
                "0 (unbounded)" if ms == 0 else f"{ms:.0f}ms",
                f"non-zero, at most {limit_ms // 1000}s",
                _placed_fix(conn, name, sql.SQL(queries["role_setting_fix"]).format(
                    sql.Identifier(role), _setting_name(name), sql.Literal(want)
                ).as_string(conn), "the service sets a tighter limit per transaction; "
                    "this is the safety net for every other session", role_level=True)))

        # Durability: a hold, a sale or a stored "no" acknowledged to a client must
        # survive a crash of the server (docs/guarantees.md).
        for name, accepted, fix in (("fsync", ("on",), queries["fsync_fix"]),
                                ("full_page_writes", ("on",), queries["full_page_writes_fix"]),
                                ("synchronous_commit",
                                 ("on", "local", "remote_write", "remote_apply"),
                                 sql.SQL(queries["role_setting_fix"]).format(
                                     sql.Identifier(role), sql.Identifier("synchronous_commit"),
                                     sql.Literal("on")).as_string(conn))):
            v = setting(name)
            found = v[0] if v else "?"
            why = "an acknowledged hold, sale or refusal must survive a crash"
            out.append(Finding(
                f"{name} (role {role})" if name == "synchronous_commit" else name,
                "ok" if found in accepted else "fail", found, " or ".join(accepted),
                _placed_fix(conn, name, fix, why, role_level=True)
                if name == "synchronous_commit" else _fix(fix, why)))

        v = setting("autovacuum_naptime")
        s_ = _ms(*v) / 1000 if v else 60.0
        out.append(Finding(
            "autovacuum_naptime", "fail" if s_ > 15 else "ok", f"{s_:g}s", "at most 15s",
            _fix(queries["autovacuum_naptime_fix"],
                 "the pool partitions churn dead tuples every second")))

        v = setting("autovacuum_max_workers")
        n = int(v[0]) if v else 3
        out.append(Finding(
            "autovacuum_max_workers", "fail" if n < 5 else "ok", str(n), "at least 5",
            _fix(queries["autovacuum_max_workers_fix"],
                 "restart; 16 pool partitions compete for workers")))

        v = setting("autovacuum")
        out.append(Finding(
            "autovacuum", "ok" if v and v[0] == "on" else "fail", v[0] if v else "?", "on",
            _fix(queries["autovacuum_fix"])))

        rows = conn.execute(queries["pool_partition_option_list"], (where,)).fetchall()
        if not rows:
            out.append(Finding("stock_unit partitions", "fail", "no stock_unit partitions",
                               "stock_unit_p0..p15 with autovacuum settings",
                               "pgreserve migrate (this is not a migrated pgreserve database)"))
        else:
            missing = [r[0] for r in rows if not _tuned(r[1])]
            out.append(Finding(
                "stock_unit partition autovacuum settings", "fail" if missing else "ok",
                f"{len(rows) - len(missing)} of {len(rows)} partitions tuned"
                + (f"; untuned: {', '.join(missing)}" if missing else ""),
                "autovacuum_vacuum_scale_factor = 0 and a fixed threshold on every partition",
                queries["pool_partition_autovacuum_fix"] + "  -- as in migration 0001"))

        v = setting("shared_preload_libraries")
        libs = v[0] if v else ""
        loaded = "pg_stat_statements" in [x.strip() for x in libs.split(",")]
        track = setting("pg_stat_statements.track")
        ok = loaded and track is not None and track[0] == "all"
        out.append(Finding(
            "pg_stat_statements", "ok" if ok else "fail",
            f"shared_preload_libraries='{libs}', track="
            f"{track[0] if track else '(not loaded)'}",
            "preloaded, pg_stat_statements.track = all",
            _fix(queries["pg_stat_statements_preload_fix"], "restart; then CREATE EXTENSION "
                 "pg_stat_statements (track=all sees the statements inside the functions)")))
        if ok:
            ext = conn.execute(queries["pg_stat_statements_exists"]).fetchone()
            out.append(Finding(
                "pg_stat_statements extension", "ok" if ext else "warn",
                "created" if ext else "not created in this database", "created",
                _fix(queries["pg_stat_statements_create_fix"])))

        v = setting("log_lock_waits")
        out.append(Finding(
            "log_lock_waits", "ok" if v and v[0] == "on" else "fail", v[0] if v else "?",
            "on", _placed_fix(conn, "log_lock_waits", queries["log_lock_waits_fix"])))

        v = setting("log_min_duration_statement")
        ms = _ms(*v) if v else -1.0
        out.append(Finding(
            "log_min_duration_statement",
            "ok" if 0 < ms <= SLOW_STATEMENT_MS else "warn",
            "-1 (disabled)" if ms < 0 else "0 (every statement)" if ms == 0 else f"{ms:.0f}ms",
            f"between 1ms and {SLOW_STATEMENT_MS}ms",
            _placed_fix(conn, "log_min_duration_statement",
                        queries["log_min_duration_statement_fix"],
                        "slow statements show in the server log with their tag; 0 would "
                        "log every statement of a sale")))

        v = setting("track_functions")
        out.append(Finding(
            "track_functions", "ok" if v and v[0] in ("pl", "all") else "warn",
            v[0] if v else "?", "pl",
            _placed_fix(conn, "track_functions", queries["track_functions_fix"],
                        "counts inline vs background pool refills")))

        max_conn = int(required("max_connections"))
        reserved = 0
        for name in ("superuser_reserved_connections", "reserved_connections"):
            v = setting(name)
            if v is not None:
                reserved += int(v[0])
        need = processes * len(API_ROLES) * pool_size + extra_connections
        usable = max_conn - reserved
        out.append(Finding(
            "max_connections vs pool sizes",
            "fail" if need > usable else "warn" if need > 0.8 * usable else "ok",
            f"max_connections={max_conn} ({usable} usable)",
            f">= {need} ({processes} process(es) x {len(API_ROLES)} role pools x "
            f"{pool_size} + {extra_connections} for workers and admin)",
            sql.SQL(queries["max_connections_fix"]).format(
                sql.Literal(max(need * 5 // 4, 100))).as_string(conn)
            + ";  -- restart; or lower PGRESERVE_POOL_SIZE, or put PgBouncer in front "
            "(docs/operations.md)"))

        age = int(scalar(queries["database_xid_age"]))
        freeze = int(required("autovacuum_freeze_max_age"))
        out.append(Finding(
            "xid age", "fail" if age > 1_000_000_000 else "warn" if age > freeze else "ok",
            f"age(datfrozenxid)={age}", f"below autovacuum_freeze_max_age ({freeze})",
            queries["database_freeze_fix"] + " the oldest tables; find what holds back the xmin "
            "(long transactions, idle in transaction, replication slots)"))
    out.append(_schema_finding(dsn, schema))
    return out


def _schema_finding(dsn: str, schema: str | None) -> Finding:
    """Does the database hold exactly this version's migrations and function files?"""
    want = "every migration and function file of this pgreserve, and no other"
    try:
        migration_check.check_database(dsn, schema)
    except MigrationError as exc:  # DatabaseTooNew, a changed or legacy history
        return Finding("schema", "fail", exc.message, want,
                       "run the pgreserve that migrated this database, or recreate it")
    except DatabaseNotMigrated as exc:
        return Finding("schema", "fail", exc.message, want, str(exc.details["command"]))
    return Finding("schema", "ok", f"{len(migrations.available())} migrations", want, "")


def diagnose_pgbouncer(admin_url: str) -> list[Finding]:
    """PgBouncer's pools: clients waiting for a server connection (cl_waiting, maxwait)
    and the pool mode the service needs (transaction)."""
    try:
        report = read_pgbouncer(admin_url)
    except psycopg.Error as exc:
        return [Finding("pgbouncer admin console", "fail", f"unreadable: {exc}".strip(),
                        "the console answers SHOW POOLS",
                        "check --pgbouncer-admin-url (database pgbouncer) and that the user is "
                        "in admin_users or stats_users of pgbouncer.ini")]
    pools = [p for p in report.pools if p.database != "pgbouncer"]  # the console itself
    waiting = [p for p in pools if p.clients_waiting > 0]
    worst = max((p.max_wait_s for p in pools), default=0.0)
    out = [Finding(
        "pgbouncer clients waiting", "warn" if waiting else "ok",
        "; ".join(f"{p.database}/{p.user}: cl_waiting={p.clients_waiting}, "
                  f"maxwait={p.max_wait_s:.3f}s, sv_active={p.servers_active}"
                  for p in waiting)
        if waiting else f"none waiting in {len(pools)} pool(s), maxwait={worst:.3f}s",
        "cl_waiting = 0",
        "clients queue for server connections: find who holds them (pgreserve ops holdtime, "
        "idle in transaction), then raise pool_size / default_pool_size in pgbouncer.ini "
        "within max_connections")]
    modes = sorted({p.pool_mode for p in pools if p.pool_mode and p.pool_mode != "transaction"})
    if pools:
        out.append(Finding(
            "pgbouncer pool_mode", "warn" if modes else "ok",
            ", ".join(modes) if modes else "transaction", "transaction",
            "pool_mode = transaction in pgbouncer.ini (docs/operations.md, PgBouncer)"))
    return out


def failed(findings: list[Finding]) -> bool:
    return any(f.status == "fail" for f in findings)


def as_json(findings: list[Finding]) -> dict[str, Any]:
    return {"ok": not failed(findings), "findings": [f.as_json() for f in findings]}


def _tuned(reloptions: str) -> bool:
    """A pool partition's options as migration 0001 sets them: autovacuum on, a zero
    scale factor and a fixed threshold (not any option that merely starts like them)."""
    options = dict(o.split("=", 1) for o in reloptions.split(",") if "=" in o)
    try:
        return (float(options.get("autovacuum_vacuum_scale_factor", "nan")) == 0
                and int(options.get("autovacuum_vacuum_threshold", "-1")) >= 0
                and _pg_true(options.get("autovacuum_enabled", "true")))
    except ValueError:
        return False


def _pg_true(value: str) -> bool:
    """A boolean option PostgreSQL reads as true, in any spelling it stores as given
    (true, yes, on, 1, and the prefixes t, tr, y, ye; any case)."""
    text = value.strip().lower()
    return text in ("on", "1") or (text != "" and ("true".startswith(text)
                                                   or "yes".startswith(text)))
