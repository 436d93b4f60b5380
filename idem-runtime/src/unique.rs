//! The unique-constraint backstop as a helper: "conflict is success".
//!
//! A business table with a unique key (a ledger row per order, an order per
//! client order number) is what stops a second effect when everything else
//! failed: the claim lost to a Redis failover, a crash between the business
//! commit and the record, a key secret rotated mid-retry. Two helpers run the
//! statements that make that constraint an answer instead of an error:
//!
//! - [`InsertOnce`]: an `INSERT` whose unique violation means "already done".
//!   It appends the dialect's no-op conflict clause itself
//!   (`ON CONFLICT (…) DO NOTHING` on PostgreSQL and SQLite, a no-op
//!   `ON DUPLICATE KEY UPDATE` on MySQL) and says whether the row was new.
//!   Never `INSERT IGNORE`, which also turns truncation and other data errors
//!   into warnings, and never a caught unique violation, which on PostgreSQL
//!   aborts the surrounding transaction. [`InsertOnce::returning`] makes it an
//!   [`InsertReturning`], which hands back the row's columns, the new row's or
//!   the one already there ([`Found`]), for the step that must find its own
//!   row when it runs again.
//! - [`Transition`]: the state-machine guard
//!   `UPDATE t SET status = to WHERE id = … AND status = from`; zero rows means
//!   the row had already moved.
//!
//! All count every "already done" answer as
//! `idem_unique_conflicts_total{scope}`. Next to
//! `idem_calls_total{outcome="replayed"}` it is one dashboard: replays are the
//! duplicates idem caught, conflicts the ones that got past it to the
//! database. Conflicts rising while replays do not means the keys or the store
//! are not doing their job.
//!
//! All take a pool, a connection, or the caller's transaction (`&mut *tx`;
//! [`InsertReturning`], which runs two statements, also `&mut tx`): they never
//! raise an error on a duplicate, so the transaction stays usable.
//!
//! ```
//! # #[cfg(all(feature = "sqlite", feature = "postgres"))] mod doc {
//! # use sqlx::{Postgres, Sqlite};
//! # async fn go(
//! #     mut tx: sqlx::Transaction<'static, Sqlite>,
//! #     pool: sqlx::PgPool,
//! #     (uid, no, sku, qty, order_id): (i64, String, String, i64, i64),
//! # ) -> Result<(), sqlx::Error> {
//! use idem_runtime::unique::{InsertOnce, Transition};
//!
//! let ledger = InsertOnce::<Sqlite>::new(
//!     "orders.stock_ledger",
//!     "INSERT INTO stock_ledger (user_id, client_order_no, sku, delta) VALUES (?1, ?2, ?3, ?4)",
//!     &["user_id", "client_order_no", "sku"],
//! )?;
//! if ledger.run(&mut *tx, |q| q.bind(uid).bind(&no).bind(&sku).bind(-qty)).await? {
//!     // the row is new: move the stock
//! }
//! let pay = Transition::<Postgres>::new("orders.pay", "orders", "id", "status")?;
//! pay.run(&pool, order_id, "unpaid", "paid").await?; // false: already paid
//! # Ok(())
//! # }
//! # }
//! ```

use std::marker::PhantomData;

mod returning;
pub use returning::{Found, InsertReturning};

use sqlx::query::Query;
use sqlx::{Database, Encode, Executor, IntoArguments, Type};

/// The metric counting "already done" answers, labelled `scope`.
pub const CONFLICTS_METRIC: &str = "idem_unique_conflicts_total";

fn conflict(scope: &str) {
    metrics::counter!(CONFLICTS_METRIC, "scope" => scope.to_owned()).increment(1);
}

mod sealed {
    pub trait Sealed {}
}

