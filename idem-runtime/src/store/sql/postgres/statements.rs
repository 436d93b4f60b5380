//! The SQL the PostgreSQL store sends, one statement per operation, with
//! the argument for each beside it; `records.rs`, `recovery.rs` and
//! `migrations.rs` bind and run them.

// The server's wall clock, in milliseconds. `clock_timestamp()` rather than
// `now()`: inside a caller's transaction `now()` stays frozen at BEGIN, and a
// long transaction would then see leases that ended long ago as live.
macro_rules! server_now {
    () => {
        "(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    };
}

// One reading of the server clock per statement, so every comparison in it
// agrees with every other (`clock_timestamp()` moves between calls).
macro_rules! with_clock {
    () => {
        concat!("WITH clock AS (SELECT ", server_now!(), " AS now)\n")
    };
}

// The fresh row both claim statements insert, attempted only when a plain
// read does not show a live record that may not be taken (DONE, or
// PROCESSING under someone else's lease). It is PROCESSING ($6 = 1, no
// outcome), or DONE with its outcome and result ($6 = 2, `claim_done`).
macro_rules! insert_unless_held {
    () => {
        "INSERT INTO idem_records AS r
    (key, state, token, fence, lease_until, expires_at, fingerprint, taken_over, outcome, result)
SELECT $1, $6, $2, 1, clock.now + $3, clock.now + $4, $5, FALSE, $7, $8 FROM clock
WHERE NOT EXISTS (
    SELECT 1 FROM idem_records AS live
    WHERE live.key = $1
      AND live.expires_at > clock.now
      AND (live.state = 2
           OR (live.state = 1 AND live.lease_until > clock.now AND live.token <> $2)))
"
    };
}

// The claim's one statement in the common cases: it inserts a fresh record
// (the caller wins), or it answers with the record that is there (a replay, or
// Busy), in one round trip. ON CONFLICT DO NOTHING takes no lock on the
// conflicting row and raises no unique violation, so a duplicate never aborts
// the caller's transaction, and replays of a hot key inside transactions do
// not queue behind each other. The INSERT is only attempted when a plain read
// does not already show a live record that may not be taken (DONE, or
// PROCESSING under someone else's lease), exactly when TAKE below would try
// it: what a claim waits on and when REPEATABLE READ fails it are the same in
// both statements.
//
// The second arm reads the row only when nothing was inserted, with the
// statement's snapshot (data-modifying CTEs and the main query share one):
// a record that may be taken (expired, released, PROCESSING past its lease,
// or the claimant's own) goes on to TAKE. A row another transaction committed
// after the snapshot (the INSERT waited on its uncommitted insert) is not
// visible here: no row comes back, and the claim loop reads it afresh.
//
// An INSERT that waited on another transaction's uncommitted insert of the
// same key (which then rolled back) computed its values before the wait.
// RETURNING reads the clock after it, and the claim loop restarts a lease
// whose start lies too far before that (`Won::began_long_ago`).
pub(super) const CLAIM: &str = concat!(
    with_clock!(),
    ", ins AS (\n",
    insert_unless_held!(),
    "ON CONFLICT (key) DO NOTHING
    RETURNING fence, taken_over, lease_until, ",
    server_now!(),
    " AS now)
SELECT TRUE AS won, NULL::int8 AS state, NULL::bytea AS token, fence, taken_over, lease_until,
       NULL::int8 AS expires_at, NULL::bytea AS fingerprint, NULL::int8 AS outcome,
       NULL::bytea AS result, now
FROM ins
UNION ALL
SELECT FALSE, state::int8, token, fence, taken_over, lease_until, expires_at, fingerprint,
       outcome::int8, result, clock.now
FROM idem_records CROSS JOIN clock
WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM ins)"
);

