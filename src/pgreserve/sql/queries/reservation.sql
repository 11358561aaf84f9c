-- Holds and their lifecycle (core/service.py).

-- name: reservation_reserve
SELECT reserve_v1(%s, %s, %s, %s::text[], %s::text[], %s::integer[],
 %s::interval, %s);

-- name: reservation_claim
SELECT claim_v1(%s, %s, %s);

-- name: reservation_release
SELECT release_v1(%s, %s, %s);

-- name: reservation_extend
SELECT extend_v1(%s, %s, %s, %s);

-- name: reservation_transition_keyed
-- claim, release or extend under a request key: the first answer is stored and replayed.
SELECT transition_keyed_v1(%s, %s, %s, %s, %s, %s, %s);

-- name: reservation_view
SELECT reservation_view_v1(%s, %s, coalesce(%s, clock_timestamp()));

-- name: reservation_expire_due
SELECT expire_due_v1(%s, %s);