/// A database the helpers speak: SQLite, PostgreSQL or MySQL (by the crate's
/// features). Sealed: the SQL each writes is part of the contract.
pub trait UniqueDialect: Database + sealed::Sealed {
    #[doc(hidden)]
    fn conflict_clause(columns: &[&str]) -> String;
    #[doc(hidden)]
    fn placeholder(n: usize) -> String;
    #[doc(hidden)]
    fn inserted(result: &Self::QueryResult) -> bool;
    #[doc(hidden)]
    fn rows(result: &Self::QueryResult) -> u64;
    /// The clause that makes the insert return the new row, where there is
    /// one.
    #[doc(hidden)]
    fn returning_clause(columns: &str) -> Option<String>;
    /// How the read of an existing row locks it.
    #[doc(hidden)]
    fn locking_read() -> &'static str;
}

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
impl sealed::Sealed for sqlx::Sqlite {}
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
impl UniqueDialect for sqlx::Sqlite {
    fn conflict_clause(columns: &[&str]) -> String {
        format!(" ON CONFLICT ({}) DO NOTHING", columns.join(", "))
    }
    fn placeholder(n: usize) -> String {
        format!("?{n}")
    }
    fn inserted(result: &Self::QueryResult) -> bool {
        result.rows_affected() == 1
    }
    fn rows(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
    fn returning_clause(columns: &str) -> Option<String> {
        Some(format!(" RETURNING {columns}"))
    }
    fn locking_read() -> &'static str {
        // The insert took the database's write lock: nothing to add.
        ""
    }
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl sealed::Sealed for sqlx::Postgres {}
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl UniqueDialect for sqlx::Postgres {
    fn conflict_clause(columns: &[&str]) -> String {
        format!(" ON CONFLICT ({}) DO NOTHING", columns.join(", "))
    }
    fn placeholder(n: usize) -> String {
        format!("${n}")
    }
    fn inserted(result: &Self::QueryResult) -> bool {
        result.rows_affected() == 1
    }
    fn rows(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
    fn returning_clause(columns: &str) -> Option<String> {
        Some(format!(" RETURNING {columns}"))
    }
    fn locking_read() -> &'static str {
        // The weakest lock that keeps the row from being deleted until the
        // caller's transaction ends (what a foreign key takes); under READ
        // COMMITTED a row deleted meanwhile is not read, and the insert runs
        // again.
        " FOR KEY SHARE"
    }
}

/// What the MySQL conflict clause leaves as the statement's insert id: sqlx
/// connects with `CLIENT_FOUND_ROWS`, so a no-op update reports one affected
/// row just like an insert, and the insert id is what tells them apart. An
/// `AUTO_INCREMENT` column never reaches it.
#[cfg(feature = "mysql")]
const MYSQL_DUPLICATE: u64 = i64::MAX as u64;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
impl sealed::Sealed for sqlx::MySql {}
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
impl UniqueDialect for sqlx::MySql {
    fn conflict_clause(columns: &[&str]) -> String {
        // MySQL has no conflict target: any unique key of the table fires it.
        // The assignment keeps the column as it is (a no-op update) and marks
        // the statement's insert id.
        let c = columns[0];
        format!(" ON DUPLICATE KEY UPDATE {c} = IF(LAST_INSERT_ID({MYSQL_DUPLICATE}), {c}, {c})")
    }
    fn placeholder(_: usize) -> String {
        "?".to_owned()
    }
    fn inserted(result: &Self::QueryResult) -> bool {
        result.rows_affected() >= 1 && result.last_insert_id() != MYSQL_DUPLICATE
    }
    fn rows(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
    fn returning_clause(_: &str) -> Option<String> {
        // MariaDB's `INSERT … RETURNING` is not MySQL's: the row is read
        // after the insert, new or not.
        None
    }
    fn locking_read() -> &'static str {
        // A locking read sees the latest committed row; a plain one inside a
        // REPEATABLE READ transaction sees its snapshot, which misses a row
        // committed after it was taken (the duplicate the insert just met).
        // Both MySQL and MariaDB spell it so.
        " LOCK IN SHARE MODE"
    }
}

/// Why a helper's statement was refused before it ran.
fn invalid(msg: String) -> sqlx::Error {
    sqlx::Error::InvalidArgument(msg)
}

fn identifier(what: &str, name: &str) -> Result<(), sqlx::Error> {
    let mut chars = name.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "{what} {name:?} is not a plain SQL identifier (letters, digits, '_', '.')"
        )))
    }
}

