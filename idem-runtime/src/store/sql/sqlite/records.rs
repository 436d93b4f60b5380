//! The record's life on SQLite: the claim's one upsert, completion, release,
//! renewal, eviction, the purge of dead records and the counts, on the
//! store's clock. SQLite has one writer at a time, so no error is worth a
//! retry and there is no row lock to spare. The SQL is in `statements.rs`.

use std::time::Duration;

use sqlx::{Row as _, Sqlite, SqliteConnection};

use super::key;
use super::statements::*;
use crate::clock::Clock;
use crate::key::Key;
use crate::store::sql::dialect::Dialect;
use crate::store::sql::record::{Record, Upserted, Won, claimed_state, millis, released_up_to};
use crate::store::sql::store::{stats_of, stats_sql};
use crate::store::{ClaimRequest, Completion, Token};

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
        _fresh_first: bool,
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
        let row = sqlx::query_as(&stats_sql("?1", "idem_records"))
            .bind(clock.now_millis())
            .fetch_one(conn)
            .await?;
        Ok(stats_of(row))
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
