-- The schema's functions run with search_path = pg_catalog, pg_temp, whatever the caller's.
--
-- The completion (complete_atomic, complete) runs in the handler's transaction, after the
-- handler's own statements: a handler that routes a tenant with
-- `SET LOCAL search_path = tenant_a, pg_catalog` (which the README allows) put tenant_a's
-- functions ahead of the built-ins. A now() or clock_timestamp() there (a frozen clock is a common
-- testing pattern) wrote the record's created_at, completed_at and expires_at from it: a record
-- from the year 2000 looked expired at once, another replica ran the handler again and was fenced
-- off, a purge deleted the record within its retention, and the next retry ran the handler a
-- second time and committed (two business writes for one key; a review's reproducer).
-- Shadowing pg_try_advisory_xact_lock would have broken the claim's mutual exclusion alike.
--
-- A SET clause on the function is PostgreSQL's own answer ("Writing SECURITY DEFINER Functions
-- Safely"): it covers the operators and type names in the bodies as well as the functions, and
-- the caller's setting is back when the function returns (deferred triggers of the application's
-- at COMMIT still see the application's search_path). The temporary schema goes last, so that
-- nothing there can stand in for a built-in either.
--
-- Every function of the library's, whatever migration created it (overloads kept for servers not
-- yet upgraded included), named one by one: the schema may hold the application's functions too
-- (schema="public", or a schema of its own), and those are not the library's to change. A loop
-- over every function of the schema set this search_path on them as well, and an application
-- function that finds its tables through the caller's search_path failed from the upgrade on;
-- one owned by another role (an extension's) failed the migration. A later migration that
-- replaces a function must say SET search_path again: CREATE OR REPLACE drops the clause
-- (tests/integration/test_shadowed_builtins.py checks that every function of the store's schema
-- has it).
ALTER FUNCTION {schema}.claim(text, text, bigint, text, bytea, float8, float8)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.claim_atomic(text, text, bigint, text, bytea, float8, float8)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.claim_with_start(text, text, bigint, text, bytea, float8, float8)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.complete(text, text, bigint, integer, text, bytea, bytea, float8)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.complete_atomic(
    text, text, text, bytea, integer, text, bytea, bytea, float8)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.verify_claim(text, text, bigint, bigint)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.verify_claim(text, text, bigint, bigint, timestamptz)
    SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.outbox_wake()
    SET search_path = pg_catalog, pg_temp;
