-- An in-progress claim past its lease and its retention is a new key, for another request too.
--
-- A key past its retention is treated as new (the wire contract). claim() took an in-progress
-- record whose lease had run out over only for the same fingerprint: a claim left behind by an
-- attempt that was released (a transient error, a cancelled call), stalled or died, and was not
-- retried within its retention, answered every other request under the key KEY_REUSED until a
-- purge happened to delete the row (purge deletes exactly these rows: in progress, past
-- expires_at and past the lease).
--
-- Now such a record is taken over by another request as a new operation: the method and the
-- fingerprint are replaced, and created_at (the operation's start) restarts, as for a completed
-- record past retention and as for a purged record claimed again. The fencing token goes up as
-- for every takeover; with the new start, verify_claim (migration 0013), renew and release keep
-- the stalled owner off the new claim. The same request still continues the operation and keeps
-- its start, past the retention or not. A lease still running keeps the key its owner's, past
-- the retention or not: the retention counts from the claim, and the owner is at work.
--
-- Races, all under the key's claim lock (pg_try_advisory_xact_lock) as before: a concurrent
-- claimer fails fast (GI001) and looks again, finding this claim; a stalled owner whose final
-- transaction got the lock first (verify_claim) commits, and its outcome is then kept for its
-- retention from the completion (migration 0007), or else it is fenced off (GI003); a purge
-- that deleted the row first leaves a plain insert, and one that comes after re-checks the new
-- row version, which is within retention and leased, and keeps it.
--
-- claim() keeps its signature: claim_with_start and claim_atomic call it, and so do servers not
-- yet upgraded during a rolling deploy. Such a server's look-up still sees the record as in
-- progress and answers another request KEY_REUSED, as before; where it claims without looking
-- first (an atomic call on a key it has not seen) it gets the new rule already.
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
        -- The same request continues the operation (a crashed owner's work) and keeps its
        -- start, so child keys follow the steps declared when it began; anything else taken
        -- over here is a new operation, begun now.
        created_at = CASE WHEN r.state = 'in_progress' AND r.fingerprint = EXCLUDED.fingerprint
                          THEN r.created_at ELSE clock_timestamp() END,
        completed_at = NULL,
        expires_at = EXCLUDED.expires_at,
        retention = EXCLUDED.retention
    WHERE (r.state = 'completed'
           AND GREATEST(r.expires_at, r.completed_at + r.retention) <= clock_timestamp())
       OR (r.state = 'in_progress' AND r.locked_until <= clock_timestamp()
           AND (r.fingerprint = EXCLUDED.fingerprint OR r.expires_at <= clock_timestamp()))
    RETURNING r.fencing_token INTO v_token;
    IF v_token IS NULL THEN
        RAISE EXCEPTION 'idempotency key is already recorded' USING ERRCODE = 'GI002';
    END IF;
    RETURN v_token;
END
$$;
