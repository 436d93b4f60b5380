//! The embedded durable store: SQLite through sqlx, in a file or in memory.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{Connection, Row as _, SqliteConnection};

use super::migrate;
use crate::clock::{Clock, SystemClock, duration_millis};
use crate::error::StoreError;
use crate::key::{Fingerprint, Key};
use crate::store::tx::TxConnection;
use crate::store::{
    AsStore, Claim, ClaimRequest, Completion, DEFAULT_MAX_RESULT_BYTES, Outcome, RecordInfo,
    RecordState, Store, StoreRef, StoredResult, Token,
};

const BACKEND: &str = "sqlite";
const RELEASED: i64 = 0;
const PROCESSING: i64 = 1;
const DONE: i64 = 2;

// The row may be taken when it is expired, released, or PROCESSING past its
// lease; a claim retried under the same token gets its own row back. SQLite
// evaluates every SET expression against the old row, so their order is free.
const CLAIM: &str = "
INSERT INTO idem_records (key, state, token, fence, lease_until, expires_at, fingerprint, taken_over)
VALUES (?1, 1, ?2, 1, ?3, ?4, ?5, 0)
ON CONFLICT (key) DO UPDATE SET
    state       = 1,
    fence       = CASE WHEN idem_records.state = 1 AND idem_records.token = excluded.token
                       THEN idem_records.fence ELSE idem_records.fence + 1 END,
    taken_over  = (idem_records.state = 1 AND idem_records.expires_at > ?6
                   AND idem_records.token <> excluded.token),
    token       = excluded.token,
    lease_until = excluded.lease_until,
    expires_at  = excluded.expires_at,
    fingerprint = excluded.fingerprint,
    outcome     = NULL,
    result      = NULL
WHERE idem_records.expires_at <= ?6
   OR idem_records.state = 0
   OR (idem_records.state = 1
       AND (idem_records.lease_until <= ?6 OR idem_records.token = excluded.token))
RETURNING fence, taken_over";

const COMPLETED_BY: &str = "SELECT 1 FROM idem_records WHERE key = ?1 AND state = 2 AND token = ?2";

const READ: &str = "
SELECT state, fence, lease_until, expires_at, fingerprint, outcome, result
FROM idem_records WHERE key = ?1";

// Expiry is kept at least as far as the lease: a body may run past its ttl,
// and while it heartbeats its record must not expire under it.
const RENEW: &str = "
UPDATE idem_records SET lease_until = ?1, expires_at = max(expires_at, ?1)
WHERE key = ?2 AND state = 1 AND token = ?3 AND expires_at > ?4";

// A released record also expires at once, so purging finds it through the
// `expires_at` index like any other dead record; the row (and its fence) stays
// until then, and a claim takes it either way.
const RELEASE: &str = "
UPDATE idem_records SET state = 0, expires_at = min(expires_at, ?3)
WHERE key = ?1 AND state = 1 AND token = ?2";

// Dead records are exactly those with `expires_at` in the past (released ones
// included, see RELEASE): the batch is a range of the `expires_at` index, read
// in its order, never a scan of the table under the write lock. SQLite has one
// writer at a time, so there is nothing to skip: sweepers and claims take
// turns, each for one bounded batch.
const PURGE: &str = "
DELETE FROM idem_records WHERE key IN (
    SELECT key FROM idem_records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)";

/// Records in SQLite: durable on one machine, exact across the processes that
/// share the file. The default embedded store.
///
/// Files are opened in WAL mode with a busy timeout, so concurrent writers wait
/// for each other instead of failing. The schema is created by embedded
/// migrations recorded in `idem_schema_migrations`.
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
    pool: SqlitePool,
    clock: Arc<dyn Clock>,
    max_result_bytes: usize,
    location: Arc<str>,
}

