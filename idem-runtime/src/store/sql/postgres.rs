// Over 600 lines: two claim statements (CLAIM, TAKE), each with the argument
// that keeps it safe inside a caller's transaction, and the doc examples of
// the public API. The SQL stays next to the code that binds it.

//! PostgreSQL store through sqlx: records shared by every replica of a service,
//! leases on the database server's clock, and claims that can join the
//! caller's own transaction. The dialect's statements, clock and migration
//! lock; the algorithms are the shared ones in `store.rs`.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, Postgres};
use sqlx::{Connection as _, Executor as _, Row as _};

use super::dialect::Dialect;
use super::record::{Record, Upserted, Won, claimed_state, millis, released_up_to};
use super::recovery;
use super::schema_migrations;
use super::store::{Core, Settings, connect_pool, server_location, tx_connection};
use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::key::Key;
use crate::store::{
    Abandoned, ClaimRequest, Completion, RecoveryArgs, RecoveryInfo, RecoveryTurn, Token, Turn,
};

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
const CLAIM: &str = concat!(
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

// `claim_done`'s first try, for a key with no row at all (a consumer's new
// message, the usual case): a plain insert of the DONE record. It costs the
// server less than CLAIM's data-modifying CTE and its read of the row that is
// there (measured with pgbench at 16 clients: 0.84–0.94 of the reference
// notes' dedup insert per transaction, against 0.75–0.82 for CLAIM). A row
// already there (a replay, a busy or released record) returns nothing and
// CLAIM decides, so such a call costs a statement more. ON CONFLICT DO NOTHING
// locks nothing and waits only on another transaction's uncommitted insert of
// the key, as CLAIM's insert would.
const INSERT_DONE: &str = concat!(
    "INSERT INTO idem_records
    (key, state, token, fence, lease_until, expires_at, fingerprint, taken_over, outcome, result)
VALUES ($1, $6, $2, 1, ",
    server_now!(),
    " + $3, ",
    server_now!(),
    " + $4, $5, FALSE, $7, $8)
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
const TAKE: &str = concat!(
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

const COMPLETED_BY: &str = "SELECT 1 FROM idem_records WHERE key = $1 AND state = 2 AND token = $2";

const READ: &str = concat!(
    "SELECT state::int8 AS state, token, fence, taken_over, lease_until, expires_at, fingerprint,
       outcome::int8 AS outcome, result, ",
    server_now!(),
    " AS now
FROM idem_records WHERE key = $1"
);

// The one row it updates reads the clock once, in its SET list (no clock CTE
// to join).
const COMPLETE: &str = concat!(
    "UPDATE idem_records SET state = 2, outcome = $1, result = $2, expires_at = ",
    server_now!(),
    " + $3
WHERE key = $4 AND state = 1 AND token = $5"
);

// A released record also expires at once, so the sweeper finds it through the
// `expires_at` index like any other dead record; the row (and its fence) stays
// until then, and a claim takes it either way.
// $3 is 1 on the pool; 2 inside the caller's transaction, where the record may
// be one `claim_done` wrote DONE before its body failed.
const RELEASE: &str = concat!(
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
const RENEW: &str = concat!(
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
const EVICT: &str = concat!(
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
const PURGE: &str = concat!(
    with_clock!(),
    "DELETE FROM idem_records WHERE key IN (
    SELECT key FROM idem_records
    WHERE expires_at <= (SELECT now FROM clock)
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED)"
);

// Recovery (`recovery.rs`): the arguments of a recoverable claim, under the
// token that just acquired its record, on the claim's transaction. A
// takeover keeps the count, backoff and parking of the call it continues.
const KEEP_ARGS: &str = "
INSERT INTO idem_recovery AS a (key, token, scope, args, attempts, next_at, parked)
VALUES ($1, $2, $3, $4, 0, 0, NULL)
ON CONFLICT (key) DO UPDATE SET
    token    = excluded.token,
    scope    = excluded.scope,
    args     = excluded.args,
    attempts = CASE WHEN $5 THEN a.attempts ELSE 0 END,
    next_at  = CASE WHEN $5 THEN a.next_at ELSE 0 END,
    parked   = CASE WHEN $5 THEN a.parked ELSE NULL END";

const RECOVERY_SCOPES: &str = concat!(
    with_clock!(),
    "SELECT DISTINCT a.scope FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
CROSS JOIN clock
WHERE r.state = 1 AND r.expires_at > clock.now"
);

const ABANDONED: &str = concat!(
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

// One turn (see sqlite.rs). Two workers at once: the second waits on the
// row, then finds its backoff moved (the WHERE is evaluated again on the row
// the first wrote) and takes nothing.
const TAKE_TURN: &str = concat!(
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

const RECOVERY_INFO: &str = concat!(
    with_clock!(),
    "SELECT a.scope AS scope, a.attempts::int8 AS attempts, a.next_at AS next_at,
       a.parked AS parked, length(a.args)::int8 AS args_bytes
FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
CROSS JOIN clock
WHERE a.key = $1 AND r.state = 1 AND r.expires_at > clock.now"
);

const RETRY_RECOVERY: &str = concat!(
    with_clock!(),
    "UPDATE idem_recovery AS a SET attempts = 0, next_at = 0, parked = NULL
FROM clock
WHERE a.key = $1
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.key = a.key AND r.token = a.token AND r.state = 1
                AND r.expires_at > clock.now)"
);

// SKIP LOCKED: a row a recoverable claim is writing right now is left to it.
const PURGE_RECOVERY: &str = "
DELETE FROM idem_recovery WHERE key IN (
    SELECT a.key FROM idem_recovery AS a
    WHERE NOT EXISTS (SELECT 1 FROM idem_records AS r
                      WHERE r.key = a.key AND r.token = a.token AND r.state = 1)
    LIMIT $1
    FOR UPDATE SKIP LOCKED)";

/// Records in PostgreSQL: exact across every process and machine that uses
/// the database, durable, and on one clock (the server's) however many
/// application servers compare leases.
///
/// A claim is one statement, which inserts a fresh record or answers with the
/// one that is there (a replay, Busy) without locking it; only a record that
/// may be taken over (expired, released, a lease run out) costs a second,
/// `INSERT … ON CONFLICT (key) DO UPDATE … WHERE … RETURNING`. The
/// schema is created by embedded migrations recorded in
/// `idem_schema_migrations`, run when the store opens (see
/// [`PgStoreBuilder::skip_migrations`]). A statement that loses a deadlock or a
/// lock wait on the pool is retried a few times (see
/// [`PgStore::is_retryable`]).
///
/// With the same SQL, a claim can also run inside the caller's own
/// transaction (see [`TxConnection`](crate::store::tx::TxConnection)), so the record commits or rolls back
/// with the business writes.
///
/// ```no_run
/// use idem_runtime::store::sql::PgStore;
///
/// # async fn start() -> Result<(), idem_runtime::StoreError> {
/// let store = PgStore::connect("postgres://app@db.internal:5432/orders").await?;
/// idem_runtime::install(store);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct PgStore {
    core: Arc<Core<Postgres>>,
}

/// Configures a [`PgStore`].
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::store::sql::PgStore;
///
/// # async fn start() -> Result<(), idem_runtime::StoreError> {
/// let store = PgStore::builder()
///     .max_result_bytes(64 * 1024)
///     .max_connections(16)
///     .acquire_timeout(Duration::from_secs(2))
///     .connect("postgres://app@db.internal:5432/orders")
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct PgStoreBuilder {
    settings: Settings,
}

impl PgStoreBuilder {
    /// The largest result kept (default 1 MiB).
    pub fn max_result_bytes(mut self, limit: usize) -> Self {
        self.settings.max_result_bytes = limit;
        self
    }

    /// The size of the pool [`connect`](Self::connect) opens (default 10).
    /// Not used with [`pool`](Self::pool), which keeps the application's.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.settings.max_connections = n.max(1);
        self
    }

    /// How long a call waits for a connection before it fails closed with
    /// [`crate::Error::Store`] (default 5 s, where sqlx's own default of 30 s
    /// would hold a request that long while the database is down). Opening the
    /// store retries a refused connection for as long, and then tries once
    /// more, as long again, to say why. Not used with [`pool`](Self::pool).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.settings.acquire_timeout = timeout;
        self
    }

    /// Opens the store without applying the embedded migrations: for a
    /// database user without DDL rights, when the schema is applied at deploy
    /// time (with [`PgStore::migrate`] or the SQL in `migrations/postgres`).
    /// The store then runs no DDL at all.
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::PgStore::builder().skip_migrations();
    /// ```
    pub fn skip_migrations(mut self) -> Self {
        self.settings.migrate = false;
        self
    }

    /// Connects to the database a `postgres://` URL names and migrates it.
    ///
    /// Errors name the host, port and database, never the user or password.
    ///
    /// ```no_run
    /// # async fn start() -> Result<(), idem_runtime::StoreError> {
    /// let store = idem_runtime::store::sql::PgStore::builder()
    ///     .connect("postgres://app@127.0.0.1:5432/orders")
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(self, url: &str) -> Result<PgStore, StoreError> {
        // The URL may carry a password: it never becomes the location.
        let options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::new(Postgres::BACKEND, "<unparsable postgres URL>", e))?;
        self.connect_with(options).await
    }

    /// Connects with options built in code (a password from a secret store,
    /// TLS settings) and migrates the database.
    ///
    /// ```no_run
    /// use sqlx::postgres::PgConnectOptions;
    ///
    /// # async fn start() -> Result<(), idem_runtime::StoreError> {
    /// let options = PgConnectOptions::new()
    ///     .host("db.internal")
    ///     .database("orders")
    ///     .username("app")
    ///     .password(&std::env::var("DB_PASSWORD").unwrap_or_default());
    /// let store = idem_runtime::store::sql::PgStore::builder().connect_with(options).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect_with(self, options: PgConnectOptions) -> Result<PgStore, StoreError> {
        let location = location(&options);
        let pool = connect_pool(options, &self.settings, &location).await?;
        self.finish(pool, location).await
    }

    /// Uses a pool the application already has (its size, timeouts and TLS
    /// settings) and migrates the database.
    ///
    /// ```no_run
    /// use sqlx::PgPool;
    ///
    /// # async fn start() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPool::connect("postgres://app@127.0.0.1:5432/orders").await?;
    /// let store = idem_runtime::store::sql::PgStore::builder().pool(pool.clone()).await?;
    /// // MySQL and MariaDB: MySqlStore::builder().pool(pool.clone()).await?
    /// # Ok(())
    /// # }
    /// ```
    pub async fn pool(self, pool: PgPool) -> Result<PgStore, StoreError> {
        let location = location(&pool.connect_options());
        self.finish(pool, location).await
    }

    async fn finish(self, pool: PgPool, location: String) -> Result<PgStore, StoreError> {
        // Time is the server's: the store's clock is never read.
        let core = Core::open(
            pool,
            std::sync::Arc::new(SystemClock),
            &self.settings,
            location,
        )
        .await?;
        Ok(PgStore {
            core: Arc::new(core),
        })
    }
}

fn location(options: &PgConnectOptions) -> String {
    server_location(
        options.get_socket().map(|p| p.as_path()),
        options.get_host(),
        options.get_port(),
        options.get_database(),
    )
}

impl PgStore {
    /// Configures a store.
    pub fn builder() -> PgStoreBuilder {
        PgStoreBuilder {
            settings: Settings::default(),
        }
    }

    /// Connects to the database a `postgres://` URL names and migrates it.
    pub async fn connect(url: &str) -> Result<PgStore, StoreError> {
        PgStore::builder().connect(url).await
    }

    /// The pool, to run the application's own queries on the same database
    /// (and to begin the transactions a same-transaction claim runs in).
    ///
    /// ```no_run
    /// # async fn run(store: idem_runtime::store::sql::PgStore) -> Result<(), sqlx::Error> {
    /// let mut tx = store.pool().begin().await?;
    /// sqlx::query("UPDATE stock SET qty = qty - 1 WHERE sku = $1")
    ///     .bind("SKU-1")
    ///     .execute(&mut *tx)
    ///     .await?;
    /// tx.commit().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn pool(&self) -> &PgPool {
        &self.core.pool
    }

    /// Applies the embedded migrations that are not yet recorded in
    /// `idem_schema_migrations`. Idempotent, and safe from several processes
    /// at once: one transaction under `pg_advisory_xact_lock` does it all, so
    /// a second process waits and then finds everything applied. Opening a
    /// store runs it already.
    ///
    /// ```no_run
    /// # async fn run(store: idem_runtime::store::sql::PgStore) -> Result<(), idem_runtime::StoreError> {
    /// store.migrate().await?; // a no-op the second time
    /// # Ok(())
    /// # }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.core.migrate().await
    }

    /// Whether a store error is a lost lock conflict (`40P01` deadlock,
    /// `40001` serialization failure, `55P03` lock not available), so running
    /// the work again may succeed.
    ///
    /// The store retries these itself on its pool. Inside your transaction it
    /// cannot: PostgreSQL has already aborted the whole transaction, so retry
    /// the transaction from the start when this says `true`.
    ///
    /// ```
    /// use idem_runtime::StoreError;
    /// use idem_runtime::store::sql::PgStore;
    ///
    /// let io = StoreError::new("postgres", "db:5432/orders", std::io::Error::other("reset"));
    /// assert!(!PgStore::is_retryable(&io));
    /// ```
    pub fn is_retryable(error: &StoreError) -> bool {
        super::store::is_retryable::<Postgres>(error)
    }
}

