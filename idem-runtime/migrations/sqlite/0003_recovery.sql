-- Recovery (`#[idempotent(..., recover)]`): the arguments a recoverable claim
-- stores beside its record, so a worker can finish the call if its caller never
-- comes back. A row counts only while its record is PROCESSING under `token`
-- (the claim that stored it); a completed, released or taken-over record's row
-- is ignored, and the sweeper's purge deletes it. The arguments are sealed by
-- the runtime (opaque here).
CREATE TABLE IF NOT EXISTS idem_recovery (
    key      BLOB    NOT NULL PRIMARY KEY,
    token    BLOB    NOT NULL,
    scope    BLOB    NOT NULL,
    args     BLOB    NOT NULL,
    -- recoveries attempted, when the next may start (ms), and why the worker
    -- stopped (NULL unless parked for an operator)
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at  INTEGER NOT NULL DEFAULT 0,
    parked   BLOB
) WITHOUT ROWID;

-- The worker's listing by scope.
CREATE INDEX IF NOT EXISTS idem_recovery_scope ON idem_recovery (scope, next_at);
