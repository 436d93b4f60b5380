//! The MySQL / MariaDB store: records in an InnoDB table through sqlx, on the
//! server's clock. The dialect's statements (`statements.rs`), the record's
//! operations and retryable errors (`records.rs`), the rows of
//! `idem_recovery` (`recovery.rs`) and the migrations under their lock
//! (`migrations.rs`); the algorithms are the shared ones in `sql/store.rs`.
//!
//! A plain read answers a replay or a Busy claim without locking anything; only
//! a record that may be taken goes on to one `INSERT … ON DUPLICATE KEY UPDATE`
//! whose assignments decide, on the old row, whether the caller may take it.
//! The statement's insert id then tells the caller what it got: none for a row
//! it inserted, a marker its update branch left otherwise. There is no `INSERT
//! IGNORE` (it turns truncation and NULL errors into warnings) and no caught
//! duplicate-key error anywhere.
//!
//! # Limits of MySQL and MariaDB
//!
//! What the server answers at its edges, and what the store, `tx = tx` calls,
//! `Runner::run_in_tx` and the outbox make of it. A row whose test says `none
//! yet` is not checked against a real server. The tests run MariaDB 10.11;
//! nothing here is run against MySQL 8, so the rows say what MySQL does from
//! its documentation, and two things idem leans on are MariaDB-tested only:
//! the outbox insert's `ON DUPLICATE KEY UPDATE` that fails a statement
//! whose id another message holds (it relies on `IF` evaluating only the
//! branch it takes), and reading its `VARBINARY` names back as text.
//!
//! | limit or odd answer | what MySQL/MariaDB does | what idem does | test |
//! |---|---|---|---|
//! | `max_allowed_packet` (16 MiB on MariaDB 10.11, 64 MiB on MySQL 8) | a larger statement is refused (1153) and the connection closed: the transaction is gone | results: keep `max_result_bytes` under it (not checked); `outbox::put_all` writes at most 4 MiB per statement, so only a single message over the limit fails, with the server's reason | `tests/outbox/scenarios.rs::a_batch_past_every_statement_cap_is_written_whole` (17 × 1 MiB), `tests/outbox/main.rs::mysql_one_message_over_max_allowed_packet_names_the_limit` |
//! | collation of the `VARCHAR(255)` columns: the database's default, e.g. `utf8mb4_general_ci` (case- and accent-insensitive, trailing spaces ignored) | `'Order-1' = 'order-1'`, `'e' = 'é'` and `'a' = 'a '` are all true | the outbox's `id`, `topic` and `ordering_key` are `VARBINARY` (migration 4): compared as bytes, as on PostgreSQL and SQLite. An id held by another message is `OutboxError::IdTaken` | `tests/outbox/scenarios.rs::names_that_differ_only_in_case_accent_or_trailing_space_are_distinct`, `tests/outbox/scenarios.rs::a_callers_id_held_by_another_message_is_refused` |
//! | a lost deadlock (1213) | rolls the whole transaction back; the statements after it run in autocommit and `COMMIT` answers OK | `commit_refused` reads `@@in_transaction` (MariaDB), or `information_schema.innodb_trx` where MySQL lacks it (1193), and `run_in_tx` redelivers instead of acking | `tests/consumer_tx.rs::mysql::a_transaction_the_server_ended_is_not_acked`, `tests/mysql/transaction.rs::deadlock_inside_a_transaction_reaches_the_caller` |
//! | lock wait timeout (1205, `innodb_lock_wait_timeout`) | with `innodb_rollback_on_timeout` off (the default) only the statement is rolled back: the transaction stays open | retried on the pool; inside the caller's transaction the error reaches the caller, and `MySqlStore::is_retryable` says so | pool: `tests/mysql/claim.rs::lock_wait_timeout_on_the_pool_is_retried`; inside a transaction: `tests/mysql/transaction.rs::lock_wait_timeout_inside_a_transaction_keeps_the_transaction` |
//! | at most 65 535 placeholders per prepared statement | refused (1390) | `outbox::put_all` writes 1 000 messages (5 000 placeholders) per statement at most; the relay's batch (at most 10 000, and the token) stays under | `tests/outbox/scenarios.rs::a_batch_past_every_statement_cap_is_written_whole` (13 108 messages) |
//! | `TEXT` columns hold 65 535 bytes (`headers`, `last_error`) | strict mode: `Data too long` (1406) | `put` refuses headers over 65 535 bytes as stored on every database, so the three answer alike | `tests/outbox/scenarios.rs::outside_a_call_a_message_needs_an_id_and_a_repeated_id_is_one_row` (65 535 and 65 536) |
//! | connection lost after the claim | the claim may have committed | fails closed; the claim is taken over after its lease | `tests/mysql/fail_closed.rs::connection_lost_after_the_claim_is_taken_over_after_the_lease` |

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::MySql;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlPool};

