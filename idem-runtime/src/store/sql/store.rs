//! The SQL stores' shared half: the claim loop and completion written once
//! over a [`Dialect`]'s steps, the pool path with its retries, errors, the
//! `Store` every dialect's store forwards to (`Core`, behind the `Arc` its
//! handle holds), and the `TxConnection` each dialect's connection gets from
//! [`tx_connection!`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::{Pool, PoolConnection};

use super::dialect::Dialect;
use super::record::Upserted;
use crate::clock::Clock;
use crate::error::StoreError;
use crate::key::Key;
use crate::store::{
    Abandoned, Claim, ClaimRequest, Completion, RecordInfo, RecoveryArgs, RecoveryInfo,
    RecoveryTurn, Token, Turn,
};

/// How many read-upsert rounds a claim makes before giving up on a record
/// that keeps changing under it.
const CLAIM_ROUNDS: usize = 8;

/// How many times the pool path runs an operation that lost a lock conflict
/// ([`Dialect::is_retryable`]). The same on every dialect; only which errors
/// count differs.
pub(crate) const MAX_ATTEMPTS: u32 = 6;

/// A claim on one connection: read first where the dialect needs it, then
/// its upsert, then what holds the record if the upsert did not take it.
///
/// The reads and the upsert are separate statements: a record evicted,
/// released or whose lease ran out in between is simply claimed next round.
///
/// With `done` (only inside the caller's transaction) the record is written
/// DONE with that completion in the claim itself: see [`Dialect::upsert`].
/// `in_tx` says the claim runs on the caller's transaction, where its first
/// upsert may bet on a new key (see [`Dialect::upsert`]'s `fresh_first`).
pub(crate) async fn claim_on<D: Dialect>(
    conn: &mut D::Connection,
    clock: &dyn Clock,
    req: ClaimRequest<'_>,
    done: Option<Completion<'_>>,
    in_tx: bool,
) -> Result<Claim, sqlx::Error> {
    // A record written DONE lives for the completion's ttl, as a completed
    // one does; the dialects write `req.ttl`.
    let req = match done {
        Some(completion) => ClaimRequest {
            ttl: completion.ttl,
            ..req
        },
        None => req,
    };
    for round in 0..CLAIM_ROUNDS {
        if D::READ_FIRST
            && let Some(record) = D::read(conn, clock, req.key).await?
            && let Some(answer) = record.judge(req.token)?
        {
            return Ok(answer);
        }
        let holder = match D::upsert(conn, clock, req, done, in_tx && round == 0).await? {
            Upserted::Won(won) => {
                // On the pool the row is already committed, so another caller
                // may take a lease that began too long ago before it is
                // renewed: then the renewal finds it gone and the next round
                // says who holds it. Inside a transaction the row is still
                // ours and the renewal cannot fail. A record written DONE has
                // no lease to renew: nobody takes a DONE record over.
                if done.is_none()
                    && won.began_long_ago(req.lease)
                    && !D::renew(conn, clock, req.key, req.token, req.lease).await?
                {
                    continue;
                }
                return Ok(won.claim());
            }
            Upserted::Lost(Some(record)) => record,
            Upserted::Lost(None) => match D::read(conn, clock, req.key).await? {
                Some(record) => record,
                None => continue,
            },
        };
        if let Some(answer) = holder.judge(req.token)? {
            return Ok(answer);
        }
    }
    Err(sqlx::Error::Protocol(format!(
        "the record kept changing under {CLAIM_ROUNDS} claim attempts in a row"
    )))
}

/// A completion on one connection. One re-sent after a dropped connection
/// finds the record DONE under its own token: the success it was, not a lost
/// claim.
pub(crate) async fn complete_on<D: Dialect>(
    conn: &mut D::Connection,
    clock: &dyn Clock,
    key: &Key,
    token: Token,
    completion: Completion<'_>,
) -> Result<bool, sqlx::Error> {
    Ok(D::complete(conn, clock, key, token, completion).await?
        || D::completed_by(conn, key, token).await?)
}

/// The state every SQL store holds: its pool, clock and limits.
pub(crate) struct Core<D: Dialect> {
    pub(crate) pool: Pool<D>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) max_result_bytes: usize,
    pub(crate) location: Arc<str>,
}

impl<D: Dialect> Clone for Core<D> {
    fn clone(&self) -> Self {
        Core {
            pool: self.pool.clone(),
            clock: self.clock.clone(),
            max_result_bytes: self.max_result_bytes,
            location: self.location.clone(),
        }
    }
}

impl<D: Dialect> std::fmt::Debug for Core<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("backend", &D::BACKEND)
            .field("location", &self.location)
            .field("max_result_bytes", &self.max_result_bytes)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

