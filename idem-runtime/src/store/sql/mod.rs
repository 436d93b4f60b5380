//! Stores on SQL databases through sqlx (runtime queries only: a library must
//! not need a `DATABASE_URL` at build time).
//!
//! One record layer serves every dialect: the decoded row and its judgement
//! (`record`), the claim loop, completion, retries and the `Store` /
//! `TxConnection` forwarding (`store`). Each dialect file supplies only what
//! differs (`dialect::Dialect`): its SQL, its clock, its migration lock and
//! which of its errors are worth a retry.
//!
//! Each dialect claims with one upsert whose `WHERE` decides whether the
//! existing row may be taken (`INSERT … ON CONFLICT … DO UPDATE … WHERE`), never
//! by catching a unique violation.
//!
//! ```
//! use idem_runtime::store::sql::SqliteStore;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let dir = std::env::temp_dir().join(format!("idem-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! // Opening applies idem's migrations (`skip_migrations()` on the builder to leave them to you).
//! let store = SqliteStore::open(dir.join("idem.db")).await.unwrap();
//! idem_runtime::install(store);
//! # std::fs::remove_dir_all(&dir).ok();
//! # });
//! ```

mod dialect;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod record;
mod recovery;
mod schema_migrations;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use mysql::{MySqlStore, MySqlStoreBuilder};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::{PgStore, PgStoreBuilder};
pub use schema_migrations::schema_sql;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use sqlite::{SqliteStore, SqliteStoreBuilder};