/// An `INSERT` that is done at most once per unique key.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use idem_runtime::unique::InsertOnce;
///
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// sqlx::query("CREATE TABLE ledger (order_no TEXT PRIMARY KEY, delta INTEGER NOT NULL)")
///     .execute(&pool)
///     .await?;
/// let ledger = InsertOnce::<sqlx::Sqlite>::new(
///     "orders.ledger",
///     "INSERT INTO ledger (order_no, delta) VALUES (?1, ?2)",
///     &["order_no"],
/// )?;
/// assert!(ledger.run(&pool, |q| q.bind("A-1").bind(-2)).await?); // new
/// assert!(!ledger.run(&pool, |q| q.bind("A-1").bind(-2)).await?); // already done
/// # Ok::<(), sqlx::Error>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
pub struct InsertOnce<DB> {
    scope: String,
    sql: String,
    /// The statement as given, for [`InsertOnce::returning`].
    insert: String,
    conflict_on: Vec<String>,
    _db: PhantomData<fn() -> DB>,
}

// By hand: a derive would ask `DB: Clone`, which sqlx's database types are
// not, and a service holding one could not be `Clone`.
impl<DB> Clone for InsertOnce<DB> {
    fn clone(&self) -> Self {
        InsertOnce {
            scope: self.scope.clone(),
            sql: self.sql.clone(),
            insert: self.insert.clone(),
            conflict_on: self.conflict_on.clone(),
            _db: PhantomData,
        }
    }
}

impl<DB: UniqueDialect> InsertOnce<DB> {
    /// `insert` is a plain `INSERT INTO … VALUES …` (or `… SELECT …`) with the
    /// dialect's placeholders and no conflict clause of its own;
    /// `conflict_on` names the unique key whose violation means "already
    /// done" (on MySQL any unique key of the table counts: it has no conflict
    /// target). `scope` labels the conflict metric.
    ///
    /// Refused: `INSERT IGNORE`, `REPLACE`, a statement with its own
    /// `ON CONFLICT` / `ON DUPLICATE KEY` / `RETURNING`, or more than one
    /// statement.
    pub fn new(scope: &str, insert: &str, conflict_on: &[&str]) -> Result<Self, sqlx::Error> {
        let trimmed = insert.trim().trim_end_matches(';').trim_end();
        let upper = trimmed.to_ascii_uppercase();
        let words: Vec<&str> = upper.split_whitespace().collect();
        if words.first() != Some(&"INSERT") || words.get(1) != Some(&"INTO") {
            return Err(invalid(format!(
                "InsertOnce needs a plain `INSERT INTO …` (never INSERT IGNORE, which also swallows data errors), got {:?}",
                trimmed.chars().take(40).collect::<String>()
            )));
        }
        let joined = words.join(" ");
        for clause in ["ON CONFLICT", "ON DUPLICATE KEY", "RETURNING"] {
            if joined.contains(clause) {
                return Err(invalid(format!(
                    "InsertOnce writes the conflict clause itself: remove `{clause}` from the statement"
                )));
            }
        }
        if trimmed.contains(';') {
            return Err(invalid("InsertOnce runs one statement".to_owned()));
        }
        if conflict_on.is_empty() {
            return Err(invalid(
                "InsertOnce needs the unique key's columns (conflict_on)".to_owned(),
            ));
        }
        for c in conflict_on {
            identifier("conflict column", c)?;
        }
        Ok(InsertOnce {
            scope: scope.to_owned(),
            sql: format!("{trimmed}{}", DB::conflict_clause(conflict_on)),
            insert: trimmed.to_owned(),
            conflict_on: conflict_on.iter().map(|c| (*c).to_owned()).collect(),
            _db: PhantomData,
        })
    }

    /// The statement as it runs, conflict clause included.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// Runs the insert with the values `bind` adds, in placeholder order.
    /// `true`: the row is new, do the rest of the work. `false`: the unique
    /// key already had its row (counted in `idem_unique_conflicts_total`):
    /// the work was done before, so do not do it again.
    pub async fn run<'q, 'c, E, F>(&'q self, executor: E, bind: F) -> Result<bool, sqlx::Error>
    where
        E: Executor<'c, Database = DB>,
        F: FnOnce(
            Query<'q, DB, <DB as Database>::Arguments<'q>>,
        ) -> Query<'q, DB, <DB as Database>::Arguments<'q>>,
        <DB as Database>::Arguments<'q>: IntoArguments<'q, DB>,
    {
        let done = bind(sqlx::query(&self.sql)).execute(executor).await?;
        let new = DB::inserted(&done);
        if !new {
            conflict(&self.scope);
        }
        Ok(new)
    }
}

/// The state-machine guard: moves a row from one status to the next only if
/// it is still in the first.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use idem_runtime::unique::Transition;
///
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, status TEXT NOT NULL)")
///     .execute(&pool)
///     .await?;
/// sqlx::query("INSERT INTO orders VALUES (7, 'unpaid')").execute(&pool).await?;
/// let pay = Transition::<sqlx::Sqlite>::new("orders.pay", "orders", "id", "status")?;
/// assert!(pay.run(&pool, 7, "unpaid", "paid").await?); // moved
/// assert!(!pay.run(&pool, 7, "unpaid", "paid").await?); // already paid
/// # Ok::<(), sqlx::Error>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
pub struct Transition<DB> {
    scope: String,
    sql: String,
    _db: PhantomData<fn() -> DB>,
}

