-- A completed outcome stays replayable for at least its retention after completion.
--
-- Retention used to count from the claim only (expires_at, set once at the claim so that the
-- completion UPDATE touches no indexed column and stays HOT). A handler slower than its
-- retention then stored an outcome that had already expired, and the next retry ran again.
-- Now the record also keeps its retention; a completed record expires at
-- GREATEST(expires_at, completed_at + retention). completed_at and retention are not indexed, so
-- the completion stays a HOT update; expires_at (indexed) stays the earliest possible expiry,
-- which is what purge walks. Rows written before this migration have no retention and keep
-- expiring at expires_at (GREATEST ignores NULL).
ALTER TABLE {schema}.records ADD COLUMN IF NOT EXISTS retention interval;

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
        (scope, key, method, fingerprint, state, fencing_token, locked_until, expires_at,
         retention)
    VALUES
        (p_scope, p_key, p_method, p_fingerprint, 'in_progress', 1,
         clock_timestamp() + make_interval(secs => p_lease_s),
         clock_timestamp() + make_interval(secs => p_retention_s),
         make_interval(secs => p_retention_s))
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
        expires_at = EXCLUDED.expires_at,
        retention = EXCLUDED.retention
    WHERE (r.state = 'completed'
           AND GREATEST(r.expires_at, r.completed_at + r.retention) <= clock_timestamp())
       OR (r.state = 'in_progress' AND r.locked_until <= clock_timestamp()
           AND r.fingerprint = EXCLUDED.fingerprint)
    RETURNING r.fencing_token INTO v_token;
    IF v_token IS NULL THEN
        RAISE EXCEPTION 'idempotency key is already recorded' USING ERRCODE = 'GI002';
    END IF;
    RETURN v_token;
END
$$;
