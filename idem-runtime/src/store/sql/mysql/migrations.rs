//! The MySQL / MariaDB schema: the embedded migrations, applied one by one
//! under a session lock (`GET_LOCK`), since DDL commits implicitly and no
//! transaction can serialise it.

use sqlx::mysql::MySqlConnection;
use sqlx::pool::PoolConnection;
use sqlx::{Executor as _, MySql};

use super::statements::now_ms;
use crate::store::sql::dialect::Migrations;
use crate::store::sql::schema_migrations;

/// A user-level lock (`GET_LOCK`) serialises migrations across processes: MySQL
/// DDL commits implicitly, so a transaction cannot do it.
const MIGRATION_LOCK: &str = "idem_migrations";
const MIGRATION_LOCK_WAIT_SECS: i64 = 60;

impl Migrations for MySql {
    /// Under a session lock (`GET_LOCK`): DDL commits implicitly, so a
    /// transaction cannot serialise it.
    async fn migrate(conn: &mut PoolConnection<MySql>) -> Result<(), sqlx::Error> {
        // The lock belongs to the session. Closing this connection afterwards
        // (instead of returning it to the pool) frees the lock even when this
        // future is dropped halfway.
        conn.close_on_drop();
        let locked: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
            .bind(MIGRATION_LOCK)
            .bind(MIGRATION_LOCK_WAIT_SECS)
            .fetch_one(&mut **conn)
            .await?;
        if locked != Some(1) {
            return Err(sqlx::Error::Protocol(format!(
                "could not take the migration lock `{MIGRATION_LOCK}` within {MIGRATION_LOCK_WAIT_SECS} s; another process is migrating"
            )));
        }
        let applied = apply_migrations(conn).await;
        let unlocked = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(MIGRATION_LOCK)
            .execute(&mut **conn)
            .await;
        applied?;
        unlocked?;
        Ok(())
    }
}

async fn apply_migrations(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    // A bare string runs as a simple query, every statement in it; the
    // futures of `sqlx::raw_sql` are not `Send` for every lifetime.
    (&mut *conn)
        .execute(schema_migrations::MYSQL_LEDGER)
        .await?;
    for m in schema_migrations::MYSQL {
        let applied: Option<i64> =
            sqlx::query_scalar("SELECT version FROM idem_schema_migrations WHERE version = ?")
                .bind(m.version)
                .fetch_optional(&mut *conn)
                .await?;
        if applied.is_some() {
            continue;
        }
        // DDL commits implicitly: the migration and its ledger row cannot share
        // a transaction. The migrations are written to be re-runnable, so a
        // crash between the two only repeats a no-op next time.
        (&mut *conn).execute(m.sql).await?;
        sqlx::query(concat!(
            "INSERT INTO idem_schema_migrations (version, description, applied_at) VALUES (?, ?, ",
            now_ms!(),
            ")"
        ))
        .bind(m.version)
        .bind(m.description)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}
