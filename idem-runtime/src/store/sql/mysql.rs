//! The MySQL / MariaDB store: records in an InnoDB table through sqlx, on the
//! server's clock.
//!
//! A plain read answers a replay or a Busy claim without locking anything; only
//! a record that may be taken goes on to one `INSERT … ON DUPLICATE KEY UPDATE`
//! whose assignments decide, on the old row, whether the caller may take it,
//! and a locking read then tells the caller what it got. There is no `INSERT IGNORE` (it turns truncation and NULL
//! errors into warnings) and no caught duplicate-key error anywhere.
//!
//! The same statements run on a pooled connection ([`MySqlStore`]) or on the
//! caller's own transaction ([`TxConnection`] for [`MySqlConnection`]), so the
//! record commits or rolls back with the business writes.

use std::future::Future;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::mysql::{
    MySqlConnectOptions, MySqlConnection, MySqlDatabaseError, MySqlPool, MySqlPoolOptions, MySqlRow,
};
use sqlx::{Connection as _, Row as _};

use super::migrate;
use crate::clock::duration_millis;
use crate::error::StoreError;
use crate::key::{Fingerprint, Key};
use crate::store::tx::TxConnection;
use crate::store::{
    AsStore, Claim, ClaimRequest, Completion, DEFAULT_MAX_RESULT_BYTES, Outcome, RecordInfo,
    RecordState, Store, StoreRef, StoredResult, Token,
};

const BACKEND: &str = "mysql";
const RELEASED: i64 = 0;
const PROCESSING: i64 = 1;
const DONE: i64 = 2;

/// `ER_LOCK_DEADLOCK`: InnoDB chose this statement's transaction as a deadlock
/// victim and rolled it back.
const ER_LOCK_DEADLOCK: u16 = 1213;
/// `ER_LOCK_WAIT_TIMEOUT`: a row lock was not granted within
/// `innodb_lock_wait_timeout`.
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// How many times the pool path runs an operation that lost a lock conflict.
const MAX_ATTEMPTS: u32 = 6;

/// How many upsert-then-read rounds a claim makes before giving up on a record
/// that keeps changing under it.
const CLAIM_ROUNDS: usize = 8;

