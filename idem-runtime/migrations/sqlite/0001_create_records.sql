-- One row per idempotency key (the SHA-256 of scope and parts; no raw user data).
-- Times are milliseconds since the Unix epoch, from the store's clock.
CREATE TABLE IF NOT EXISTS idem_records (
    key         BLOB    NOT NULL PRIMARY KEY,
    -- 0 released (free to claim, fence kept), 1 processing, 2 done
    state       INTEGER NOT NULL,
    token       BLOB    NOT NULL,
    fence       INTEGER NOT NULL,
    lease_until INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    fingerprint BLOB,
    -- set by the claim that acquired the row: 1 when it took over an expired lease
    taken_over  INTEGER NOT NULL DEFAULT 0,
    outcome     INTEGER,
    result      BLOB
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at);