// A claim's first try inside the caller's transaction, for a key with no row
// at all (a new order, a consumer's new message: the usual case there): a
// plain insert of the fresh record, PROCESSING or (`claim_done`) DONE. It
// costs the server less than CLAIM's data-modifying CTE and its read of the
// row that is there (pgbench, 16 clients, the record and one business insert
// per transaction: 0.84–0.94 of the reference notes' dedup insert for the
// DONE record, against 0.75–0.82 for CLAIM). A row already there (a replay, a
// busy or released record) returns nothing and CLAIM decides, so such a call
// costs a statement more; on the pool, where a replay is one statement, CLAIM
// goes first. ON CONFLICT DO NOTHING locks nothing and waits only on another
// transaction's uncommitted insert of the key, as CLAIM's insert would; an
// insert that waited on one that rolled back is caught as in CLAIM.
//
// Above READ COMMITTED it inserts only where the statement's snapshot shows
// no row of the key (the `NOT EXISTS`, one more probe of the index). There
// the conflict check of ON CONFLICT reads the row's latest version, and one
// the transaction's snapshot cannot see (a renewal or a completion after it
// began) fails the statement with a serialization error, aborting the
// caller's transaction where CLAIM answers Busy or replays from the
// snapshot's row. At READ COMMITTED (the default, and what the docs ask for)
// every statement sees the latest committed rows, the `OR` stops at its
// first operand, and the probe is not made (pg_stat_statements: 41 µs with
// it, 37 µs without, at 16 clients).
pub(super) const INSERT_FRESH: &str = concat!(
    "INSERT INTO idem_records
    (key, state, token, fence, lease_until, expires_at, fingerprint, taken_over, outcome, result)
SELECT $1, $6, $2, 1, ",
    server_now!(),
    " + $3, ",
    server_now!(),
    " + $4, $5, FALSE, $7, $8
WHERE current_setting('transaction_isolation') = 'read committed'
   OR NOT EXISTS (SELECT 1 FROM idem_records WHERE key = $1)
ON CONFLICT (key) DO NOTHING
RETURNING fence, taken_over, lease_until, ",
    server_now!(),
    " AS now"
);

// Takes a record CLAIM found that may be taken: expired, released, or
// PROCESSING past its lease; a claim retried under the same token gets its
// own row back. SET expressions read the old row, so their order is free. A
// row the WHERE refuses is left unchanged and RETURNING yields nothing: the
// claim loop then reads it. Nothing here raises a unique violation, so a
// duplicate never aborts the caller's transaction.
//
// A claim may wait on the row's lock (another transaction claimed or holds it)
// and win only when that transaction ends, seconds after `clock` was read. Its
// lease must start when it wins, or it would begin already spent and a third
// caller could take the key over at once. DO UPDATE locks the row before it
// evaluates its SET list, so the lease and expiry there read the clock afresh.
// An INSERT that waited on an uncommitted insert that rolled back is caught
// as in CLAIM.
//
// ON CONFLICT DO UPDATE locks its target row even when the WHERE refuses it,
// and inside a caller's transaction that lock would last until commit. So the
// INSERT is attempted only when a fresh read does not show a live record that
// may not be taken (someone else took it since CLAIM read it): only a genuine
// race between the two statements reaches a refused conflict.
pub(super) const TAKE: &str = concat!(
    with_clock!(),
    insert_unless_held!(),
    "ON CONFLICT (key) DO UPDATE SET
    state       = $6,
    fence       = CASE WHEN r.state = 1 AND r.token = excluded.token
                       THEN r.fence ELSE r.fence + 1 END,
    taken_over  = (r.state = 1 AND r.expires_at > (SELECT now FROM clock)
                   AND r.token <> excluded.token),
    token       = excluded.token,
    lease_until = ",
    server_now!(),
    " + $3,
    expires_at  = ",
    server_now!(),
    " + $4,
    fingerprint = excluded.fingerprint,
    outcome     = $7,
    result      = $8
WHERE r.expires_at <= (SELECT now FROM clock)
   OR r.state = 0
   OR (r.state = 1 AND (r.lease_until <= (SELECT now FROM clock) OR r.token = excluded.token))
RETURNING fence, taken_over, lease_until, ",
    server_now!(),
    " AS now"
);