/// A user-level lock (`GET_LOCK`) serialises migrations across processes: MySQL
/// DDL commits implicitly, so a transaction cannot do it.
const MIGRATION_LOCK: &str = "idem_migrations";
const MIGRATION_LOCK_WAIT_SECS: i64 = 60;

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
//    was).
//
// The `claimable!` tests use the statement's start time: a lease that ran out
// while this statement waited on the row's lock looks live, and the claim
// reports Busy or tries again, never a takeover too early. The lease and
// expiry a winner writes count from when it got the row (`waited_ms!`), not
// from when it began to wait. An INSERT that waited on another transaction's
// uncommitted insert of the key (rolled back since) has no such hook: its
// VALUES were computed before the wait, and `claim_on` restarts that lease.
//
// The winner is then told apart by the locking read: PROCESSING under our
// token.
const CLAIM: &str = concat!(
    "INSERT INTO idem_records
    (`key`, state, token, fence, lease_until, expires_at, fingerprint, taken_over, outcome, result)
VALUES (?, 1, ?, 1, ",
    now_ms!(),
    " + ?, ",
    now_ms!(),
    " + ?, ?, FALSE, NULL, NULL)
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
    expires_at  = IF(",
    won!(),
    ", VALUES(expires_at) + ",
    waited_ms!(),
    ", expires_at)"
);

macro_rules! select_record {
    () => {
        concat!(
            "SELECT state, token, fence, taken_over, lease_until, expires_at, fingerprint,
                    outcome, result, ",
            clock_ms!(),
            " AS now
             FROM idem_records WHERE `key` = ?"
        )
    };
}

/// A plain consistent read: it takes no lock and waits for none. Inside a
/// caller's REPEATABLE READ transaction it may show an older version of the
/// row (the transaction's snapshot); see `claim_on` for why that is safe.
const COMPLETED_BY: &str = "SELECT 1 FROM idem_records WHERE `key` = ? AND state = 2 AND token = ?";

const READ: &str = select_record!();

/// After the claim's upsert: a locking read returns the latest committed row,
/// not the snapshot a REPEATABLE READ transaction may already hold (which
/// could predate a duplicate's commit). Inside a transaction the upsert already
/// holds the row's exclusive lock, so this waits for nothing; on the pool it
/// is a shared lock held for one statement.
const READ_LOCKED: &str = concat!(select_record!(), " LOCK IN SHARE MODE");

const COMPLETE: &str = concat!(
    "UPDATE idem_records SET state = 2, outcome = ?, result = ?, expires_at = ",
    clock_ms!(),
    " + ?
     WHERE `key` = ? AND state = 1 AND token = ?"
);

// A released record also expires at once, so purging finds it through the
// `expires_at` index like any other dead record; the row (and its fence) stays
// until then, and a claim takes it either way.
const RELEASE: &str = concat!(
    "UPDATE idem_records SET state = 0, expires_at = LEAST(expires_at, ",
    clock_ms!(),
    ") WHERE `key` = ? AND state = 1 AND token = ?"
);

// The lease counts from when the row was locked (the UPDATE computes its SET
// list after that). Expiry is kept at least as far as the lease: a body may run
// past its ttl, and while it heartbeats its record must not expire under it.
// The lease is bound twice rather than read back from `lease_until`, so the
// statement does not depend on the order MariaDB's SIMULTANEOUS_ASSIGNMENT
// mode would change; the second clock reading is never the earlier one.
const RENEW: &str = concat!(
    "UPDATE idem_records SET lease_until = ",
    clock_ms!(),
    " + ?, expires_at = GREATEST(expires_at, ",
    clock_ms!(),
    " + ?)
     WHERE `key` = ? AND state = 1 AND token = ? AND expires_at > ",
    clock_ms!()
);

const EVICT: &str = "DELETE FROM idem_records WHERE `key` = ?";

// Dead records are exactly those with `expires_at` in the past (released ones
// included, see RELEASE), so the batch is a range of the `expires_at` index,
// read in its order and never the whole table. SKIP LOCKED: a row another
// transaction holds (a claim re-taking it, another replica's sweeper) is left
// to it instead of waited on. MySQL accepts neither a LIMIT in an `IN`
// subquery nor SKIP LOCKED on a DELETE, so the batch is locked here and
// deleted by key (PURGE_DELETE) in the same READ COMMITTED transaction, which
// takes no gap locks. Needs MySQL 8.0.1 or MariaDB 10.6 (SKIP LOCKED).
const PURGE_SELECT: &str = concat!(
    "SELECT `key` FROM idem_records WHERE expires_at <= ",
    now_ms!(),
    " ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
);

const PURGE_DELETE: &str = "DELETE FROM idem_records WHERE `key` IN ";

/// Records in MySQL or MariaDB (InnoDB): durable, shared by every process that
/// uses the database, on the server's clock.
///
/// Opening applies the embedded migrations (recorded in
/// `idem_schema_migrations`, under a `GET_LOCK` so concurrent processes migrate
/// safely). A statement that loses a deadlock or a lock wait is retried a few
/// times with a short random backoff (a purge is not: it skips locked rows,
/// and the sweeper runs it again next round). Purging needs SKIP LOCKED:
/// MySQL 8.0.1 or MariaDB 10.6 and later. To claim inside your own transaction, see
/// the [`TxConnection`] implementation for [`MySqlConnection`].
///
/// ```no_run
/// use idem_runtime::store::sql::MySqlStore;
///
/// # async fn demo() -> Result<(), idem_runtime::StoreError> {
/// let store = MySqlStore::connect("mysql://app:secret@127.0.0.1:3306/orders").await?;
/// idem_runtime::install(store);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    max_result_bytes: usize,
    location: std::sync::Arc<str>,
}

/// Configures a [`MySqlStore`].
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::store::sql::MySqlStore;
///
/// # async fn demo() -> Result<(), idem_runtime::StoreError> {
/// let store = MySqlStore::builder()
///     .max_connections(32)
///     .acquire_timeout(Duration::from_secs(2))
///     .max_result_bytes(256 * 1024)
///     .connect("mysql://app:secret@db.internal:3306/orders")
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct MySqlStoreBuilder {
    max_result_bytes: usize,
    max_connections: u32,
    acquire_timeout: Duration,
    migrate: bool,
}

impl MySqlStoreBuilder {
    /// The largest result kept (default 1 MiB). Keep it under the server's
    /// `max_allowed_packet`.
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::MySqlStore::builder().max_result_bytes(64 * 1024);
    /// # drop(builder);
    /// ```
    pub fn max_result_bytes(mut self, limit: usize) -> Self {
        self.max_result_bytes = limit;
        self
    }

    /// The pool's size when the store opens its own (default 10).
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::MySqlStore::builder().max_connections(32);
    /// # drop(builder);
    /// ```
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long a call waits for a connection when the store opens its own
    /// pool, reconnects to a refusing server included, before failing closed
    /// with a store error (default 5 s; sqlx's own default of 30 s is long for a
    /// request path).
    ///
    /// ```
    /// use std::time::Duration;
    /// let builder = idem_runtime::store::sql::MySqlStore::builder()
    ///     .acquire_timeout(Duration::from_secs(1));
    /// # drop(builder);
    /// ```
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Whether opening applies the embedded migrations (default `true`). Turn it
    /// off when the database user may not run DDL and the schema is applied at
    /// deploy time with [`MySqlStore::migrate`].
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::MySqlStore::builder().migrate(false);
    /// # drop(builder);
    /// ```
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Connects to the database a `mysql://` URL names and migrates it.
    ///
    /// Errors name `host:port/database`, never the URL (it may hold a password).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_runtime::StoreError> {
    /// let store = idem_runtime::store::sql::MySqlStore::builder()
    ///     .connect("mysql://app:secret@127.0.0.1:3306/orders")
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(self, url: &str) -> Result<MySqlStore, StoreError> {
        // Not the URL in the error: it may carry a password. sqlx's parse error
        // does not quote it either.
        let options = MySqlConnectOptions::from_str(url)
            .map_err(|e| StoreError::new(BACKEND, "(unparsable mysql URL)", e))?;
        self.connect_with(options).await
    }

    /// Connects with explicit options and migrates.
    ///
    /// ```no_run
    /// use sqlx::mysql::MySqlConnectOptions;
    ///
    /// # async fn demo() -> Result<(), idem_runtime::StoreError> {
    /// let options = MySqlConnectOptions::new()
    ///     .host("127.0.0.1")
    ///     .username("app")
    ///     .database("orders");
    /// let store = idem_runtime::store::sql::MySqlStore::builder()
    ///     .connect_with(options)
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect_with(
        self,
        options: MySqlConnectOptions,
    ) -> Result<MySqlStore, StoreError> {
        let location = location(&options);
        let pool = MySqlPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .connect_with(options.clone())
            .await;
        let pool = match pool {
            Ok(pool) => pool,
            // The pool retries refused connections until its timeout and then
            // reports only that it timed out. One direct attempt recovers the
            // reason (refused, unknown host, access denied) for the operator.
            Err(sqlx::Error::PoolTimedOut) => {
                let why = match MySqlConnection::connect_with(&options).await {
                    Err(e) => e,
                    Ok(_) => sqlx::Error::PoolTimedOut,
                };
                return Err(StoreError::new(BACKEND, location, why));
            }
            Err(e) => return Err(StoreError::new(BACKEND, location, e)),
        };
        self.finish(pool, location).await
    }

    /// Uses a pool the application already has (its size and timeouts apply)
    /// and migrates it.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::MySqlPool::connect("mysql://app@127.0.0.1:3306/orders").await?;
    /// let store = idem_runtime::store::sql::MySqlStore::builder().pool(pool.clone()).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn pool(self, pool: MySqlPool) -> Result<MySqlStore, StoreError> {
        let location = location(&pool.connect_options());
        self.finish(pool, location).await
    }

    async fn finish(self, pool: MySqlPool, location: String) -> Result<MySqlStore, StoreError> {
        let store = MySqlStore {
            pool,
            max_result_bytes: self.max_result_bytes,
            location: location.into(),
        };
        if self.migrate {
            store.migrate().await?;
        }
        Ok(store)
    }
}

