//! The rows of `idem_recovery` on PostgreSQL: a recoverable claim's
//! arguments, the abandoned claims a worker finds, its turns, and the purge of
//! rows that no longer count. The SQL is in `statements.rs`.

use sqlx::postgres::{PgConnection, Postgres};

use super::key;
use super::statements::*;
use crate::clock::Clock;
use crate::key::Key;
use crate::store::sql::dialect::RecoveryRows;
use crate::store::sql::record::millis;
use crate::store::sql::recovery;
use crate::store::{Abandoned, RecoveryArgs, RecoveryInfo, RecoveryTurn, Token, Turn};

impl RecoveryRows for Postgres {
    async fn keep_args(
        conn: &mut PgConnection,
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
        conn: &mut PgConnection,
        _: &dyn Clock,
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        sqlx::query_scalar(RECOVERY_SCOPES).fetch_all(conn).await
    }

    async fn abandoned(
        conn: &mut PgConnection,
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
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
        turn: RecoveryTurn<'_>,
    ) -> Result<Turn, sqlx::Error> {
        let after: Option<(i64, bool)> = sqlx::query_as(TAKE_TURN)
            .bind(key(k))
            .bind(i64::try_from(turn.fence).unwrap_or(i64::MAX))
            .bind(recovery::limit(&turn))
            .bind(turn.note.as_bytes())
            .bind(millis(turn.retry_in))
            .fetch_optional(conn)
            .await?;
        Ok(recovery::turn(after))
    }

    async fn recovery_info(
        conn: &mut PgConnection,
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
        conn: &mut PgConnection,
        _: &dyn Clock,
        k: &Key,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(RETRY_RECOVERY)
            .bind(key(k))
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn purge_recovery(conn: &mut PgConnection, limit: i64) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(PURGE_RECOVERY)
            .bind(limit)
            .execute(conn)
            .await?;
        Ok(done.rows_affected())
    }
}
