-- The transactional outbox: messages written in the caller's transaction, sent
-- by a relay after it committed. Times are milliseconds since the Unix epoch.
-- SQLite has one writer at a time, so seq order is commit order.
CREATE TABLE IF NOT EXISTS idem_outbox (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    -- The stable message id the broker and the consumer deduplicate on.
    id              TEXT    NOT NULL UNIQUE,
    topic           TEXT    NOT NULL,
    ordering_key    TEXT,
    -- A JSON object of string headers, or NULL.
    headers         TEXT,
    payload         BLOB    NOT NULL,
    created_at      INTEGER NOT NULL,
    -- 0 pending, 1 sent, 2 parked
    state           INTEGER NOT NULL DEFAULT 0,
    -- Claims by relays so far (a relay that died holding it counts too).
    attempts        INTEGER NOT NULL DEFAULT 0,
    -- When a relay may take it next: after a backoff, or after the lease of
    -- the relay that claimed it ran out.
    next_attempt_at INTEGER NOT NULL,
    claim_token     BLOB,
    sent_at         INTEGER,
    last_error      TEXT
);

CREATE INDEX IF NOT EXISTS idem_outbox_pending ON idem_outbox (seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS idem_outbox_ordering ON idem_outbox (ordering_key, seq)
    WHERE state <> 1 AND ordering_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_sent ON idem_outbox (sent_at) WHERE state = 1;