/// What every builder has in common.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) max_result_bytes: usize,
    pub(crate) max_connections: u32,
    // SQLite keeps sqlx's pool defaults: its writers wait on `busy_timeout`.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) acquire_timeout: Duration,
    pub(crate) migrate: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_result_bytes: crate::store::DEFAULT_MAX_RESULT_BYTES,
            max_connections: 10,
            // sqlx's own 30 s would hold a request that long while the
            // database is down.
            acquire_timeout: Duration::from_secs(5),
            migrate: true,
        }
    }
}

impl<D: Dialect> Core<D> {
    /// The store on `pool`, migrated unless `settings` skip it.
    pub(crate) async fn open(
        pool: Pool<D>,
        clock: Arc<dyn Clock>,
        settings: &Settings,
        location: String,
    ) -> Result<Self, StoreError> {
        let core = Core {
            pool,
            clock,
            max_result_bytes: settings.max_result_bytes,
            location: location.into(),
        };
        if settings.migrate {
            core.migrate().await?;
        }
        Ok(core)
    }

    pub(crate) fn err(&self, e: sqlx::Error) -> StoreError {
        StoreError::new(D::BACKEND, &*self.location, e)
    }

    async fn conn(&self) -> Result<PoolConnection<D>, sqlx::Error> {
        self.pool.acquire().await
    }

    pub(crate) async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await.map_err(|e| self.err(e))?;
        D::migrate(&mut conn).await.map_err(|e| self.err(e))
    }

    /// Runs `op` again (a bounded number of times, after a short random pause)
    /// when it lost a lock conflict. On the pool each statement is its own
    /// transaction, so the loser's effects are already rolled back, and a
    /// claim re-sent under the same token is recognised as the same claim.
    async fn retrying<T, F, Fut>(&self, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let mut attempt = 1;
        loop {
            match op().await {
                Err(e) if attempt < MAX_ATTEMPTS && D::is_retryable(&e) => {
                    tracing::debug!(backend = D::BACKEND, error = %e, attempt, "lock conflict; retrying");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt += 1;
                }
                done => return done.map_err(|e| self.err(e)),
            }
        }
    }
}

/// Every dialect's store is one `Core` behind an `Arc` (the handle types
/// forward to it): the algorithm once, each dialect's statements through
/// [`Dialect`].
impl<D: Dialect> crate::store::Store for Core<D> {
    fn backend(&self) -> &'static str {
        D::BACKEND
    }

    fn max_result_bytes(&self) -> usize {
        self.max_result_bytes
    }

    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.retrying(|| async move {
            claim_on::<D>(&mut *self.conn().await?, &*self.clock, req, None, false).await
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
            complete_on::<D>(
                &mut *self.conn().await?,
                &*self.clock,
                key,
                token,
                completion,
            )
            .await
        })
        .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        self.retrying(|| async move {
            D::release(&mut *self.conn().await?, &*self.clock, key, token, false).await
        })
        .await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        self.retrying(|| async move {
            D::renew(&mut *self.conn().await?, &*self.clock, key, token, lease).await
        })
        .await
    }

    /// A plain read takes no lock, so there is nothing to retry.
    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        let read = async {
            match D::read(&mut *self.conn().await?, &*self.clock, key).await? {
                Some(record) => record.info(),
                None => Ok(None),
            }
        };
        read.await.map_err(|e| self.err(e))
    }

    async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
        let nobody = Token::random();
        self.retrying(|| async move {
            D::evict(&mut *self.conn().await?, &*self.clock, key, nobody).await
        })
        .await
    }

    /// Not retried: purges skip locked rows where the database can, and a
    /// purge that still fails is the sweeper's to run again next round, not
    /// something to hold a connection for now. The rows of `idem_recovery`
    /// that no longer count go in the same round, and are not in the count.
    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let purge = async {
            let mut conn = self.conn().await?;
            let purged = D::purge(&mut conn, &*self.clock, limit).await?;
            D::purge_recovery(&mut conn, limit).await?;
            Ok(purged)
        };
        purge.await.map_err(|e| self.err(e))
    }

    /// The claim and the arguments in one transaction: both are there, or
    /// neither.
    async fn claim_recoverable(
        &self,
        req: ClaimRequest<'_>,
        recovery: RecoveryArgs<'_>,
    ) -> Result<Claim, StoreError> {
        self.retrying(|| async move {
            let mut tx = self.pool.begin().await?;
            let claim = claim_on::<D>(&mut tx, &*self.clock, req, None, false).await?;
            if let Claim::Acquired { takeover, .. } = claim {
                D::keep_args(&mut tx, req.key, req.token, recovery, takeover).await?;
            }
            tx.commit().await?;
            Ok(claim)
        })
        .await
    }

    /// Plain reads: nothing to retry.
    async fn recovery_scopes(&self) -> Result<Vec<String>, StoreError> {
        let read = async { D::recovery_scopes(&mut *self.conn().await?, &*self.clock).await };
        let scopes = read.await.map_err(|e| self.err(e))?;
        Ok(scopes.into_iter().map(super::recovery::text).collect())
    }

    async fn abandoned(&self, scope: &str, limit: usize) -> Result<Vec<Abandoned>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let read =
            async { D::abandoned(&mut *self.conn().await?, &*self.clock, scope, limit).await };
        read.await.map_err(|e| self.err(e))
    }

    async fn take_recovery(&self, key: &Key, turn: RecoveryTurn<'_>) -> Result<Turn, StoreError> {
        self.retrying(|| async move {
            let mut tx = self.pool.begin().await?;
            let taken = D::take_recovery(&mut tx, &*self.clock, key, turn).await?;
            tx.commit().await?;
            Ok(taken)
        })
        .await
    }

    async fn recovery_info(&self, key: &Key) -> Result<Option<RecoveryInfo>, StoreError> {
        let read = async { D::recovery_info(&mut *self.conn().await?, &*self.clock, key).await };
        read.await.map_err(|e| self.err(e))
    }

    async fn retry_recovery(&self, key: &Key) -> Result<bool, StoreError> {
        self.retrying(|| async move {
            D::retry_recovery(&mut *self.conn().await?, &*self.clock, key).await
        })
        .await
    }

    async fn stats(&self) -> Result<crate::store::RecordStats, StoreError> {
        // A plain read: nothing to retry.
        let count = async { D::stats(&mut *self.conn().await?, &*self.clock).await };
        count.await.map_err(|e| self.err(e))
    }
}

