-- Upkeep statements read what they touch, whatever the statistics their kept plans were made on
-- (an audit of every runtime statement after 0013). Each case below was measured on a scratch
-- cluster with the generic plans the runtime keeps (migration 0009).
--
-- 1. The reclaimer releases holds whose lease is gone (spend_release_dead, every second). It
--    walks reserved holds in id order, but the index of reserved holds was keyed by message, so
--    the plan walked the ledger's primary key through the whole spend history: 40,100 rows per
--    call with 40,000 settled and 100 reserved, on current statistics. Keyed by id, it reads
--    the reserved holds only.
DROP INDEX spend_ledger_reserved_idx;
CREATE INDEX spend_ledger_reserved_idx ON spend_ledger (id) WHERE status = 'reserved';

-- 2. Work waiting for a model tier is resumed after every model call
--    (message_resume_capability). Ordered by id, the plan could walk the primary key, and did
--    when the statistics were taken during an outage (many waiting): with none waiting, every
--    row of the table per call (60,000 of 60,000 measured here). Keyed (tier, id), the statement reads in index order the waiting work of the
--    tiers asked for, and stops at its batch.
DROP INDEX agent_messages_waiting_capability_idx;
CREATE INDEX agent_messages_waiting_capability_idx ON agent_messages (waiting_for, id)
    WHERE status = 'waiting_capability';

-- 3. A wait that ended by expiry or cancellation keeps its wait_expires_at (it says when the
--    wait would have ended), and the index of waits kept every such message until it was
--    archived: after 20,000 waits expired, each expirer round (every 5 s) read all 20,000 and
--    filtered them out. The index now holds what the expirer looks for: messages still waiting.
DROP INDEX agent_messages_wait_expires_at_idx;
CREATE INDEX agent_messages_wait_expires_at_idx ON agent_messages (wait_expires_at)
    WHERE wait_expires_at IS NOT NULL
      AND status IN ('awaiting_approval', 'held_budget', 'waiting_capability');

-- 4. run_budgets (a row per run, read by key on every reservation of a run's budget) grows
--    like the envelope; a plan kept from when it was small scans it sequentially. It is
--    re-analyzed on growth like the other tables the runtime reads by key. Otherwise as in 0009.
CREATE OR REPLACE FUNCTION refresh_planner_stats(p_min_pages bigint, p_growth float8)
    RETURNS text[]
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
        'appliance.idempotency_keys', 'appliance.spend_ledger', 'appliance.inference_calls',
        'appliance.run_budgets'
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
