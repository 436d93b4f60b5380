//! The SQL the MySQL / MariaDB store sends, one statement per operation,
//! with the argument for each beside it; `records.rs` and `recovery.rs` bind
//! and run them.

/// Milliseconds since the Unix epoch on the server's clock, as SQL.
///
/// `UTC_TIMESTAMP` and `TIMESTAMPDIFF` are pure arithmetic on UTC, so the
/// session's `time_zone` never enters (`UNIX_TIMESTAMP(NOW(3))` goes through the
/// session zone and is off by an hour around a DST change). It is the
/// statement's start time, the same value everywhere inside one statement.
macro_rules! now_ms {
    () => {
        "(TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
    };
}

/// How long the statement has been running, in milliseconds, read where it is
/// evaluated: after any row lock the statement waited for. `SYSDATE` is the
/// only clock that moves within a statement, and it is local time; its
/// distance from `NOW` (the statement's start, also local) is the same in
/// every zone. Never negative: a DST change in the middle of a lock wait could
/// otherwise make it so. (`SYSDATE` makes a statement unsafe for
/// statement-based replication; ROW and MIXED binlogs, the defaults, log the
/// values.)
macro_rules! waited_ms {
    () => {
        "(GREATEST(0, TIMESTAMPDIFF(MICROSECOND, NOW(6), SYSDATE(6))) DIV 1000)"
    };
}

/// The server's clock in milliseconds since the epoch when evaluated, not
/// when the statement began: a lease must start when its statement got the row
/// lock, not seconds earlier when it began to wait for it.
macro_rules! clock_ms {
    () => {
        concat!("(", now_ms!(), " + ", waited_ms!(), ")")
    };
}

/// On the old row: the caller may take it (expired, released, PROCESSING past
/// its lease, or PROCESSING under the caller's own token: a retried claim).
macro_rules! claimable {
    () => {
        concat!(
            "(expires_at <= ",
            now_ms!(),
            " OR state = 0 OR (state = 1 AND (lease_until <= ",
            now_ms!(),
            " OR token = VALUES(token))))"
        )
    };
}

/// After `token` has been assigned: the caller won. Tokens are random, so the
/// row carries the caller's token only if it won, or if it is the caller's own
/// earlier claim already completed (DONE and live), which must stay DONE.
macro_rules! won {
    () => {
        concat!(
            "(token = VALUES(token) AND (state <> 2 OR expires_at <= ",
            now_ms!(),
            "))"
        )
    };
}

