-- Less PostgreSQL CPU per atomic first execution (issue 9; measured with callgrind on the
-- backend, user-space instructions per call, in benchmarks/README.md).
--
-- 1. complete_atomic inserts with ON CONFLICT DO NOTHING and only then, if a row was there,
--    updates it. The record is almost always new; an INSERT ... ON CONFLICT DO UPDATE pays for
--    setting up its update projection and WHERE on every call all the same (-5% of the
--    backend's instructions per call).
-- 2. The records table's CHECK on state goes: PostgreSQL re-reads and re-plans a CHECK from the
--    catalog on every INSERT (-6%), and the only writers of the column are this schema's own
--    functions, which write 'in_progress' or 'completed' literally.
ALTER TABLE {schema}.records DROP CONSTRAINT IF EXISTS records_state_check;

-- Same contract as in migration 0008: inserts the record, or completes the in-progress row
-- claim() wrote, or replaces a record past retention; anything else raises GI003 and the
-- transaction does not commit.
CREATE OR REPLACE FUNCTION {schema}.complete_atomic(
    p_scope text, p_key text, p_method text, p_fingerprint bytea, p_code integer,
    p_message text, p_details bytea, p_response bytea, p_retention_s double precision
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- Twice at most: a purge may delete the expired row found by the first INSERT before the
    -- UPDATE reaches it (the claim's advisory lock keeps other attempts out, not the purge).
    FOR attempt IN 1..2 LOOP
        INSERT INTO {schema}.records
            (scope, key, method, fingerprint, state, fencing_token, locked_until, status_code,
             status_message, status_details, response, created_at, completed_at, expires_at,
             retention)
        VALUES
            (p_scope, p_key, p_method, p_fingerprint, 'completed', 1, NULL, p_code,
             p_message, p_details, p_response, now(), clock_timestamp(),
             now() + make_interval(secs => p_retention_s), make_interval(secs => p_retention_s))
        ON CONFLICT (scope, key) DO NOTHING;
        IF FOUND THEN
            RETURN;
        END IF;
        UPDATE {schema}.records AS r SET
            method = p_method,
            fingerprint = p_fingerprint,
            state = 'completed',
            fencing_token = CASE WHEN r.state = 'in_progress' THEN r.fencing_token
                                 ELSE r.fencing_token + 1 END,
            locked_until = NULL,
            status_code = p_code,
            status_message = p_message,
            status_details = p_details,
            response = p_response,
            -- completing this attempt's own claim row keeps its start and its expires_at (HOT)
            created_at = CASE WHEN r.state = 'in_progress' THEN r.created_at ELSE now() END,
            completed_at = clock_timestamp(),
            expires_at = CASE WHEN r.state = 'in_progress' THEN r.expires_at
                              ELSE now() + make_interval(secs => p_retention_s) END,
            retention = make_interval(secs => p_retention_s)
        WHERE r.scope = p_scope AND r.key = p_key
          AND (r.state = 'in_progress'
               OR GREATEST(r.expires_at, r.completed_at + r.retention) <= clock_timestamp());
        IF FOUND THEN
            RETURN;
        END IF;
        -- Not found: either the row holds an outcome within retention (lost: GI003 below), or
        -- a purge deleted it meanwhile (insert again).
        PERFORM 1 FROM {schema}.records WHERE scope = p_scope AND key = p_key;
        EXIT WHEN FOUND;
    END LOOP;
    RAISE EXCEPTION 'idempotency claim was lost to another attempt' USING ERRCODE = 'GI003';
END
$$;
