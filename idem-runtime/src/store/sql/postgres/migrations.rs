//! The PostgreSQL schema: the embedded migrations, all in one transaction
//! under `pg_advisory_xact_lock` (DDL is transactional here).

use sqlx::pool::PoolConnection;
use sqlx::postgres::Postgres;
use sqlx::{Connection as _, Executor as _};

use super::statements::server_now;
use crate::store::sql::dialect::Migrations;
use crate::store::sql::schema_migrations;

impl Migrations for Postgres {
    /// One transaction under `pg_advisory_xact_lock` does it all: DDL is
    /// transactional here, so a second process waits and then finds
    /// everything applied.
    async fn migrate(conn: &mut PoolConnection<Postgres>) -> Result<(), sqlx::Error> {
        let mut tx = conn.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(schema_migrations::POSTGRES_LOCK)
            .execute(&mut *tx)
            .await?;
        // Checked rather than `CREATE TABLE IF NOT EXISTS`, which logs a notice
        // at every start; the lock makes check-then-create safe.
        let has_ledger: bool =
            sqlx::query_scalar("SELECT to_regclass('idem_schema_migrations') IS NOT NULL")
                .fetch_one(&mut *tx)
                .await?;
        if !has_ledger {
            sqlx::query(schema_migrations::POSTGRES_LEDGER)
                .execute(&mut *tx)
                .await?;
        }
        let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM idem_schema_migrations")
            .fetch_all(&mut *tx)
            .await?;
        for m in schema_migrations::POSTGRES {
            if applied.contains(&m.version) {
                continue;
            }
            // A bare string runs as a simple query, so a migration may hold
            // several statements. (`sqlx::raw_sql` would too, but its future
            // is not `Send` for every lifetime.)
            tx.execute(m.sql).await?;
            sqlx::query(concat!(
                "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES ($1, $2, ",
                server_now!(),
                ")"
            ))
            .bind(m.version)
            .bind(m.description)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await
    }
}
