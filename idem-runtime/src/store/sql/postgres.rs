//! PostgreSQL store through sqlx: records shared by every replica of a service,
//! leases on the database server's clock, and claims that can join the
//! caller's own transaction.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions, PgRow, Postgres};
use sqlx::{Connection as _, Executor as _, Row as _};

use super::migrate;
use crate::clock::duration_millis;
use crate::error::StoreError;
use crate::key::{Fingerprint, Key};
use crate::store::tx::TxConnection;
use crate::store::{
    AsStore, Claim, ClaimRequest, Completion, DEFAULT_MAX_RESULT_BYTES, Outcome, RecordInfo,
    RecordState, Store, StoreRef, StoredResult, Token,
};

const BACKEND: &str = "postgres";
const RELEASED: i16 = 0;
const PROCESSING: i16 = 1;
const DONE: i16 = 2;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

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

// The row may be taken when it is expired, released, or PROCESSING past its
// lease; a claim retried under the same token gets its own row back. SET
// expressions read the old row, so their order is free. A row the WHERE
// refuses is left unchanged and RETURNING yields nothing: the loser then reads
// it. Nothing here raises a unique violation, so a duplicate never aborts the
// caller's transaction.
//
// A claim may wait on the row's lock (another transaction claimed or holds it)
// and win only when that transaction ends, seconds after `clock` was read. Its
// lease must start when it wins, or it would begin already spent and a third
// caller could take the key over at once. DO UPDATE locks the row before it
// evaluates its SET list, so the lease and expiry there read the clock afresh.
// An INSERT that waited on another transaction's uncommitted insert of the
// same key (which then rolled back) has no such hook: its values were computed
// before the wait. RETURNING tells the two apart (`started` against `now`, both
// after the wait) and `claim_on` restarts a lease that began too early.
//
// ON CONFLICT DO UPDATE locks its target row even when the WHERE refuses it,
// and inside a caller's transaction that lock would last until commit: every
// replay of a hot key would queue behind the others. So the INSERT is only
// attempted when a plain read does not already show a live record that may not
// be taken (DONE, or PROCESSING under someone else's lease). A replay then
// costs a lock-free read; only a genuine race reaches the conflict path.
const CLAIM: &str = concat!(
    with_clock!(),
    "INSERT INTO idem_records AS r
    (key, state, token, fence, lease_until, expires_at, fingerprint, taken_over)
SELECT $1, 1, $2, 1, clock.now + $3, clock.now + $4, $5, FALSE FROM clock
WHERE NOT EXISTS (
    SELECT 1 FROM idem_records AS live
    WHERE live.key = $1
      AND live.expires_at > clock.now
      AND (live.state = 2
           OR (live.state = 1 AND live.lease_until > clock.now AND live.token <> $2)))
ON CONFLICT (key) DO UPDATE SET
    state       = 1,
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
    outcome     = NULL,
    result      = NULL
WHERE r.expires_at <= (SELECT now FROM clock)
   OR r.state = 0
   OR (r.state = 1 AND (r.lease_until <= (SELECT now FROM clock) OR r.token = excluded.token))
RETURNING fence, taken_over, lease_until - $3 AS started, ",
    server_now!(),
    " AS now"
);

const COMPLETED_BY: &str = "SELECT 1 FROM idem_records WHERE key = $1 AND state = 2 AND token = $2";

const READ: &str = concat!(
    "SELECT state, fence, lease_until, expires_at, fingerprint, outcome, result, ",
    server_now!(),
    " AS now
FROM idem_records WHERE key = $1"
);

const COMPLETE: &str = concat!(
    with_clock!(),
    "UPDATE idem_records SET state = 2, outcome = $1, result = $2, expires_at = clock.now + $3
FROM clock
WHERE key = $4 AND state = 1 AND token = $5"
);

