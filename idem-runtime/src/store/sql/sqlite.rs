//! The embedded durable store: SQLite through sqlx, in a file or in memory.
//! The dialect's statements and clock; the algorithms are the shared ones in
//! `store.rs`.
//!
//! # Limits of SQLite
//!
//! What the library (bundled with sqlx) answers at its edges, and what the
//! store, `tx = tx` calls, `Runner::run_in_tx` and the outbox make of it. A row
//! whose test says `none yet` is not checked.
//!
//! | limit or odd answer | what SQLite does | what idem does | test |
//! |---|---|---|---|
//! | one writer at a time | a writer waits up to `busy_timeout` (the store's default: 5 s), then `SQLITE_BUSY`; a read transaction that then writes fails at once with `SQLITE_BUSY_SNAPSHOT` (WAL) | no read before the claim's write (`READ_FIRST` off): a duplicate waits for the writer, then replays or claims | `tests/transaction.rs::sqlite_concurrent_duplicate_waits_for_the_writer_and_replays`, `tests/transaction.rs::sqlite_a_claim_that_waited_for_the_write_lock_starts_its_lease_when_it_wins`, `tests/transaction.rs::sqlite_a_writer_held_past_busy_timeout_fails_the_claim_closed` |
//! | a transaction SQLite ends by itself: `ON CONFLICT ROLLBACK`, `RAISE(ROLLBACK)`, and possibly `SQLITE_FULL`, `SQLITE_IOERR`, `SQLITE_NOMEM`, `SQLITE_BUSY`, `SQLITE_INTERRUPT` | rolls back; the statements after it run in autocommit; `COMMIT` fails (no transaction is active). Only `sqlite3_get_autocommit` tells | `commit_refused` answers `None`; the failed `COMMIT` is `TxError::Commit`: not acked, and the redelivery runs again. What the handler wrote after the rollback (in autocommit) stays, as on MariaDB | `tests/consumer_tx.rs::a_transaction_sqlite_rolled_back_itself_is_not_acked` |
//! | at most 32 766 bound variables per statement | `too many SQL variables` | `outbox::put_all` writes 1 000 messages (5 000 variables) per statement at most; the relay's marks bind at most 10 000 and the token | `tests/outbox/scenarios.rs::a_batch_past_every_statement_cap_is_written_whole` (13 108 messages) |
//! | a string or blob over `SQLITE_MAX_LENGTH` (1 000 000 000 bytes) | `SQLITE_TOOBIG` | results stay under `max_result_bytes` (1 MiB unless set; not capped) | at the 1 MiB cap: `tests/conformance.rs::sqlite_file_store::outcomes_and_payloads_round_trip`; at 1 GB: not tested (a 1 GB value in CI) |

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Connection as _, Executor as _, Row as _, Sqlite, SqliteConnection};

use super::dialect::Dialect;
use super::record::{Record, Upserted, Won, claimed_state, millis, released_up_to};
use super::recovery;
use super::schema_migrations;
use super::store::{Core, Settings, tx_connection};
use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::key::Key;
use crate::store::{
    Abandoned, ClaimRequest, Completion, RecoveryArgs, RecoveryInfo, RecoveryTurn, Token, Turn,
};

// The row may be taken when it is expired, released, or PROCESSING past its
// lease; a claim retried under the same token gets its own row back. SQLite
// evaluates every SET expression against the old row, so their order is free.
// The row written is PROCESSING (?7 = 1, no outcome), or DONE with its outcome
// and result (?7 = 2, `claim_done`).
const CLAIM: &str = "
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

const READ: &str = "
SELECT state, token, fence, taken_over, lease_until, expires_at, fingerprint, outcome, result
FROM idem_records WHERE key = ?1";

const COMPLETE: &str = "
UPDATE idem_records SET state = 2, outcome = ?1, result = ?2, expires_at = ?3
WHERE key = ?4 AND state = 1 AND token = ?5";

const COMPLETED_BY: &str = "SELECT 1 FROM idem_records WHERE key = ?1 AND state = 2 AND token = ?2";

// Expiry is kept at least as far as the lease: a body may run past its ttl,
// and while it heartbeats its record must not expire under it.
const RENEW: &str = "
UPDATE idem_records SET lease_until = ?1, expires_at = max(expires_at, ?1)
WHERE key = ?2 AND state = 1 AND token = ?3 AND expires_at > ?4";

