//! PostgreSQL store through sqlx: records shared by every replica of a service,
//! leases on the database server's clock, and claims that can join the
//! caller's own transaction. The dialect's statements (`statements.rs`), the
//! record's operations and retryable errors (`records.rs`), the rows of
//! `idem_recovery` (`recovery.rs`) and the migrations under their lock
//! (`migrations.rs`); the algorithms are the shared ones in `sql/store.rs`.
//!
//! # Limits of PostgreSQL
//!
//! What the server (and sqlx in front of it) answers at its edges, and what the
//! store, `tx = tx` calls, `Runner::run_in_tx` and the outbox make of it. A row
//! whose test says `none yet` is not checked against a real server.
//!
//! | limit or odd answer | what PostgreSQL does | what idem does | test |
//! |---|---|---|---|
//! | a transaction aborted by a failed statement (25P02) | every later statement fails with 25P02; `COMMIT` answers `ROLLBACK` and no error | `commit_refused` asks (`SELECT 1`) and `run_in_tx` rolls back and redelivers instead of acking | `tests/consumer_tx.rs::postgres::an_aborted_transaction_is_not_acked_and_redelivers` |
//! | `COMMIT` that fails (a deferred constraint, a serialization failure at commit) | an error, nothing kept | `TxError::Commit`: not acked, redelivered | `tests/consumer_tx.rs::postgres::a_commit_that_fails_is_not_acked_and_leaves_no_record` |
//! | connection lost while `COMMIT` is in flight | the transaction may have committed | `TxError::Commit`: not acked; the redelivery replays the record if it committed, runs if it did not | `tests/consumer_tx.rs::postgres::a_commit_whose_answer_is_lost_is_not_acked_and_its_redelivery_replays` |
//! | session ended by the server mid-transaction (`idle_in_transaction_session_timeout`, a restart) | the transaction is rolled back and the connection closed | the body's next statement or the commit fails: not acked; a claim on the pool is taken over after its lease | pool: `tests/postgres/fail_closed.rs::a_connection_lost_between_claim_and_complete_is_taken_over_after_the_lease`; inside `run_in_tx`: `tests/consumer_tx.rs::postgres::a_session_the_server_ends_mid_transaction_is_not_acked` (2 s timeout, idle 50 ms and 3 s) |
//! | lost lock conflicts: 40P01, 40001, 55P03 | the statement fails, and the transaction with it (25P02 after) | retried on the pool; inside the caller's transaction the error reaches the caller and `PgStore::is_retryable` says so | `tests/postgres/transaction.rs::a_serialization_failure_in_a_transaction_is_retryable` |
//! | at most 65 535 bind parameters per statement | sqlx refuses before sending (`too many arguments for query`) | `outbox::put_all` writes 1 000 messages (6 000 parameters) per statement at most: a batch of any size is written; the relay's batch binds arrays | `tests/outbox/scenarios.rs::a_batch_past_every_statement_cap_is_written_whole` (13 108 messages) |
//! | `text` holds no NUL; `text`/`bytea` at most 1 GB | error (22021, 54000) | `put` refuses control characters in topic, id and ordering key and CR, LF, NUL in header values; results stay under `max_result_bytes` (1 MiB unless set) | CR/LF and NUL: `tests/outbox/scenarios.rs::outside_a_call_a_message_needs_an_id_and_a_repeated_id_is_one_row`; the 1 GB edge: not tested (a 1 GB result in CI) |

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, Postgres};

use super::dialect::Dialect;
use super::store::{Core, Settings, connect_pool, server_location, tx_connection};
use crate::clock::SystemClock;
use crate::error::StoreError;
use crate::key::Key;

mod migrations;
mod records;
mod recovery;
mod statements;

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
    /// A claim here bets on a new key: its first statement is a plain insert
    /// of the fresh record, the cheapest first call. A key that has a row
    /// answers that insert with nothing, and the claim's usual statement then
    /// answers from the record held (DONE, or another owner's live lease)
    /// without locking it (see `CLAIM`): a replay adds two statements to the
    /// transaction, and replays of a hot key do not queue behind each other's
    /// transactions; only a claim that takes the row holds its lock until the
    /// caller's transaction ends.
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

/// A key as the `bytea` the tables hold.
fn key(key: &Key) -> &[u8] {
    &key.as_bytes()[..]
}
