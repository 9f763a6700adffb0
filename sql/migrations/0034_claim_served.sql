-- Runners that serve different pipelines share one bus.
--
-- A runner claimed whatever its lane held, and failed work it had no handler for ("no
-- handler") until dead: with two runners serving different pipelines, each killed the other's
-- work. Now:
-- 1. each runner records the stages it serves (runners.serves, 'pipeline/stage' each; NULL for
--    a runner that did not say), and a runner's claim skips the stages that another live runner
--    serves and it does not (`claimable`'s p_skip), leaving them to that runner;
-- 2. work that no live runner serves is still claimed, and the runner that took it parks it as
--    waiting (waiting_capability, waiting_for 'stage:pipeline/stage', with the capability wait's
--    expiry): out of the claim's index, so it costs later claims nothing, and resumed by the
--    first runner that serves the stage (at its start, and at each of its reports).
--
-- The skip is a filter, not an index key: a claim reads past the skipped stages' ready work
-- queued ahead of its own in its lane, tier and tenant, work that the runners serving it are
-- draining. `claimable` is a function only to keep the claim's text short (the driver caches
-- the parsing of statements up to 4 KiB only): a single-expression SQL function, inlined by the
-- planner, so the plan is exactly what it says. Not late (the expirer's work), and not skipped.

ALTER TABLE runners ADD COLUMN serves text[];

CREATE FUNCTION claimable(p_deadline timestamptz, p_pipeline text, p_stage text,
                          p_skip text[], p_now timestamptz) RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
    SELECT (p_deadline IS NULL OR p_deadline > clock(p_now))
       AND (p_skip IS NULL OR NOT (p_pipeline || '/' || p_stage = ANY (p_skip)))
$$;

GRANT EXECUTE ON FUNCTION claimable(timestamptz, text, text, text[], timestamptz)
    TO appliance_app, appliance_system;
