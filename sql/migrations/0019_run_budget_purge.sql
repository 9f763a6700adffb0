-- Run budgets of runs long idle are deleted, a bounded sweep at a time, like expired keys.
--
-- run_budgets holds a row per run ((tenant, source, source id), created by its first
-- reservation) and nothing ever deleted one: the table grew by a row for every source id ever
-- run. A run's budget is now stamped with its last reservation (used_at) and deleted once the
-- run has reserved nothing for longer than the idle horizon the caller passes (the runtime
-- passes the larger of the idempotency retention and the longest budget hold): by then the run's
-- keys have expired, so the same request is new work with a budget of its own anyway. Work
-- that resumes a run after that (a redrive of work dead for longer, work deferred further out)
-- starts the run's budget afresh; the monthly cap still bounds what it may spend.
--
-- used_at carries no index, so reservations stay heap-only updates. The purge sweeps the table
-- in storage order, a window of 1,024 pages per call resumed from a cursor (as 0016 does for
-- keys): bounded whatever the table's size, with no index for reservations to maintain.

-- Budgets that exist now count as used now: they are purged one horizon after this migration.
ALTER TABLE run_budgets ADD COLUMN used_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE run_budgets ALTER COLUMN used_at DROP DEFAULT;

INSERT INTO upkeep_cursors (name) VALUES ('run_budgets');

-- As in 0005, stamping used_at on every reservation (refused ones too: the run is alive), and
-- taking the budget again when a purge deleted it between the insert and the lock: it had been
-- idle past the horizon, so the run starts a fresh one rather than going unaccounted.
CREATE OR REPLACE FUNCTION run_budget_reserve(
    p_tenant text, p_source text, p_source_id text, p_pipeline text, p_limits jsonb,
    p_reserve numeric, p_verification boolean, p_ask jsonb, p_now timestamptz
) RETURNS text
    LANGUAGE plpgsql SET search_path = appliance, pg_catalog AS $$
DECLARE
    at timestamptz := coalesce(p_now, now());
    b run_budgets;
    d text;
    lim numeric;
    usable numeric;
BEGIN
    FOR attempt IN 1..3 LOOP
        INSERT INTO run_budgets (tenant, source, source_id, pipeline, limits,
                                 verification_reserve, started_at, used_at)
        VALUES (p_tenant, p_source, p_source_id, p_pipeline, p_limits, p_reserve, at, at)
        ON CONFLICT DO NOTHING;
        SELECT * INTO b FROM run_budgets
        WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id
        FOR UPDATE;
        EXIT WHEN FOUND;
    END LOOP;
    IF b.tenant IS NULL THEN
        RAISE EXCEPTION 'run budget of %/%/% vanished three times while being reserved',
            p_tenant, p_source, p_source_id
            USING ERRCODE = 'serialization_failure';
    END IF;
    IF b.limits ? 'wall_seconds'
       AND extract(epoch FROM at - b.started_at) > (b.limits ->> 'wall_seconds')::numeric THEN
        UPDATE run_budgets SET exhausted = coalesce(exhausted, 'wall_time'),
                               used_at = greatest(used_at, at)
        WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id;
        RETURN 'wall_time';
    END IF;
    FOR d IN SELECT jsonb_object_keys(p_ask) ORDER BY 1 LOOP
        CONTINUE WHEN NOT b.limits ? d;
        lim := (b.limits ->> d)::numeric;
        usable := CASE WHEN p_verification THEN lim ELSE lim * (1 - b.verification_reserve) END;
        IF coalesce((b.used ->> d)::numeric, 0) + (p_ask ->> d)::numeric > usable THEN
            UPDATE run_budgets SET exhausted = coalesce(exhausted, d),
                                   used_at = greatest(used_at, at)
            WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id;
            RETURN d;
        END IF;
    END LOOP;
    UPDATE run_budgets r
    SET used = (SELECT jsonb_object_agg(k, coalesce((r.used ->> k)::numeric, 0)
                                            + coalesce((p_ask ->> k)::numeric, 0))
                FROM (SELECT jsonb_object_keys(r.used) AS k
                      UNION SELECT jsonb_object_keys(p_ask)) AS keys),
        used_at = greatest(r.used_at, at)
    WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id;
    RETURN NULL;
END
$$;

