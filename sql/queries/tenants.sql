-- Named queries of tenants.

-- name: tenant_add :one
-- Register a tenant; returns nothing when it already exists.
INSERT INTO tenants (name, display_name) VALUES (%(name)s, %(display_name)s)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: tenant_list :many
-- Every tenant, by name.
SELECT name, display_name, created_at FROM tenants ORDER BY name;

-- name: tenant_exists :one
-- Whether a tenant is registered.
SELECT EXISTS (SELECT FROM tenants WHERE name = %(name)s) AS present;

-- name: tenant_count :one
-- How many tenants are registered.
SELECT count(*) AS n FROM tenants;

-- name: tenant_set :one
-- Scope the current transaction to one tenant (SET LOCAL: it cannot leak to the pool's next user).
SELECT set_config('appliance.tenant', %(tenant)s, true) AS tenant;
