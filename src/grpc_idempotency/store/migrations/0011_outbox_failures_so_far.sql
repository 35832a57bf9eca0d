-- Pending rows keep what they have been charged so far (migration 0010): every earlier claim
-- counts as a failure, as before, except the one under lease now.
--
-- Apart from 0010, so that the table's ACCESS EXCLUSIVE lock is not held while this runs over
-- a backlog: here only the rows it updates are locked (relays pass over them, SKIP LOCKED, and
-- enqueues insert new rows). Until it has run, such a row counts its failures from zero: it
-- gets up to max_attempts more tries, never fewer.
UPDATE {schema}.outbox
SET failures = attempts - (locked_until IS NOT NULL)::int
WHERE state = 'pending' AND attempts > 0 AND failures = 0;
