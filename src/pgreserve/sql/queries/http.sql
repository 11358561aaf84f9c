-- The HTTP layer's own statements (http/routes/).

-- name: health_check
-- /healthz: a round trip on the API's pool, nothing read.
SELECT 1;
