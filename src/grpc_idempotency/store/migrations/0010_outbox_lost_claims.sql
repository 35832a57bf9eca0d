-- Claims that end with no outcome are counted apart from failed deliveries.
--
-- A relay that dies while delivering a batch (kill -9, OOM) records nothing: every row of the
-- batch comes due again when the lease ends. Counting such a claim as a failed delivery charged
-- every row of the batch for the one row whose delivery killed the relay, and after
-- max_attempts crashes parked them all as dead letters, rows never delivered included.
--
-- failures:    failed deliveries recorded by a relay (mark_failed); backoff and dead letters
--              count these. attempts still counts claims and stays the fencing token.
-- lost_claims: claims in a row that ended with no recorded outcome, counted when the row is
--              claimed again (a due pending row whose locked_until is still set lost its last
--              claim) and reset by a claim that follows a recorded one. A row whose last claim
--              was lost is claimed alone, so all but the first of a run of lost claims are its
--              own; max_attempts of them in a row park it without another delivery.
--
-- Constant defaults: no table rewrite, and the ACCESS EXCLUSIVE lock the ALTER takes is held
-- for no more than that (every enqueue and relay statement waits on it): the pending rows'
-- counts are filled in by migration 0011, in a transaction of its own, under row locks only.
ALTER TABLE {schema}.outbox
    ADD COLUMN failures    integer NOT NULL DEFAULT 0,
    ADD COLUMN lost_claims integer NOT NULL DEFAULT 0;
