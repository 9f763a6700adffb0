-- Expired idempotency keys are found by sweeping the table in storage order, a bounded window
-- of pages per call, from where the last call stopped; no index.
--
-- 0012 found them through a BRIN index on expires_at. A BRIN range's summary only ever widens:
-- once the keys of a range expired and were deleted, VACUUM let new keys (expiring 90 days
-- later) take their space, and the range kept the old minimum. After one retention period every
-- reused range matched `expires_at <= now` for good, and each purge round (every minute) read
-- them all to find nothing: measured here, 54,785 of 100,000 keys read with none expired after
-- one expire-and-refill cycle; in a steady state, the whole table each minute.
--
-- The sweep reads at most a window of 1,024 pages (8 MiB) per call, or stops at its batch of
-- deletions and resumes there. An expired key answers no duplicate (a new request takes it
-- over), so deleting it a sweep later changes nothing; the table holds about one sweep's worth
-- of expired keys at most. Enqueues no longer maintain an index on the expiry either.

DROP INDEX idempotency_keys_expires_at_idx;

-- Where each sweep resumes: the first block of its next window. Owner-only (the purge is
-- SECURITY DEFINER).
CREATE TABLE upkeep_cursors (
    name text PRIMARY KEY,
    block bigint NOT NULL DEFAULT 0 CHECK (block >= 0)
);
INSERT INTO upkeep_cursors (name) VALUES ('idempotency_keys');

CREATE OR REPLACE FUNCTION purge_idempotency_keys(p_now timestamptz, p_batch integer)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    at timestamptz := coalesce(p_now, now());
    window_pages constant bigint := 1024;
    blocks bigint := pg_relation_size('appliance.idempotency_keys')
                     / current_setting('block_size')::bigint;
    first_block bigint;
    last_block bigint;
    purged integer;
BEGIN
    -- One purger at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.purge_keys')) THEN
        RETURN 0;
    END IF;
    SELECT c.block INTO first_block FROM upkeep_cursors c WHERE c.name = 'idempotency_keys';
    IF first_block >= blocks THEN
        first_block := 0;  -- past the end (or the table shrank): a new sweep
    END IF;
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
    -- A full batch may have left expired keys further on in the window: the next call resumes
    -- at the last block it deleted from. Otherwise the window is done.
    UPDATE upkeep_cursors
    SET block = CASE WHEN purged >= p_batch THEN last_block
                     ELSE first_block + window_pages END
    WHERE name = 'idempotency_keys';
    RETURN purged;
END
$$;