// A released record also expires at once, so the sweeper finds it through the
// `expires_at` index like any other dead record; the row (and its fence) stays
// until then, and a claim takes it either way.
const RELEASE: &str = concat!(
    with_clock!(),
    "UPDATE idem_records SET state = 0, expires_at = LEAST(expires_at, clock.now)
FROM clock
WHERE key = $1 AND state = 1 AND token = $2"
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

const EVICT: &str = "DELETE FROM idem_records WHERE key = $1";

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

/// Records in PostgreSQL: exact across every process and machine that uses
/// the database, durable, and on one clock (the server's) however many
/// application servers compare leases.
///
/// The claim is one `INSERT … ON CONFLICT (key) DO UPDATE … WHERE … RETURNING`
/// statement; only a caller that loses it reads the row a second time. The
/// schema is created by embedded migrations recorded in
/// `idem_schema_migrations`, run when the store opens.
///
/// With the same SQL, a claim can also run inside the caller's own
/// transaction (see [`TxConnection`]), so the record commits or rolls back
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
    pool: PgPool,
    max_result_bytes: usize,
    location: Arc<str>,
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
    max_result_bytes: usize,
    max_connections: u32,
    acquire_timeout: Duration,
}

impl PgStoreBuilder {
    /// The largest result kept (default 1 MiB).
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::PgStore::builder().max_result_bytes(4096);
    /// ```
    pub fn max_result_bytes(mut self, limit: usize) -> Self {
        self.max_result_bytes = limit;
        self
    }

    /// The size of the pool [`connect`](Self::connect) opens (default 10).
    /// Not used with [`pool`](Self::pool), which keeps the application's.
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::PgStore::builder().max_connections(32);
    /// ```
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long a call waits for a connection before it fails closed with
    /// [`crate::Error::Store`] (default 5 s, where sqlx's own default of 30 s
    /// would hold a request that long while the database is down). Opening the
    /// store retries a refused connection for as long. Not used with
    /// [`pool`](Self::pool).
    ///
    /// ```
    /// use std::time::Duration;
    /// let builder = idem_runtime::store::sql::PgStore::builder()
    ///     .acquire_timeout(Duration::from_secs(1));
    /// ```
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
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
            .map_err(|e| StoreError::new(BACKEND, "<unparsable postgres URL>", e))?;
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
        let connected = PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .connect_with(options.clone())
            .await;
        let pool = match connected {
            Ok(pool) => pool,
            // sqlx retries a refused connection until the timeout and then
            // reports only the timeout; one direct attempt tells the operator why.
            Err(sqlx::Error::PoolTimedOut) => {
                let cause = why_unreachable(&options, self.acquire_timeout).await;
                return Err(StoreError::new(BACKEND, location, cause));
            }
            Err(e) => return Err(StoreError::new(BACKEND, location, e)),
        };
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
    /// # Ok(())
    /// # }
    /// ```
    pub async fn pool(self, pool: PgPool) -> Result<PgStore, StoreError> {
        let location = location(&pool.connect_options());
        self.finish(pool, location).await
    }

    async fn finish(self, pool: PgPool, location: String) -> Result<PgStore, StoreError> {
        let store = PgStore {
            pool,
            max_result_bytes: self.max_result_bytes,
            location: location.into(),
        };
        store.migrate().await?;
        Ok(store)
    }
}

/// Where the server is, for errors: host, port and database, built from the
/// parsed options so a user name or password can never slip in.
fn location(options: &PgConnectOptions) -> String {
    let server = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        None if options.get_host().contains(':') => {
            format!("[{}]:{}", options.get_host(), options.get_port())
        }
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    match options.get_database() {
        Some(db) => format!("{server}/{db}"),
        None => server,
    }
}

async fn why_unreachable(options: &PgConnectOptions, timeout: Duration) -> sqlx::Error {
    match tokio::time::timeout(timeout, PgConnection::connect_with(options)).await {
        Ok(Err(e)) => e,
        Ok(Ok(conn)) => {
            // Up again just now: the timeout is still what happened.
            let _ = conn.close().await;
            sqlx::Error::PoolTimedOut
        }
        Err(_) => sqlx::Error::PoolTimedOut,
    }
}

impl PgStore {
    /// Configures a store.
    ///
    /// ```
    /// let builder = idem_runtime::store::sql::PgStore::builder();
    /// ```
    pub fn builder() -> PgStoreBuilder {
        PgStoreBuilder {
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
        }
    }

