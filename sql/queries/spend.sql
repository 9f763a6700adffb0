-- Named queries of the spend ledger, the monthly cap and run budgets.

-- name: spend_reserve :one
-- Reserve a call's worst-case cost against every scope, or nothing (see spend_reserve()).
SELECT * FROM spend_reserve(%(tenant)s, %(lane)s::lane, %(amount)s::numeric, %(message_id)s,
                            %(lease_token)s, %(pipeline)s, %(stage)s, %(kind)s, %(model)s,
                            %(tier)s, %(now)s::timestamptz);

-- name: spend_settle :one
-- Settle or release a hold to the measured cost (NULL: it was settled or released already); `lowered`: its cost replaced a larger upper bound charged while its lease was gone, so spend went down.
WITH before AS MATERIALIZED (
    -- As of this statement's snapshot: the hold before spend_settle changes it.
    SELECT l.status, l.amount, l.note FROM spend_ledger l WHERE l.id = %(hold)s
)
SELECT s.charged,
       coalesce(b.status = 'settled' AND b.note LIKE 'lease gone%%' AND s.charged < b.amount,
                false) AS lowered
FROM (SELECT spend_settle(%(hold)s, %(amount)s::numeric, %(energy)s, %(provenance)s,
                          %(status)s, %(note)s, %(now)s::timestamptz) AS charged) AS s
LEFT JOIN before b ON true;

-- name: spend_release_dead :one
-- Release the holds of leases that are gone (a bounded batch).
SELECT spend_release_dead(%(batch)s, %(now)s::timestamptz) AS released;

-- name: spend_cap_set :exec
-- Set the monthly cap of a scope (the appliance, or one tenant).
INSERT INTO spend_caps (scope, monthly_cap, updated_at, updated_by)
VALUES (%(scope)s, %(cap)s::numeric, clock_timestamp(), %(actor)s)
ON CONFLICT (scope) DO UPDATE
SET monthly_cap = excluded.monthly_cap, updated_at = excluded.updated_at,
    updated_by = excluded.updated_by;

