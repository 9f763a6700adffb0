-- The update trigger joins its transition tables (old_rows with new_rows, by id) in several
-- statements. PL/pgSQL plans each of them once per session, for the row count of the first
-- statement that fires the trigger there, and keeps that plan. A session whose first update
-- wrote one row planned nested loops, and a later update of many rows then compared every row
-- with every row: measured here, complete_many of 2,000 took 1.3 s where hash joins take 35 ms,
-- and a maintenance batch of 500 took 72 ms where it takes 7-13. Hash joins cost the small
-- statements of the hot path nothing measurable (claim(10) + complete_many of 10, A/B in one
-- run: within noise), and grow linearly.
ALTER FUNCTION agent_messages_log_update() SET enable_nestloop = off;
-- enqueue_requests, which the trigger calls for stage hand-offs, keeps the planner's usual
-- choice: its own plans are kept per session too, made by whichever caller runs it first.
ALTER FUNCTION enqueue_requests(timestamptz, interval, jsonb, integer, text)
    SET enable_nestloop = on;