    /// Connects to the database a `postgres://` URL names and migrates it.
    ///
    /// ```no_run
    /// # async fn start() -> Result<(), idem_runtime::StoreError> {
    /// let store = idem_runtime::store::sql::PgStore::connect("postgres://app@127.0.0.1/orders").await?;
    /// # Ok(())
    /// # }
    /// ```
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
        &self.pool
    }

    fn err(&self, e: impl Into<BoxError>) -> StoreError {
        StoreError::new(BACKEND, &*self.location, e)
    }

    async fn conn(&self) -> Result<sqlx::pool::PoolConnection<Postgres>, StoreError> {
        self.pool.acquire().await.map_err(|e| self.err(e))
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
        let mut tx = self.pool.begin().await.map_err(|e| self.err(e))?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(migrate::POSTGRES_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        // Checked rather than `CREATE TABLE IF NOT EXISTS`, which logs a notice
        // at every start; the lock makes check-then-create safe.
        let has_ledger: bool =
            sqlx::query_scalar("SELECT to_regclass('idem_schema_migrations') IS NOT NULL")
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
        if !has_ledger {
            sqlx::query(migrate::POSTGRES_LEDGER)
                .execute(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
        }
        let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM idem_schema_migrations")
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        for m in migrate::POSTGRES {
            if applied.contains(&m.version) {
                continue;
            }
            // A bare string runs as a simple query, so a migration may hold
            // several statements. (`sqlx::raw_sql` would too, but its future
            // is not `Send` for every lifetime.)
            tx.execute(m.sql).await.map_err(|e| self.err(e))?;
            sqlx::query(concat!(
                "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES ($1, $2, ",
                server_now!(),
                ")"
            ))
            .bind(m.version)
            .bind(m.description)
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        }
        tx.commit().await.map_err(|e| self.err(e))
    }
}

// The operations, written once against a connection: the pool path runs them
// on a pooled connection, the same-transaction path on the caller's.

/// Durations as milliseconds the server can add to its clock without
/// overflowing a BIGINT (a "forever" ttl stays forever).
fn millis(d: Duration) -> i64 {
    duration_millis(d).min(i64::MAX / 4)
}

async fn claim_on(conn: &mut PgConnection, req: ClaimRequest<'_>) -> Result<Claim, BoxError> {
    // The upsert and the loser's read are two statements; a row released or
    // expired in between is simply claimed on the next turn.
    for _ in 0..8 {
        let won = sqlx::query(CLAIM)
            .bind(&req.key.as_bytes()[..])
            .bind(&req.token.0[..])
            .bind(millis(req.lease))
            .bind(millis(req.ttl))
            .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(row) = won {
            let f: i64 = row.try_get("fence")?;
            let takeover: bool = row.try_get("taken_over")?;
            let (started, now): (i64, i64) = (row.try_get("started")?, row.try_get("now")?);
            // Only an INSERT that waited gets here with an old lease (see
            // CLAIM). On the pool the row is already committed, so another
            // caller may have taken it over meanwhile: then the renewal finds
            // it gone and the next round reports whoever holds it.
            if began_long_ago(started, now, req.lease)
                && !renew_on(&mut *conn, req.key, req.token, req.lease).await?
            {
                continue;
            }
            return Ok(Claim::Acquired {
                fence: fence(f),
                takeover,
            });
        }
        let Some(record) = read_on(conn, req.key).await? else {
            continue;
        };
        if !record.live() {
            continue;
        }
        match record.state {
            DONE => {
                return record
                    .stored()
                    .map(Claim::Done)
                    .ok_or_else(|| "a DONE record without an outcome".into());
            }
            PROCESSING if record.lease_until > record.now => {
                return Ok(Claim::Busy {
                    lease_remaining: remaining(record.lease_until, record.now),
                    fingerprint: record.fingerprint,
                });
            }
            _ => continue,
        }
    }
    Err("the record kept changing under eight claim attempts in a row".into())
}

/// Whether a lease that started at `started` (server milliseconds) lost more
/// than a tenth of itself before `now`: the claim waited on a lock, and its
/// lease must start again. A smaller loss is the statement's own run time.
fn began_long_ago(started: i64, now: i64, lease: Duration) -> bool {
    now.saturating_sub(started).saturating_mul(10) > millis(lease)
}

async fn renew_on(
    conn: &mut PgConnection,
    key: &Key,
    token: Token,
    lease: Duration,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(RENEW)
        .bind(millis(lease))
        .bind(&key.as_bytes()[..])
        .bind(&token.0[..])
        .execute(conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

async fn complete_on(
    conn: &mut PgConnection,
    key: &Key,
    token: Token,
    completion: Completion<'_>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(COMPLETE)
        .bind(i16::from(completion.outcome.code()))
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

async fn release_on(conn: &mut PgConnection, key: &Key, token: Token) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(RELEASE)
        .bind(&key.as_bytes()[..])
        .bind(&token.0[..])
        .execute(conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

async fn read_on(conn: &mut PgConnection, key: &Key) -> Result<Option<Record>, sqlx::Error> {
    sqlx::query(READ)
        .bind(&key.as_bytes()[..])
        .fetch_optional(conn)
        .await?
        .map(|r| Record::decode(&r))
        .transpose()
}

/// A record as read back, with the server's clock at the time of reading.
struct Record {
    state: i16,
    fence: i64,
    lease_until: i64,
    expires_at: i64,
    fingerprint: Option<Fingerprint>,
    result: Option<(Outcome, Vec<u8>)>,
    now: i64,
}

impl Record {
    fn decode(r: &PgRow) -> Result<Record, sqlx::Error> {
        let fingerprint: Option<Vec<u8>> = r.try_get("fingerprint")?;
        let fingerprint = fingerprint
            .map(|b| <[u8; 32]>::try_from(b.as_slice()).map(Fingerprint::from_bytes))
            .transpose()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
        let outcome: Option<i16> = r.try_get("outcome")?;
        let payload: Option<Vec<u8>> = r.try_get("result")?;
        let result = match outcome {
            None => None,
            Some(code) => Some((
                Outcome::from_code(i64::from(code))
                    .ok_or_else(|| corrupt("unknown outcome code"))?,
                payload.unwrap_or_default(),
            )),
        };
        Ok(Record {
            state: r.try_get("state")?,
            fence: r.try_get("fence")?,
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

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn max_result_bytes(&self) -> usize {
        self.max_result_bytes
    }

    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let mut conn = self.conn().await?;
        claim_on(&mut conn, req).await.map_err(|e| self.err(e))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        complete_on(&mut conn, key, token, completion)
            .await
            .map_err(|e| self.err(e))
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        release_on(&mut conn, key, token)
            .await
            .map_err(|e| self.err(e))
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        renew_on(&mut conn, key, token, lease)
            .await
            .map_err(|e| self.err(e))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        let mut conn = self.conn().await?;
        let record = read_on(&mut conn, key).await.map_err(|e| self.err(e))?;
        let Some(record) = record.filter(Record::live) else {
            return Ok(None);
        };
        let (state, lease_until_millis) = match record.state {
            PROCESSING => (RecordState::Processing, record.lease_until),
            _ => (RecordState::Done, 0),
        };
        let (f, expires_at_millis) = (fence(record.fence), record.expires_at);
        Ok(Some(RecordInfo {
            state,
            fence: f,
            lease_until_millis,
            expires_at_millis,
            result: record.stored(),
        }))
    }

    async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
        let done = sqlx::query(EVICT)
            .bind(&key.as_bytes()[..])
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(PURGE)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(done.rows_affected())
    }
}

impl AsStore for PgStore {
    fn as_store(&self) -> StoreRef {
        StoreRef::new(self.clone())
    }
}

/// A connection has no address to show, so errors on the caller's own
/// connection say where they happened instead.
const IN_TX: &str = "the caller's transaction";

fn tx_err(e: impl Into<BoxError>) -> StoreError {
    StoreError::new(BACKEND, IN_TX, e)
}

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
/// reads it without locking it (see `CLAIM`), so replays of a hot key do not
/// queue behind each other's transactions; only a claim that takes the row
/// holds its lock until the caller's transaction ends.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_runtime::store::tx::{AsTxConnection, TxConnection};
/// use idem_runtime::{Claim, ClaimRequest, Key, Token};
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
#[async_trait]
impl TxConnection for PgConnection {
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