-- name: spend_cap_default :exec
-- Set the appliance cap only when none is set yet (the runner's configured default).
INSERT INTO spend_caps (scope, monthly_cap, updated_by)
VALUES ('appliance', %(cap)s::numeric, 'settings')
ON CONFLICT (scope) DO NOTHING;

-- name: spend_config_set :exec
-- The ledger's time zone, currency, interactive share, alert fractions and amortisation.
UPDATE spend_config
SET time_zone = %(time_zone)s, currency = %(currency)s,
    interactive_share = %(interactive_share)s::numeric,
    alert_fractions = %(alert_fractions)s::numeric[],
    amortisation_monthly = %(amortisation_monthly)s::numeric;

-- name: spend_status :many
-- This month's figures per scope with a cap or with spend: cap, spent, reserved, and the provenance of what was settled.
WITH m AS (SELECT spend_month(coalesce(%(now)s::timestamptz, now())) AS month),
scopes AS (
    SELECT scope FROM spend_caps
    UNION SELECT sm.scope FROM spend_months sm, m WHERE sm.month = m.month
)
SELECT s.scope, m.month, c.monthly_cap AS cap,
       coalesce(sm.spent, 0) AS spent, coalesce(sm.reserved, 0) AS reserved,
       (SELECT currency FROM spend_config) AS currency,
       (SELECT interactive_share FROM spend_config) AS interactive_share,
       (SELECT coalesce(jsonb_object_agg(p.provenance, p.n), '{}'::jsonb)
        FROM (SELECT l.provenance, count(*) AS n FROM spend_ledger l
              WHERE l.month = m.month AND l.status IN ('settled', 'platform')
                AND (s.scope = 'appliance' OR 'tenant:' || l.tenant = s.scope)
                AND l.provenance IS NOT NULL
              GROUP BY l.provenance) AS p) AS provenance
FROM scopes s
CROSS JOIN m
LEFT JOIN spend_caps c ON c.scope = s.scope
LEFT JOIN spend_months sm ON sm.month = m.month AND sm.scope = s.scope
ORDER BY s.scope = 'appliance' DESC, s.scope;

-- name: spend_today :one
-- Settled spend and energy since the start of today (in the ledger's time zone).
SELECT coalesce(sum(l.amount), 0) AS spent, coalesce(sum(l.energy_joules), 0) AS joules,
       count(*) AS calls, (SELECT currency FROM spend_config) AS currency,
       coalesce(array_agg(DISTINCT l.provenance) FILTER (WHERE l.provenance IS NOT NULL),
                '{}') AS provenance
FROM spend_ledger l
WHERE l.status = 'settled'
  AND l.settled_at >= (date_trunc('day', coalesce(%(now)s::timestamptz, now())
                                         AT TIME ZONE (SELECT time_zone FROM spend_config))
                       AT TIME ZONE (SELECT time_zone FROM spend_config));

-- name: spend_alerts :many
-- Alert fractions crossed this month, newest first.
SELECT month, scope, fraction, spent, cap, at
FROM spend_alerts
WHERE month = spend_month(coalesce(%(now)s::timestamptz, now()))
ORDER BY at DESC;

-- name: spend_month_now :one
-- The current month by the database clock, in the ledger's time zone.
SELECT spend_month(coalesce(%(now)s::timestamptz, now())) AS month;

-- name: message_resume_budget :many
-- Messages held for budget go back to pending: all of them, or one tenant's (the cap was raised), or with `earlier_months_only` those held in a month before this one by the database clock (the month rolled over, also when no runner saw the boundary itself); a bounded batch.
WITH ready AS (
    -- Oldest hold first, read in the order of the index of holds up to a bound on the hold's
    -- time that the index can use (local midnight starting this month, or none), so that no
    -- plan reads more holds than it resumes (migration 0014). The month itself is then checked
    -- exactly: where local midnight happens twice (a DST fall-back on the 1st), the bound is the
    -- later instant, and the hour before it is this month already.
    SELECT m.id FROM agent_messages m
    WHERE m.status = 'held_budget'
      -- A tenant's cap raised frees that tenant's work only (NULL: every tenant's).
      AND (%(tenant)s::text IS NULL OR m.tenant = %(tenant)s::text)
      AND m.updated_at < CASE
          WHEN %(earlier_months_only)s
          THEN (SELECT spend_month(clock(%(now)s))::timestamp AT TIME ZONE c.time_zone
                FROM spend_config c)
          ELSE 'infinity'::timestamptz END
      AND (NOT %(earlier_months_only)s
           OR spend_month(m.updated_at) < spend_month(clock(%(now)s)))
    ORDER BY m.updated_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE agent_messages m
SET status = 'pending',
    waiting_for = NULL,
    wait_expires_at = NULL,
    not_before = coalesce(%(now)s::timestamptz, now()),
    deferred = false,
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = %(reason)s,
    status_actor = %(actor)s
FROM ready
WHERE m.id = ready.id
RETURNING m.id;

-- name: message_budget_recheck :one
-- A message just parked in held_budget goes straight back to pending when a cap of its scopes (the appliance, its tenant) changed, or the month turned, since its attempt was claimed: a `cap set` (or a rollover sweep) that ran between the refusal and the park found nothing to resume. A change up to 0.1 s before the claim resumes it too (such a message may go round again for that long).
UPDATE agent_messages m
SET status = 'pending',
    waiting_for = NULL,
    wait_expires_at = NULL,
    not_before = coalesce(%(now)s::timestamptz, now()),
    deferred = false,
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = 'budget_recheck: the cap or the month changed while it was being held',
    status_actor = %(actor)s
WHERE m.id = %(id)s AND m.status = 'held_budget'
  AND (EXISTS (SELECT FROM spend_caps c
               WHERE c.scope IN ('appliance', 'tenant:' || m.tenant)
                 -- A cap's time is taken just before its commit (spend_cap_set): the margin
                 -- covers a commit still flushing when the claim began.
                 AND c.updated_at >= m.claimed_at - interval '100 milliseconds')
       OR spend_month(m.claimed_at) < spend_month(clock(%(now)s)))
RETURNING m.id;

-- name: run_budget_reserve :one
-- Reserve work against a run's budget (NULL: it fits; else the exhausted dimension).
SELECT run_budget_reserve(%(tenant)s, %(source)s, %(source_id)s, %(pipeline)s, %(limits)s,
                          %(reserve)s::numeric, %(verification)s, %(ask)s,
                          %(now)s::timestamptz) AS exhausted;

-- name: run_budget_check :one
-- Read only: the dimension a reservation of `ask` would find exhausted now (NULL: it would
-- fit), by run_budget_reserve's rules, over the run's row or, before its first reservation,
-- the limits it would start with.
SELECT CASE
           WHEN b.limits ? 'wall_seconds'
                AND extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - b.started_at)
                    > (b.limits ->> 'wall_seconds')::numeric THEN 'wall_time'
           ELSE (SELECT k.d FROM jsonb_object_keys(%(ask)s::jsonb) AS k(d)
                 WHERE b.limits ? k.d
                   AND coalesce((b.used ->> k.d)::numeric, 0) + (%(ask)s::jsonb ->> k.d)::numeric
                       > (b.limits ->> k.d)::numeric
                         * CASE WHEN %(verification)s THEN 1 ELSE 1 - b.verification_reserve END
                 ORDER BY k.d LIMIT 1)
       END AS exhausted
FROM (SELECT r.limits, r.used, r.started_at, r.verification_reserve, 0 AS rank
      FROM run_budgets r
      WHERE r.tenant = %(tenant)s AND r.source = %(source)s AND r.source_id = %(source_id)s
      UNION ALL
      SELECT %(limits)s::jsonb, '{}'::jsonb, coalesce(%(now)s::timestamptz, now()),
             %(reserve)s::numeric, 1) AS b
ORDER BY b.rank
LIMIT 1;

-- name: run_budget_refused :exec
-- Record a refusal the read-only check found (the run's exhausted dimension, its last use),
-- reserving nothing, as run_budget_reserve records its own (a new run's budget is started).
INSERT INTO run_budgets AS r (tenant, source, source_id, pipeline, limits, verification_reserve,
                              started_at, used_at, exhausted)
VALUES (%(tenant)s, %(source)s, %(source_id)s, %(pipeline)s, %(limits)s, %(reserve)s::numeric,
        coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now()),
        %(exhausted)s)
ON CONFLICT (tenant, source, source_id) DO UPDATE
SET exhausted = coalesce(r.exhausted, excluded.exhausted),
    used_at = greatest(r.used_at, excluded.used_at);

-- name: run_budget_adjust :exec
-- Give back what a reservation did not use.
SELECT run_budget_adjust(%(tenant)s, %(source)s, %(source_id)s, %(delta)s);

-- name: run_budgets_purge :one
-- Delete one bounded batch of budgets of runs idle longer than `idle` (0 while another runner
-- purges).
SELECT purge_run_budgets(%(now)s::timestamptz, %(idle)s::interval, %(batch)s) AS purged;

-- name: spend_waiters_purge :one
-- Delete one bounded batch of the cap's waiting-line places nobody asked for in the hour a
-- place is kept (spend_reserve deletes them too, but only when some call is refused).
WITH gone AS (
    DELETE FROM spend_waiters w
    WHERE w.ctid = ANY (ARRAY(SELECT x.ctid FROM spend_waiters x
                              WHERE x.seen_at < coalesce(%(now)s::timestamptz, now())
                                                - interval '1 hour'
                              ORDER BY x.seen_at
                              LIMIT %(batch)s
                              FOR UPDATE SKIP LOCKED))
    RETURNING 1
)
SELECT count(*) AS purged FROM gone;

-- name: run_budget_get :one
-- One run's budget: limits, use and the dimension that ran out, if any.
SELECT tenant, source, source_id, pipeline, limits, verification_reserve, used, started_at,
       used_at, exhausted
FROM run_budgets
WHERE tenant = %(tenant)s AND source = %(source)s AND source_id = %(source_id)s;

-- name: calibration_upsert :exec
-- Store a model's measured (or estimated) joules per token.
INSERT INTO energy_calibration
    (model, sha256, joules_per_token, idle_watts, tokens, provenance, source, measured_at)
VALUES (%(model)s, %(sha256)s, %(joules_per_token)s::numeric, %(idle_watts)s::numeric,
        %(tokens)s, %(provenance)s, %(source)s, now())
ON CONFLICT (model, sha256) DO UPDATE
SET joules_per_token = excluded.joules_per_token, idle_watts = excluded.idle_watts,
    tokens = excluded.tokens, provenance = excluded.provenance, source = excluded.source,
    measured_at = excluded.measured_at;

-- name: calibration_list :many
-- Every stored calibration.
SELECT model, sha256, joules_per_token, idle_watts, tokens, provenance, source, measured_at
FROM energy_calibration
ORDER BY model;

-- name: spend_platform_month :one
-- Charge the month's amortisation once, as a platform cost.
SELECT spend_platform_month(%(now)s::timestamptz) AS charged;
