//! The record's life on PostgreSQL: the claim (CLAIM, or INSERT_FRESH first
//! inside the caller's transaction, then TAKE for a record that may be
//! taken over), completion, release, renewal, eviction, the purge of dead
//! records, the counts, and which server errors are worth a retry. The SQL is
//! in `statements.rs`.

use std::time::Duration;

use sqlx::postgres::{PgConnection, Postgres};
use sqlx::{Executor as _, Row as _};

use super::key;
use super::statements::*;
use crate::clock::Clock;
use crate::key::Key;
use crate::store::sql::dialect::Dialect;
use crate::store::sql::record::{
    Record, Upserted, Won, claimed_state, completion_slack, millis, released_up_to,
};
use crate::store::sql::store::{stats_of, stats_sql};
use crate::store::{ClaimRequest, Completion, Token};

/// CLAIM or TAKE, which take the same parameters.
fn claim_query<'q>(
    sql: &'q str,
    req: &'q ClaimRequest<'_>,
    done: Option<Completion<'q>>,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(key(req.key))
        .bind(&req.token.as_bytes()[..])
        .bind(millis(req.lease))
        .bind(millis(req.ttl))
        .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
        .bind(claimed_state(done) as i16)
        .bind(done.map(|d| i16::from(d.outcome.code())))
        .bind(done.map(|d| d.payload))
}

fn won(row: &sqlx::postgres::PgRow) -> Result<Won, sqlx::Error> {
    Ok(Won {
        fence: row.try_get("fence")?,
        takeover: row.try_get("taken_over")?,
        lease_until: row.try_get("lease_until")?,
        now: row.try_get("now")?,
    })
}

impl Dialect for Postgres {
    const BACKEND: &'static str = "postgres";

    /// No: CLAIM reads first itself (its `NOT EXISTS`, and the record it
    /// answers with), in the same round trip.
    const READ_FIRST: bool = false;

    async fn read(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
    ) -> Result<Option<Record>, sqlx::Error> {
        let row = sqlx::query(READ).bind(key(k)).fetch_optional(conn).await?;
        row.map(|r| Record::decode(&r, r.try_get("now")?))
            .transpose()
    }

    async fn upsert(
        conn: &mut PgConnection,
        _: &dyn Clock,
        req: ClaimRequest<'_>,
        done: Option<Completion<'_>>,
        fresh_first: bool,
    ) -> Result<Upserted, sqlx::Error> {
        if fresh_first
            && let Some(row) = claim_query(INSERT_FRESH, &req, done)
                .fetch_optional(&mut *conn)
                .await?
        {
            return won(&row).map(Upserted::Won);
        }
        let Some(row) = claim_query(CLAIM, &req, done)
            .fetch_optional(&mut *conn)
            .await?
        else {
            return Ok(Upserted::Lost(None));
        };
        if row.try_get("won")? {
            return won(&row).map(Upserted::Won);
        }
        let record = Record::decode(&row, row.try_get("now")?)?;
        if record.holds_off(req.token) {
            return Ok(Upserted::Lost(Some(record)));
        }
        match claim_query(TAKE, &req, done).fetch_optional(conn).await? {
            Some(row) => won(&row).map(Upserted::Won),
            None => Ok(Upserted::Lost(None)),
        }
    }

    async fn complete(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(COMPLETE)
            .bind(i16::from(completion.outcome.code()))
            .bind(completion.payload)
            .bind(millis(completion.ttl))
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .bind(completion_slack(completion.ttl))
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn completed_by(
        conn: &mut PgConnection,
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
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        done_too: bool,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RELEASE)
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .bind(released_up_to(done_too) as i16)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        token: Token,
        lease: Duration,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RENEW)
            .bind(millis(lease))
            .bind(key(k))
            .bind(&token.as_bytes()[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn evict(
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        nobody: Token,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(EVICT)
            .bind(key(k))
            .bind(&nobody.as_bytes()[..])
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge(conn: &mut PgConnection, _: &dyn Clock, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(PURGE).bind(limit).execute(conn).await?;
        Ok(done.rows_affected())
    }

    async fn stats(
        conn: &mut PgConnection,
        _: &dyn Clock,
    ) -> Result<crate::store::RecordStats, sqlx::Error> {
        let sql = format!(
            "{}{}",
            with_clock!(),
            stats_sql("clock.now", "idem_records CROSS JOIN clock")
        );
        let row = sqlx::query_as(&sql).fetch_one(conn).await?;
        Ok(stats_of(row))
    }

    fn is_retryable(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Database(db) => {
                matches!(db.code().as_deref(), Some("40P01" | "40001" | "55P03"))
            }
            _ => false,
        }
    }

    async fn commit_refused(conn: &mut PgConnection) -> Result<Option<&'static str>, sqlx::Error> {
        // sqlx keeps the server's transaction status ('E' in ReadyForQuery)
        // to itself, so ask: in an aborted transaction every statement fails
        // with 25P02 until it ends.
        match conn.execute("SELECT 1").await {
            Ok(_) => Ok(None),
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("25P02") => Ok(Some(
                "the transaction was aborted by an earlier failed statement: \
                 PostgreSQL would roll it back at COMMIT",
            )),
            Err(e) => Err(e),
        }
    }
}
