-- Plans that stay sound as the hot table grows by orders of magnitude.
--
-- Runtime connections keep one generic plan per statement for their lifetime (plan_cache_mode =
-- force_generic_plan), replanned only when the table's statistics change. A runner that starts
-- on an empty envelope (a fresh box, a quiet hour) plans for a tiny table; when a burst arrives,
-- autovacuum's ANALYZE may come a minute or more later. Measured here: a runner started on an
-- empty database drained a 20,000-message burst at ~320 msgs/s (against ~3,200 with plans made on
-- current statistics): every acknowledgement read the whole table, every claim the whole lane.
-- Two defences: the claim is written so that any plan reads a bounded number of rows (see
-- sql/queries/runner.sql), and the maintenance service re-analyzes the envelope (and the other
-- tables the runtime reads by key) as soon as it has grown well past what its statistics describe.

-- clock(now): the injected time when given, else the transaction's. A SQL function the planner
-- inlines, so `clock(%(now)s)` plans exactly as `coalesce(%(now)s::timestamptz, now())`; it keeps
-- long named statements (the claim) within the driver's 4 KiB statement cache, where they are
-- parsed once per process rather than on every call (see appliance/db/queries.py).
CREATE FUNCTION clock(p_now timestamptz) RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$ SELECT coalesce(p_now, now()) $$;
GRANT EXECUTE ON FUNCTION clock(timestamptz) TO appliance_app, appliance_system;

-- ANALYZE each table the runtime reads by key that has grown to `p_growth` times its size at its
-- last ANALYZE (or VACUUM), and to at least `p_min_pages`; returns the tables analyzed. Sizes are
-- the files', known at once: the row counters of the statistics views can lag ten seconds behind
-- an idle writer. ANALYZE invalidates every session's cached plans of the table, so the next
-- call of each statement is planned on the new figures. Runs as the owner (the runtime roles own
-- nothing); one caller at a time (the others skip).
CREATE FUNCTION refresh_planner_stats(p_min_pages bigint, p_growth float8) RETURNS text[]
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    t regclass;
    analyzed text[] := '{}';
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance:refresh_planner_stats')) THEN
        RETURN analyzed;
    END IF;
    FOREACH t IN ARRAY ARRAY[
        'appliance.agent_messages', 'appliance.message_transitions',
        'appliance.idempotency_keys', 'appliance.spend_ledger', 'appliance.inference_calls'
    ]::regclass[] LOOP
        IF pg_relation_size(t) / current_setting('block_size')::bigint
           >= greatest(p_min_pages, p_growth * (SELECT c.relpages FROM pg_class c WHERE c.oid = t))
        THEN
            -- SKIP_LOCKED: when autovacuum holds the table, it is refreshing the figures
            -- already (and waiting would get it cancelled after deadlock_timeout). Qualified, so
            -- no temporary table of the caller's session can stand in for it.
            EXECUTE (SELECT format('ANALYZE (SKIP_LOCKED) %I.%I', n.nspname, c.relname)
                     FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE c.oid = t);
            analyzed := analyzed || t::text;
        END IF;
    END LOOP;
    RETURN analyzed;
END
$$;
REVOKE ALL ON FUNCTION refresh_planner_stats(bigint, float8) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION refresh_planner_stats(bigint, float8) TO appliance_system;
