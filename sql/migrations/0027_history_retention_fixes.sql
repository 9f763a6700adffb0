-- prune_history (0025), three ways it could lose track or stall, fixed:
--
-- 1. A month was swept from a cursor in id order and then dropped, whatever was still on its
--    way into it: a message archived into the month after the sweep had passed its id (ids do
--    not follow finishing order), or between the last sweep and the DROP, left its transition
--    log behind with nothing pointing to it. A month is now swept only while no finished
--    message of it is still in the envelope: every call checks, so once a sweep has begun
--    nothing more can arrive (a message's finishing time lies in the past; an archiver moving
--    rows of the month holds them in the envelope, for this check, until it commits).
-- 2. One long reader of the archive stopped every kind of pruning: a DROP that gave up after
--    its second undid the whole call, model calls and ledger lines included. Now only the DROP
--    is undone (the month is tried again next round) and the rest goes on; a lock not had in
--    time by the other steps (the archiver creating a month's partition holds the default
--    one) undoes those steps alone, and the month's sweep stays. A DROP that gives up ends
--    the round: readers wait behind it at most once a round.
-- 3. After a DROP the archive stayed locked for the rest of the call: a call now ends with a
--    DROP, so readers and the archiver wait for nothing more than the DROP itself.
-- Also: a call deletes at most ten log rows a message on average (a message deferred or
-- retried many times has thousands), model calls and ledger lines of a message still in the
-- envelope (dead, or held) are kept with it, and the cursor of a month dropped by other means,
-- or of a month a message is still on its way to, is forgotten.

CREATE OR REPLACE FUNCTION prune_history(p_cutoff timestamptz, p_batch integer) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    SET lock_timeout TO '1s'
    AS $$
DECLARE
    done integer := 0;
    n integer;
    part regclass;
    part_name text;
    month_end timestamptz;
    after_id bigint;
    ids bigint[];
    rows_gone integer;
    last_cut bigint;
    swept_to bigint;
    swept integer;
    dropped_later boolean := false;
