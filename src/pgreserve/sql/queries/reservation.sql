-- Holds and their lifecycle (core/service.py).

-- name: reservation_reserve
SELECT reserve_v1(%s, %s, %s, %s::text[], %s::text[], %s::integer[],
 %s::interval, %s, %s, %s::jsonb);

-- name: reservation_claim
SELECT claim_v1(%s, %s, %s);

-- name: reservation_release
SELECT release_v1(%s, %s, %s);

-- name: reservation_extend
SELECT extend_v2(%s, %s, %s, %s, %s);

-- name: reservation_transition_keyed
-- claim, release or extend under a request key: the first answer is stored and replayed.
SELECT transition_keyed_v2(%s, %s, %s, %s, %s, %s, %s, %s);

-- name: reservation_reserve_in
-- The same four calls on a caller's connection: each function named with its schema,
-- so the caller's search_path is never touched.
SELECT {}.reserve_v1(%s, %s, %s, %s::text[], %s::text[], %s::integer[],
 %s::interval, %s, %s, %s::jsonb);

-- name: reservation_claim_in
SELECT {}.claim_v1(%s, %s, %s);

-- name: reservation_release_in
SELECT {}.release_v1(%s, %s, %s);

-- name: reservation_transition_keyed_in
SELECT {}.transition_keyed_v2(%s, %s, %s, %s, %s, %s, %s, %s);

-- name: reservation_change
-- The whole new cart of an active reservation, under a request key (change.sql).
SELECT change_v1(%s, %s, %s, %s, %s::text[], %s::text[], %s::integer[], %s);

-- name: reservation_change_in
-- The same on a caller's connection (see reservation_reserve_in).
SELECT {}.change_v1(%s, %s, %s, %s, %s::text[], %s::text[], %s::integer[], %s);

-- name: reservation_view
SELECT reservation_view_v1(%s, %s, coalesce(%s, clock_timestamp()));

-- name: reservation_expire_due
SELECT expire_due_v1(%s, %s);

-- name: reservation_due_one_line
-- Due holds of one line, soonest first, with their bucket: the sweeper sends
-- them through their bucket's combiner (expire_due_v1 then takes the rest).
SELECT r.tenant_id, l.bucket_id, r.reservation_id
FROM reservation r
JOIN reservation_line l
  ON l.tenant_id = r.tenant_id AND l.reservation_id = r.reservation_id
WHERE r.status = 'active' AND r.expires_at <= coalesce(%s, clock_timestamp())
  AND NOT EXISTS (SELECT 1 FROM reservation_line o
                  WHERE o.tenant_id = r.tenant_id AND o.reservation_id = r.reservation_id
                    AND o.line_no <> l.line_no)
ORDER BY r.expires_at
LIMIT %s;

-- name: reservation_list
-- A page of the tenant's reservations, newest first, after a (created_at,
-- reservation_id) position: a range of reservation_list_idx. `statuses` (NULL: all)
-- are those the reservation document shows (an active hold past its expiry is
-- expired).
SELECT r.created_at, r.reservation_id,
       reservation_view_v1(r.tenant_id, r.reservation_id, c.now)
FROM (SELECT coalesce(%(now)s::timestamptz, statement_timestamp()) AS now) c, reservation r
WHERE r.tenant_id = %(tenant)s
  AND (r.created_at, r.reservation_id) < (%(before_created)s, %(before_id)s)
  AND (%(statuses)s::text[] IS NULL
       OR CASE WHEN r.status = 'active' AND r.expires_at <= c.now THEN 'expired'
               ELSE r.status END = ANY (%(statuses)s::text[]))
ORDER BY r.created_at DESC, r.reservation_id DESC
LIMIT %(limit)s;

-- name: reservation_list_by_reference
-- The same, of one reference (a cart or order id): a range of reservation_reference_idx.
SELECT r.created_at, r.reservation_id,
       reservation_view_v1(r.tenant_id, r.reservation_id, c.now)
FROM (SELECT coalesce(%(now)s::timestamptz, statement_timestamp()) AS now) c, reservation r
WHERE r.tenant_id = %(tenant)s AND r.reference = %(reference)s
  AND (r.created_at, r.reservation_id) < (%(before_created)s, %(before_id)s)
  AND (%(statuses)s::text[] IS NULL
       OR CASE WHEN r.status = 'active' AND r.expires_at <= c.now THEN 'expired'
               ELSE r.status END = ANY (%(statuses)s::text[]))
ORDER BY r.created_at DESC, r.reservation_id DESC
LIMIT %(limit)s;
