//! The rows of `idem_recovery` on SQLite: a recoverable claim's arguments,
//! the abandoned claims a worker finds, its turns, and the purge of rows that
//! no longer count. The SQL is in `statements.rs`.

use sqlx::{Sqlite, SqliteConnection};

use super::key;
use super::statements::*;
use crate::clock::Clock;
use crate::key::Key;
use crate::store::sql::dialect::RecoveryRows;
use crate::store::sql::record::millis;
use crate::store::sql::recovery;
use crate::store::{Abandoned, RecoveryArgs, RecoveryInfo, RecoveryTurn, Token, Turn};

impl RecoveryRows for Sqlite {
    async fn keep_args(
        conn: &mut SqliteConnection,
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
            .execute(conn)
            .await
            .map(drop)
    }

    async fn recovery_scopes(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        sqlx::query_scalar(RECOVERY_SCOPES)
            .bind(clock.now_millis())
            .fetch_all(conn)
            .await
    }

    async fn abandoned(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        scope: &str,
        limit: i64,
    ) -> Result<Vec<Abandoned>, sqlx::Error> {
        let rows = sqlx::query(ABANDONED)
            .bind(scope.as_bytes())
            .bind(clock.now_millis())
            .bind(limit)
            .fetch_all(conn)
            .await?;
        rows.iter().map(recovery::abandoned).collect()
    }

    async fn take_recovery(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
        turn: RecoveryTurn<'_>,
    ) -> Result<Turn, sqlx::Error> {
        let taken = sqlx::query(TAKE_TURN)
            .bind(key(k))
            .bind(i64::try_from(turn.fence).unwrap_or(i64::MAX))
            .bind(recovery::limit(&turn))
            .bind(turn.note.as_bytes())
            .bind(clock.now_millis())
            .bind(millis(turn.retry_in))
            .execute(&mut *conn)
            .await?;
        if taken.rows_affected() == 0 {
            return Ok(Turn::Gone);
        }
        let after: (i64, bool) = sqlx::query_as(TAKEN).bind(key(k)).fetch_one(conn).await?;
        Ok(recovery::turn(Some(after)))
    }

    async fn recovery_info(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
    ) -> Result<Option<RecoveryInfo>, sqlx::Error> {
        let row = sqlx::query(RECOVERY_INFO)
            .bind(key(k))
            .bind(clock.now_millis())
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(recovery::info).transpose()
    }

    async fn retry_recovery(
        conn: &mut SqliteConnection,
        clock: &dyn Clock,
        k: &Key,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RETRY_RECOVERY)
            .bind(key(k))
            .bind(clock.now_millis())
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_recovery(conn: &mut SqliteConnection, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(PURGE_RECOVERY)
            .bind(limit)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }
}
