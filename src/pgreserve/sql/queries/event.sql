-- The outbox event feed (core/service.py).

-- name: event_list
-- Only events of transactions below the snapshot's xmin: none can appear before the cursor later.
SELECT xid::text::bigint, event_id, type, payload, created_at FROM outbox_event
 WHERE tenant_id = %s AND (xid, event_id) > (%s::text::xid8, %s)
   AND xid < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY xid, event_id LIMIT %s;
