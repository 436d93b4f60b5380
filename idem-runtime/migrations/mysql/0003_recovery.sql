-- Recovery (`#[idempotent(..., recover)]`): the arguments a recoverable claim
-- stores beside its record, so a worker can finish the call if its caller never
-- comes back. A row counts only while its record is PROCESSING under `token`
-- (the claim that stored it); a completed, released or taken-over record's row
-- is ignored, and the sweeper's purge deletes it. The arguments are sealed by
-- the runtime (opaque here). A table of its own: plain calls never touch it.
CREATE TABLE IF NOT EXISTS idem_recovery (
    `key`    BINARY(32)      NOT NULL,
    token    BINARY(16)      NOT NULL,
    scope    VARBINARY(1024) NOT NULL,
    args     LONGBLOB        NOT NULL,
    -- recoveries attempted, when the next may start (ms, the server's clock),
    -- and why the worker stopped (NULL unless parked for an operator)
    attempts INT             NOT NULL DEFAULT 0,
    next_at  BIGINT          NOT NULL DEFAULT 0,
    parked   BLOB            NULL,
    PRIMARY KEY (`key`),
    -- the worker's listing by scope
    INDEX idem_recovery_scope (scope, next_at)
) ENGINE = InnoDB;