/// The stats query over `from`, with `now` the dialect's clock in
/// milliseconds. Dead records (released or expired) are counted apart from
/// live ones in any state, as the claim judges them.
pub(crate) fn stats_sql(now: &str, from: &str) -> String {
    let alive = format!("expires_at > {now} AND state <> 0");
    format!(
        "SELECT
    COUNT(CASE WHEN {alive} AND state = 1 AND lease_until > {now} THEN 1 END),
    COUNT(CASE WHEN {alive} AND state = 1 AND lease_until <= {now} THEN 1 END),
    COUNT(CASE WHEN {alive} AND state = 2 THEN 1 END),
    COUNT(CASE WHEN expires_at <= {now} OR state = 0 THEN 1 END),
    COUNT(CASE WHEN {alive} AND state NOT IN (1, 2) THEN 1 END)
FROM {from}"
    )
}

/// Counts from the one row every dialect's stats query returns, in the order
/// processing, stalled, done, dead, unknown.
pub(crate) fn stats_of(row: (i64, i64, i64, i64, i64)) -> crate::store::RecordStats {
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    crate::store::RecordStats {
        processing: n(row.0),
        stalled: n(row.1),
        done: n(row.2),
        dead: n(row.3),
        unknown: n(row.4),
    }
}

/// Whether a store error is a lost lock conflict on dialect `D`.
pub(crate) fn is_retryable<D: Dialect>(error: &StoreError) -> bool {
    error.backend() == D::BACKEND
        && std::error::Error::source(error)
            .and_then(|s| s.downcast_ref::<sqlx::Error>())
            .is_some_and(D::is_retryable)
}

/// Full jitter over a doubling window (10, 20, 40, … ms, at most 640): the
/// transactions that conflicted must not meet again in lockstep.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let window = 5u64 << attempt.min(7);
    Duration::from_millis(1 + rand::random::<u64>() % window)
}

