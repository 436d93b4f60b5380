//! The record's life on MySQL / MariaDB: the claim's plain read and its one
//! `INSERT … ON DUPLICATE KEY UPDATE` (what its insert id says the caller
//! got), completion, release, renewal, eviction, the purge of dead records,
//! the counts, and which server errors are worth a retry. The SQL is in
//! `statements.rs`.

use std::time::{Duration, Instant};

use sqlx::mysql::{MySqlConnection, MySqlDatabaseError};
use sqlx::{Connection as _, MySql, Row as _};

use super::key;
use super::statements::*;
use crate::clock::Clock;
use crate::key::Key;
use crate::store::sql::dialect::Dialect;
use crate::store::sql::record::{Record, Upserted, Won, claimed_state, millis, released_up_to};
use crate::store::sql::store::{stats_of, stats_sql};
use crate::store::{ClaimRequest, Completion, Token};

/// `ER_LOCK_DEADLOCK`: InnoDB chose this statement's transaction as a deadlock
/// victim and rolled it back.
const ER_LOCK_DEADLOCK: u16 = 1213;

/// `ER_LOCK_WAIT_TIMEOUT`: a row lock was not granted within
/// `innodb_lock_wait_timeout`.
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// `Unknown system variable`.
const ER_UNKNOWN_SYSTEM_VARIABLE: u16 = 1193;

pub(super) fn is_transient_code(number: u16) -> bool {
    matches!(number, ER_LOCK_DEADLOCK | ER_LOCK_WAIT_TIMEOUT)
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
        _fresh_first: bool,
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
        let row = sqlx::query_as(&stats_sql(now_ms!(), "idem_records"))
            .fetch_one(conn)
            .await?;
        Ok(stats_of(row))
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
