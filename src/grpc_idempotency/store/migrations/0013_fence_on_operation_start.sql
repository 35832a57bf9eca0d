-- The final transaction of a phased claim fences on the fencing token and the operation's start
-- (created_at), not on the token alone.
--
-- The token counts the claims of one record: a takeover adds one and keeps created_at, but a
-- record that is purged (an in-progress claim past both its retention and its lease) and claimed
-- again starts over at 1, with a new created_at. An owner that stalled while its record was
-- purged still held token 1, passed verify_claim, and committed over the new owner's claim (which
-- then got LEASE_LOST). The pair is unique over the key's history: a record is purged only
-- after its expires_at (its claim plus a positive retention), so the claim that replaces it
-- starts later on the database's clock.
--
-- An overload, so that servers not yet upgraded keep calling verify_claim(text, text, bigint,
-- bigint) against this schema during a rolling deploy (those still fence on the token alone).
--
-- complete() is unchanged: it runs in the final transaction after verify_claim, which holds the
-- row lock until COMMIT, so neither a takeover nor a purge can reach the row in between.
CREATE OR REPLACE FUNCTION {schema}.verify_claim(
    p_scope text, p_key text, p_token bigint, p_lock bigint, p_started_at timestamptz
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- Blocking is fine: claim() only ever tries this lock, for the span of one statement.
    PERFORM pg_advisory_xact_lock(p_lock);
    PERFORM 1 FROM {schema}.records
     WHERE scope = p_scope AND key = p_key AND state = 'in_progress' AND fencing_token = p_token
       AND created_at = p_started_at
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency claim was lost to another attempt' USING ERRCODE = 'GI003';
    END IF;
END
$$;
