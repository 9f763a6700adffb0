-- The claim's condition on each candidate message, beside its index conditions: not late (the
-- expirer's), and of a stage the claiming runner serves (`served`: 'pipeline/stage' each; NULL
-- takes any). A runner that serves some pipelines leaves the others' work to the runners that
-- serve them, where it used to claim it and fail it ("no handler") until dead.
--
-- A function only to keep the claim's text short (the driver caches the parsing of statements
-- up to 4 KiB only); a single-expression SQL function, so the planner inlines it and plans
-- exactly what it says.

CREATE FUNCTION claimable(p_deadline timestamptz, p_pipeline text, p_stage text,
                          p_served text[], p_now timestamptz) RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
    SELECT (p_deadline IS NULL OR p_deadline > clock(p_now))
       AND (p_served IS NULL OR p_pipeline || '/' || p_stage = ANY (p_served))
$$;

GRANT EXECUTE ON FUNCTION claimable(timestamptz, text, text, text[], timestamptz)
    TO appliance_app, appliance_system;