// A released record also expires at once, so purging finds it through the
// `expires_at` index like any other dead record; the row (and its fence) stays
// until then, and a claim takes it either way.
// ?4 is 1 on the pool; 2 inside the caller's transaction, where the record may
// be one `claim_done` wrote DONE before its body failed.
const RELEASE: &str = "
UPDATE idem_records SET state = 0, expires_at = min(expires_at, ?3)
WHERE key = ?1 AND state IN (1, ?4) AND token = ?2";

// An operator's override that keeps fences growing (see `Store::evict`): a
// PROCESSING row stays, disowned (a token nobody holds) with its lease ended,
// so the next claim takes it over with the next fence; anything else live is
// released. `state` is set last: MySQL reads columns already set in the same
// SET list, and the other expressions need the old state.
const EVICT: &str = "
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
const PURGE: &str = "
DELETE FROM idem_records WHERE key IN (
    SELECT key FROM idem_records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)";

// Recovery (`recovery.rs`): the arguments of a recoverable claim, under the
// token that just acquired its record, on the claim's transaction. A
// takeover keeps the count, backoff and parking of the call it continues.
const KEEP_ARGS: &str = "
INSERT INTO idem_recovery (key, token, scope, args, attempts, next_at, parked)
VALUES (?1, ?2, ?3, ?4, 0, 0, NULL)
ON CONFLICT (key) DO UPDATE SET
    token    = excluded.token,
    scope    = excluded.scope,
    args     = excluded.args,
    attempts = CASE WHEN ?5 THEN idem_recovery.attempts ELSE 0 END,
    next_at  = CASE WHEN ?5 THEN idem_recovery.next_at ELSE 0 END,
    parked   = CASE WHEN ?5 THEN idem_recovery.parked ELSE NULL END";

const RECOVERY_SCOPES: &str = "
SELECT DISTINCT a.scope FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
WHERE r.state = 1 AND r.expires_at > ?1";

const ABANDONED: &str = "
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
const TAKE_TURN: &str = "
UPDATE idem_recovery SET
    parked   = CASE WHEN attempts >= ?3 THEN ?4 ELSE NULL END,
    next_at  = CASE WHEN attempts >= ?3 THEN next_at ELSE ?5 + ?6 END,
    attempts = CASE WHEN attempts >= ?3 THEN attempts ELSE attempts + 1 END
WHERE key = ?1 AND parked IS NULL AND (next_at <= ?5 OR ?3 = 0)
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.key = idem_recovery.key AND r.token = idem_recovery.token
                AND r.state = 1 AND r.fence = ?2 AND r.lease_until <= ?5 AND r.expires_at > ?5)";

const TAKEN: &str = "SELECT attempts, parked IS NOT NULL FROM idem_recovery WHERE key = ?1";

const RECOVERY_INFO: &str = "
SELECT a.scope AS scope, a.attempts AS attempts, a.next_at AS next_at, a.parked AS parked,
       length(a.args) AS args_bytes
FROM idem_recovery AS a
JOIN idem_records AS r ON r.key = a.key AND r.token = a.token
WHERE a.key = ?1 AND r.state = 1 AND r.expires_at > ?2";

const RETRY_RECOVERY: &str = "
UPDATE idem_recovery SET attempts = 0, next_at = 0, parked = NULL
WHERE key = ?1
  AND EXISTS (SELECT 1 FROM idem_records AS r
              WHERE r.key = idem_recovery.key AND r.token = idem_recovery.token
                AND r.state = 1 AND r.expires_at > ?2)";

const PURGE_RECOVERY: &str = "
DELETE FROM idem_recovery WHERE key IN (
    SELECT a.key FROM idem_recovery AS a
    WHERE NOT EXISTS (SELECT 1 FROM idem_records AS r
                      WHERE r.key = a.key AND r.token = a.token AND r.state = 1)
    LIMIT ?1)";

/// Records in SQLite: durable on one machine, exact across the processes that
/// share the file. The default embedded store.
///
/// Files are opened in WAL mode with a busy timeout, so concurrent writers wait
/// for each other instead of failing. The schema is created by embedded
/// migrations recorded in `idem_schema_migrations` (see
/// [`SqliteStoreBuilder::skip_migrations`]).
///
/// ```
/// use idem_runtime::store::sql::SqliteStore;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = SqliteStore::in_memory().await?;
/// idem_runtime::install(store);
/// # Ok::<(), idem_runtime::StoreError>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct SqliteStore {
    core: Arc<Core<Sqlite>>,
}

/// Configures a [`SqliteStore`].
#[derive(Debug)]
pub struct SqliteStoreBuilder {
    clock: Arc<dyn Clock>,
    settings: Settings,
    busy_timeout: Duration,
}

