-- Expired idempotency keys are deleted. A key answers duplicates for its retention window
-- (default 90 days) and after that a new request with the same key is taken as new (migration
-- 0003 takes the expired key over), so an expired key decides nothing; but nothing deleted
-- one, and the table grew by a row for every source id ever enqueued. Maintenance now deletes
-- them in bounded batches, one purger at a time.
--
-- The expiry grows with the enqueue time, so keys lie in the heap roughly in expiry order: a
-- BRIN index (a summary per range of pages) finds the expired ones, and costs an enqueue
-- next to nothing. A B-tree on the expiry cost batch enqueue about 5% here; the BRIN index
-- nothing measurable. Ranges are summarised by autovacuum (autosummarize); pages not yet
-- summarised are simply read.

CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys
    USING brin (expires_at) WITH (autosummarize = on);

CREATE FUNCTION purge_idempotency_keys(p_now timestamptz, p_batch integer) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    purged integer;
BEGIN
    -- One purger at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.purge_keys')) THEN
        RETURN 0;
    END IF;
    -- A key an enqueue is taking over right now is locked: skipped here, and its new expiry
    -- keeps it. The expiry is checked again on the row deleted.
    -- The rows are found through the BRIN index in storage order (no sort of all expired
    -- keys) and deleted by their tuple ids (a TID scan, whatever the batch size's estimate).
    DELETE FROM idempotency_keys k
    WHERE k.ctid = ANY (ARRAY(
              SELECT d.ctid FROM idempotency_keys d
              WHERE d.expires_at <= coalesce(p_now, now())
              LIMIT p_batch
              FOR UPDATE SKIP LOCKED))
      AND k.expires_at <= coalesce(p_now, now());
    GET DIAGNOSTICS purged = ROW_COUNT;
    RETURN purged;
END
$$;

REVOKE ALL ON FUNCTION purge_idempotency_keys(timestamptz, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION purge_idempotency_keys(timestamptz, integer) TO appliance_system;
