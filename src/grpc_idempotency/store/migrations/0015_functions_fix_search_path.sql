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
-- Every function of the schema, whatever migration created it (overloads kept for servers not yet
-- upgraded included). A later migration that replaces a function must say SET search_path again:
-- CREATE OR REPLACE drops the clause (tests/integration/test_shadowed_builtins.py checks).
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
        WHERE p.pronamespace = '{schema}'::regnamespace AND p.prokind = 'f'
    LOOP
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = pg_catalog, pg_temp', f);
    END LOOP;
END
$$;
