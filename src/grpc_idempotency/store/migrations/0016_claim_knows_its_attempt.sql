-- A phased claim knows its own row: one that committed but whose answer was lost claims again.
--
-- A phased claim commits on its own. When its connection is reset or its session ends after the
-- COMMIT but before the answer reaches the server (a failover, a pooler restart, a DBA's
-- pg_terminate_backend at the wrong moment), the store claims once more on a fresh connection.
-- That second try found the first try's row in progress, leased, and lost the race to it: the
-- call was answered IN_PROGRESS, and so was every retry of the operation until the lease ran out,
-- with nobody behind the claim.
--
-- Each call's claim now carries a random attempt id (the server's, never sent on the wire), kept
-- in the row as claim_attempt. A try that finds the row in progress under its own attempt id
-- takes it as claimed, with the row's fencing token and start and a lease renewed from now: it is
-- the same call, and no other attempt could have claimed the key in between without ending that
-- row (a takeover or a completion changes what is compared below). Any other attempt gets GI002,
-- as before. A takeover's lease now counts from after its wait for the row, if it waited.
--
-- The column holds the attempt id XOR the fencing token it claimed with. A server not yet
-- upgraded (rolling deploy) takes an expired claim over with claim(), which keeps claim_attempt
-- but adds one to the token: compared with the token folded in, its takeover no longer reads as
-- the earlier attempt's claim. A completion sets state = 'completed', which the match requires
-- to be 'in_progress'; a purge deletes the row.
--
-- The column is nullable without a default: adding it rewrites nothing. Rows written before this
-- migration, by claim() or by the atomic path (whose claim is in the call's own transaction, where
-- no answer can be lost without losing the claim with it), keep it NULL, which matches nothing.
--
-- A new overload with the attempt id: claim_with_start(text, text, bigint, text, bytea, float8,
-- float8) and claim() keep their signatures for servers not yet upgraded. Its body is claim()'s,
-- with the attempt id written and the start returned by the same statement (the wrapper of
-- migration 0012 read it back with a second look-up).
ALTER TABLE {schema}.records ADD COLUMN IF NOT EXISTS claim_attempt bigint;

CREATE OR REPLACE FUNCTION {schema}.claim_with_start(
    p_scope text, p_key text, p_lock bigint, p_method text, p_fingerprint bytea,
    p_retention_s double precision, p_lease_s double precision, p_attempt bigint,
    OUT token bigint, OUT started_at timestamptz
)
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RAISE EXCEPTION 'idempotency key is claimed by a concurrent attempt'
            USING ERRCODE = 'GI001';
    END IF;
    INSERT INTO {schema}.records AS r
        (scope, key, method, fingerprint, state, fencing_token, locked_until, expires_at,
         retention, claim_attempt)
    VALUES
        (p_scope, p_key, p_method, p_fingerprint, 'in_progress', 1,
         clock_timestamp() + make_interval(secs => p_lease_s),
         clock_timestamp() + make_interval(secs => p_retention_s),
         make_interval(secs => p_retention_s),
         p_attempt # 1)
    ON CONFLICT (scope, key) DO UPDATE SET
        method = EXCLUDED.method,
        fingerprint = EXCLUDED.fingerprint,
        state = 'in_progress',
        fencing_token = r.fencing_token + 1,
        -- The clock read now, not in VALUES: a takeover that waited on the row's lock (a purge
        -- batch, a stale owner's renewal) was granted a lease shorter by that wait.
        locked_until = clock_timestamp() + make_interval(secs => p_lease_s),
        status_code = NULL, status_message = NULL, status_details = NULL, response = NULL,
        -- As in claim(): the same request continues the operation and keeps its start.
        created_at = CASE WHEN r.state = 'in_progress' AND r.fingerprint = EXCLUDED.fingerprint
                          THEN r.created_at ELSE clock_timestamp() END,
        completed_at = NULL,
        expires_at = EXCLUDED.expires_at,
        retention = EXCLUDED.retention,
        claim_attempt = p_attempt # (r.fencing_token + 1)
    WHERE (r.state = 'completed'
           AND GREATEST(r.expires_at, r.completed_at + r.retention) <= clock_timestamp())
       OR (r.state = 'in_progress' AND r.locked_until <= clock_timestamp()
           AND (r.fingerprint = EXCLUDED.fingerprint OR r.expires_at <= clock_timestamp()))
    RETURNING r.fencing_token, r.created_at INTO token, started_at;
    IF token IS NULL THEN
        -- Taken, and not to be taken over: this call's own earlier try, or someone else's. Its
        -- own claim gets a whole lease from now, as a claim does: the try that found it may
        -- have waited most of the first one out (a reconnect, the claim lock), and the lease
        -- keeper's first renewal comes a third of a lease after this answer.
        UPDATE {schema}.records r
           SET locked_until = GREATEST(r.locked_until,
                                       clock_timestamp() + make_interval(secs => p_lease_s))
         WHERE r.scope = p_scope AND r.key = p_key AND r.state = 'in_progress'
           AND r.claim_attempt = p_attempt # r.fencing_token
        RETURNING r.fencing_token, r.created_at INTO token, started_at;
        IF token IS NULL THEN
            RAISE EXCEPTION 'idempotency key is already recorded' USING ERRCODE = 'GI002';
        END IF;
    END IF;
END
$$;
