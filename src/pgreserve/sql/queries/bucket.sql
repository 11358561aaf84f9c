-- Reads of stock buckets (core/service.py).

-- name: bucket_view
-- One bucket by (tenant, sku, location); %s first is the injectable clock.
SELECT bucket_view_v1(tenant_id, bucket_id, coalesce(%s, clock_timestamp()))
 FROM stock_bucket WHERE tenant_id = %s AND sku = %s AND location = %s;