pub(super) const COMPLETED_BY: &str =
    "SELECT 1 FROM idem_records WHERE key = $1 AND state = 2 AND token = $2";

pub(super) const READ: &str = concat!(
    "SELECT state::int8 AS state, token, fence, taken_over, lease_until, expires_at, fingerprint,
       outcome::int8 AS outcome, result, ",
    server_now!(),
    " AS now
FROM idem_records WHERE key = $1"
);

// The record lives its ttl ($3) from now, but an expiry already within the
// slack ($6, `completion_slack`) before that is kept as it is: the claim wrote
// it moments ago. Then no indexed column changes (`expires_at` is indexed for
// the sweeper, `key` never changes), and PostgreSQL rewrites the row on its
// own page with no new index entries (a HOT update; the table's fillfactor
// leaves the room, migration 0004). Setting it afresh every time made every
// completion a new tuple plus an entry in both indexes.
pub(super) const COMPLETE: &str = concat!(
    "UPDATE idem_records SET state = 2, outcome = $1, result = $2,
    expires_at = CASE WHEN expires_at BETWEEN ",
    server_now!(),
    " + $3 - $6 AND ",
    server_now!(),
    " + $3 THEN expires_at ELSE ",
    server_now!(),
    " + $3 END
WHERE key = $4 AND state = 1 AND token = $5"
);

// A released record also expires at once, so the sweeper finds it through the
// `expires_at` index like any other dead record; the row (and its fence) stays
// until then, and a claim takes it either way.
// $3 is 1 on the pool; 2 inside the caller's transaction, where the record may
// be one `claim_done` wrote DONE before its body failed.
pub(super) const RELEASE: &str = concat!(
    with_clock!(),
    "UPDATE idem_records SET state = 0, expires_at = LEAST(expires_at, clock.now)
FROM clock
WHERE key = $1 AND state IN (1, $3) AND token = $2"
);

// The owner's row is locked first (`mine`), and the new lease computed only
// once the join has that row: a plain UPDATE would compute its SET list before
// waiting on a lock another transaction holds, and start the lease that long
// ago. Expiry is kept at least as far as the lease: a body may run past its
// ttl, and while it heartbeats its record must not expire under it.
pub(super) const RENEW: &str = concat!(
    "WITH mine AS (
    SELECT key FROM idem_records WHERE key = $2 AND state = 1 AND token = $3 FOR UPDATE)
UPDATE idem_records AS r SET
    lease_until = ",
    server_now!(),
    " + $1,
    expires_at  = GREATEST(r.expires_at, ",
    server_now!(),
    " + $1)
FROM mine
WHERE r.key = mine.key AND r.expires_at > ",
    server_now!()
);

// An operator's override that keeps fences growing (see `Store::evict`): a
// PROCESSING row stays, disowned (a token nobody holds) with its lease ended;
// anything else live is released.
pub(super) const EVICT: &str = concat!(
    with_clock!(),
    "UPDATE idem_records SET
    lease_until = CASE WHEN state = 1 THEN LEAST(lease_until, clock.now) ELSE lease_until END,
    expires_at  = CASE WHEN state = 1 THEN expires_at ELSE LEAST(expires_at, clock.now) END,
    token       = $2,
    state       = CASE WHEN state = 1 THEN 1 ELSE 0 END
FROM clock
WHERE key = $1 AND state <> 0 AND expires_at > clock.now"
);

// Dead records are exactly those with `expires_at` in the past (released ones
// included, see RELEASE). ORDER BY walks the `expires_at` index and stops at the
// first live row: without it the planner's guess for a generic `<= now` picks a
// sequential scan, which reads the whole table when nothing is dead. SKIP
// LOCKED: sweepers on several replicas split the dead rows instead of queueing
// on each other, and a row a claim is re-taking right now is left to the claim.
pub(super) const PURGE: &str = concat!(
    with_clock!(),
    "DELETE FROM idem_records WHERE key IN (
    SELECT key FROM idem_records
    WHERE expires_at <= (SELECT now FROM clock)
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED)"
);

