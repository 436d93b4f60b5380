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
pub(crate) const SQLITE: &[Migration] = &[
    Migration {
        version: 1,
        description: "create idem_records",
        sql: include_str!("../../../migrations/sqlite/0001_create_records.sql"),
    },
    Migration {
        version: 2,
        description: "create idem_outbox",
        sql: include_str!("../../../migrations/sqlite/0002_create_outbox.sql"),
    },
    Migration {
        version: 3,
        description: "create idem_recovery",
        sql: include_str!("../../../migrations/sqlite/0003_recovery.sql"),
    },
];

#[cfg(feature = "sqlite")]
pub(crate) const SQLITE_LEDGER: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (
    version     INTEGER NOT NULL PRIMARY KEY,
    description TEXT    NOT NULL,
    applied_at  INTEGER NOT NULL
)";

#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: &[Migration] = &[
    Migration {
        version: 1,
        description: "create idem_records",
        sql: include_str!("../../../migrations/postgres/0001_create_records.sql"),
    },
    Migration {
        version: 2,
        description: "create idem_outbox",
        sql: include_str!("../../../migrations/postgres/0002_create_outbox.sql"),
    },
    Migration {
        version: 3,
        description: "create idem_recovery",
        sql: include_str!("../../../migrations/postgres/0003_recovery.sql"),
    },
    Migration {
        version: 4,
        description: "leave room for completions in idem_records",
        sql: include_str!("../../../migrations/postgres/0004_records_fillfactor.sql"),
    },
    Migration {
        version: 5,
        description: "outbox writers wake relays without a trigger",
        sql: include_str!("../../../migrations/postgres/0005_outbox_wakeup_in_insert.sql"),
    },
];

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
pub(crate) const MYSQL: &[Migration] = &[
    Migration {
        version: 1,
        description: "create idem_records",
        sql: include_str!("../../../migrations/mysql/0001_create_records.sql"),
    },
    Migration {
        version: 2,
        description: "create idem_outbox",
        sql: include_str!("../../../migrations/mysql/0002_create_outbox.sql"),
    },
    Migration {
        version: 3,
        description: "create idem_recovery",
        sql: include_str!("../../../migrations/mysql/0003_recovery.sql"),
    },
    Migration {
        version: 4,
        description: "outbox names as bytes",
        sql: include_str!("../../../migrations/mysql/0004_outbox_names_as_bytes.sql"),
    },
];

#[cfg(feature = "mysql")]
pub(crate) const MYSQL_LEDGER: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (
    version     BIGINT       NOT NULL PRIMARY KEY,
    description VARCHAR(255) NOT NULL,
    applied_at  BIGINT       NOT NULL
) ENGINE = InnoDB";

/// The whole schema as one script a DBA applies by hand (for stores built with
/// `skip_migrations()`): the ledger, every migration, and the ledger rows
/// that record them, so a store opened later with migrations on finds them
/// applied. Safe to run twice.
#[allow(dead_code)] // which dialects exist depends on the features built
fn script(
    backend: &str,
    ledger: &str,
    migrations: &[Migration],
    now_ms: &str,
    on_duplicate: &str,
) -> String {
    let mut out = format!(
        "-- idem schema for {backend}: apply once with a user that may run DDL, then open the\n\
         -- stores with .skip_migrations() under the service account (it needs SELECT, INSERT,\n\
         -- UPDATE and DELETE on idem_records, idem_outbox and idem_recovery).\n\n{};\n",
        ledger.replacen(
            "CREATE TABLE idem_schema_migrations",
            "CREATE TABLE IF NOT EXISTS idem_schema_migrations",
            1
        )
    );
    for m in migrations {
        out.push_str(&format!(
            "\n-- migration {}: {}\n{}\nINSERT INTO idem_schema_migrations (version, description, applied_at)\nVALUES ({}, '{}', {}){on_duplicate};\n",
            m.version,
            m.description,
            m.sql.trim_end(),
            m.version,
            m.description.replace('\'', "''"),
            now_ms,
        ));
    }
    out
}

/// The schema script of the SQL store whose backend is named `backend`
/// (`"sqlite"`, `"postgres"` or `"mysql"`, as [`crate::store::Store::backend`]
/// names them), if this build has that store.
pub fn schema_sql(backend: &str) -> Option<String> {
    match backend {
        #[cfg(feature = "sqlite")]
        "sqlite" => Some(script(
            "sqlite",
            SQLITE_LEDGER,
            SQLITE,
            "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
            " ON CONFLICT (version) DO NOTHING",
        )),
        #[cfg(feature = "postgres")]
        "postgres" => Some(script(
            "postgres",
            POSTGRES_LEDGER,
            POSTGRES,
            "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            " ON CONFLICT (version) DO NOTHING",
        )),
        #[cfg(feature = "mysql")]
        "mysql" => Some(script(
            "mysql",
            MYSQL_LEDGER,
            MYSQL,
            "(TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
            " ON DUPLICATE KEY UPDATE version = version",
        )),
        _ => None,
    }
}