impl MySqlStore {
    /// Configures a store.
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::MySqlStore::builder();
    /// # drop(builder);
    /// ```
    pub fn builder() -> MySqlStoreBuilder {
        MySqlStoreBuilder {
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            migrate: true,
        }
    }

    /// Connects to the database a `mysql://` URL names and migrates it.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_runtime::StoreError> {
    /// let store = idem_runtime::store::sql::MySqlStore::connect("mysql://app@127.0.0.1/orders").await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<MySqlStore, StoreError> {
        MySqlStore::builder().connect(url).await
    }

    /// The pool, to run the application's own queries (and transactions) on the
    /// same database.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_runtime::store::sql::MySqlStore) -> Result<(), sqlx::Error> {
    /// let mut tx = store.pool().begin().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Applies the embedded migrations that are not yet recorded in
    /// `idem_schema_migrations`. Idempotent, and safe from several processes
    /// at once: they take turns under `GET_LOCK('idem_migrations', 60)`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_runtime::StoreError> {
    /// // Deploy time, with a user allowed to run DDL:
    /// let store = idem_runtime::store::sql::MySqlStore::connect("mysql://admin@db/orders").await?;
    /// store.migrate().await?; // already done by `connect`; running it again is a no-op
    /// # Ok(())
    /// # }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        // The lock belongs to the session. Closing this connection afterwards
        // (instead of returning it to the pool) frees the lock even when this
        // future is dropped halfway.
        conn.close_on_drop();
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(MIGRATION_LOCK)
            .bind(MIGRATION_LOCK_WAIT_SECS)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        if locked != Some(1) {
            return Err(StoreError::new(
                BACKEND,
                &*self.location,
                format!(
                    "could not take the migration lock `{MIGRATION_LOCK}` within {MIGRATION_LOCK_WAIT_SECS} s; another process is migrating"
                ),
            ));
        }
        let applied = apply_migrations(&mut conn).await;
        let unlocked = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(MIGRATION_LOCK)
            .execute(&mut *conn)
            .await;
        applied.map_err(|e| self.err(e))?;
        unlocked.map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Whether a store error is a lost lock conflict (InnoDB deadlock 1213, or
    /// lock wait timeout 1205), so running the work again may succeed.
    ///
    /// The store retries these itself on its pool. Inside your transaction it
    /// cannot: a deadlock has already rolled the whole transaction back, so
    /// retry the transaction from the start when this says `true`.
    ///
    /// ```
    /// use idem_runtime::StoreError;
    /// use idem_runtime::store::sql::MySqlStore;
    ///
    /// let io = StoreError::new("mysql", "db:3306/orders", std::io::Error::other("reset"));
    /// assert!(!MySqlStore::is_retryable(&io));
    /// ```
    pub fn is_retryable(error: &StoreError) -> bool {
        std::error::Error::source(error)
            .and_then(|s| s.downcast_ref::<sqlx::Error>())
            .is_some_and(is_transient)
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        StoreError::new(BACKEND, &*self.location, e)
    }

    /// Runs `op` again (a bounded number of times, after a short random pause)
    /// when it lost a deadlock or a lock wait. On the pool each statement is its
    /// own transaction, so the loser's effects are already rolled back and a
    /// claim re-sent under the same token is recognised as the same claim.
    async fn retrying<T, F, Fut>(&self, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let mut attempt = 1;
        loop {
            match op().await {
                Err(e) if attempt < MAX_ATTEMPTS && is_transient(&e) => {
                    tracing::debug!(error = %e, attempt, "mysql lock conflict; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                }
                done => return done.map_err(|e| self.err(e)),
            }
        }
    }
}

async fn apply_migrations(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(migrate::MYSQL_LEDGER)
        .execute(&mut *conn)
        .await?;
    for m in migrate::MYSQL {
        let applied: Option<i64> =
            sqlx::query_scalar("SELECT version FROM idem_schema_migrations WHERE version = ?")
                .bind(m.version)
                .fetch_optional(&mut *conn)
                .await?;
        if applied.is_some() {
            continue;
        }
        // DDL commits implicitly: the migration and its ledger row cannot share
        // a transaction. The migrations are written to be re-runnable, so a
        // crash between the two only repeats a no-op next time.
        sqlx::raw_sql(m.sql).execute(&mut *conn).await?;
        sqlx::query(concat!(
            "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES (?, ?, ",
            now_ms!(),
            ")"
        ))
        .bind(m.version)
        .bind(m.description)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// `host:port/database` (or the socket path): the parts of the options that
/// are safe to log. Never the user or the password.
fn location(options: &MySqlConnectOptions) -> String {
    let database = options.get_database().unwrap_or("");
    match options.get_socket() {
        Some(socket) => format!("unix:{}/{database}", socket.display()),
        None if options.get_host().contains(':') => {
            format!("[{}]:{}/{database}", options.get_host(), options.get_port())
        }
        None => format!("{}:{}/{database}", options.get_host(), options.get_port()),
    }
}

/// Whether `e` is a lost lock conflict worth running again.
fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|m| is_transient_code(m.number())),
        _ => false,
    }
}

fn is_transient_code(number: u16) -> bool {
    matches!(number, ER_LOCK_DEADLOCK | ER_LOCK_WAIT_TIMEOUT)
}

/// Full jitter over a doubling window (5, 10, 20, … ms): the transactions that
/// deadlocked together must not meet again in lockstep.
fn backoff(attempt: u32) -> Duration {
    let window = 5u64 << attempt.min(6);
    Duration::from_millis(1 + rand::random::<u64>() % window)
}

/// Lease and ttl in milliseconds, kept far enough from `i64::MAX` that adding
/// the server's "now" cannot overflow BIGINT (strict mode would reject it).
fn millis(d: Duration) -> i64 {
    duration_millis(d).min(i64::MAX / 2)
}

/// A record as read back, with the server's time of the read.
struct Record {
    state: i64,
    token: Vec<u8>,
    fence: i64,
    taken_over: bool,
    lease_until: i64,
    expires_at: i64,
    fingerprint: Option<Fingerprint>,
    result: Option<(Outcome, Vec<u8>)>,
    now: i64,
}

impl Record {
    fn decode(r: &MySqlRow) -> Result<Record, sqlx::Error> {
        let fingerprint: Option<Vec<u8>> = r.try_get("fingerprint")?;
        let fingerprint = fingerprint
            .map(|b| <[u8; 32]>::try_from(b.as_slice()).map(Fingerprint::from_bytes))
            .transpose()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
        let outcome: Option<i64> = r.try_get("outcome")?;
        let payload: Option<Vec<u8>> = r.try_get("result")?;
        let result = match outcome {
            None => None,
            Some(code) => Some((
                Outcome::from_code(code).ok_or_else(|| corrupt("unknown outcome code"))?,
                payload.unwrap_or_default(),
            )),
        };
        Ok(Record {
            state: r.try_get("state")?,
            token: r.try_get("token")?,
            fence: r.try_get("fence")?,
            taken_over: r.try_get("taken_over")?,
            lease_until: r.try_get("lease_until")?,
            expires_at: r.try_get("expires_at")?,
            fingerprint,
            result,
            now: r.try_get("now")?,
        })
    }

    fn live(&self) -> bool {
        self.state != RELEASED && self.expires_at > self.now
    }

    fn stored(self) -> Option<StoredResult> {
        let fingerprint = self.fingerprint;
        self.result.map(|(outcome, payload)| StoredResult {
            fingerprint,
            outcome,
            payload,
        })
    }
}

fn corrupt(what: &'static str) -> sqlx::Error {
    sqlx::Error::Decode(what.into())
}

fn remaining(until: i64, now: i64) -> Duration {
    Duration::from_millis(u64::try_from(until.saturating_sub(now)).unwrap_or(0))
}

fn fence(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

// The statements, on one connection: a pooled one for the store, or the
// caller's inside its transaction (`TxConnection`). Neither retries here: the
// pool path wraps them in `retrying`, the transaction path must not (see
// `MySqlStore::is_retryable`).

async fn read_on(
    conn: &mut MySqlConnection,
    sql: &'static str,
    key: &Key,
) -> Result<Option<Record>, sqlx::Error> {
    sqlx::query(sql)
        .bind(&key.as_bytes()[..])
        .fetch_optional(&mut *conn)
        .await?
        .map(|r| Record::decode(&r))
        .transpose()
}

/// What a record tells a claimant without being taken: a replay, or Busy.
fn held(row: Record, token: Token) -> Result<Option<Claim>, sqlx::Error> {
    if !row.live() {
        return Ok(None);
    }
    match row.state {
        DONE => row
            .stored()
            .map(|stored| Some(Claim::Done(stored)))
            .ok_or_else(|| corrupt("a DONE record without an outcome")),
        PROCESSING if row.lease_until > row.now && row.token != token.0 => Ok(Some(Claim::Busy {
            lease_remaining: remaining(row.lease_until, row.now),
            fingerprint: row.fingerprint,
        })),
        _ => Ok(None),
    }
}

/// Whether a lease written at its statement's start lost more than a tenth of
/// itself before `now`: the claim waited on a lock, and its lease must start
/// again. A smaller loss is the round trip and the statement's own run time.
fn began_long_ago(lease_until: i64, lease: Duration, now: i64) -> bool {
    let started = lease_until.saturating_sub(millis(lease));
    now.saturating_sub(started).saturating_mul(10) > millis(lease)
}

async fn claim_on(conn: &mut MySqlConnection, req: ClaimRequest<'_>) -> Result<Claim, sqlx::Error> {
    // The upsert, even one that changes nothing, locks the row until the
    // transaction ends: inside a caller's transaction, every replay of a hot
    // key would queue behind the others, two transactions replaying two keys
    // in opposite orders would deadlock, and a duplicate told Busy would block
    // the owner's renewals and completion. So a plain read comes first, and a
    // record that may not be taken (DONE, or another owner's live lease) is
    // answered from it without a lock. In a REPEATABLE READ transaction that
    // read is the transaction's snapshot and may be old: an old DONE is still
    // the key's result (a DONE record only ever expires), and an old Busy is an
    // answer the owner could have given a moment earlier. Anything else
    // (absent, expired, released, a lease run out) goes on to the upsert, which
    // sees the latest committed row.
    //
    // The upsert and the reads are separate statements. A row that was
    // evicted, released or whose lease ran out in between is simply claimed
    // next round.
    for _ in 0..CLAIM_ROUNDS {
        if let Some(row) = read_on(conn, READ, req.key).await?
            && let Some(answer) = held(row, req.token)?
        {
            return Ok(answer);
        }
        sqlx::query(CLAIM)
            .bind(&req.key.as_bytes()[..])
            .bind(&req.token.0[..])
            .bind(millis(req.lease))
            .bind(millis(req.ttl))
            .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .execute(&mut *conn)
            .await?;
        let Some(row) = read_on(conn, READ_LOCKED, req.key).await? else {
            continue;
        };
        if row.state == PROCESSING && row.token == req.token.0 {
            // On the pool the row is already committed, so another caller may
            // take a lease that began too long ago before it is renewed: then
            // the renewal finds it gone and the next round says who holds it.
            if began_long_ago(row.lease_until, req.lease, row.now)
                && !renew_on(conn, req.key, req.token, req.lease).await?
            {
                continue;
            }
            return Ok(Claim::Acquired {
                fence: fence(row.fence),
                takeover: row.taken_over,
            });
        }
        if let Some(answer) = held(row, req.token)? {
            return Ok(answer);
        }
    }
    Err(sqlx::Error::Protocol(format!(
        "the record kept changing under {CLAIM_ROUNDS} claim attempts in a row"
    )))
}

async fn complete_on(
    conn: &mut MySqlConnection,
    key: &Key,
    token: Token,
    completion: Completion<'_>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(COMPLETE)
        .bind(i64::from(completion.outcome.code()))
        .bind(completion.payload)
        .bind(millis(completion.ttl))
        .bind(&key.as_bytes()[..])
        .bind(&token.0[..])
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() == 1 {
        return Ok(true);
    }
    // A completion re-sent after a dropped connection finds the record DONE
    // under its own token: the success it was, not a lost claim.
    let completed_by_us = sqlx::query(COMPLETED_BY)
        .bind(&key.as_bytes()[..])
        .bind(&token.0[..])
        .fetch_optional(&mut *conn)
        .await?;
    Ok(completed_by_us.is_some())
}

async fn renew_on(
    conn: &mut MySqlConnection,
    key: &Key,
    token: Token,
    lease: Duration,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(RENEW)
        .bind(millis(lease))
        .bind(millis(lease))
        .bind(&key.as_bytes()[..])
        .bind(&token.0[..])
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// One purge batch, in its own READ COMMITTED transaction (see PURGE_SELECT).
async fn purge_on(conn: &mut MySqlConnection, limit: i64) -> Result<u64, sqlx::Error> {
    // Applies to the next transaction only: the connection keeps its level.
    sqlx::query("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *conn)
        .await?;
    let mut tx = conn.begin().await?;
    let keys: Vec<Vec<u8>> = sqlx::query_scalar(PURGE_SELECT)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
    if keys.is_empty() {
        tx.commit().await?;
        return Ok(0);
    }
    let sql = format!("{PURGE_DELETE}({})", vec!["?"; keys.len()].join(", "));
    let mut delete = sqlx::query(&sql);
    for key in &keys {
        delete = delete.bind(key);
    }
    let done = delete.execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(done.rows_affected())
}

async fn release_on(
    conn: &mut MySqlConnection,
    key: &Key,
    token: Token,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(RELEASE)
        .bind(&key.as_bytes()[..])
        .bind(&token.0[..])
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

#[async_trait]
impl Store for MySqlStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn max_result_bytes(&self) -> usize {
        self.max_result_bytes
    }

    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.retrying(|| async move {
            let mut conn = self.pool.acquire().await?;
            claim_on(&mut conn, req).await
        })
        .await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        self.retrying(|| async move {
            let mut conn = self.pool.acquire().await?;
            complete_on(&mut conn, key, token, completion).await
        })
        .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        self.retrying(|| async move {
            let mut conn = self.pool.acquire().await?;
            release_on(&mut conn, key, token).await
        })
        .await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        self.retrying(|| async move {
            let mut conn = self.pool.acquire().await?;
            renew_on(&mut conn, key, token, lease).await
        })
        .await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        let Some(row) = read_on(&mut conn, READ, key)
            .await
            .map_err(|e| self.err(e))?
            .filter(Record::live)
        else {
            return Ok(None);
        };
        let (state, lease_until_millis) = match row.state {
            PROCESSING => (RecordState::Processing, row.lease_until),
            _ => (RecordState::Done, 0),
        };
        let (f, expires_at_millis) = (fence(row.fence), row.expires_at);
        Ok(Some(RecordInfo {
            state,
            fence: f,
            lease_until_millis,
            expires_at_millis,
            result: row.stored(),
        }))
    }

    async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
        self.retrying(|| async move {
            let done = sqlx::query(EVICT)
                .bind(&key.as_bytes()[..])
                .execute(&self.pool)
                .await?;
            Ok(done.rows_affected() == 1)
        })
        .await
    }

    /// Not retried: SKIP LOCKED leaves nothing to wait for, and a purge that
    /// still fails is the sweeper's to run again next round, not something to
    /// hold a connection for now.
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        purge_on(&mut conn, limit).await.map_err(|e| self.err(e))
    }
}

impl AsStore for MySqlStore {
    fn as_store(&self) -> StoreRef {
        StoreRef::new(self.clone())
    }
}

/// Claims inside the caller's MySQL/MariaDB transaction
/// (`#[idempotent(tx = tx)]`): the record commits or rolls back with the
/// business writes, on the `idem_records` table [`MySqlStore`] migrates.
///
/// A replay (a DONE record) and a Busy answer (another owner's live lease) come
/// from a plain read and take no lock, so they never queue behind, block, or
/// deadlock with other transactions. A claim that takes the record upserts
/// it, and holds its row lock until this transaction ends: a concurrent
/// duplicate waits on it, then replays what this transaction committed or
/// claims the key if it rolled back.
///
/// Nothing is retried here: a deadlock has already rolled the caller's
/// transaction back, so the error goes to the caller, and
/// [`MySqlStore::is_retryable`] says whether to run the transaction again.
/// InnoDB can still deadlock where two transactions each take a row (claims of
/// two new keys in opposite orders), and where two or more duplicates wait on
/// one transaction's claim of a key that did not exist before and that
/// transaction rolls back: their inserts then meet on the key's gap, and
/// InnoDB rolls one of them back with 1213.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::{Claim, ClaimRequest, Key, Token};
/// use idem_runtime::store::tx::{AsTxConnection, TxConnection};
///
/// # async fn demo(pool: sqlx::MySqlPool) -> Result<(), Box<dyn std::error::Error>> {
/// let key = Key::builder("orders").part("client-order-42").finish();
/// let mut tx = pool.begin().await?;
/// let claim = tx
///     .tx_connection()
///     .claim(ClaimRequest {
///         key: &key,
///         token: Token::random(),
///         fingerprint: None,
///         lease: Duration::from_secs(30),
///         ttl: Duration::from_secs(24 * 3600),
///     })
///     .await?;
/// if let Claim::Acquired { .. } = claim {
///     // business writes on `tx`, then `complete` on `tx`, then:
///     tx.commit().await?;
/// }
/// # Ok(())
/// # }
/// ```
#[async_trait]
impl TxConnection for MySqlConnection {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn in_transaction(&self) -> bool {
        sqlx::Connection::is_in_transaction(self)
    }

    async fn claim(&mut self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        claim_on(self, req).await.map_err(tx_err)
    }

    async fn complete(
        &mut self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        complete_on(self, key, token, completion)
            .await
            .map_err(tx_err)
    }

    async fn release(&mut self, key: &Key, token: Token) -> Result<bool, StoreError> {
        release_on(self, key, token).await.map_err(tx_err)
    }
}

/// A connection does not know the URL it came from; say where it is instead.
fn tx_err(e: sqlx::Error) -> StoreError {
    StoreError::new(BACKEND, "the caller's transaction", e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlocks_and_lock_wait_timeouts_are_retried() {
        assert!(is_transient_code(1213));
        assert!(is_transient_code(1205));
    }

    #[test]
    fn other_errors_are_not_retried() {
        // duplicate key, data too long, NULL into NOT NULL, server gone away
        for n in [1062, 1406, 1048, 2006, 1146] {
            assert!(!is_transient_code(n), "{n}");
        }
        assert!(!is_transient(&sqlx::Error::PoolTimedOut));
        assert!(!is_transient(&sqlx::Error::Io(std::io::Error::other(
            "reset"
        ))));
    }

    #[test]
    fn backoff_stays_short_and_bounded() {
        for attempt in 1..MAX_ATTEMPTS + 4 {
            let d = backoff(attempt);
            assert!(
                d >= Duration::from_millis(1) && d <= Duration::from_millis(321),
                "{d:?}"
            );
        }
    }

    #[test]
    fn location_never_carries_credentials() {
        let o =
            MySqlConnectOptions::from_str("mysql://app:s3cret@db.internal:3307/orders").unwrap();
        assert_eq!(location(&o), "db.internal:3307/orders");
        let o = MySqlConnectOptions::new().host("::1").database("d");
        assert_eq!(location(&o), "[::1]:3306/d");
    }

    /// The purge reads a range of the `expires_at` index, not the table, on a
    /// table where nearly every row is live. Needs the test server
    /// (`IDEM_MYSQL_URL`); says so and passes without it, unless
    /// `IDEM_REQUIRE_SERVICES=1`.
    #[tokio::test]
    async fn purge_walks_the_expires_at_index() {
        use sqlx::Executor as _;

        let url = std::env::var("IDEM_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let admin = match MySqlPool::connect(&url).await {
            Ok(pool) => pool,
            Err(e) if std::env::var("IDEM_REQUIRE_SERVICES").is_ok_and(|v| v == "1") => {
                panic!("MariaDB is unreachable: {e}")
            }
            Err(e) => return eprintln!("SKIPPED: MariaDB is unreachable: {e}"),
        };
        let db = format!("idem_plan_{:016x}", rand::random::<u64>());
        admin
            .execute(format!("CREATE DATABASE `{db}`").as_str())
            .await
            .unwrap();
        let options = MySqlConnectOptions::from_str(&url).unwrap().database(&db);
        let store = MySqlStore::builder().connect_with(options).await.unwrap();
        store
            .pool()
            .execute(
                "INSERT INTO idem_records (`key`, state, token, fence, lease_until, expires_at)
                 WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 500)
                 SELECT UNHEX(SHA2(i, 256)), 2, UNHEX(MD5(i)), 1, 0,
                        IF(i <= 5, 0, 9000000000000 + i)
                 FROM n",
            )
            .await
            .unwrap();
        store
            .pool()
            .execute("ANALYZE TABLE idem_records")
            .await
            .unwrap();
        let plan = sqlx::query(&format!("EXPLAIN {PURGE_SELECT}"))
            .bind(100_i64)
            .fetch_all(store.pool())
            .await
            .unwrap();
        let steps: Vec<(String, Option<String>)> = plan
            .iter()
            .map(|row| {
                let text = |col: &str| {
                    row.try_get::<Option<Vec<u8>>, _>(col)
                        .ok()
                        .flatten()
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .or_else(|| row.try_get::<Option<String>, _>(col).ok().flatten())
                };
                (text("type").unwrap_or_default(), text("key"))
            })
            .collect();
        store.pool().close().await;
        admin
            .execute(format!("DROP DATABASE `{db}`").as_str())
            .await
            .unwrap();
        assert_eq!(
            steps,
            vec![(
                "range".to_owned(),
                Some("idem_records_expires_at".to_owned())
            )]
        );
    }

    #[test]
    fn claim_assigns_token_before_the_columns_that_read_it() {
        // The ordering argument in the comment above CLAIM, checked on the text.
        let pos = |col: &str| {
            CLAIM
                .find(&format!("\n    {col:<11} = IF("))
                .unwrap_or_else(|| panic!("{col} assignment"))
        };
        assert!(pos("fence") < pos("taken_over"));
        assert!(pos("taken_over") < pos("token"));
        for col in ["lease_until", "fingerprint", "outcome", "result", "state"] {
            assert!(pos("token") < pos(col), "{col}");
        }
        assert!(pos("state") < pos("expires_at"));
        assert!(!CLAIM.contains("IGNORE"));
    }
}
