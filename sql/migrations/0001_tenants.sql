-- Tenants: the unit of isolation (row-level security) and, later, of fairness and budgets.

CREATE TABLE tenants (
    name text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9_.-]{0,62}$'),
    display_name text,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The tenant of the current transaction, set with SET LOCAL (set_config(..., true)) by the
-- adapter. Unset or empty means NULL, and NULL matches no row: fail closed.
CREATE FUNCTION current_tenant() RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT NULLIF(current_setting('appliance.tenant', true), '') $$;

GRANT SELECT ON tenants TO appliance_app;
GRANT SELECT, INSERT, UPDATE ON tenants TO appliance_system;
GRANT EXECUTE ON FUNCTION current_tenant() TO appliance_app, appliance_system;
