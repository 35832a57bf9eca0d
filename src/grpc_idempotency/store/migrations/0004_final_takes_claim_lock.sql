-- The final transaction of a phased claim now also holds the key's claim lock (the advisory
-- lock that claim() tries first). Without it, once a long final transaction outlived its lease a
-- competing claim on another replica saw an expired lease and queued on the row lock for as long
-- as the final transaction lasted, holding a pooled connection past its own max_wait. With it,
-- the competing claim fails fast (GI001) and waits, connection-free, within its budget.
DROP FUNCTION {schema}.verify_claim(text, text, bigint);

CREATE FUNCTION {schema}.verify_claim(
    p_scope text, p_key text, p_token bigint, p_lock bigint
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- Blocking is fine: claim() only ever tries this lock, for the span of one statement.
    PERFORM pg_advisory_xact_lock(p_lock);
    PERFORM 1 FROM {schema}.records
     WHERE scope = p_scope AND key = p_key AND state = 'in_progress' AND fencing_token = p_token
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency claim was lost to another attempt' USING ERRCODE = 'GI003';
    END IF;
END
$$;
