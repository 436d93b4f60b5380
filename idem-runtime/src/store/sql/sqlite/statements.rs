//! The SQL the SQLite store sends, one statement per operation, with the
//! argument for each beside it; `records.rs` and `recovery.rs` bind and run
//! them. Time is the store's clock, bound as a parameter.

// The row may be taken when it is expired, released, or PROCESSING past its
// lease; a claim retried under the same token gets its own row back. SQLite
// evaluates every SET expression against the old row, so their order is free.
// The row written is PROCESSING (?7 = 1, no outcome), or DONE with its outcome
// and result (?7 = 2, `claim_done`).
pub(super) const CLAIM: &str = "
INSERT INTO idem_records
    (key, state, token, fence, lease_until, expires_at, fingerprint, taken_over, outcome, result)
VALUES (?1, ?7, ?2, 1, ?3, ?4, ?5, 0, ?8, ?9)
ON CONFLICT (key) DO UPDATE SET
    state       = ?7,
    fence       = CASE WHEN idem_records.state = 1 AND idem_records.token = excluded.token
                       THEN idem_records.fence ELSE idem_records.fence + 1 END,
    taken_over  = (idem_records.state = 1 AND idem_records.expires_at > ?6
                   AND idem_records.token <> excluded.token),
    token       = excluded.token,
    lease_until = excluded.lease_until,
    expires_at  = excluded.expires_at,
    fingerprint = excluded.fingerprint,
    outcome     = ?8,
    result      = ?9
WHERE idem_records.expires_at <= ?6
   OR idem_records.state = 0
   OR (idem_records.state = 1
       AND (idem_records.lease_until <= ?6 OR idem_records.token = excluded.token))
RETURNING fence, taken_over";

pub(super) const READ: &str = "
SELECT state, token, fence, taken_over, lease_until, expires_at, fingerprint, outcome, result
FROM idem_records WHERE key = ?1";

pub(super) const COMPLETE: &str = "
UPDATE idem_records SET state = 2, outcome = ?1, result = ?2, expires_at = ?3
WHERE key = ?4 AND state = 1 AND token = ?5";

pub(super) const COMPLETED_BY: &str =
    "SELECT 1 FROM idem_records WHERE key = ?1 AND state = 2 AND token = ?2";

// Expiry is kept at least as far as the lease: a body may run past its ttl,
// and while it heartbeats its record must not expire under it.
pub(super) const RENEW: &str = "
UPDATE idem_records SET lease_until = ?1, expires_at = max(expires_at, ?1)
WHERE key = ?2 AND state = 1 AND token = ?3 AND expires_at > ?4";

// A released record also expires at once, so purging finds it through the
// `expires_at` index like any other dead record; the row (and its fence) stays
// until then, and a claim takes it either way.
// ?4 is 1 on the pool; 2 inside the caller's transaction, where the record may
// be one `claim_done` wrote DONE before its body failed.
pub(super) const RELEASE: &str = "
UPDATE idem_records SET state = 0, expires_at = min(expires_at, ?3)
WHERE key = ?1 AND state IN (1, ?4) AND token = ?2";

// An operator's override that keeps fences growing (see `Store::evict`): a
// PROCESSING row stays, disowned (a token nobody holds) with its lease ended,
// so the next claim takes it over with the next fence; anything else live is
// released. `state` is set last: MySQL reads columns already set in the same
// SET list, and the other expressions need the old state.
pub(super) const EVICT: &str = "
UPDATE idem_records SET
    lease_until = CASE WHEN state = 1 THEN min(lease_until, ?3) ELSE lease_until END,
    expires_at  = CASE WHEN state = 1 THEN expires_at ELSE min(expires_at, ?3) END,
    token       = ?2,
    state       = CASE WHEN state = 1 THEN 1 ELSE 0 END
WHERE key = ?1 AND state <> 0 AND expires_at > ?3";