impl SqliteStoreBuilder {
    /// The clock for leases and expiry (default: the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The largest result kept (default 1 MiB).
    pub fn max_result_bytes(mut self, limit: usize) -> Self {
        self.settings.max_result_bytes = limit;
        self
    }

    /// How long a writer waits for another one before failing (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// The connection pool's size for files (default 8).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.settings.max_connections = n.max(1);
        self
    }

    /// Opens the store without applying the embedded migrations: for a
    /// database whose schema is applied at deploy time (with
    /// [`SqliteStore::migrate`], or the SQL in `migrations/sqlite`) by someone
    /// allowed to, so the store runs no DDL at all.
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::SqliteStore::builder().skip_migrations();
    /// # drop(builder);
    /// ```
    pub fn skip_migrations(mut self) -> Self {
        self.settings.migrate = false;
        self
    }

    /// Opens (creating if missing) the database file at `path` and migrates it.
    pub async fn open(self, path: impl AsRef<Path>) -> Result<SqliteStore, StoreError> {
        let options = SqliteConnectOptions::new().filename(path.as_ref());
        self.open_file(options).await
    }

    /// Opens the database a `sqlite:` URL names (`sqlite://orders.db`,
    /// `sqlite::memory:`) and migrates it.
    pub async fn connect(self, url: &str) -> Result<SqliteStore, StoreError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::new(Sqlite::BACKEND, url.to_owned(), e))?;
        let location = options.get_filename().display().to_string();
        if location == ":memory:" || url.contains("mode=memory") {
            return self.in_memory_with(options, location).await;
        }
        self.open_file(options).await
    }

    async fn open_file(self, options: SqliteConnectOptions) -> Result<SqliteStore, StoreError> {
        let location = options.get_filename().display().to_string();
        // WAL lets readers run beside the one writer; the busy timeout makes
        // concurrent writers queue instead of failing with SQLITE_BUSY.
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(self.busy_timeout);
        let pool = SqlitePoolOptions::new()
            .max_connections(self.settings.max_connections)
            .connect_with(options)
            .await
            .map_err(|e| StoreError::new(Sqlite::BACKEND, location.clone(), e))?;
        self.finish(pool, location).await
    }

    /// A private in-memory database, gone with the store.
    pub async fn in_memory(self) -> Result<SqliteStore, StoreError> {
        let options = SqliteConnectOptions::from_str("sqlite::memory:")
            .map_err(|e| StoreError::new(Sqlite::BACKEND, ":memory:", e))?;
        self.in_memory_with(options, ":memory:".into()).await
    }

    async fn in_memory_with(
        self,
        options: SqliteConnectOptions,
        location: String,
    ) -> Result<SqliteStore, StoreError> {
        // Every connection to `:memory:` is a database of its own: keep exactly one,
        // forever, or records would vanish with a recycled connection.
        let pool = SqlitePoolOptions::new()
            .min_connections(1)
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await
            .map_err(|e| StoreError::new(Sqlite::BACKEND, location.clone(), e))?;
        self.finish(pool, location).await
    }

    /// Uses a pool the application already has (sharing its file) and migrates it.
    pub async fn pool(self, pool: SqlitePool) -> Result<SqliteStore, StoreError> {
        let location = pool.connect_options().get_filename().display().to_string();
        self.finish(pool, location).await
    }

    async fn finish(self, pool: SqlitePool, location: String) -> Result<SqliteStore, StoreError> {
        let core = Core::open(pool, self.clock, &self.settings, location).await?;
        Ok(SqliteStore {
            core: Arc::new(core),
        })
    }
}

impl SqliteStore {
    /// Configures a store.
    pub fn builder() -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            clock: Arc::new(SystemClock),
            settings: Settings {
                max_connections: 8,
                ..Settings::default()
            },
            busy_timeout: Duration::from_secs(5),
        }
    }

    /// Opens (creating if missing) the database file at `path`.
    ///
    /// ```no_run
    /// # async fn start() -> Result<(), idem_runtime::StoreError> {
    /// idem_runtime::install(idem_runtime::store::sql::SqliteStore::open("idem.db").await?);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn open(path: impl AsRef<Path>) -> Result<SqliteStore, StoreError> {
        SqliteStore::builder().open(path).await
    }

    /// A private in-memory database.
    pub async fn in_memory() -> Result<SqliteStore, StoreError> {
        SqliteStore::builder().in_memory().await
    }

    /// The pool, to run the application's own queries on the same database.
    pub fn pool(&self) -> &SqlitePool {
        &self.core.pool
    }

    /// Applies the embedded migrations that are not yet recorded. Idempotent,
    /// and safe to run from several processes at once (SQLite serialises the
    /// write transactions).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.core.migrate().await
    }

    /// Whether a store error is worth running the work again for. Never on
    /// SQLite: a writer already waits for the others up to the busy timeout,
    /// and one that still fails has waited as long as it was told to.
    ///
    /// ```
    /// use idem_runtime::StoreError;
    /// use idem_runtime::store::sql::SqliteStore;
    ///
    /// let io = StoreError::new("sqlite", "orders.db", std::io::Error::other("disk full"));
    /// assert!(!SqliteStore::is_retryable(&io));
    /// ```
    pub fn is_retryable(error: &StoreError) -> bool {
        super::store::is_retryable::<Sqlite>(error)
    }
}

