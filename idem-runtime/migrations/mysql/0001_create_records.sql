-- One row per idempotency key (the SHA-256 of scope and parts; no raw user data).
-- Times are milliseconds since the Unix epoch, from the server's clock.
-- Every column is binary or numeric, so the table's character set never matters.
-- IF NOT EXISTS: DDL commits implicitly in MySQL, so a process that dies between
-- this statement and the ledger row re-runs it harmlessly.
CREATE TABLE IF NOT EXISTS idem_records (
    `key`       BINARY(32) NOT NULL,
    -- 0 released (free to claim, fence kept), 1 processing, 2 done
    state       TINYINT    NOT NULL,
    token       BINARY(16) NOT NULL,
    fence       BIGINT     NOT NULL,
    lease_until BIGINT     NOT NULL,
    expires_at  BIGINT     NOT NULL,
    fingerprint BINARY(32) NULL,
    -- set by the claim that acquired the row: TRUE when it took over an expired lease
    taken_over  BOOL       NOT NULL DEFAULT FALSE,
    outcome     TINYINT    NULL,
    result      LONGBLOB   NULL,
    PRIMARY KEY (`key`),
    -- the sweeper deletes by expiry in bounded batches
    INDEX idem_records_expires_at (expires_at)
) ENGINE = InnoDB;
