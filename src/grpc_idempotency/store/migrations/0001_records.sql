-- Idempotency records: one row per (scope, key).
-- state 'in_progress': an attempt owns the key until it commits or its lease (locked_until) ends.
-- state 'completed': the outcome below is replayed until expires_at.
CREATE TABLE {schema}.records (
    scope          text        NOT NULL,
    key            text        NOT NULL,
    method         text        NOT NULL,
    fingerprint    bytea       NOT NULL,
    state          text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    fencing_token  bigint      NOT NULL,
    locked_until   timestamptz,
    status_code    integer,
    status_message text,
    status_details bytea,
    response       bytea,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    completed_at   timestamptz,
    expires_at     timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);

-- Purge walks this in bounded batches.
CREATE INDEX records_expires_at ON {schema}.records (expires_at);

-- The atomic-mode claim, run as the first statement of the call's transaction.
-- The advisory lock makes a concurrent duplicate fail fast (GI001) instead of queueing on the
-- primary key's unique index while holding a pooled connection: a storm of duplicates must not
-- starve calls with other keys. A row past retention, or an in-progress row whose lease ended
-- with the same fingerprint, is taken over in the same statement; anything else is GI002.
CREATE FUNCTION {schema}.claim(
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
        created_at = clock_timestamp(),
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

-- Records the outcome of the attempt holding p_token (NULL: the claim made in this transaction).
-- Raises GI003 when that attempt no longer owns the key, so its transaction cannot commit.
CREATE FUNCTION {schema}.complete(
    p_scope text, p_key text, p_token bigint, p_code integer, p_message text,
    p_details bytea, p_response bytea, p_retention_s double precision
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {schema}.records SET
        state = 'completed',
        locked_until = NULL,
        status_code = p_code,
        status_message = p_message,
        status_details = p_details,
        response = p_response,
        completed_at = clock_timestamp(),
        expires_at = clock_timestamp() + make_interval(secs => p_retention_s)
    WHERE scope = p_scope AND key = p_key AND state = 'in_progress'
      AND (p_token IS NULL OR fencing_token = p_token);
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency claim was lost to another attempt' USING ERRCODE = 'GI003';
    END IF;
END
$$;