/// Configures a [`SqliteStore`].
#[derive(Debug)]
pub struct SqliteStoreBuilder {
    clock: Arc<dyn Clock>,
    max_result_bytes: usize,
    busy_timeout: Duration,
    max_connections: u32,
}

impl SqliteStoreBuilder {
    /// The clock for leases and expiry (default: the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The largest result kept (default 1 MiB).
    pub fn max_result_bytes(mut self, limit: usize) -> Self {
        self.max_result_bytes = limit;
        self
    }

    /// How long a writer waits for another one before failing (default 5 s).
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// The connection pool's size for files (default 8).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
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
            .map_err(|e| StoreError::new(BACKEND, url.to_owned(), e))?;
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
            .max_connections(self.max_connections)
            .connect_with(options)
            .await
            .map_err(|e| StoreError::new(BACKEND, location.clone(), e))?;
        self.finish(pool, location).await
    }

    /// A private in-memory database, gone with the store.
    pub async fn in_memory(self) -> Result<SqliteStore, StoreError> {
        let options = SqliteConnectOptions::from_str("sqlite::memory:")
            .map_err(|e| StoreError::new(BACKEND, ":memory:", e))?;
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
            .map_err(|e| StoreError::new(BACKEND, location.clone(), e))?;
        self.finish(pool, location).await
    }

    /// Uses a pool the application already has (sharing its file) and migrates it.
    pub async fn pool(self, pool: SqlitePool) -> Result<SqliteStore, StoreError> {
        let location = pool.connect_options().get_filename().display().to_string();
        self.finish(pool, location).await
    }

    async fn finish(self, pool: SqlitePool, location: String) -> Result<SqliteStore, StoreError> {
        let store = SqliteStore {
            pool,
            clock: self.clock,
            max_result_bytes: self.max_result_bytes,
            location: location.into(),
        };
        store.migrate().await?;
        Ok(store)
    }
}

impl SqliteStore {
    /// Configures a store.
    pub fn builder() -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            clock: Arc::new(SystemClock),
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
            busy_timeout: Duration::from_secs(5),
            max_connections: 8,
        }
    }

    /// Opens (creating if missing) the database file at `path`.
    pub async fn open(path: impl AsRef<Path>) -> Result<SqliteStore, StoreError> {
        SqliteStore::builder().open(path).await
    }

    /// A private in-memory database.
    pub async fn in_memory() -> Result<SqliteStore, StoreError> {
        SqliteStore::builder().in_memory().await
    }

    /// The pool, to run the application's own queries on the same database.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    fn err(&self, e: sqlx::Error) -> StoreError {
        StoreError::new(BACKEND, &*self.location, e)
    }

    fn now(&self) -> i64 {
        self.clock.now_millis()
    }

    /// Applies the embedded migrations that are not yet recorded. Idempotent,
    /// and safe to run from several processes at once (SQLite serialises the
    /// write transactions).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        sqlx::query(migrate::SQLITE_LEDGER)
            .execute(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        for m in migrate::SQLITE {
            let mut tx = conn.begin().await.map_err(|e| self.err(e))?;
            let applied: Option<i64> =
                sqlx::query_scalar("SELECT version FROM idem_schema_migrations WHERE version = ?1")
                    .bind(m.version)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(|e| self.err(e))?;
            if applied.is_some() {
                continue;
            }
            sqlx::raw_sql(m.sql)
                .execute(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
            sqlx::query(
                "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES (?1, ?2, ?3)",
            )
            .bind(m.version)
            .bind(m.description)
            .bind(SystemClock.now_millis())
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
            tx.commit().await.map_err(|e| self.err(e))?;
        }
        Ok(())
    }

    async fn read(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        read_on(&mut conn, key).await.map_err(|e| self.err(e))
    }
}

/// A record as read back.
struct Record {
    state: i64,
    fence: i64,
    lease_until: i64,
    expires_at: i64,
    fingerprint: Option<Fingerprint>,
    result: Option<StoredResultParts>,
}