// Recovery (`sql/recovery.rs`): the arguments of a recoverable claim, under the
// token that just acquired its record, on the claim's transaction. A
// takeover keeps the count, backoff and parking of the call it continues.
pub(super) const KEEP_ARGS: &str = "
INSERT INTO idem_recovery AS a (key, token, scope, args, attempts, next_at, parked)
VALUES ($1, $2, $3, $4, 0, 0, NULL)
ON CONFLICT (key) DO UPDATE SET
    token    = excluded.token,
    scope    = excluded.scope,
    args     = excluded.args,
    attempts = CASE WHEN $5 THEN a.attempts ELSE 0 END,
    next_at  = CASE WHEN $5 THEN a.next_at ELSE 0 END,
    parked   = CASE WHEN $5 THEN a.parked ELSE NULL END";

pub(super) const RECOVERY_SCOPES: &str = concat!(
    with_clock!(),
    "SELECT DISTINCT a.scope FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
CROSS JOIN clock
WHERE r.state = 1 AND r.expires_at > clock.now"
);

pub(super) const ABANDONED: &str = concat!(
    with_clock!(),
    "SELECT a.key AS key, r.fence AS fence, a.args AS args, a.attempts::int8 AS attempts,
       r.lease_until AS lease_until
FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
CROSS JOIN clock
WHERE a.scope = $1 AND a.parked IS NULL AND a.next_at <= clock.now
  AND r.state = 1 AND r.lease_until <= clock.now AND r.expires_at > clock.now
ORDER BY r.lease_until
LIMIT $2"
);

// One turn (see sqlite/statements.rs). Two workers at once: the second waits on the
// row, then finds its backoff moved (the WHERE is evaluated again on the row
// the first wrote) and takes nothing.
pub(super) const TAKE_TURN: &str = concat!(
    with_clock!(),
    "UPDATE idem_recovery AS a SET
    parked   = CASE WHEN a.attempts >= $3 THEN $4 ELSE NULL END,
    next_at  = CASE WHEN a.attempts >= $3 THEN a.next_at ELSE clock.now + $5 END,
    attempts = CASE WHEN a.attempts >= $3 THEN a.attempts ELSE a.attempts + 1 END
FROM clock
WHERE a.key = $1 AND a.parked IS NULL AND (a.next_at <= clock.now OR $3 = 0)
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.key = a.key AND r.token = a.token AND r.state = 1 AND r.fence = $2
                AND r.lease_until <= clock.now AND r.expires_at > clock.now)
RETURNING a.attempts::int8, a.parked IS NOT NULL"
);

pub(super) const RECOVERY_INFO: &str = concat!(
    with_clock!(),
    "SELECT a.scope AS scope, a.attempts::int8 AS attempts, a.next_at AS next_at,
       a.parked AS parked, length(a.args)::int8 AS args_bytes
FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
CROSS JOIN clock
WHERE a.key = $1 AND r.state = 1 AND r.expires_at > clock.now"
);

pub(super) const RETRY_RECOVERY: &str = concat!(
    with_clock!(),
    "UPDATE idem_recovery AS a SET attempts = 0, next_at = 0, parked = NULL
FROM clock
WHERE a.key = $1
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.key = a.key AND r.token = a.token AND r.state = 1
                AND r.expires_at > clock.now)"
);

// SKIP LOCKED: a row a recoverable claim is writing right now is left to it.
pub(super) const PURGE_RECOVERY: &str = "
DELETE FROM idem_recovery WHERE key IN (
    SELECT a.key FROM idem_recovery AS a
    WHERE NOT EXISTS (SELECT 1 FROM idem_records AS r
                      WHERE r.key = a.key AND r.token = a.token AND r.state = 1)
    LIMIT $1
    FOR UPDATE SKIP LOCKED)";

pub(super) use server_now;
pub(super) use with_clock;
