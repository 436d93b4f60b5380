//! The SQLite schema: the embedded migrations, each in its own write
//! transaction (SQLite serialises writers, so no other lock is needed).

use sqlx::pool::PoolConnection;
use sqlx::{Connection as _, Executor as _, Sqlite};

use crate::clock::{Clock, SystemClock};
use crate::store::sql::dialect::Migrations;
use crate::store::sql::schema_migrations;

impl Migrations for Sqlite {
    /// Each migration in its own write transaction: SQLite serialises them,
    /// and a second process finds the ledger row and skips.
    async fn migrate(conn: &mut PoolConnection<Sqlite>) -> Result<(), sqlx::Error> {
        sqlx::query(schema_migrations::SQLITE_LEDGER)
            .execute(&mut **conn)
            .await?;
        for m in schema_migrations::SQLITE {
            let mut tx = conn.begin().await?;
            let applied: Option<i64> =
                sqlx::query_scalar("SELECT version FROM idem_schema_migrations WHERE version = ?1")
                    .bind(m.version)
                    .fetch_optional(&mut *tx)
                    .await?;
            if applied.is_some() {
                continue;
            }
            // A bare string runs every statement in it; `sqlx::raw_sql` would
            // too, but its future is not `Send` for every lifetime.
            (&mut *tx).execute(m.sql).await?;
            sqlx::query(
                "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES (?1, ?2, ?3)",
            )
            .bind(m.version)
            .bind(m.description)
            .bind(SystemClock.now_millis())
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
        Ok(())
    }
}