// By hand: a derive would ask `DB: Clone`, which sqlx's database types are
// not, and a service holding one could not be `Clone`.
impl<DB> Clone for Transition<DB> {
    fn clone(&self) -> Self {
        Transition {
            scope: self.scope.clone(),
            sql: self.sql.clone(),
            _db: PhantomData,
        }
    }
}

impl<DB: UniqueDialect> Transition<DB> {
    /// `UPDATE {table} SET {status} = to WHERE {id} = id AND {status} = from`.
    /// The names must be plain identifiers (they are written into the SQL,
    /// never values).
    pub fn new(scope: &str, table: &str, id: &str, status: &str) -> Result<Self, sqlx::Error> {
        identifier("table", table)?;
        identifier("id column", id)?;
        identifier("status column", status)?;
        let sql = format!(
            "UPDATE {table} SET {status} = {} WHERE {id} = {} AND {status} = {}",
            DB::placeholder(1),
            DB::placeholder(2),
            DB::placeholder(3)
        );
        Ok(Transition {
            scope: scope.to_owned(),
            sql,
            _db: PhantomData,
        })
    }

    /// The statement as it runs.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// Moves row `id` from `from` to `to`. `true`: it moved, do the work that
    /// goes with the move. `false`: it was not in `from` (already moved, or
    /// absent), counted in `idem_unique_conflicts_total`.
    pub async fn run<'q, 'c, E, I, S>(
        &'q self,
        executor: E,
        id: I,
        from: S,
        to: S,
    ) -> Result<bool, sqlx::Error>
    where
        E: Executor<'c, Database = DB>,
        I: 'q + Send + Encode<'q, DB> + Type<DB>,
        S: 'q + Send + Encode<'q, DB> + Type<DB>,
        <DB as Database>::Arguments<'q>: IntoArguments<'q, DB>,
    {
        let done = sqlx::query(&self.sql)
            .bind(to)
            .bind(id)
            .bind(from)
            .execute(executor)
            .await?;
        let moved = DB::rows(&done) >= 1;
        if !moved {
            conflict(&self.scope);
        }
        Ok(moved)
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    #[test]
    fn insert_ignore_and_own_clauses_are_refused() {
        type S = InsertOnce<sqlx::Sqlite>;
        for bad in [
            "INSERT IGNORE INTO t (a) VALUES (?1)",
            "REPLACE INTO t (a) VALUES (?1)",
            "insert into t (a) values (?1) on conflict do nothing",
            "INSERT INTO t (a) VALUES (?1) RETURNING a",
            "INSERT INTO t (a) VALUES (?1); DELETE FROM t",
        ] {
            assert!(S::new("s", bad, &["a"]).is_err(), "{bad}");
        }
        assert!(S::new("s", "INSERT INTO t (a) VALUES (?1)", &[]).is_err());
        assert!(S::new("s", "INSERT INTO t (a) VALUES (?1)", &["a; DROP"]).is_err());
        let ok = S::new("s", " INSERT INTO t (a, b) VALUES (?1, ?2); ", &["a", "b"]).unwrap();
        assert_eq!(
            ok.sql(),
            "INSERT INTO t (a, b) VALUES (?1, ?2) ON CONFLICT (a, b) DO NOTHING"
        );
    }

    #[test]
    fn transition_names_must_be_identifiers() {
        type T = Transition<sqlx::Sqlite>;
        assert!(T::new("s", "orders; --", "id", "status").is_err());
        assert_eq!(
            T::new("s", "shop.orders", "id", "status").unwrap().sql(),
            "UPDATE shop.orders SET status = ?1 WHERE id = ?2 AND status = ?3"
        );
    }
}
