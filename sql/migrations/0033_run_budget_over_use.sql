-- A run that used more than its budget's limit is marked exhausted when the use is recorded.
--
-- A model call reserves its estimate from the run's budget, and run_budget_adjust then books
-- what it really used. A call that used more than it reserved could take a dimension past its
-- limit, and the run was marked exhausted only when its next reservation was refused: until
-- then its budget read as in order (status, cockpit), and a run with no further step never
-- showed it at all. The adjustment now marks the first dimension (by name, as a reservation's
-- refusal does) whose use is above its limit. At the limit is not over it: a verification
-- stage may use the reserve up to the limit exactly.

CREATE OR REPLACE FUNCTION run_budget_adjust(
    p_tenant text, p_source text, p_source_id text, p_delta jsonb
) RETURNS void
    LANGUAGE sql SET search_path TO 'appliance', 'pg_catalog', 'pg_temp' AS $$
    UPDATE run_budgets r
    SET used = (SELECT jsonb_object_agg(k, greatest(0, coalesce((r.used ->> k)::numeric, 0)
                                                   + coalesce((p_delta ->> k)::numeric, 0)))
                FROM (SELECT jsonb_object_keys(r.used) AS k) AS keys)
    WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id;
    -- A second statement of the function: it sees the use just booked.
    UPDATE run_budgets r
    SET exhausted = (SELECT min(k) FROM jsonb_object_keys(r.used) AS k
                     WHERE r.limits ? k
                       AND (r.used ->> k)::numeric > (r.limits ->> k)::numeric)
    WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id
      AND r.exhausted IS NULL
      AND EXISTS (SELECT FROM jsonb_object_keys(r.used) AS k
                  WHERE r.limits ? k
                    AND (r.used ->> k)::numeric > (r.limits ->> k)::numeric);
$$;
