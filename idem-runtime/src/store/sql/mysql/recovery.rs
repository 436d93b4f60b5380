//! The rows of `idem_recovery` on MySQL / MariaDB: a recoverable claim's
//! arguments, the abandoned claims a worker finds, its turns, and the purge of
//! rows that no longer count. The SQL is in `statements.rs`.

use sqlx::MySql;
use sqlx::mysql::MySqlConnection;

use super::key;
use super::statements::*;
use crate::clock::Clock;
use crate::key::Key;
use crate::store::sql::dialect::RecoveryRows;
use crate::store::sql::record::millis;
use crate::store::sql::recovery;
use crate::store::{Abandoned, RecoveryArgs, RecoveryInfo, RecoveryTurn, Token, Turn};

impl RecoveryRows for MySql {
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
}
