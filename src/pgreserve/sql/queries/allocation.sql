-- Allocation across locations (core/service.py).

-- name: location_priority_set
SELECT location_priority_set_v1(%s, %s::text[]);

-- name: location_priority_get
SELECT location_priority_get_v1(%s);

-- name: reservation_reserve_allocated
SELECT reserve_allocated_v1(%s, %s, %s, %s::text[], %s::text[], %s::integer[], %s::text[],
 %s::integer[], %s::boolean[], %s::interval, %s, %s, %s::jsonb);

-- name: reservation_reserve_allocated_in
-- On a caller's connection: the function named with its schema.
SELECT {}.reserve_allocated_v1(%s, %s, %s, %s::text[], %s::text[], %s::integer[], %s::text[],
 %s::integer[], %s::boolean[], %s::interval, %s, %s, %s::jsonb);
