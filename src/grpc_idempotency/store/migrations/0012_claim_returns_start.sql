-- A phased claim returns when its operation began (created_at), with its fencing token.
--
-- Child keys follow the steps declared when the operation began: an operation begun before
-- charge-card.v1's retired_at keeps v1's child key on every attempt. A takeover read that start
-- from the record, but the first attempt had none and used the newest step: an operation begun
-- before retired_at on new code called downstream with v2's key and, taken over after a crash,
-- with v1's, and the downstream effect ran twice. Now every attempt knows the start, on the
-- database's clock, the one retired_at is compared with on takeovers too.
--
-- A wrapper, so that claim() keeps its signature for servers not yet upgraded.
CREATE OR REPLACE FUNCTION {schema}.claim_with_start(
    p_scope text, p_key text, p_lock bigint, p_method text, p_fingerprint bytea,
    p_retention_s double precision, p_lease_s double precision,
    OUT token bigint, OUT started_at timestamptz
)
LANGUAGE plpgsql AS $$
BEGIN
    token := {schema}.claim(p_scope, p_key, p_lock, p_method, p_fingerprint, p_retention_s,
                            p_lease_s);
    SELECT r.created_at INTO started_at FROM {schema}.records r
    WHERE r.scope = p_scope AND r.key = p_key;
END
$$;