-- The storage-order sweeps (0016's key purge, this one) share their cursor handling: where a
-- call's window starts (a new sweep past the end of the table, or where the table shrank),
-- and where the next one resumes (at the last block deleted from, when a full batch may have
-- left more in the window; else after the window).
CREATE FUNCTION upkeep_window_start(p_name text, p_table regclass) RETURNS bigint
    LANGUAGE sql SET search_path = appliance, pg_catalog
    AS $$
    SELECT CASE WHEN c.block >= pg_relation_size(p_table) / current_setting('block_size')::bigint
                THEN 0 ELSE c.block END
    FROM upkeep_cursors c WHERE c.name = p_name
$$;

CREATE FUNCTION upkeep_window_done(
    p_name text, p_first bigint, p_pages bigint, p_done integer, p_batch integer, p_last bigint
) RETURNS void
    LANGUAGE sql SET search_path = appliance, pg_catalog
    AS $$
    UPDATE upkeep_cursors
    SET block = CASE WHEN p_done >= p_batch THEN p_last ELSE p_first + p_pages END
    WHERE name = p_name
$$;

REVOKE ALL ON FUNCTION upkeep_window_start(text, regclass) FROM PUBLIC;
REVOKE ALL ON FUNCTION upkeep_window_done(text, bigint, bigint, integer, integer, bigint)
    FROM PUBLIC;

-- As in 0016, with the cursor handling above.
CREATE OR REPLACE FUNCTION purge_idempotency_keys(p_now timestamptz, p_batch integer)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    at timestamptz := coalesce(p_now, now());
    window_pages constant bigint := 1024;
    first_block bigint;
    last_block bigint;
    purged integer;
BEGIN
    -- One purger at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.purge_keys')) THEN
        RETURN 0;
    END IF;
    first_block := upkeep_window_start('idempotency_keys', 'appliance.idempotency_keys');
    -- A key an enqueue is taking over right now is locked: skipped here, and its new expiry
    -- keeps it. The expiry is checked again on the row deleted. The window is read by a TID
    -- range scan and the rows deleted by their tuple ids, whatever the statistics.
    WITH gone AS (
        DELETE FROM idempotency_keys k
        WHERE k.ctid = ANY (ARRAY(
                  SELECT d.ctid FROM idempotency_keys d
                  WHERE d.ctid >= format('(%s,0)', first_block)::tid
                    AND d.ctid < format('(%s,0)', first_block + window_pages)::tid
                    AND d.expires_at <= at
                  ORDER BY d.ctid
                  LIMIT p_batch
                  FOR UPDATE SKIP LOCKED))
          AND k.expires_at <= at
        RETURNING k.ctid
    )
    SELECT count(*), max((g.ctid::text::point)[0])::bigint INTO purged, last_block FROM gone g;
    PERFORM upkeep_window_done('idempotency_keys', first_block, window_pages, purged, p_batch,
                               last_block);
    RETURN purged;
END
$$;

-- Delete one bounded batch of budgets idle for longer than p_idle (as of p_now), from the
-- next window of the sweep; how many. A budget being reserved right now is locked: skipped,
-- and its new stamp keeps it. The idleness is checked again on the row deleted.
CREATE FUNCTION purge_run_budgets(p_now timestamptz, p_idle interval, p_batch integer)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    before timestamptz := coalesce(p_now, now()) - p_idle;
    window_pages constant bigint := 1024;
    first_block bigint;
    last_block bigint;
    purged integer;
BEGIN
    IF p_idle IS NULL OR p_idle <= interval '0' THEN
        RAISE EXCEPTION 'run budget idle horizon must be positive, got %', p_idle
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One purger at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.purge_run_budgets')) THEN
        RETURN 0;
    END IF;
    first_block := upkeep_window_start('run_budgets', 'appliance.run_budgets');
    WITH gone AS (
        DELETE FROM run_budgets b
        WHERE b.ctid = ANY (ARRAY(
                  SELECT d.ctid FROM run_budgets d
                  WHERE d.ctid >= format('(%s,0)', first_block)::tid
                    AND d.ctid < format('(%s,0)', first_block + window_pages)::tid
                    AND d.used_at < before
                  ORDER BY d.ctid
                  LIMIT p_batch
                  FOR UPDATE SKIP LOCKED))
          AND b.used_at < before
        RETURNING b.ctid
    )
    SELECT count(*), max((g.ctid::text::point)[0])::bigint INTO purged, last_block FROM gone g;
    PERFORM upkeep_window_done('run_budgets', first_block, window_pages, purged, p_batch,
                               last_block);
    RETURN purged;
END
$$;

REVOKE ALL ON FUNCTION purge_run_budgets(timestamptz, interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION purge_run_budgets(timestamptz, interval, integer) TO appliance_system;
