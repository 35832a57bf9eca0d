-- Phased mode: the claim commits on its own (with a lease and a fencing token) and the outcome
-- commits later, in a final transaction that must still own the claim.

-- Locks the claim row for the final transaction and checks that p_token still owns it.
-- Raises GI003 otherwise: a stalled owner whose lease was taken over cannot commit. Holding the
-- row lock until COMMIT means no takeover can slip in between this check and the outcome.
CREATE FUNCTION {schema}.verify_claim(p_scope text, p_key text, p_token bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM {schema}.records
     WHERE scope = p_scope AND key = p_key AND state = 'in_progress' AND fencing_token = p_token
       FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotency claim was lost to another attempt' USING ERRCODE = 'GI003';
    END IF;
END
$$;
