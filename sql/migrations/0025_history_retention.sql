-- The audit history gets a retention. Archived messages, their transition logs, the model-call
-- records, the spend ledger's lines and the records of stopped runners were kept for ever: on a
-- box with a fixed disk that is a slow way to stop. prune_history removes, a bounded batch at a
-- time, what has been finished for longer than the history retention (runner setting; 400 days
-- by default, or never):
--   * a month of the archive once the whole month lies before the cutoff: first the transition
--     logs of its messages (oldest message first, from a cursor, so a large month is walked
--     once), then the month's partition, in one DROP; rows of the default partition one by
--     one, with their logs;
--   * model calls made before the cutoff;
--   * spend ledger lines and alerts of months that ended before the cutoff (by the ledger's
--     time zone; open reservations stay); the month's totals (spend_months) are kept;
--   * runners stopped, or last seen, before the cutoff.
-- Work still in the envelope (pending, running, dead, ...) keeps its whole log whatever its age.

-- Where the log sweep of each archive month got to (the last message id done).
CREATE TABLE prune_cursors (
    name text PRIMARY KEY,
    last_id bigint NOT NULL
);

CREATE FUNCTION prune_history(p_cutoff timestamptz, p_batch integer) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    -- Dropping a month's partition needs the archive to itself for a moment: behind a long
    -- reader it gives up after a second (the whole call is undone) and tries next round.
    SET lock_timeout TO '1s'
    AS $$
DECLARE
    done integer := 0;
    n integer;
    part regclass;
    part_name text;
    after_id bigint;
    ids bigint[];
BEGIN
    IF p_cutoff IS NULL OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'prune_history needs a cutoff and a batch of at least 1, got % and %',
            p_cutoff, p_batch USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One pruner at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.prune_history')) THEN
        RETURN 0;
    END IF;

    -- 1. Archive months that ended before the cutoff, oldest first. archive_messages names
    --    each month's partition agent_messages_archive_yYYYYmMM, bounded by the UTC month.
    WHILE done < p_batch LOOP
        SELECT c.oid::regclass, c.relname INTO part, part_name
        FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'agent_messages_archive'::regclass
          AND c.relname ~ '^agent_messages_archive_y[0-9]{4}m[0-9]{2}$'
          AND ((to_date(right(c.relname, 8), '"y"YYYY"m"MM') + interval '1 month')::timestamp
               AT TIME ZONE 'UTC') <= p_cutoff
        ORDER BY c.relname
        LIMIT 1;
        EXIT WHEN NOT FOUND;
        SELECT pc.last_id INTO after_id FROM prune_cursors pc WHERE pc.name = part_name;
        EXECUTE format('SELECT array_agg(s.id ORDER BY s.id) FROM'
                       ' (SELECT a.id FROM %s a WHERE a.id > $1 ORDER BY a.id LIMIT $2) AS s',
                       part)
            INTO ids USING coalesce(after_id, 0), p_batch - done;
        n := coalesce(cardinality(ids), 0);
        IF n > 0 THEN
            DELETE FROM message_transitions t WHERE t.message_id = ANY (ids);
            INSERT INTO prune_cursors AS pc (name, last_id) VALUES (part_name, ids[n])
            ON CONFLICT (name) DO UPDATE SET last_id = excluded.last_id;
            done := done + n;
        END IF;
        -- A short sweep has reached the month's end: the month goes, rows and all.
        IF done < p_batch THEN
            EXECUTE format('DROP TABLE %s', part);
            DELETE FROM prune_cursors pc WHERE pc.name = part_name;
        END IF;
    END LOOP;

    -- 2. Rows of the default partition (months archived before they had partitions).
    IF done < p_batch THEN
        SELECT array_agg(s.id) INTO ids
        FROM (SELECT d.id FROM agent_messages_archive_default d
              WHERE d.finished_at < p_cutoff ORDER BY d.id LIMIT p_batch - done) AS s;
        n := coalesce(cardinality(ids), 0);
        IF n > 0 THEN
            DELETE FROM message_transitions t WHERE t.message_id = ANY (ids);
            DELETE FROM agent_messages_archive_default d WHERE d.id = ANY (ids);
            done := done + n;
        END IF;
    END IF;

    -- 3. Model calls made before the cutoff.
    IF done < p_batch THEN
        DELETE FROM inference_calls c
        WHERE c.id = ANY (ARRAY(SELECT i.id FROM inference_calls i WHERE i.at < p_cutoff
                                ORDER BY i.at LIMIT p_batch - done));
        GET DIAGNOSTICS n = ROW_COUNT;
        done := done + n;
    END IF;

    -- 4. Ledger lines of months that ended before the cutoff (an open reservation stays until
    --    it is settled or released), then those months' alerts.
    IF done < p_batch THEN
        DELETE FROM spend_ledger l
        WHERE l.id = ANY (ARRAY(SELECT s.id FROM spend_ledger s
                                WHERE s.month < spend_month(p_cutoff) AND s.status <> 'reserved'
                                ORDER BY s.month LIMIT p_batch - done));
        GET DIAGNOSTICS n = ROW_COUNT;
        done := done + n;
    END IF;
    IF done < p_batch THEN
        DELETE FROM spend_alerts a
        WHERE a.ctid = ANY (ARRAY(SELECT s.ctid FROM spend_alerts s
                                  WHERE s.month < spend_month(p_cutoff)
                                  LIMIT p_batch - done));
        GET DIAGNOSTICS n = ROW_COUNT;
        done := done + n;
    END IF;

    -- 5. Runners stopped, or last seen (killed), before the cutoff.
    IF done < p_batch THEN
        DELETE FROM runners r
        WHERE r.id = ANY (ARRAY(SELECT s.id FROM runners s
                                WHERE coalesce(s.stopped_at, s.seen_at) < p_cutoff
                                LIMIT p_batch - done));
        GET DIAGNOSTICS n = ROW_COUNT;
        done := done + n;
    END IF;
    RETURN done;
EXCEPTION WHEN lock_not_available THEN
    RAISE NOTICE 'prune_history: the archive is in use (%); trying again next round', SQLERRM;
    RETURN 0;
END
$$;
REVOKE ALL ON FUNCTION prune_history(timestamptz, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION prune_history(timestamptz, integer) TO appliance_system;
