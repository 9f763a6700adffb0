-- Cluster-level set-up that precedes the numbered migrations: the roles and the schema they own.
-- Idempotent; run by the migrator as the connecting (admin) user, under the migration lock.
-- Roles are cluster objects, not schema objects, so they live here and not in schema.sql.
--   appliance_owner   owns every object; migrations run as it (SET ROLE). Cannot log in.
--   appliance_app     tenant-scoped runtime role: sees only the tenant set with SET LOCAL.
--   appliance_system  the bus machinery (claim, reclaim, expire, status) across tenants
--                     (BYPASSRLS where the migrating user may grant it: see below).
-- Neither runtime role owns anything.
DO $$
DECLARE
    spec text[];
BEGIN
    FOREACH spec SLICE 1 IN ARRAY ARRAY[
        ['appliance_owner', 'NOLOGIN'], ['appliance_app', 'LOGIN'], ['appliance_system', 'LOGIN']
    ] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = spec[1]) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I %s', spec[1], spec[2]);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                -- Another database of this cluster created it at the same moment: fine.
                NULL;
            END;
        END IF;
    END LOOP;
    -- The bus machinery sees every tenant by design. Under row-level security PostgreSQL may not
    -- use an index for quals built on functions that are not leakproof (enum equality is
    -- not), so the claim would scan and sort every pending row; BYPASSRLS keeps the claim on
    -- its partial index. Only a superuser can grant it; elsewhere the policy still applies.
    IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
       AND NOT (SELECT rolbypassrls FROM pg_roles WHERE rolname = 'appliance_system') THEN
        ALTER ROLE appliance_system BYPASSRLS;
    END IF;
    -- The migrating user must be able to SET ROLE appliance_owner (a superuser always can).
    IF NOT pg_has_role(current_user, 'appliance_owner', 'MEMBER') THEN
        EXECUTE format('GRANT appliance_owner TO %I', current_user);
    END IF;
END
$$;

-- Advisory locks are open to every role by default. Holding the machinery's keys, the tenant
-- role could stall every enqueue (each takes the stage-tier lock shared) and switch the
-- archive, key purge and history prune off without an error (they skip a round when their
-- lock is taken). In this database only the owner and the machinery take them. The functions
-- belong to the bootstrap superuser: another migrating user (an external server's owner)
-- cannot change that, and is told.
DO $$
DECLARE
    f regprocedure;
BEGIN
    IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
        RAISE WARNING 'advisory locks stay open to every role of this database: only a '
            'superuser can limit them (the migration ran as %)', current_user;
        RETURN;
    END IF;
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc p
        WHERE p.pronamespace = 'pg_catalog'::regnamespace
          AND p.proname LIKE 'pg\_%advisory%lock%' AND p.proname NOT LIKE '%unlock%'
        ORDER BY p.oid
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO appliance_owner, appliance_system', f);
    END LOOP;
END
$$;

-- Temporary objects for the owner alone. A SECURITY DEFINER function's temporary table lives in
-- its caller's session: a runtime role that made one of that name first (with a trigger of its
-- own, in pg_temp) had that trigger run as the owner. The runtime roles use none. The
-- database's privilege, so its owner (or a superuser) must make this change; another
-- migrating user is told.
DO $$
BEGIN
    IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
       OR pg_has_role(current_user,
                      (SELECT datdba FROM pg_database WHERE datname = current_database()),
                      'MEMBER') THEN
        EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
        EXECUTE format('GRANT TEMPORARY ON DATABASE %I TO appliance_owner', current_database());
    ELSE
        RAISE WARNING 'temporary tables stay open to every role of this database: only its '
            'owner or a superuser can limit them (the migration ran as %)', current_user;
    END IF;
END
$$;

-- Ending or cancelling a server process is open to the processes of the same role: every
-- tenant's statements run as one role, so one tenant's SQL could cancel another's. The
-- machinery needs neither; an operator does it as the admin. Like the advisory locks below,
-- only a superuser can change it.
DO $$
BEGIN
    IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
        REVOKE EXECUTE ON FUNCTION pg_catalog.pg_cancel_backend(integer) FROM PUBLIC;
        REVOKE EXECUTE ON FUNCTION pg_catalog.pg_terminate_backend(integer, bigint) FROM PUBLIC;
    END IF;
END
$$;

CREATE SCHEMA IF NOT EXISTS appliance AUTHORIZATION appliance_owner;
REVOKE ALL ON SCHEMA appliance FROM PUBLIC;
GRANT USAGE ON SCHEMA appliance TO appliance_app, appliance_system;

CREATE TABLE IF NOT EXISTS appliance.schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
-- Only when it differs: ALTER TABLE .. OWNER takes an ACCESS EXCLUSIVE lock even when nothing
-- changes, so every migrate run (one with nothing to apply included) queued behind any reader
-- of this table, and every command's schema check queued behind it.
DO $$
BEGIN
    IF (SELECT c.relowner::regrole::text FROM pg_class c
        WHERE c.oid = 'appliance.schema_migrations'::regclass) <> 'appliance_owner' THEN
        ALTER TABLE appliance.schema_migrations OWNER TO appliance_owner;
    END IF;
END
$$;