// Dead records are exactly those with `expires_at` in the past (released ones
// included, see RELEASE): the batch is a range of the `expires_at` index, read
// in its order, never a scan of the table under the write lock. SQLite has one
// writer at a time, so there is nothing to skip: sweepers and claims take
// turns, each for one bounded batch.
pub(super) const PURGE: &str = "
DELETE FROM idem_records WHERE key IN (
    SELECT key FROM idem_records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)";

// Recovery (`sql/recovery.rs`): the arguments of a recoverable claim, under the
// token that just acquired its record, on the claim's transaction. A
// takeover keeps the count, backoff and parking of the call it continues.
pub(super) const KEEP_ARGS: &str = "
INSERT INTO idem_recovery (key, token, scope, args, attempts, next_at, parked)
VALUES (?1, ?2, ?3, ?4, 0, 0, NULL)
ON CONFLICT (key) DO UPDATE SET
    token    = excluded.token,
    scope    = excluded.scope,
    args     = excluded.args,
    attempts = CASE WHEN ?5 THEN idem_recovery.attempts ELSE 0 END,
    next_at  = CASE WHEN ?5 THEN idem_recovery.next_at ELSE 0 END,
    parked   = CASE WHEN ?5 THEN idem_recovery.parked ELSE NULL END";

pub(super) const RECOVERY_SCOPES: &str = "
SELECT DISTINCT a.scope FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
WHERE r.state = 1 AND r.expires_at > ?1";

pub(super) const ABANDONED: &str = "
SELECT a.key AS key, r.fence AS fence, a.args AS args, a.attempts AS attempts,
       r.lease_until AS lease_until
FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
WHERE a.scope = ?1 AND a.parked IS NULL AND a.next_at <= ?2
  AND r.state = 1 AND r.lease_until <= ?2 AND r.expires_at > ?2
ORDER BY r.lease_until
LIMIT ?3";

// One turn: the record must still be PROCESSING under the token that stored
// the arguments, at the fence the worker saw, its lease run out. `?3` is the
// attempt limit (0 parks at once, whatever the backoff). `parked` and
// `next_at` are set before `attempts` and read only its old value, which
// holds on every dialect (MySQL assigns left to right).
pub(super) const TAKE_TURN: &str = "
UPDATE idem_recovery SET
    parked   = CASE WHEN attempts >= ?3 THEN ?4 ELSE NULL END,
    next_at  = CASE WHEN attempts >= ?3 THEN next_at ELSE ?5 + ?6 END,
    attempts = CASE WHEN attempts >= ?3 THEN attempts ELSE attempts + 1 END
WHERE key = ?1 AND parked IS NULL AND (next_at <= ?5 OR ?3 = 0)
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.key = idem_recovery.key AND r.token = idem_recovery.token
                AND r.state = 1 AND r.fence = ?2 AND r.lease_until <= ?5 AND r.expires_at > ?5)";

pub(super) const TAKEN: &str =
    "SELECT attempts, parked IS NOT NULL FROM idem_recovery WHERE key = ?1";

pub(super) const RECOVERY_INFO: &str = "
SELECT a.scope AS scope, a.attempts AS attempts, a.next_at AS next_at, a.parked AS parked,
       length(a.args) AS args_bytes
FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
WHERE a.key = ?1 AND r.state = 1 AND r.expires_at > ?2";

pub(super) const RETRY_RECOVERY: &str = "
UPDATE idem_recovery SET attempts = 0, next_at = 0, parked = NULL
WHERE key = ?1
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.key = idem_recovery.key AND r.token = idem_recovery.token
                AND r.state = 1 AND r.expires_at > ?2)";

pub(super) const PURGE_RECOVERY: &str = "
DELETE FROM idem_recovery WHERE key IN (
    SELECT a.key FROM idem_recovery AS a
    WHERE NOT EXISTS (SELECT 1 FROM idem_records AS r
                      WHERE r.key = a.key AND r.token = a.token AND r.state = 1)
    LIMIT ?1)";
