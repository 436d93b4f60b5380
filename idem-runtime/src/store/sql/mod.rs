//! Stores on SQL databases through sqlx (runtime queries only: a library must
//! not need a `DATABASE_URL` at build time).
//!
//! Each dialect claims with one upsert whose `WHERE` decides whether the
//! existing row may be taken (`INSERT … ON CONFLICT … DO UPDATE … WHERE`), never
//! by catching a unique violation.

mod migrate;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

#[cfg(feature = "mysql")]
pub use mysql::{MySqlStore, MySqlStoreBuilder};
#[cfg(feature = "postgres")]
pub use postgres::{PgStore, PgStoreBuilder};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteStore, SqliteStoreBuilder};
