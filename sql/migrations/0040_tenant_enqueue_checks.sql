-- Times Python cannot read are refused where they enter the envelope, and functions no
-- runtime role calls are closed to PUBLIC.
--
-- PostgreSQL stores times that no Python datetime holds: 'infinity', '-infinity', and finite
-- ones outside the years 1-9999 (UTC). The runner reads every claimed row into Python, so one
-- such row failed every claim of its lane, for every tenant, until its lease lapsed, and again
-- at each re-claim. The Python validation never sends one, but the tenant role's enqueue (a
-- caller sending it SQL) could, as not_before or deadline, or as its clock (p_now, which
-- becomes the row's created_at and updated_at): tenant_clock refused only infinite clocks.
-- Now the envelope's checks refuse such a not_before or deadline on every path, and the
-- tenant functions' clock is held to the same years.
--
-- Left to the Python validation (EnqueueRequest.build), deliberately, rather than repeated in
-- enqueue_tenant_requests: names, lengths, priorities, the derived key namespace, the
-- directive's white space and the context's size. Each concerns only the tenant's own work,
-- and the tenant role is no wall against a caller who can send it SQL (it sets its own
-- tenant: README, security model); repeated there, request by request, those checks cost a
-- quarter of a batch enqueue's throughput (the derived key's SHA-256 the most). The table's
-- own checks (max_attempts, hops, a blank directive) and casts (lane, the numbers) stand.

-- Within what Python reads back (years 1-9999 in UTC, so also finite). NOT VALID, then
-- validated: the rows already there were written through the Python, and the scan does not
-- hold writers back for its length.
ALTER TABLE agent_messages
    ADD CONSTRAINT agent_messages_not_before_readable
        CHECK (not_before >= timestamptz '0001-01-01 00:00:00+00'
               AND not_before < timestamptz '10000-01-01 00:00:00+00') NOT VALID,
    ADD CONSTRAINT agent_messages_deadline_readable
        CHECK (deadline >= timestamptz '0001-01-01 00:00:00+00'
               AND deadline < timestamptz '10000-01-01 00:00:00+00') NOT VALID;
ALTER TABLE agent_messages VALIDATE CONSTRAINT agent_messages_not_before_readable;
ALTER TABLE agent_messages VALIDATE CONSTRAINT agent_messages_deadline_readable;

-- A tenant's clock: finite (migration 0037) and within the years Python reads back, with a
-- margin of a century at the top: the row's times are this clock plus a lease, a runtime, a
-- backoff or a retention, each far shorter.
CREATE OR REPLACE FUNCTION tenant_clock(p_now timestamptz)
    RETURNS timestamptz
    LANGUAGE plpgsql STABLE
    AS $$
BEGIN
    IF p_now IS NOT NULL AND NOT isfinite(p_now) THEN
        RAISE EXCEPTION 'the time given (%) is not a finite time', p_now
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_now < timestamptz '0001-01-01 00:00:00+00'
       OR p_now >= timestamptz '9900-01-01 00:00:00+00' THEN
        RAISE EXCEPTION 'the time given (%) is out of range (years 1-9899, UTC)', p_now
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN coalesce(p_now, now());
END
$$;

-- Functions that ran as their caller and were open to PUBLIC. No role but the runtime ones
-- has USAGE on the schema, so PUBLIC meant those: each now goes to the roles that call it
-- (named queries, RLS policies, the functions they call), and to no other. Trigger functions
-- are not called by anyone (PostgreSQL checks EXECUTE on them when a trigger is created, not
-- when it fires). Functions only called inside SECURITY DEFINER functions run as the owner.
REVOKE EXECUTE ON FUNCTION
    current_tenant(),
    idempotency_key(text, text, text),
    clock(timestamptz),
    claimable(timestamptz, text, text, text[], timestamptz),
    spend_month(timestamptz),
    spend_settle(bigint, numeric, double precision, text, text, text, timestamptz),
    spend_release_dead(integer, timestamptz),
    spend_reserve(text, lane, numeric, bigint, bigint, text, text, text, text, text,
                  timestamptz),
    run_budget_reserve(text, text, text, text, jsonb, numeric, boolean, jsonb, timestamptz),
    run_budget_adjust(text, text, text, jsonb),
    spend_platform_month(timestamptz),
    spend_alert_check(date, text, timestamptz),
    agent_messages_log_insert(),
    agent_messages_log_update(),
    tenants_runtime_row(),
    tenants_guard()
    FROM PUBLIC;
-- Row-level security's policies call current_tenant() as the tenant role; the tenant role's
-- reads of a run's stages derive keys (item_stage_holders), and both roles read the clock
-- (the claim's and status's queries) and claimability (kept as granted in migration 0034).
-- The grants below were already held; they are restated so that this file says who calls what.
GRANT EXECUTE ON FUNCTION
    current_tenant(),
    idempotency_key(text, text, text),
    clock(timestamptz),
    claimable(timestamptz, text, text, text[], timestamptz)
    TO appliance_app, appliance_system;
-- The spend machinery runs as the system role; spend_settle and spend_platform_month call
-- spend_alert_check as their caller, which had it only through PUBLIC.
GRANT EXECUTE ON FUNCTION
    spend_month(timestamptz),
    spend_settle(bigint, numeric, double precision, text, text, text, timestamptz),
    spend_release_dead(integer, timestamptz),
    spend_reserve(text, lane, numeric, bigint, bigint, text, text, text, text, text,
                  timestamptz),
    run_budget_reserve(text, text, text, text, jsonb, numeric, boolean, jsonb, timestamptz),
    run_budget_adjust(text, text, text, jsonb),
    spend_platform_month(timestamptz),
    spend_alert_check(date, text, timestamptz)
    TO appliance_system;

-- Functions the owner creates from now on start closed: each migration grants what it means
-- to. Not `IN SCHEMA appliance`: a schema's default privileges can only add to the global
-- ones, so revoking PUBLIC's EXECUTE there would change nothing.
ALTER DEFAULT PRIVILEGES FOR ROLE appliance_owner REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
