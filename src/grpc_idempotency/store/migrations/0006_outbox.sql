-- The transactional outbox: side effects outside the database, enqueued in the same transaction
-- as the business change, delivered at least once by relays.
--
-- key is the child key of the declared outbox step (keys.child_key(scope, parent key, step)),
-- unique with its scope: a re-run of the handler cannot enqueue the same effect twice, and the
-- key travels with the message (as idempotency-key, or as a broker's message id) so receivers
-- dedupe. Relays select rows by state and due time, never by an id watermark, so a row that
-- commits after a higher-numbered one (a commit-order gap) is still delivered.
CREATE TABLE {schema}.outbox (
    id              bigserial   PRIMARY KEY,
    scope           text        NOT NULL,
    key             text        NOT NULL,
    step            text        NOT NULL,
    parent_key      text        NOT NULL,
    method          text        NOT NULL,
    payload_type    text        NOT NULL,
    payload         bytea       NOT NULL,
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'sent', 'dead')),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    locked_until    timestamptz,
    claimed_by      text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at         timestamptz,
    UNIQUE (scope, key)
);

-- Relays look for due pending rows; the partial index stays small as rows are sent.
CREATE INDEX outbox_due ON {schema}.outbox (next_attempt_at, id) WHERE state = 'pending';
-- Purging sent rows after retention, listing dead letters.
CREATE INDEX outbox_done ON {schema}.outbox (state, sent_at) WHERE state <> 'pending';

-- Wakes relays (LISTEN {schema_name}_outbox) when rows commit; they also poll, so a lost
-- notification only delays delivery.
CREATE FUNCTION {schema}.outbox_wake() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{schema_name}_outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_wake AFTER INSERT ON {schema}.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.outbox_wake();

-- Idempotent consumers: a message id is inserted here in the same transaction as the
-- consumer's effect; a duplicate delivery finds it and is acknowledged without effect.
CREATE TABLE {schema}.processed_messages (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX processed_messages_expires_at ON {schema}.processed_messages (expires_at);