forward_store!(PgStore => core);

tx_connection! {
    /// Claims on the caller's connection, inside whatever transaction it has open:
    /// the same statements as [`PgStore`], against the same `idem_records` table
    /// (open a [`PgStore`] once at start-up so its migrations have run).
    ///
    /// A duplicate's claim waits on the record's unique index while the first
    /// transaction is open, then replays what it committed (or claims the key if
    /// it rolled back); the claim is an upsert, so it never aborts the caller's
    /// transaction. Run the transaction at READ COMMITTED (PostgreSQL's default):
    /// at REPEATABLE READ or above, PostgreSQL reports that wait as a
    /// serialization failure instead.
    ///
    /// A claim that finds the record held (DONE, or another owner's live lease)
    /// answers from it in the claim's one statement, without locking it (see
    /// `CLAIM`), so a replay adds one statement to the transaction and replays
    /// of a hot key do not queue behind each other's transactions; only a claim
    /// that takes the row holds its lock until the caller's transaction ends.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idem_runtime::store::tx::{AsTxConnection, TxConnection};
    /// use idem_runtime::Key;
    /// use idem_runtime::store::{Claim, ClaimRequest, Token};
    ///
    /// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// let key = Key::builder("orders::create").part("c-1").finish();
    /// let mut tx = pool.begin().await?;
    /// let req = ClaimRequest {
    ///     key: &key,
    ///     token: Token::random(),
    ///     fingerprint: None,
    ///     lease: Duration::from_secs(30),
    ///     ttl: Duration::from_secs(24 * 3600),
    /// };
    /// if let Claim::Acquired { .. } = tx.tx_connection().claim(req).await? {
    ///     // … the business writes on `&mut *tx`, then complete on the same connection …
    /// }
    /// tx.commit().await?; // the record commits with them, or not at all
    /// # Ok(())
    /// # }
    /// ```
    PgConnection => Postgres, SystemClock
}

