//! Opening the store `--store` names (or, for the outbox, its database),
//! without running any DDL.

use std::path::Path;
use std::time::Duration;

use idem_runtime::store::StoreRef;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sql::{MySqlStore, PgStore, SqliteStore};

use crate::Failure;

enum Kind<'a> {
    Sqlite(&'a str),
    Postgres,
    MySql,
    Redis,
}

/// The schemes of the server stores: a string that starts with one of these
/// but lacks its `//` is a mistyped URL, never a SQLite path.
const SERVER_SCHEMES: [&str; 6] = [
    "postgres",
    "postgresql",
    "mysql",
    "mariadb",
    "redis",
    "rediss",
];

fn kind(url: &str) -> Result<Kind<'_>, Failure> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    if scheme.is_none() {
        // Never quote the string back: a mistyped URL may hold a password.
        if let Some((s, _)) = url.split_once(':') {
            if SERVER_SCHEMES.iter().any(|k| s.eq_ignore_ascii_case(k)) {
                return Err(Failure::Error(format!(
                    "malformed store URL: `{}:` must be followed by `//` (e.g. {}://user@host/db); the rest is not shown, it may hold a password",
                    s.to_ascii_lowercase(),
                    s.to_ascii_lowercase()
                )));
            }
        }
    }
    match scheme.as_deref() {
        Some("postgres" | "postgresql") => Ok(Kind::Postgres),
        Some("mysql" | "mariadb") => Ok(Kind::MySql),
        Some("redis" | "rediss" | "redis+unix" | "unix") => Ok(Kind::Redis),
        Some("sqlite") => Ok(Kind::Sqlite(&url["sqlite://".len()..])),
        Some(other) => Err(Failure::Error(format!(
            "unknown store URL scheme {other:?}: use a SQLite path, postgres://, mysql:// or redis://"
        ))),
        None => Ok(Kind::Sqlite(url.strip_prefix("sqlite:").unwrap_or(url))),
    }
}

/// The SQL dialect of a store URL (for `schema`), without connecting.
pub fn dialect_of(url: &str) -> Result<&'static str, Failure> {
    match kind(url)? {
        Kind::Sqlite(_) => Ok("sqlite"),
        Kind::Postgres => Ok("postgres"),
        Kind::MySql => Ok("mysql"),
        Kind::Redis => Err(Failure::Error(
            "a Redis store has no schema to apply".into(),
        )),
    }
}

/// Opens the store. SQL stores skip their migrations: an operator's tool
/// never changes a schema, and may run as a user that cannot.
pub async fn open(url: &str, redis_prefix: &str) -> Result<StoreRef, Failure> {
    Ok(match kind(url)? {
        Kind::Sqlite(path) => {
            check_sqlite_file(path)?;
            StoreRef::new(SqliteStore::builder().skip_migrations().open(path).await?)
        }
        Kind::Postgres => StoreRef::new(
            PgStore::builder()
                .skip_migrations()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(3))
                .connect(url)
                .await?,
        ),
        Kind::MySql => StoreRef::new(
            MySqlStore::builder()
                .skip_migrations()
                .max_connections(2)
                .acquire_timeout(Duration::from_secs(3))
                .connect(&mysql_url(url))
                .await?,
        ),
        Kind::Redis => StoreRef::new(
            RedisStore::builder()
                .key_prefix(redis_prefix)
                .connect(url)
                .await?,
        ),
    })
}

/// The pool of a SQL store's database, for the outbox (its table lives there).
pub enum SqlPool {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
}

/// Opens the database of a SQL store the way [`open`] does (no DDL), with up
/// to `connections` connections to a server.
pub async fn open_sql(url: &str, connections: u32) -> Result<SqlPool, Failure> {
    Ok(match kind(url)? {
        Kind::Sqlite(path) => {
            check_sqlite_file(path)?;
            let store = SqliteStore::builder().skip_migrations().open(path).await?;
            SqlPool::Sqlite(store.pool().clone())
        }
        Kind::Postgres => {
            let store = PgStore::builder()
                .skip_migrations()
                .max_connections(connections)
                .acquire_timeout(Duration::from_secs(3))
                .connect(url)
                .await?;
            SqlPool::Postgres(store.pool().clone())
        }
        Kind::MySql => {
            let store = MySqlStore::builder()
                .skip_migrations()
                .max_connections(connections)
                .acquire_timeout(Duration::from_secs(3))
                .connect(&mysql_url(url))
                .await?;
            SqlPool::MySql(store.pool().clone())
        }
        Kind::Redis => {
            return Err(Failure::Error(
                "the outbox lives in a SQL database (the one the service writes its messages in): pass --store a SQLite path or a postgres:// or mysql:// URL, not redis://".into(),
            ));
        }
    })
}

fn check_sqlite_file(path: &str) -> Result<(), Failure> {
    if path.is_empty() || !Path::new(path).is_file() {
        return Err(Failure::Error(format!(
            "no SQLite database at {} (the path is a file the service opened with SqliteStore::open)",
            shown_path(path)
        )));
    }
    Ok(())
}

/// sqlx knows MariaDB as `mysql://` only.
fn mysql_url(url: &str) -> String {
    match url.split_once("://") {
        Some((s, rest)) if s.eq_ignore_ascii_case("mariadb") => format!("mysql://{rest}"),
        _ => url.to_owned(),
    }
}

/// A path as an error may quote it: what looks like credentials (anything
/// before an `@`, as in a URL's `user:password@`) is left out.
fn shown_path(path: &str) -> String {
    match path.rsplit_once('@') {
        Some((_, rest)) => format!("\"…@{rest}\" (the part before `@` is not shown)"),
        None => format!("{path:?}"),
    }
}
