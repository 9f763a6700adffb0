-- A spend ledger row or a model call record that names a message belongs to that message's
-- tenant.
--
-- spend_reserve took its tenant from the caller and checked only the lease, and the model call
-- record took tenant and message as given: a caller passing another tenant charged that
-- tenant's cap for the message's call, and showed the message's id, pipeline, stage and model
-- to the wrong tenant (both tables are read by tenant under row-level security). The callers
-- pass the message's own tenant; now the database holds them to it. A message no longer in
-- the hot table (archived) is not looked for.

CREATE FUNCTION message_tenant_guard() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = appliance, pg_catalog, pg_temp
    AS $$
DECLARE
    owner_tenant text;
BEGIN
    IF NEW.message_id IS NULL THEN
        RETURN NEW;
    END IF;
    SELECT m.tenant INTO owner_tenant FROM agent_messages m WHERE m.id = NEW.message_id;
    IF FOUND AND owner_tenant IS DISTINCT FROM NEW.tenant THEN
        RAISE EXCEPTION '% row of tenant % names message %, which is of tenant %',
            TG_TABLE_NAME, coalesce(NEW.tenant, 'none'), NEW.message_id, owner_tenant
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

REVOKE ALL ON FUNCTION message_tenant_guard() FROM PUBLIC;

CREATE TRIGGER spend_ledger_message_tenant_trg
    BEFORE INSERT OR UPDATE OF tenant, message_id ON spend_ledger
    FOR EACH ROW EXECUTE FUNCTION message_tenant_guard();

CREATE TRIGGER inference_calls_message_tenant_trg
    BEFORE INSERT OR UPDATE OF tenant, message_id ON inference_calls
    FOR EACH ROW EXECUTE FUNCTION message_tenant_guard();