fn key(key: &Key) -> &[u8] {
    &key.as_bytes()[..]
}

/// CLAIM or TAKE, which take the same parameters.
fn claim_query<'q>(
    sql: &'q str,
    req: &'q ClaimRequest<'_>,
    done: Option<Completion<'q>>,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(key(req.key))
        .bind(&req.token.as_bytes()[..])
        .bind(millis(req.lease))
        .bind(millis(req.ttl))
        .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
        .bind(claimed_state(done) as i16)
        .bind(done.map(|d| i16::from(d.outcome.code())))
        .bind(done.map(|d| d.payload))
}

fn won(row: &sqlx::postgres::PgRow) -> Result<Won, sqlx::Error> {
    Ok(Won {
        fence: row.try_get("fence")?,
        takeover: row.try_get("taken_over")?,
        lease_until: row.try_get("lease_until")?,
        now: row.try_get("now")?,
    })
}

impl Dialect for Postgres {
    const BACKEND: &'static str = "postgres";

    /// No: CLAIM reads first itself (its `NOT EXISTS`, and the record it
    /// answers with), in the same round trip.
    const READ_FIRST: bool = false;

    async fn read(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
    ) -> Result<Option<Record>, sqlx::Error> {
        let row = sqlx::query(READ).bind(key(k)).fetch_optional(conn).await?;
        row.map(|r| Record::decode(&r, r.try_get("now")?))
            .transpose()
    }