forward_store!(SqliteStore => core);

tx_connection! {
    /// Claims inside the caller's SQLite transaction (`#[idempotent(tx = tx)]`).
    /// SQLite has one writer at a time, so a concurrent duplicate waits for this
    /// transaction (up to the busy timeout) and then replays or claims. Time is
    /// this process's clock.
    SqliteConnection => Sqlite, SystemClock
}

fn key(key: &Key) -> &[u8] {
    &key.as_bytes()[..]
}

impl Dialect for Sqlite {
    const BACKEND: &'static str = "sqlite";

    /// No: a read would pin the caller's transaction to its snapshot, and
    /// SQLite cannot turn a snapshot another writer has since moved past into
    /// a write (`SQLITE_BUSY_SNAPSHOT`, without waiting): a duplicate that
    /// waited on the writer would fail instead of replaying. SQLite locks the
    /// whole database for a write anyway, so there is no row lock to spare.
    const READ_FIRST: bool = false;

    async fn read(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
    ) -> Result<Option<Record>, sqlx::Error> {
        let now = clock.now_millis();
        let row = sqlx::query(READ)
            .bind(key(k))
            .fetch_optional(&mut *conn)
            .await?;
        row.map(|r| Record::decode(&r, now)).transpose()
    }

    async fn upsert(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        req: ClaimRequest<'_>,
        done: Option<Completion<'_>>,
    ) -> Result<Upserted, sqlx::Error> {
        let now = clock.now_millis();
        let lease_until = now.saturating_add(millis(req.lease));
        let won = sqlx::query(CLAIM)
            .bind(key(req.key))
            .bind(&req.token.as_bytes()[..])
            .bind(lease_until)
            .bind(now.saturating_add(millis(req.ttl)))
            .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .bind(now)
            .bind(claimed_state(done))
            .bind(done.map(|d| i64::from(d.outcome.code())))
            .bind(done.map(|d| d.payload))
            .fetch_optional(&mut *conn)
            .await?;
        let Some(row) = won else {
            return Ok(Upserted::Lost(None));
        };
        // The statement may have waited for the database's write lock (up to
        // the busy timeout) with `now` read before: the clock after it says
        // how long.
        Ok(Upserted::Won(Won {
            fence: row.try_get("fence")?,
            takeover: row.try_get("taken_over")?,
            lease_until,
            now: clock.now_millis(),
        }))
    }

