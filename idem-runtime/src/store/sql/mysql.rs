// Over 600 lines: MySQL has no RETURNING, so each operation reads back what
// its statement did (insert ids, a locked re-read), and its migrations and
// purge need steps the other dialects do without. The SQL is in
// `mysql/statements.rs`, the unit tests in `mysql/tests.rs`.

//! The MySQL / MariaDB store: records in an InnoDB table through sqlx, on the
//! server's clock. The dialect's statements, clock, migration lock and
//! retryable errors; the algorithms are the shared ones in `store.rs`.
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
use std::time::{Duration, Instant};

use sqlx::mysql::{MySqlConnectOptions, MySqlConnection, MySqlDatabaseError, MySqlPool};
use sqlx::pool::PoolConnection;
use sqlx::{Connection as _, Executor as _, MySql, Row as _};

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

mod statements;
use statements::*;

/// `ER_LOCK_DEADLOCK`: InnoDB chose this statement's transaction as a deadlock
/// victim and rolled it back.
const ER_LOCK_DEADLOCK: u16 = 1213;
/// `ER_LOCK_WAIT_TIMEOUT`: a row lock was not granted within
/// `innodb_lock_wait_timeout`.
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// A user-level lock (`GET_LOCK`) serialises migrations across processes: MySQL
/// DDL commits implicitly, so a transaction cannot do it.
const MIGRATION_LOCK: &str = "idem_migrations";
const MIGRATION_LOCK_WAIT_SECS: i64 = 60;

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

fn key(key: &Key) -> &[u8] {
    &key.as_bytes()[..]
}

async fn read_with(
    conn: &mut MySqlConnection,
    sql: &'static str,
    k: &Key,
) -> Result<Option<Record>, sqlx::Error> {
    let row = sqlx::query(sql).bind(key(k)).fetch_optional(conn).await?;
    row.map(|r| Record::decode(&r, r.try_get("now")?))
        .transpose()
}

impl Dialect for MySql {
    const BACKEND: &'static str = "mysql";

    /// Yes. The upsert, even one that changes nothing, locks the row until the
    /// transaction ends: inside a caller's transaction, every replay of a hot
    /// key would queue behind the others, two transactions replaying two keys
    /// in opposite orders would deadlock, and a duplicate told Busy would block
    /// the owner's renewals and completion. In a REPEATABLE READ transaction
    /// the plain read is the transaction's snapshot and may be old: an old
    /// DONE is still the key's result (a DONE record only ever expires), and an
    /// old Busy is an answer the owner could have given a moment earlier.
    /// Anything else goes on to the upsert, which sees the latest committed
    /// row.
    const READ_FIRST: bool = true;

    async fn read(
        conn: &mut MySqlConnection,
        _: &dyn Clock,
        k: &Key,
    ) -> Result<Option<Record>, sqlx::Error> {
        read_with(conn, READ, k).await
    }

    /// One statement when it inserts the row or takes an existing one; a
    /// claim that lost reads the holder with a locking read. The update
    /// branch counts its lease from when it had the row; an insert, from when
    /// its statement began.
    async fn upsert(
        conn: &mut MySqlConnection,
        clock: &dyn Clock,
        req: ClaimRequest<'_>,
        done: Option<Completion<'_>>,
    ) -> Result<Upserted, sqlx::Error> {
        let sent = Instant::now();
        let claimed = sqlx::query(CLAIM)
            .bind(key(req.key))
            .bind(claimed_state(done))
            .bind(&req.token.as_bytes()[..])
            .bind(millis(req.lease))
            .bind(millis(req.ttl))
            .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .bind(done.map(|d| i64::from(d.outcome.code())))
            .bind(done.map(|d| d.payload))
            .execute(&mut *conn)
            .await?;
        match claimed.last_insert_id() {
            INSERTED => {
                // The insert's VALUES were computed when the statement began,
                // and the server waited at most as long as the client did: the
                // claim loop restarts the lease when that is more than a
                // statement's own run time (a wait on another transaction's
                // uncommitted insert of the key, rolled back since).
                let waited = i64::try_from(sent.elapsed().as_millis()).unwrap_or(i64::MAX);
                Ok(Upserted::Won(Won::after(1, false, req.lease, waited)))
            }
            LOST => Ok(Upserted::Lost(read_with(conn, READ_LOCKED, req.key).await?)),
            won => {
                let fence = i64::try_from(won / 2).map_err(|_| {
                    sqlx::Error::Protocol(format!("claim marker {won} out of range"))
                })?;
                // The update branch wrote the record PROCESSING (see CLAIM).
                if let Some(completion) = done
                    && !Self::complete(conn, clock, req.key, req.token, completion).await?
                {
                    return Err(sqlx::Error::Protocol(
                        "the record this claim took was gone at its completion".into(),
                    ));
                }
                // The update branch counts its lease from when it had the row.
                Ok(Upserted::Won(Won::after(fence, won % 2 == 1, req.lease, 0)))
            }
        }
    }

