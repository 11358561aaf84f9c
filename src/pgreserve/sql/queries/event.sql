-- The outbox event feed (core/service.py).

-- name: event_list
-- Only events of transactions below the snapshot's xmin: none can appear before the cursor later.
-- Ordered by the table's xid (the feed index), not by the output column of that name.
SELECT xid::text::bigint, event_id, type, payload, created_at FROM outbox_event
 WHERE tenant_id = %s AND (xid, event_id) > (%s::text::xid8, %s)
   AND xid < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY outbox_event.xid, outbox_event.event_id LIMIT %s;