    async fn complete(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, sqlx::Error> {
        let expires_at = clock.now_millis().saturating_add(millis(completion.ttl));
        let done = sqlx::query(COMPLETE)
            .bind(i64::from(completion.outcome.code()))
            .bind(completion.payload)
            .bind(expires_at)
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn completed_by(
        conn: &mut SqliteConnection,
        k: &Key,
        token: Token,
    ) -> Result<bool, sqlx::Error> {
        let found = sqlx::query(COMPLETED_BY)
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .fetch_optional(&mut *conn)
            .await?;
        Ok(found.is_some())
    }

    async fn release(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
        token: Token,
        done_too: bool,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RELEASE)
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .bind(clock.now_millis())
            .bind(released_up_to(done_too))
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
        token: Token,
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let now = clock.now_millis();
        let done = sqlx::query(RENEW)
            .bind(now.saturating_add(millis(lease)))
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .bind(now)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn evict(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
        nobody: Token,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(EVICT)
            .bind(key(k))
            .bind(&nobody.as_bytes()[..])
            .bind(clock.now_millis())
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(PURGE)
            .bind(clock.now_millis())
            .bind(limit)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected())
    }

    async fn stats(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
    ) -> Result<crate::store::RecordStats, sqlx::Error> {
        let row = sqlx::query_as(&super::store::stats_sql("?1", "idem_records"))
            .bind(clock.now_millis())
            .fetch_one(conn)
            .await?;
        Ok(super::store::stats_of(row))
    }

    async fn keep_args(
        conn: &mut SqliteConnection,
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
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        sqlx::query_scalar(RECOVERY_SCOPES)
            .bind(clock.now_millis())
            .fetch_all(conn)
            .await
    }

    async fn abandoned(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        scope: &str,
        limit: i64,
    ) -> Result<Vec<Abandoned>, sqlx::Error> {
        let rows = sqlx::query(ABANDONED)
            .bind(scope.as_bytes())
            .bind(clock.now_millis())
            .bind(limit)
            .fetch_all(conn)
            .await?;
        rows.iter().map(recovery::abandoned).collect()
    }

    async fn take_recovery(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
        turn: RecoveryTurn<'_>,
    ) -> Result<Turn, sqlx::Error> {
        let taken = sqlx::query(TAKE_TURN)
            .bind(key(k))
            .bind(i64::try_from(turn.fence).unwrap_or(i64::MAX))
            .bind(recovery::limit(&turn))
            .bind(turn.note.as_bytes())
            .bind(clock.now_millis())
            .bind(millis(turn.retry_in))
            .execute(&mut *conn)
            .await?;
        if taken.rows_affected() == 0 {
            return Ok(Turn::Gone);
        }
        let after: (i64, bool) = sqlx::query_as(TAKEN).bind(key(k)).fetch_one(conn).await?;
        Ok(recovery::turn(Some(after)))
    }

    async fn recovery_info(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
    ) -> Result<Option<RecoveryInfo>, sqlx::Error> {
        let row = sqlx::query(RECOVERY_INFO)
            .bind(key(k))
            .bind(clock.now_millis())
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(recovery::info).transpose()
    }

    async fn retry_recovery(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RETRY_RECOVERY)
            .bind(key(k))
            .bind(clock.now_millis())
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_recovery(conn: &mut SqliteConnection, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(PURGE_RECOVERY)
            .bind(limit)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }

    /// Each migration in its own write transaction: SQLite serialises them,
    /// and a second process finds the ledger row and skips.
    async fn migrate(conn: &mut PoolConnection<Sqlite>) -> Result<(), sqlx::Error> {
        sqlx::query(schema_migrations::SQLITE_LEDGER)
            .execute(&mut **conn)
            .await?;
        for m in schema_migrations::SQLITE {
            let mut tx = conn.begin().await?;
            let applied: Option<i64> =
                sqlx::query_scalar("SELECT version FROM idem_schema_migrations WHERE version = ?1")
                    .bind(m.version)
                    .fetch_optional(&mut *tx)
                    .await?;
            if applied.is_some() {
                continue;
            }
            // A bare string runs every statement in it; `sqlx::raw_sql` would
            // too, but its future is not `Send` for every lifetime.
            (&mut *tx).execute(m.sql).await?;
            sqlx::query(
                "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES (?1, ?2, ?3)",
            )
            .bind(m.version)
            .bind(m.description)
            .bind(SystemClock.now_millis())
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
        Ok(())
    }

    fn is_retryable(_: &sqlx::Error) -> bool {
        false
    }

    async fn commit_refused(_: &mut SqliteConnection) -> Result<Option<&'static str>, sqlx::Error> {
        // When SQLite ends a transaction on its own (a conflict clause of
        // ROLLBACK, RAISE(ROLLBACK), and some full-disk, I/O, busy and
        // interrupt errors), its COMMIT then fails ("no transaction is
        // active"), which sqlx reports: nothing to ask beforehand.
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use sqlx::Row as _;

    use super::*;

    /// The purge reads a range of the `expires_at` index, never the whole
    /// table (which it would do under the database's one write lock).
    #[tokio::test]
    async fn purge_walks_the_expires_at_index() {
        let store = SqliteStore::in_memory().await.unwrap();
        // Rows of (id, parent, notused, detail).
        let plan: Vec<String> = sqlx::query(&format!("EXPLAIN QUERY PLAN {PURGE}"))
            .bind(0_i64)
            .bind(10_i64)
            .fetch_all(store.pool())
            .await
            .unwrap()
            .iter()
            .map(|row| row.get::<String, _>(3))
            .collect();
        assert!(
            plan.iter()
                .any(|d| d.contains("INDEX idem_records_expires_at (expires_at<?)")),
            "{plan:?}"
        );
        assert!(
            !plan.iter().any(|d| d.starts_with("SCAN idem_records")),
            "{plan:?}"
        );
    }
}