// ON DUPLICATE KEY UPDATE assigns left to right, and each expression sees the
// columns already assigned before it (unlike SQLite and PostgreSQL, which see
// the old row throughout). So the order is the algorithm:
//
// 1. `fence` and `taken_over` first, while `claimable!` still reads the old
//    row (neither is part of it);
// 2. `token` next, to ours exactly when the row was claimable. From here on the
//    old row is gone, and `won!` (the token is ours, and the row is not our own
//    live DONE record) stands in for "claimable";
// 3. `lease_until`, `fingerprint`, `outcome`, `result`, then `state`, each
//    under `won!`, which reads `state` and `expires_at`: both still old;
// 4. `expires_at` last: after step 3, `won!` still holds for a winner (its
//    state is now 1) and still fails for everyone else (their state is as it
//    was). Its test also leaves the statement's insert id (below).
//
// The `claimable!` tests use the statement's start time: a lease that ran out
// while this statement waited on the row's lock looks live, and the claim
// reports Busy or tries again, never a takeover too early. The lease and
// expiry a winner writes count from when it got the row (`waited_ms!`), not
// from when it began to wait. An INSERT that waited on another transaction's
// uncommitted insert of the key (rolled back since) has no such hook: its
// VALUES were computed before the wait, and `upsert` restarts that lease.
//
// A fresh row is inserted PROCESSING, or DONE with its outcome and result for
// `claim_done`; the update branch always writes PROCESSING (every `won!` after
// `state` relies on a winner's state not being 2), and `upsert` completes
// right after it.
//
// What the caller got comes back in the OK packet, with no read: the insert id
// is 0 when the statement inserted the row (nothing in it calls
// `LAST_INSERT_ID`, and the table has no AUTO_INCREMENT column), and otherwise
// the value the update branch gave `LAST_INSERT_ID(…)`: `fence * 2 +
// taken_over` for a winner (never below 2: fences start at 1), LOST for anyone
// else. The server sets that id per statement: one left on the connection by
// an earlier statement does not reach this statement's OK packet.
// (`rows_affected` cannot tell: sqlx connects with CLIENT_FOUND_ROWS, so a
// no-op update counts one row, as an insert does.)
pub(super) const CLAIM: &str = concat!(
    "INSERT INTO idem_records
    (`key`, state, token, fence, lease_until, expires_at, fingerprint, taken_over, outcome, result)
VALUES (?, ?, ?, 1, ",
    now_ms!(),
    " + ?, ",
    now_ms!(),
    " + ?, ?, FALSE, ?, ?)
ON DUPLICATE KEY UPDATE
    fence       = IF(",
    claimable!(),
    ", IF(state = 1 AND token = VALUES(token), fence, fence + 1), fence),
    taken_over  = IF(",
    claimable!(),
    ", IF(state = 1 AND token = VALUES(token), taken_over, state = 1 AND expires_at > ",
    now_ms!(),
    "), taken_over),
    token       = IF(",
    claimable!(),
    ", VALUES(token), token),
    lease_until = IF(",
    won!(),
    ", VALUES(lease_until) + ",
    waited_ms!(),
    ", lease_until),
    fingerprint = IF(",
    won!(),
    ", VALUES(fingerprint), fingerprint),
    outcome     = IF(",
    won!(),
    ", NULL, outcome),
    result      = IF(",
    won!(),
    ", NULL, result),
    state       = IF(",
    won!(),
    ", 1, state),
    expires_at  = IF(LAST_INSERT_ID(IF(",
    won!(),
    ", fence * 2 + taken_over, 1)) > 1, VALUES(expires_at) + ",
    waited_ms!(),
    ", expires_at)"
);

// Recovery (`sql/recovery.rs`): the arguments of a recoverable claim, under the
// token that just acquired its record, on the claim's transaction. A
// takeover keeps the count, backoff and parking of the call it continues
// (each of the three reads only its own old value, so the order is free).
pub(super) const KEEP_ARGS: &str = "
INSERT INTO idem_recovery (`key`, token, scope, args, attempts, next_at, parked)
VALUES (?, ?, ?, ?, 0, 0, NULL)
ON DUPLICATE KEY UPDATE
    attempts = IF(?, attempts, 0),
    next_at  = IF(?, next_at, 0),
    parked   = IF(?, parked, NULL),
    token    = VALUES(token),
    scope    = VALUES(scope),
    args     = VALUES(args)";

pub(super) const RECOVERY_SCOPES: &str = concat!(
    "SELECT DISTINCT a.scope FROM idem_recovery AS a
JOIN idem_records AS r ON r.`key` = a.`key` AND r.token = a.token
WHERE r.state = 1 AND r.expires_at > ",
    now_ms!()
);

pub(super) const ABANDONED: &str = concat!(
    "SELECT a.`key` AS `key`, r.fence AS fence, a.args AS args,
       CAST(a.attempts AS SIGNED) AS attempts, r.lease_until AS lease_until
FROM idem_recovery AS a
JOIN idem_records AS r ON r.`key` = a.`key` AND r.token = a.token
WHERE a.scope = ? AND a.parked IS NULL AND a.next_at <= ",
    now_ms!(),
    "
  AND r.state = 1 AND r.lease_until <= ",
    now_ms!(),
    " AND r.expires_at > ",
    now_ms!(),
    "
ORDER BY r.lease_until
LIMIT ?"
);

// One turn (see sqlite/statements.rs): `parked` and `next_at` are assigned before
// `attempts`, so both read its old value. The limit is bound three times,
// then once more in the WHERE.
pub(super) const TAKE_TURN: &str = concat!(
    "UPDATE idem_recovery AS a SET
    a.parked   = IF(a.attempts >= ?, ?, NULL),
    a.next_at  = IF(a.attempts >= ?, a.next_at, ",
    now_ms!(),
    " + ?),
    a.attempts = IF(a.attempts >= ?, a.attempts, a.attempts + 1)
WHERE a.`key` = ? AND a.parked IS NULL AND (a.next_at <= ",
    now_ms!(),
    " OR ? = 0)
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.`key` = a.`key` AND r.token = a.token AND r.state = 1 AND r.fence = ?
                AND r.lease_until <= ",
    now_ms!(),
    " AND r.expires_at > ",
    now_ms!(),
    ")"
);

pub(super) const TAKEN: &str = "SELECT CAST(attempts AS SIGNED), CAST(parked IS NOT NULL AS SIGNED)
FROM idem_recovery WHERE `key` = ?";

pub(super) const RECOVERY_INFO: &str = concat!(
    "SELECT a.scope AS scope, CAST(a.attempts AS SIGNED) AS attempts, a.next_at AS next_at,
       a.parked AS parked, CAST(LENGTH(a.args) AS SIGNED) AS args_bytes
FROM idem_recovery AS a
JOIN idem_records AS r ON r.`key` = a.`key` AND r.token = a.token
WHERE a.`key` = ? AND r.state = 1 AND r.expires_at > ",
    now_ms!()
);

pub(super) const RETRY_RECOVERY: &str = concat!(
    "UPDATE idem_recovery AS a SET a.attempts = 0, a.next_at = 0, a.parked = NULL
WHERE a.`key` = ?
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.`key` = a.`key` AND r.token = a.token AND r.state = 1
                AND r.expires_at > ",
    now_ms!(),
    ")"
);

// The derived table is materialised first (MySQL allows no LIMIT in an IN
// subquery, nor a subquery on the table being deleted from).
pub(super) const PURGE_RECOVERY: &str = "
DELETE FROM idem_recovery WHERE `key` IN (
    SELECT `key` FROM (
        SELECT a.`key` FROM idem_recovery AS a
        WHERE NOT EXISTS (SELECT 1 FROM idem_records AS r
                          WHERE r.`key` = a.`key` AND r.token = a.token AND r.state = 1)
        LIMIT ?) AS stale)";

/// The claim's insert id when it inserted the row: its update branch, which
/// alone calls `LAST_INSERT_ID`, never ran.
pub(super) const INSERTED: u64 = 0;
/// The claim's insert id when its update branch left the row to its holder
/// (`1` in CLAIM).
pub(super) const LOST: u64 = 1;

macro_rules! select_record {
    () => {
        concat!(
            "SELECT state, token, fence, lease_until, expires_at, fingerprint, outcome, result, ",
            clock_ms!(),
            " AS now
             FROM idem_records WHERE `key` = ?"
        )
    };
}

pub(super) const COMPLETED_BY: &str =
    "SELECT 1 FROM idem_records WHERE `key` = ? AND state = 2 AND token = ?";

/// A plain consistent read: it takes no lock and waits for none. Inside a
/// caller's REPEATABLE READ transaction it may show an older version of the
/// row (the transaction's snapshot); see `claim_on` for why that is safe.
pub(super) const READ: &str = select_record!();

/// After a claim that did not take the record: a locking read returns the
/// latest committed row, not the snapshot a REPEATABLE READ transaction may
/// already hold (which could predate a duplicate's commit). Inside a
/// transaction the upsert already holds the row's exclusive lock, so this
/// waits for nothing; on the pool it is a shared lock held for one statement.
pub(super) const READ_LOCKED: &str = concat!(select_record!(), " LOCK IN SHARE MODE");

pub(super) const COMPLETE: &str = concat!(
    "UPDATE idem_records SET state = 2, outcome = ?, result = ?, expires_at = ",
    clock_ms!(),
    " + ?
     WHERE `key` = ? AND state = 1 AND token = ?"
);

// A released record also expires at once, so purging finds it through the
// `expires_at` index like any other dead record; the row (and its fence) stays
// until then, and a claim takes it either way.
// The last parameter is 1 on the pool; 2 inside the caller's transaction,
// where the record may be one `claim_done` wrote DONE before its body failed.
pub(super) const RELEASE: &str = concat!(
    "UPDATE idem_records SET state = 0, expires_at = LEAST(expires_at, ",
    clock_ms!(),
    ") WHERE `key` = ? AND token = ? AND state IN (1, ?)"
);

// The lease counts from when the row was locked (the UPDATE computes its SET
// list after that). Expiry is kept at least as far as the lease: a body may run
// past its ttl, and while it heartbeats its record must not expire under it.
// The lease is bound twice rather than read back from `lease_until`, so the
// statement does not depend on the order MariaDB's SIMULTANEOUS_ASSIGNMENT
// mode would change; the second clock reading is never the earlier one.
pub(super) const RENEW: &str = concat!(
    "UPDATE idem_records SET lease_until = ",
    clock_ms!(),
    " + ?, expires_at = GREATEST(expires_at, ",
    clock_ms!(),
    " + ?)
     WHERE `key` = ? AND state = 1 AND token = ? AND expires_at > ",
    clock_ms!()
);

// An operator's override that keeps fences growing (see `Store::evict`): a
// PROCESSING row stays, disowned (a token nobody holds) with its lease ended;
// anything else live is released. `state` is set last: MySQL evaluates the
// SET list left to right on the new values, and the rest needs the old state.
pub(super) const EVICT: &str = concat!(
    "UPDATE idem_records SET
    lease_until = CASE WHEN state = 1 THEN LEAST(lease_until, ",
    now_ms!(),
    ") ELSE lease_until END,
    expires_at  = CASE WHEN state = 1 THEN expires_at ELSE LEAST(expires_at, ",
    now_ms!(),
    ") END,
    token       = ?,
    state       = CASE WHEN state = 1 THEN 1 ELSE 0 END
WHERE `key` = ? AND state <> 0 AND expires_at > ",
    now_ms!()
);

// Dead records are exactly those with `expires_at` in the past (released ones
// included, see RELEASE), so the batch is a range of the `expires_at` index,
// read in its order and never the whole table. SKIP LOCKED: a row another
// transaction holds (a claim re-taking it, another replica's sweeper) is left
// to it instead of waited on. MySQL accepts neither a LIMIT in an `IN`
// subquery nor SKIP LOCKED on a DELETE, so the batch is locked here and
// deleted by key (PURGE_DELETE) in the same READ COMMITTED transaction, which
// takes no gap locks. Needs MySQL 8.0.1 or MariaDB 10.6 (SKIP LOCKED).
pub(super) const PURGE_SELECT: &str = concat!(
    "SELECT `key` FROM idem_records WHERE expires_at <= ",
    now_ms!(),
    " ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
);

pub(super) const PURGE_DELETE: &str = "DELETE FROM idem_records WHERE `key` IN ";

pub(super) use now_ms;