/// Opening a store on a database server (not a file).
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod server {
    use std::path::Path;

    use sqlx::pool::{Pool, PoolOptions};
    use sqlx::{ConnectOptions as _, Connection};

    use super::{Dialect, Settings};
    use crate::error::StoreError;

    /// Opens a pool to a server, and if the server cannot be reached, says why.
    ///
    /// sqlx retries a refused connection until the acquire timeout and then
    /// reports only the timeout; one direct attempt, bounded by the same timeout
    /// (a server that accepts and never answers must not hang the start-up),
    /// recovers the reason (refused, unknown host, access denied).
    pub(crate) async fn connect_pool<D: Dialect>(
        options: <D::Connection as Connection>::Options,
        settings: &Settings,
        location: &str,
    ) -> Result<Pool<D>, StoreError> {
        let connected = PoolOptions::<D>::new()
            .max_connections(settings.max_connections)
            .acquire_timeout(settings.acquire_timeout)
            .connect_with(options.clone())
            .await;
        match connected {
            Ok(pool) => Ok(pool),
            Err(sqlx::Error::PoolTimedOut) => {
                let why =
                    match tokio::time::timeout(settings.acquire_timeout, options.connect()).await {
                        Ok(Err(e)) => e,
                        Ok(Ok(conn)) => {
                            // Up again just now: the timeout is still what happened.
                            let _ = conn.close().await;
                            sqlx::Error::PoolTimedOut
                        }
                        Err(_) => sqlx::Error::PoolTimedOut,
                    };
                Err(StoreError::new(D::BACKEND, location, why))
            }
            Err(e) => Err(StoreError::new(D::BACKEND, location, e)),
        }
    }

    /// Where a server is, for errors: `host:port/database`, `[v6]:port/database`
    /// or `unix:/path/database`, built from parsed options so a user name or a
    /// password can never slip in.
    pub(crate) fn server_location(
        socket: Option<&Path>,
        host: &str,
        port: u16,
        database: Option<&str>,
    ) -> String {
        let server = match socket {
            Some(socket) => format!("unix:{}", socket.display()),
            None if host.contains(':') => format!("[{host}]:{port}"),
            None => format!("{host}:{port}"),
        };
        match database {
            Some(db) => format!("{server}/{db}"),
            None => server,
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use server::{connect_pool, server_location};

/// `impl TxConnection` for a dialect's connection: the same steps as its
/// store, on the caller's connection, never retried (a lost deadlock has
/// rolled the caller's transaction back), on `$clock`.
macro_rules! tx_connection {
    ($(#[$doc:meta])* $conn:ty => $db:ty, $clock:expr) => {
        $(#[$doc])*
        #[async_trait::async_trait]
        impl $crate::store::tx::TxConnection for $conn {
            fn backend(&self) -> &'static str {
                <$db as $crate::store::sql::dialect::Dialect>::BACKEND
            }

            fn in_transaction(&self) -> bool {
                sqlx::Connection::is_in_transaction(self)
            }

            async fn commit_refused(&mut self) -> Result<Option<&'static str>, $crate::StoreError> {
                <$db as $crate::store::sql::dialect::Dialect>::commit_refused(self)
                    .await
                    .map_err(|e| $crate::StoreError::new(self.backend(), $crate::store::tx::IN_TX, e))
            }

            async fn claim(
                &mut self,
                req: $crate::store::ClaimRequest<'_>,
            ) -> Result<$crate::store::Claim, $crate::StoreError> {
                $crate::store::sql::store::claim_on::<$db>(self, &$clock, req, None, true)
                    .await
                    .map_err(|e| $crate::StoreError::new(self.backend(), $crate::store::tx::IN_TX, e))
            }

            fn claims_done(&self) -> bool {
                true
            }

            async fn claim_done(
                &mut self,
                req: $crate::store::ClaimRequest<'_>,
                completion: $crate::store::Completion<'_>,
            ) -> Result<$crate::store::Claim, $crate::StoreError> {
                $crate::store::sql::store::claim_on::<$db>(self, &$clock, req, Some(completion), true)
                    .await
                    .map_err(|e| $crate::StoreError::new(self.backend(), $crate::store::tx::IN_TX, e))
            }

            async fn complete(
                &mut self,
                key: &$crate::Key,
                token: $crate::store::Token,
                completion: $crate::store::Completion<'_>,
            ) -> Result<bool, $crate::StoreError> {
                $crate::store::sql::store::complete_on::<$db>(self, &$clock, key, token, completion)
                    .await
                    .map_err(|e| $crate::StoreError::new(self.backend(), $crate::store::tx::IN_TX, e))
            }

            async fn release(
                &mut self,
                key: &$crate::Key,
                token: $crate::store::Token,
            ) -> Result<bool, $crate::StoreError> {
                <$db as $crate::store::sql::dialect::Dialect>::release(self, &$clock, key, token, true)
                    .await
                    .map_err(|e| $crate::StoreError::new(self.backend(), $crate::store::tx::IN_TX, e))
            }
        }
    };
}

pub(crate) use tx_connection;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_short_and_bounded() {
        for attempt in 1..MAX_ATTEMPTS + 4 {
            let d = backoff(attempt);
            assert!(
                d >= Duration::from_millis(1) && d <= Duration::from_millis(641),
                "{d:?}"
            );
        }
    }

    #[cfg(any(feature = "postgres", feature = "mysql"))]
    #[test]
    fn locations_name_the_server_and_database_only() {
        use std::path::Path;

        assert_eq!(
            server_location(None, "db.internal", 3307, Some("orders")),
            "db.internal:3307/orders"
        );
        assert_eq!(server_location(None, "::1", 5432, None), "[::1]:5432");
        assert_eq!(
            server_location(Some(Path::new("/run/pg")), "localhost", 5432, Some("d")),
            "unix:/run/pg/d"
        );
    }
}