    async fn complete(
        conn: &mut MySqlConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(COMPLETE)
            .bind(i64::from(completion.outcome.code()))
            .bind(completion.payload)
            .bind(millis(completion.ttl))
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn completed_by(
        conn: &mut MySqlConnection,
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
        conn: &mut MySqlConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        done_too: bool,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RELEASE)
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .bind(released_up_to(done_too))
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        conn: &mut MySqlConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RENEW)
            .bind(millis(lease))
            .bind(millis(lease))
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn evict(
        conn: &mut MySqlConnection,
        _: &dyn Clock,
        k: &Key,
        nobody: Token,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(EVICT)
            .bind(&nobody.as_bytes()[..])
            .bind(key(k))
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    /// One batch, in its own READ COMMITTED transaction (see PURGE_SELECT).
    async fn purge(
        conn: &mut MySqlConnection,
        _: &dyn Clock,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
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

    async fn stats(
        conn: &mut MySqlConnection,
        _: &dyn Clock,
    ) -> Result<crate::store::RecordStats, sqlx::Error> {
        let row = sqlx::query_as(&super::store::stats_sql(now_ms!(), "idem_records"))
            .fetch_one(conn)
            .await?;
        Ok(super::store::stats_of(row))
    }

    /// Under a session lock (`GET_LOCK`): DDL commits implicitly, so a
    /// transaction cannot serialise it.
    async fn migrate(conn: &mut PoolConnection<MySql>) -> Result<(), sqlx::Error> {
        // The lock belongs to the session. Closing this connection afterwards
        // (instead of returning it to the pool) frees the lock even when this
        // future is dropped halfway.
        conn.close_on_drop();
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(MIGRATION_LOCK)
            .bind(MIGRATION_LOCK_WAIT_SECS)
            .fetch_one(&mut **conn)
            .await?;
        if locked != Some(1) {
            return Err(sqlx::Error::Protocol(format!(
                "could not take the migration lock `{MIGRATION_LOCK}` within {MIGRATION_LOCK_WAIT_SECS} s; another process is migrating"
            )));
        }
        let applied = apply_migrations(conn).await;
        let unlocked = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(MIGRATION_LOCK)
            .execute(&mut **conn)
            .await;
        applied?;
        unlocked?;
        Ok(())
    }

    async fn keep_args(
        conn: &mut MySqlConnection,
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
            .bind(takeover)
            .bind(takeover)
            .execute(conn)
            .await
            .map(drop)
    }

    async fn recovery_scopes(
        conn: &mut MySqlConnection,
        _: &dyn Clock,
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        sqlx::query_scalar(RECOVERY_SCOPES).fetch_all(conn).await
    }

    async fn abandoned(
        conn: &mut MySqlConnection,
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
        conn: &mut MySqlConnection,
        _: &dyn Clock,
        k: &Key,
        turn: RecoveryTurn<'_>,
    ) -> Result<Turn, sqlx::Error> {
        let limit = recovery::limit(&turn);
        let taken = sqlx::query(TAKE_TURN)
            .bind(limit)
            .bind(turn.note.as_bytes())
            .bind(limit)
            .bind(millis(turn.retry_in))
            .bind(limit)
            .bind(key(k))
            .bind(limit)
            .bind(i64::try_from(turn.fence).unwrap_or(i64::MAX))
            .execute(&mut *conn)
            .await?;
        // CLIENT_FOUND_ROWS: a matched row counts even if nothing changed,
        // and every match changes `attempts`, `next_at` or `parked`.
        if taken.rows_affected() == 0 {
            return Ok(Turn::Gone);
        }
        let (attempts, parked): (i64, i64) =
            sqlx::query_as(TAKEN).bind(key(k)).fetch_one(conn).await?;
        Ok(recovery::turn(Some((attempts, parked != 0))))
    }

    async fn recovery_info(
        conn: &mut MySqlConnection,
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
        conn: &mut MySqlConnection,
        _: &dyn Clock,
        k: &Key,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RETRY_RECOVERY)
            .bind(key(k))
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_recovery(conn: &mut MySqlConnection, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(PURGE_RECOVERY)
            .bind(limit)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }

    fn is_retryable(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Database(db) => db
                .try_downcast_ref::<MySqlDatabaseError>()
                .is_some_and(|m| is_transient_code(m.number())),
            _ => false,
        }
    }

    async fn commit_refused(
        conn: &mut MySqlConnection,
    ) -> Result<Option<&'static str>, sqlx::Error> {
        // sqlx counts its own BEGINs; the server may have ended the
        // transaction under it (a lost deadlock rolls it back). MariaDB says
        // so in `@@in_transaction`; MySQL lacks the variable (1193) and lists
        // the connection's InnoDB transaction instead, which the claim's own
        // write has started.
        const GONE: &str = "the server had already rolled the transaction back \
             (a lost deadlock or lock wait): the statements after it ran in autocommit";
        let open: i64 = match sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
            .fetch_one(&mut *conn)
            .await
        {
            Ok(open) => open,
            Err(sqlx::Error::Database(db))
                if db
                    .try_downcast_ref::<MySqlDatabaseError>()
                    .is_some_and(|m| m.number() == ER_UNKNOWN_SYSTEM_VARIABLE) =>
            {
                sqlx::query_scalar(
                    "SELECT COUNT(*) FROM information_schema.innodb_trx \
                     WHERE trx_mysql_thread_id = CONNECTION_ID()",
                )
                .fetch_one(&mut *conn)
                .await?
            }
            Err(e) => return Err(e),
        };
        Ok((open == 0).then_some(GONE))
    }
}

/// `Unknown system variable`.
const ER_UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;

fn is_transient_code(number: u16) -> bool {
    matches!(number, ER_LOCK_DEADLOCK | ER_LOCK_WAIT_TIMEOUT)
}

async fn apply_migrations(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    // A bare string runs as a simple query, every statement in it; the
    // futures of `sqlx::raw_sql` are not `Send` for every lifetime.
    (&mut *conn)
        .execute(schema_migrations::MYSQL_LEDGER)
        .await?;
    for m in schema_migrations::MYSQL {
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
        (&mut *conn).execute(m.sql).await?;
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

#[cfg(test)]
mod tests;