    async fn upsert(
        conn: &mut PgConnection,
        _: &dyn Clock,
        req: ClaimRequest<'_>,
        done: Option<Completion<'_>>,
    ) -> Result<Upserted, sqlx::Error> {
        if done.is_some()
            && let Some(row) = claim_query(INSERT_DONE, &req, done)
                .fetch_optional(&mut *conn)
                .await?
        {
            return won(&row).map(Upserted::Won);
        }
        let Some(row) = claim_query(CLAIM, &req, done)
            .fetch_optional(&mut *conn)
            .await?
        else {
            return Ok(Upserted::Lost(None));
        };
        if row.try_get("won")? {
            return won(&row).map(Upserted::Won);
        }
        let record = Record::decode(&row, row.try_get("now")?)?;
        if record.holds_off(req.token) {
            return Ok(Upserted::Lost(Some(record)));
        }
        match claim_query(TAKE, &req, done).fetch_optional(conn).await? {
            Some(row) => won(&row).map(Upserted::Won),
            None => Ok(Upserted::Lost(None)),
        }
    }

    async fn complete(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(COMPLETE)
            .bind(i16::from(completion.outcome.code()))
            .bind(completion.payload)
            .bind(millis(completion.ttl))
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn completed_by(
        conn: &mut PgConnection,
        k: &Key,
        token: Token,
    ) -> Result<bool, sqlx::Error> {
        let found = sqlx::query(COMPLETED_BY)
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .fetch_optional(conn)
            .await?;
        Ok(found.is_some())
    }

    async fn release(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        done_too: bool,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RELEASE)
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .bind(released_up_to(done_too) as i16)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RENEW)
            .bind(millis(lease))
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn evict(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        nobody: Token,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(EVICT)
            .bind(key(k))
            .bind(&nobody.as_bytes()[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge(conn: &mut PgConnection, _: &dyn Clock, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(PURGE).bind(limit).execute(conn).await?;
        Ok(done.rows_affected())
    }

    async fn stats(
        conn: &mut PgConnection,
        _: &dyn Clock,
    ) -> Result<crate::store::RecordStats, sqlx::Error> {
        let sql = format!(
            "{}{}",
            with_clock!(),
            super::store::stats_sql("clock.now", "idem_records CROSS JOIN clock")
        );
        let row = sqlx::query_as(&sql).fetch_one(conn).await?;
        Ok(super::store::stats_of(row))
    }

    async fn keep_args(
        conn: &mut PgConnection,
        k: &Key,
        token: Token,
        args: RecoveryArgs<'_>,
        takeover: bool,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(KEEP_ARGS)
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .bind(args.scope.as_bytes())
            .bind(args.args)
            .bind(takeover)
            .execute(conn)
            .await
            .map(drop)
    }

    async fn recovery_scopes(
        conn: &mut PgConnection,
        _: &dyn Clock,
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        sqlx::query_scalar(RECOVERY_SCOPES).fetch_all(conn).await
    }

    async fn abandoned(
        conn: &mut PgConnection,
        _: &dyn Clock,
        scope: &str,
        limit: i64,
    ) -> Result<Vec<Abandoned>, sqlx::Error> {
        let rows = sqlx::query(ABANDONED)
            .bind(scope.as_bytes())
            .bind(limit)
            .fetch_all(conn)
            .await?;
        rows.iter().map(recovery::abandoned).collect()
    }

    async fn take_recovery(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        turn: RecoveryTurn<'_>,
    ) -> Result<Turn, sqlx::Error> {
        let after: Option<(i64, bool)> = sqlx::query_as(TAKE_TURN)
            .bind(key(k))
            .bind(i64::try_from(turn.fence).unwrap_or(i64::MAX))
            .bind(recovery::limit(&turn))
            .bind(turn.note.as_bytes())
            .bind(millis(turn.retry_in))
            .fetch_optional(conn)
            .await?;
        Ok(recovery::turn(after))
    }

    async fn recovery_info(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
    ) -> Result<Option<RecoveryInfo>, sqlx::Error> {
        let row = sqlx::query(RECOVERY_INFO)
            .bind(key(k))
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(recovery::info).transpose()
    }

    async fn retry_recovery(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RETRY_RECOVERY)
            .bind(key(k))
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_recovery(conn: &mut PgConnection, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(PURGE_RECOVERY)
            .bind(limit)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }

    /// One transaction under `pg_advisory_xact_lock` does it all: DDL is
    /// transactional here, so a second process waits and then finds
    /// everything applied.
    async fn migrate(conn: &mut PoolConnection<Postgres>) -> Result<(), sqlx::Error> {
        let mut tx = conn.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(schema_migrations::POSTGRES_LOCK)
            .execute(&mut *tx)
            .await?;
        // Checked rather than `CREATE TABLE IF NOT EXISTS`, which logs a notice
        // at every start; the lock makes check-then-create safe.
        let has_ledger: bool =
            sqlx::query_scalar("SELECT to_regclass('idem_schema_migrations') IS NOT NULL")
                .fetch_one(&mut *tx)
                .await?;
        if !has_ledger {
            sqlx::query(schema_migrations::POSTGRES_LEDGER)
                .execute(&mut *tx)
                .await?;
        }
        let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM idem_schema_migrations")
            .fetch_all(&mut *tx)
            .await?;
        for m in schema_migrations::POSTGRES {
            if applied.contains(&m.version) {
                continue;
            }
            // A bare string runs as a simple query, so a migration may hold
            // several statements. (`sqlx::raw_sql` would too, but its future
            // is not `Send` for every lifetime.)
            tx.execute(m.sql).await?;
            sqlx::query(concat!(
                "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES ($1, $2, ",
                server_now!(),
                ")"
            ))
            .bind(m.version)
            .bind(m.description)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await
    }

    fn is_retryable(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Database(db) => {
                matches!(db.code().as_deref(), Some("40P01" | "40001" | "55P03"))
            }
            _ => false,
        }
    }

    async fn commit_refused(conn: &mut PgConnection) -> Result<Option<&'static str>, sqlx::Error> {
        // sqlx keeps the server's transaction status ('E' in ReadyForQuery)
        // to itself, so ask: in an aborted transaction every statement fails
        // with 25P02 until it ends.
        match conn.execute("SELECT 1").await {
            Ok(_) => Ok(None),
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("25P02") => Ok(Some(
                "the transaction was aborted by an earlier failed statement: \
                 PostgreSQL would roll it back at COMMIT",
            )),
            Err(e) => Err(e),
        }
    }
}
