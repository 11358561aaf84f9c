-- Settings of a SKU over all its locations (core/service.py).

-- name: sku_settings
SELECT sku_settings_v1(%s, %s);

-- name: sku_update
SELECT sku_update_v1(%s, %s, %s, %s, %s, %s::text[]);
