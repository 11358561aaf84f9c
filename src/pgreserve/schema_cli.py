"""`--schema`, the option of every command that takes a database (db/schema.py)."""

from __future__ import annotations

import click

from .db.schema import DEFAULT_SCHEMA, ENV, check, use
from .errors import InvalidRequest


def check_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--schema's check alone: a name that cannot be a schema is a BadParameter."""
    if value is not None:
        try:
            check(value)
        except InvalidRequest as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return value


def use_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The --schema callback: the name checked, then this process's schema."""
    check_option(ctx, param, value)
    if value is not None:
        use(value)
    return value


# `--schema` beside `--database-url`: it sets PGRESERVE_SCHEMA for the command, so
# every pool, worker, monitor and child process the command starts uses it.
schema_option = click.option(
    "--schema", envvar=ENV, default=None, show_envvar=True, expose_value=False,
    is_eager=True, callback=use_option,
    help=f"PostgreSQL schema of pgreserve's tables and functions (default {DEFAULT_SCHEMA}).")