struct StoredResultParts {
    outcome: Outcome,
    payload: Vec<u8>,
}

impl Record {
    fn decode(r: &SqliteRow) -> Result<Record, sqlx::Error> {
        let fingerprint: Option<Vec<u8>> = r.try_get("fingerprint")?;
        let fingerprint = fingerprint
            .map(|b| <[u8; 32]>::try_from(b.as_slice()).map(Fingerprint::from_bytes))
            .transpose()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
        let outcome: Option<i64> = r.try_get("outcome")?;
        let payload: Option<Vec<u8>> = r.try_get("result")?;
        let result = match outcome {
            None => None,
            Some(code) => Some(StoredResultParts {
                outcome: Outcome::from_code(code).ok_or_else(|| corrupt("unknown outcome code"))?,
                payload: payload.unwrap_or_default(),
            }),
        };
        Ok(Record {
            state: r.try_get("state")?,
            fence: r.try_get("fence")?,
            lease_until: r.try_get("lease_until")?,
            expires_at: r.try_get("expires_at")?,
            fingerprint,
            result,
        })
    }

    fn live(&self, now: i64) -> bool {
        self.state != RELEASED && self.expires_at > now
    }

    fn stored(self) -> Option<StoredResult> {
        let fingerprint = self.fingerprint;
        self.result.map(|r| StoredResult {
            fingerprint,
            outcome: r.outcome,
            payload: r.payload,
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
// caller's inside its transaction (`TxConnection`).

async fn read_on(conn: &mut SqliteConnection, key: &Key) -> Result<Option<Record>, sqlx::Error> {
    sqlx::query(READ)
        .bind(&key.as_bytes()[..])
        .fetch_optional(&mut *conn)
        .await?
        .map(|r| Record::decode(&r))
        .transpose()
}

async fn claim_on(
    conn: &mut SqliteConnection,
    clock: &dyn Clock,
    req: ClaimRequest<'_>,
) -> Result<Claim, sqlx::Error> {
    // The upsert and the loser's read are two statements; a row released or
    // expired in between is simply claimed on the next turn.
    for _ in 0..8 {
        let now = clock.now_millis();
        let won = sqlx::query(CLAIM)
            .bind(&req.key.as_bytes()[..])
            .bind(&req.token.0[..])
            .bind(now.saturating_add(duration_millis(req.lease)))
            .bind(now.saturating_add(duration_millis(req.ttl)))
            .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
            .bind(now)
            .fetch_optional(&mut *conn)
            .await?;
        if let Some(row) = won {
            let f: i64 = row.try_get("fence")?;
            let taken_over: bool = row.try_get("taken_over")?;
            // The statement may have waited for the database's write lock (up
            // to the busy timeout) with `now` read before: the lease must start
            // when the claim won, or it begins already spent. Inside a caller's
            // transaction the write lock is still ours, so the renewal cannot
            // fail; on the pool another writer may have taken the key over in
            // between, and then the next round says who holds it.
            let after = clock.now_millis();
            if began_long_ago(now, after, req.lease)
                && !renew_on(&mut *conn, clock, req.key, req.token, req.lease).await?
            {
                continue;
            }
            return Ok(Claim::Acquired {
                fence: fence(f),
                takeover: taken_over,
            });
        }
        let Some(row) = read_on(conn, req.key).await? else {
            continue;
        };
        if !row.live(now) {
            continue;
        }
        match row.state {
            DONE => {
                return row
                    .stored()
                    .map(Claim::Done)
                    .ok_or_else(|| corrupt("a DONE record without an outcome"));
            }
            PROCESSING if row.lease_until > now => {
                return Ok(Claim::Busy {
                    lease_remaining: remaining(row.lease_until, now),
                    fingerprint: row.fingerprint,
                });
            }
            _ => continue,
        }
    }
    Err(sqlx::Error::Protocol(
        "the record kept changing under eight claim attempts in a row".into(),
    ))
}

/// Whether a lease that started at `started` lost more than a tenth of itself
/// before `now`: the claim waited for the write lock, and its lease must start
/// again. A smaller loss is the statement's own run time.
fn began_long_ago(started: i64, now: i64, lease: Duration) -> bool {
    now.saturating_sub(started).saturating_mul(10) > duration_millis(lease)
}

async fn renew_on(
    conn: &mut SqliteConnection,
    clock: &dyn Clock,
    key: &Key,
    token: Token,
    lease: Duration,
) -> Result<bool, sqlx::Error> {
    let now = clock.now_millis();
    let done = sqlx::query(RENEW)
        .bind(now.saturating_add(duration_millis(lease)))
        .bind(&key.as_bytes()[..])
        .bind(&token.0[..])
        .bind(now)
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

async fn complete_on(
    conn: &mut SqliteConnection,
    clock: &dyn Clock,
    key: &Key,
    token: Token,
    completion: Completion<'_>,
) -> Result<bool, sqlx::Error> {
    let expires_at = clock
        .now_millis()
        .saturating_add(duration_millis(completion.ttl));
    let done = sqlx::query(
        "UPDATE idem_records SET state = 2, outcome = ?1, result = ?2, expires_at = ?3
         WHERE key = ?4 AND state = 1 AND token = ?5",
    )
    .bind(i64::from(completion.outcome.code()))
    .bind(completion.payload)
    .bind(expires_at)
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

async fn release_on(
    conn: &mut SqliteConnection,
    clock: &dyn Clock,
    key: &Key,
    token: Token,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(RELEASE)
        .bind(&key.as_bytes()[..])
        .bind(&token.0[..])
        .bind(clock.now_millis())
        .execute(&mut *conn)
        .await?;
    Ok(done.rows_affected() == 1)
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn max_result_bytes(&self) -> usize {
        self.max_result_bytes
    }

    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        claim_on(&mut conn, &*self.clock, req)
            .await
            .map_err(|e| self.err(e))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        complete_on(&mut conn, &*self.clock, key, token, completion)
            .await
            .map_err(|e| self.err(e))
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        release_on(&mut conn, &*self.clock, key, token)
            .await
            .map_err(|e| self.err(e))
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| self.err(e))?;
        renew_on(&mut conn, &*self.clock, key, token, lease)
            .await
            .map_err(|e| self.err(e))
    }

    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        let now = self.now();
        let Some(row) = self.read(key).await?.filter(|r| r.live(now)) else {
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
        let done = sqlx::query("DELETE FROM idem_records WHERE key = ?1")
            .bind(&key.as_bytes()[..])
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(PURGE)
            .bind(self.now())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(done.rows_affected())
    }
}

/// Claims inside the caller's SQLite transaction (`#[idempotent(tx = tx)]`).
/// SQLite has one writer at a time, so a concurrent duplicate waits for this
/// transaction (up to the busy timeout) and then replays or claims. Time is
/// this process's clock.
#[async_trait]
impl TxConnection for SqliteConnection {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn in_transaction(&self) -> bool {
        sqlx::Connection::is_in_transaction(self)
    }

    async fn claim(&mut self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        claim_on(self, &SystemClock, req).await.map_err(tx_err)
    }

    async fn complete(
        &mut self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        complete_on(self, &SystemClock, key, token, completion)
            .await
            .map_err(tx_err)
    }

    async fn release(&mut self, key: &Key, token: Token) -> Result<bool, StoreError> {
        release_on(self, &SystemClock, key, token)
            .await
            .map_err(tx_err)
    }
}

fn tx_err(e: sqlx::Error) -> StoreError {
    StoreError::new(BACKEND, "the caller's transaction", e)
}

impl AsStore for SqliteStore {
    fn as_store(&self) -> StoreRef {
        StoreRef::new(self.clone())
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
