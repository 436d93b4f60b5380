//! Embedded schema migrations, recorded in a table of our own
//! (`idem_schema_migrations`) so they never mix with the application's
//! `_sqlx_migrations`.

/// One embedded migration.
#[allow(dead_code)] // which fields a dialect reads depends on the features built
pub(crate) struct Migration {
    pub version: i64,
    pub description: &'static str,
    pub sql: &'static str,
}

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: &[Migration] = &[Migration {
    version: 1,
    description: "create idem_records",
    sql: include_str!("../../../migrations/sqlite/0001_create_records.sql"),
}];

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_LEDGER: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (
    version     INTEGER NOT NULL PRIMARY KEY,
    description TEXT    NOT NULL,
    applied_at  INTEGER NOT NULL
)";

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: &[Migration] = &[Migration {
    version: 1,
    description: "create idem_records",
    sql: include_str!("../../../migrations/postgres/0001_create_records.sql"),
}];

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES_LEDGER: &str = "CREATE TABLE idem_schema_migrations (
    version     BIGINT NOT NULL PRIMARY KEY,
    description TEXT   NOT NULL,
    applied_at  BIGINT NOT NULL
)";

/// The `pg_advisory_xact_lock` key that serialises migrations across processes
/// (the ASCII of "idemmigr"): two replicas starting at once would otherwise race
/// to create the tables, and concurrent `CREATE TABLE IF NOT EXISTS` statements
/// can still fail on PostgreSQL with a unique violation in its catalog.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES_LOCK: i64 = 0x6964_656d_6d69_6772;

#[cfg(feature = "mysql")]
pub(crate) const MYSQL: &[Migration] = &[Migration {
    version: 1,
    description: "create idem_records",
    sql: include_str!("../../../migrations/mysql/0001_create_records.sql"),
}];

#[cfg(feature = "mysql")]
pub(crate) const MYSQL_LEDGER: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (
    version     BIGINT       NOT NULL PRIMARY KEY,
    description VARCHAR(255) NOT NULL,
    applied_at  BIGINT       NOT NULL
) ENGINE = InnoDB";