BEGIN
    IF p_cutoff IS NULL OR p_batch IS NULL OR p_batch < 1 OR p_batch > 1000000 THEN
        RAISE EXCEPTION 'prune_history needs a cutoff and a batch of 1 to 1,000,000, got % and %',
            p_cutoff, p_batch USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One pruner at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.prune_history')) THEN
        RETURN 0;
    END IF;
    DELETE FROM prune_cursors pc WHERE to_regclass('appliance.' || pc.name) IS NULL;

    -- 1. The oldest archive month that ended before the cutoff. archive_messages names each
    --    month's partition agent_messages_archive_yYYYYmMM, bounded by the UTC month.
    SELECT c.oid::regclass, c.relname,
           (to_date(right(c.relname, 8), '"y"YYYY"m"MM') + interval '1 month')::timestamp
               AT TIME ZONE 'UTC'
    INTO part, part_name, month_end
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'agent_messages_archive'::regclass
      AND c.relname ~ '^agent_messages_archive_y[0-9]{4}m[0-9]{2}$'
      AND ((to_date(right(c.relname, 8), '"y"YYYY"m"MM') + interval '1 month')::timestamp
           AT TIME ZONE 'UTC') <= p_cutoff
    ORDER BY c.relname
    LIMIT 1;
    -- Swept only once nothing more can arrive: no finished message of the month is still in
    -- the envelope (the archiver lags, or the archive retention is as long as this one).
    IF part IS NOT NULL AND EXISTS (
        SELECT FROM agent_messages h
        WHERE h.status IN ('done', 'cancelled', 'expired') AND h.finished_at < month_end
    ) THEN
        -- A message of the month is still on its way: the sweep starts again once all of it
        -- has arrived (robust even to finishing times given in the past).
        DELETE FROM prune_cursors pc WHERE pc.name = part_name;
    ELSIF part IS NOT NULL THEN
        BEGIN
            SELECT pc.last_id INTO after_id FROM prune_cursors pc WHERE pc.name = part_name;
            EXECUTE format('SELECT array_agg(s.id ORDER BY s.id) FROM'
                           ' (SELECT a.id FROM %s a WHERE a.id > $1 ORDER BY a.id LIMIT $2)'
                           ' AS s', part)
                INTO ids USING coalesce(after_id, 0), p_batch;
            n := coalesce(cardinality(ids), 0);
            IF n > 0 THEN
                -- At most ten log rows a message on average in one call: a message retried
                -- or deferred many times has a long log. The cursor passes only messages
                -- whose logs are gone; a call cut short counts as a full batch (more to do).
                WITH gone AS (
                    DELETE FROM message_transitions t
                    WHERE t.ctid = ANY (ARRAY(
                        SELECT x.ctid FROM message_transitions x WHERE x.message_id = ANY (ids)
                        ORDER BY x.message_id, x.id LIMIT p_batch * 10))
                    RETURNING t.message_id
                )
                SELECT count(*), max(g.message_id) INTO rows_gone, last_cut FROM gone AS g;
                IF rows_gone < p_batch * 10 THEN
                    after_id := ids[n];
                    done := n;
                ELSE
                    SELECT max(x) INTO swept_to
                    FROM unnest(ids) AS x WHERE x < last_cut;
                    after_id := coalesce(swept_to, after_id);
                    done := p_batch;
                END IF;
                IF after_id IS NOT NULL THEN
                    INSERT INTO prune_cursors AS pc (name, last_id) VALUES (part_name, after_id)
                    ON CONFLICT (name) DO UPDATE SET last_id = excluded.last_id;
                END IF;
            END IF;
            IF n < p_batch AND done < p_batch THEN
                -- The sweep has reached the month's end: the month goes, rows and all. Only
                -- this step is undone when a reader holds the archive past the lock timeout.
                BEGIN
                    EXECUTE format('DROP TABLE %s', part);
                    DELETE FROM prune_cursors pc WHERE pc.name = part_name;
                    -- The DROP holds the archive until commit: end the call here.
                    RETURN done;
                EXCEPTION WHEN lock_not_available THEN
                    RAISE NOTICE 'prune_history: the archive is in use (%); % is dropped next'
                                 ' round', SQLERRM, part_name;
                    -- One try a round: readers queue behind each try for up to a second.
                    dropped_later := true;
                END;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'prune_history: % is in use (%); swept next round', part_name, SQLERRM;
            done := 0;
        END;
    END IF;

    -- The rest, undone alone when a lock is not had within the timeout (the archiver
    -- creating a month's partition holds the default one): this call's sweep stays.
    swept := done;
    BEGIN
        -- 2. Rows of the default partition (months archived before they had partitions).
        IF done < p_batch THEN
            -- The rows first, then the logs of the rows deleted: a row the archiver has just
            -- moved to a new month's partition keeps its log.
            WITH gone AS (
                DELETE FROM agent_messages_archive_default d
                WHERE d.id = ANY (ARRAY(
                    SELECT x.id FROM agent_messages_archive_default x
                    WHERE x.finished_at < p_cutoff ORDER BY x.id LIMIT p_batch - done))
                RETURNING d.id
            )
            SELECT array_agg(g.id) INTO ids FROM gone AS g;
            n := coalesce(cardinality(ids), 0);
            IF n > 0 THEN
                DELETE FROM message_transitions t WHERE t.message_id = ANY (ids);
                done := done + n;
            END IF;
        END IF;

        -- 3. Model calls made before the cutoff, but for work still in the envelope.
        IF done < p_batch THEN
            DELETE FROM inference_calls c
            WHERE c.id = ANY (ARRAY(
                SELECT i.id FROM inference_calls i
                WHERE i.at < p_cutoff
                  AND NOT EXISTS (SELECT FROM agent_messages h WHERE h.id = i.message_id)
                ORDER BY i.at LIMIT p_batch - done));
            GET DIAGNOSTICS n = ROW_COUNT;
            done := done + n;
        END IF;

        -- 4. Ledger lines of months that ended before the cutoff (an open reservation stays until
        --    it is settled or released; so do the lines of work still in the envelope), then those
        --    months' alerts.
        IF done < p_batch THEN
            DELETE FROM spend_ledger l
            WHERE l.id = ANY (ARRAY(
                SELECT s.id FROM spend_ledger s
                WHERE s.month < spend_month(p_cutoff) AND s.status <> 'reserved'
                  AND NOT EXISTS (SELECT FROM agent_messages h WHERE h.id = s.message_id)
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
    EXCEPTION WHEN lock_not_available THEN
        RAISE NOTICE 'prune_history: %; the rest is pruned next round', SQLERRM;
        RETURN least(swept, p_batch - 1);
    END;
    -- A month left for next round ends this round (one try of its DROP a round).
    RETURN CASE WHEN dropped_later THEN least(done, p_batch - 1) ELSE done END;
END
$$;