use super::dialect::Dialect;
use super::store::{Core, Settings, connect_pool, server_location, tx_connection};
use crate::clock::SystemClock;
use crate::error::StoreError;
use crate::key::Key;

mod migrations;
mod records;
mod recovery;
mod statements;

/// Records in MySQL or MariaDB (InnoDB): durable, shared by every process that
/// uses the database, on the server's clock.
///
/// Opening applies the embedded migrations (recorded in
/// `idem_schema_migrations`, under a `GET_LOCK` so concurrent processes migrate
/// safely). A statement that loses a deadlock or a lock wait is retried a few
/// times with a short random backoff (see [`MySqlStore::is_retryable`]; a
/// purge is not: it skips locked rows,
/// and the sweeper runs it again next round). Purging needs SKIP LOCKED:
/// MySQL 8.0.1 or MariaDB 10.6 and later. To claim inside your own transaction, see
/// the [`TxConnection`](crate::store::tx::TxConnection) implementation for [`MySqlConnection`].
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
    core: Arc<Core<MySql>>,
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
    settings: Settings,
}

impl MySqlStoreBuilder {
    /// The largest result kept (default 1 MiB). Keep it under the server's
    /// `max_allowed_packet`.
    pub fn max_result_bytes(mut self, limit: usize) -> Self {
        self.settings.max_result_bytes = limit;
        self
    }

    /// The pool's size when the store opens its own (default 10).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.settings.max_connections = n.max(1);
        self
    }

    /// How long a call waits for a connection when the store opens its own
    /// pool, reconnects to a refusing server included, before failing closed
    /// with a store error (default 5 s; sqlx's own default of 30 s is long for a
    /// request path). Opening the store then tries once more, as long again,
    /// to say why.
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.settings.acquire_timeout = timeout;
        self
    }

    /// Opens the store without applying the embedded migrations: for a
    /// database user that may not run DDL, when the schema is applied at
    /// deploy time (with [`MySqlStore::migrate`] or the SQL in
    /// `migrations/mysql`). The store then runs no DDL at all.
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::MySqlStore::builder().skip_migrations();
    /// # drop(builder);
    /// ```
    pub fn skip_migrations(self) -> Self {
        self.migrate(false)
    }

    /// Whether opening applies the embedded migrations (default `true`);
    /// `migrate(false)` is [`skip_migrations`](Self::skip_migrations).
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.settings.migrate = migrate;
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
            .map_err(|e| StoreError::new(MySql::BACKEND, "<unparsable mysql URL>", e))?;
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
        let pool = connect_pool(options, &self.settings, &location).await?;
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
        // Time is the server's: the store's clock is never read.
        let core = Core::open(
            pool,
            std::sync::Arc::new(SystemClock),
            &self.settings,
            location,
        )
        .await?;
        Ok(MySqlStore {
            core: Arc::new(core),
        })
    }
}

impl MySqlStore {
    /// Configures a store.
    pub fn builder() -> MySqlStoreBuilder {
        MySqlStoreBuilder {
            settings: Settings::default(),
        }
    }

    /// Connects to the database a `mysql://` URL names and migrates it.
    pub async fn connect(url: &str) -> Result<MySqlStore, StoreError> {
        MySqlStore::builder().connect(url).await
    }

    /// The pool, to run the application's own queries (and transactions) on the
    /// same database.
    pub fn pool(&self) -> &MySqlPool {
        &self.core.pool
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
        self.core.migrate().await
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
        super::store::is_retryable::<MySql>(error)
    }
}

/// `host:port/database` (or the socket path): the parts of the options that
/// are safe to log. Never the user or the password.
fn location(options: &MySqlConnectOptions) -> String {
    server_location(
        options.get_socket().map(|p| p.as_path()),
        options.get_host(),
        options.get_port(),
        options.get_database(),
    )
}

forward_store!(MySqlStore => core);

tx_connection! {
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
    /// A claim that finds the key's row already there (a takeover, a claim
    /// after a release, or one that loses) leaves a marker of its own in the
    /// connection's `LAST_INSERT_ID()`, as [`InsertOnce`](crate::unique::InsertOnce)
    /// does on MySQL: take your `AUTO_INCREMENT` ids from your statement's
    /// result (`last_insert_id()`), not from `LAST_INSERT_ID()` read across an
    /// idempotent call.
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
    /// use idem_runtime::Key;
    /// use idem_runtime::store::{Claim, ClaimRequest, Token};
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
    MySqlConnection => MySql, SystemClock
}

/// A key as the `VARBINARY` the tables hold.
fn key(key: &Key) -> &[u8] {
    &key.as_bytes()[..]
}

#[cfg(test)]
mod tests;
