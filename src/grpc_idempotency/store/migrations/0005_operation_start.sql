-- An in-progress claim taken over after its owner's lease ran out is the same operation
-- continuing: keep its created_at (the operation's start). A completed record past retention is
-- a new operation: its created_at restarts. Child-key derivation uses the start to pick, for an
-- operation begun before a step was retired, the retired step it may already have run.
CREATE OR REPLACE FUNCTION {schema}.claim(
    p_scope text, p_key text, p_lock bigint, p_method text, p_fingerprint bytea,
    p_retention_s double precision, p_lease_s double precision
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_token bigint;
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RAISE EXCEPTION 'idempotency key is claimed by a concurrent attempt'
            USING ERRCODE = 'GI001';
    END IF;
    INSERT INTO {schema}.records AS r
        (scope, key, method, fingerprint, state, fencing_token, locked_until, expires_at)
    VALUES
        (p_scope, p_key, p_method, p_fingerprint, 'in_progress', 1,
         clock_timestamp() + make_interval(secs => p_lease_s),
         clock_timestamp() + make_interval(secs => p_retention_s))
    ON CONFLICT (scope, key) DO UPDATE SET
        method = EXCLUDED.method,
        fingerprint = EXCLUDED.fingerprint,
        state = 'in_progress',
        fencing_token = r.fencing_token + 1,
        locked_until = EXCLUDED.locked_until,
        status_code = NULL, status_message = NULL, status_details = NULL, response = NULL,
        -- The operation's start survives a takeover (a crashed owner's work is continued), so
        -- child keys can follow the steps that were declared when it started.
        created_at = CASE WHEN r.state = 'completed' THEN clock_timestamp() ELSE r.created_at END,
        completed_at = NULL,
        expires_at = EXCLUDED.expires_at
    WHERE (r.state = 'completed' AND r.expires_at <= clock_timestamp())
       OR (r.state = 'in_progress' AND r.locked_until <= clock_timestamp()
           AND r.fingerprint = EXCLUDED.fingerprint)
    RETURNING r.fencing_token INTO v_token;
    IF v_token IS NULL THEN
        RAISE EXCEPTION 'idempotency key is already recorded' USING ERRCODE = 'GI002';
    END IF;
    RETURN v_token;
END
$$;
