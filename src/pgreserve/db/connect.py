"""The connections pgreserve's own tools open beside the pool.

`migrate`, `reconcile`, `doctor`, the migration check, the embedded server's setup
and the bench's admin reads each open a connection of their own. Behind PgBouncer in
transaction pooling mode (1.18 and older: no prepared statements) any statement
psycopg prepares is left on a server connection that the next client then gets:
its own statement of the same name fails ("prepared statement "_pg3_0" already
exists", or "does not exist" on another server connection). psycopg prepares a query
once it has run it `prepare_threshold` times (5 by default) on one connection, which a
tool's loop does (`reconcile --freeze` over many buckets, `migrate` over many
migrations). These connections never prepare: none of them is on a hot path.
"""

from __future__ import annotations

from typing import Any

import psycopg


def connect(conninfo: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """An autocommit connection that never prepares a statement (see above)."""
    return psycopg.connect(conninfo, autocommit=True, prepare_threshold=None, **kwargs)


async def connect_async(conninfo: str, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
    """`connect`, for asyncio."""
    return await psycopg.AsyncConnection.connect(conninfo, autocommit=True,
                                                 prepare_threshold=None, **kwargs)
