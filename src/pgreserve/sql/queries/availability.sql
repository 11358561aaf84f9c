-- Availability of many SKUs at once (core/service.py availability).

-- name: availability_list
-- Every bucket of the tenant's SKUs in %s (text[]), only at the locations in %s
-- (text[]) unless that is NULL. One statement, so one snapshot: the figures of
-- all the buckets are those of one instant. %s first is the injectable clock.
SELECT bucket_view_v1(b.tenant_id, b.bucket_id, now_at.t)
  FROM (SELECT coalesce(%s, clock_timestamp()) AS t) now_at,
       stock_bucket b
 WHERE b.tenant_id = %s AND b.sku = ANY (%s::text[])
   AND (%s::text[] IS NULL OR b.location = ANY (%s::text[]))
 ORDER BY b.sku, b.location;
