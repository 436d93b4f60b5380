//! The embedded durable store: SQLite through sqlx, in a file or in memory.
//! The dialect's statements (`statements.rs`), the record's operations
//! (`records.rs`), the rows of `idem_recovery` (`recovery.rs`) and the
//! migrations (`migrations.rs`), on the store's clock; the algorithms are the
//! shared ones in `sql/store.rs`.
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

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Sqlite, SqliteConnection};

use super::dialect::Dialect;
use super::store::{Core, Settings, tx_connection};
use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::key::Key;

mod migrations;
mod records;
mod recovery;
mod statements;

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

/// A key as the `BLOB` the tables hold.
fn key(key: &Key) -> &[u8] {
    &key.as_bytes()[..]
}

#[cfg(test)]
mod tests;
