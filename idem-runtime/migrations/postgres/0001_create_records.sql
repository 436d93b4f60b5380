-- One row per idempotency key (the SHA-256 of scope and parts; no raw user data).
-- Times are milliseconds since the Unix epoch, from the database server's clock,
-- so every application server compares leases against the same clock.
CREATE TABLE IF NOT EXISTS idem_records (
    key         BYTEA    NOT NULL PRIMARY KEY,
    -- 0 released (free to claim, fence kept, expires_at set to the release), 1 processing, 2 done
    state       SMALLINT NOT NULL,
    token       BYTEA    NOT NULL,
    fence       BIGINT   NOT NULL,
    lease_until BIGINT   NOT NULL,
    expires_at  BIGINT   NOT NULL,
    fingerprint BYTEA,
    -- set by the claim that acquired the row: true when it took over an expired lease
    taken_over  BOOLEAN  NOT NULL DEFAULT FALSE,
    outcome     SMALLINT,
    result      BYTEA
);

-- The sweeper deletes by expiry (released records included) in bounded batches.
CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at);
