//! [`InsertReturning`]: conflict is success, and the caller gets the row.

use std::marker::PhantomData;

use futures_util::future::BoxFuture;

use sqlx::query::Query;
use sqlx::{Acquire, Database, Execute, Executor, FromRow, IntoArguments};

use super::{InsertOnce, UniqueDialect, conflict, identifier, invalid};

/// The row an [`InsertReturning`] call ends with, and whether this call wrote
/// it.
///
/// ```
/// use idem_runtime::unique::Found;
///
/// let found = Found::Existing((7_i64,));
/// assert!(!found.is_new());
/// assert_eq!(found.into_row(), (7,));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Found<T> {
    /// This call inserted the row: do the work that goes with it.
    New(T),
    /// The unique key already had its row (counted in
    /// `idem_unique_conflicts_total`): the work was done before.
    Existing(T),
}

impl<T> Found<T> {
    /// Whether this call inserted the row.
    ///
    /// ```
    /// assert!(idem_runtime::unique::Found::New(1).is_new());
    /// ```
    pub fn is_new(&self) -> bool {
        matches!(self, Found::New(_))
    }

    /// The row, new or not.
    ///
    /// ```
    /// let found = idem_runtime::unique::Found::New(1);
    /// assert_eq!(found.row(), &1);
    /// ```
    pub fn row(&self) -> &T {
        match self {
            Found::New(row) | Found::Existing(row) => row,
        }
    }

    /// The row, new or not.
    ///
    /// ```
    /// assert_eq!(idem_runtime::unique::Found::Existing(1).into_row(), 1);
    /// ```
    pub fn into_row(self) -> T {
        match self {
            Found::New(row) | Found::Existing(row) => row,
        }
    }
}

/// How often a call inserts again after finding no row where its insert
/// conflicted (deleted in between): then it gives up.
const ROUNDS: usize = 3;

/// An `INSERT` done at most once per unique key that hands back the row: the
/// one it inserted, or the one already there. Made by
/// [`InsertOnce::returning`].
///
/// Each dialect, and what a concurrent writer does to a call:
///
/// - **PostgreSQL**: `INSERT … ON CONFLICT (key) DO NOTHING RETURNING …`;
///   when that returns nothing, a second statement reads the row by the key
///   values the insert was given, `FOR KEY SHARE`. Under READ COMMITTED an
///   insert that met a concurrent uncommitted insert of the key waits for
///   it: if it commits, the read (a new statement, so a new snapshot) sees
///   that row; if it rolls back, the insert goes ahead and the row is new.
///   The read's lock keeps the row from being deleted (or its key changed)
///   until the caller's transaction ends. Under REPEATABLE READ or
///   SERIALIZABLE, a conflict with a row committed after the transaction's
///   snapshot is PostgreSQL's serialization failure (40001) from the insert
///   itself: retry the transaction, as for any such failure.
/// - **SQLite**: the same two statements, the read without a lock: the
///   insert took the database's write lock, which a transaction holds until
///   it ends.
/// - **MySQL / MariaDB**: the no-op `ON DUPLICATE KEY UPDATE` of
///   [`InsertOnce`], then the row read by the key's values with
///   `LOCK IN SHARE MODE` (new rows too: there is no `RETURNING`). The locking
///   read sees the latest committed row, where a plain read inside a
///   REPEATABLE READ transaction would see its snapshot, which misses a row
///   committed after it was taken. The duplicate's no-op update locks the row
///   until the transaction ends. MySQL has no conflict target: a duplicate on
///   any unique key of the table is "already done", but the row handed back
///   is always the one whose `conflict_on` columns hold the values inserted;
///   when the duplicate was on another key and there is no such row, the
///   call fails (never another row).
///
/// Outside a transaction (a pool) each statement commits alone, and a row
/// deleted between the insert that met it and the read is not there to read:
/// the call then inserts again, which makes it new (or meets the next one).
/// After three such rounds it gives up with [`sqlx::Error::RowNotFound`] and
/// a warning saying why.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use idem_runtime::unique::{Found, InsertOnce};
///
/// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
/// sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, no TEXT NOT NULL UNIQUE, qty INTEGER NOT NULL)")
///     .execute(&pool)
///     .await?;
/// let create = InsertOnce::<sqlx::Sqlite>::new(
///     "orders.create",
///     "INSERT INTO orders (no, qty) VALUES (?1, ?2)",
///     &["no"],
/// )?
/// .returning(&["id", "qty"])?;
/// // Any `sqlx::FromRow`: a tuple here, or a struct deriving it.
/// let first: Found<(i64, i64)> = create.run(&pool, |q| q.bind("A-1").bind(2)).await?;
/// assert_eq!(first, Found::New((1, 2)));
/// // A retry finds the order it made, as it was made.
/// let again: Found<(i64, i64)> = create.run(&pool, |q| q.bind("A-1").bind(5)).await?;
/// assert_eq!(again, Found::Existing((1, 2)));
/// # Ok::<(), sqlx::Error>(())
/// # }).unwrap();
/// ```
#[derive(Debug)]
pub struct InsertReturning<DB> {
    scope: String,
    /// The insert that returns the new row (PostgreSQL, SQLite), or the
    /// plain [`InsertOnce`] statement (MySQL, where the read follows both).
    insert: String,
    returns_new: bool,
    /// Reads the row by the values the insert was given, with its arguments.
    lookup: String,
    _db: PhantomData<fn() -> DB>,
}

// By hand: a derive would ask `DB: Clone`, which sqlx's database types are
// not, and a service holding one could not be `Clone`.
impl<DB> Clone for InsertReturning<DB> {
    fn clone(&self) -> Self {
        InsertReturning {
            scope: self.scope.clone(),
            insert: self.insert.clone(),
            returns_new: self.returns_new,
            lookup: self.lookup.clone(),
            _db: PhantomData,
        }
    }
}

impl<DB: UniqueDialect> InsertOnce<DB> {
    /// This insert, handing back `columns` of the row (each a column name,
    /// or `*`): the new one, or the one already there. The statement must
    /// name its columns, `conflict_on` among them, and write one row:
    /// `INSERT INTO t (a, b) VALUES (…)` or `INSERT INTO t (a, b) SELECT …`.
    ///
    /// The read runs the statement's values again (as
    /// `WITH … AS (SELECT <the values>)`) with the same arguments, and
    /// matches the `conflict_on` columns with them: give the key as
    /// arguments or literals of the column's type, never a function that
    /// makes a new value each time.
    ///
    /// ```
    /// # #[cfg(feature = "postgres")] {
    /// use idem_runtime::unique::InsertOnce;
    ///
    /// let create = InsertOnce::<sqlx::Postgres>::new(
    ///     "orders.create",
    ///     "INSERT INTO orders (user_id, no, qty) VALUES ($1, $2, $3)",
    ///     &["user_id", "no"],
    /// )?
    /// .returning(&["id"])?;
    /// assert!(create.sql().ends_with("ON CONFLICT (user_id, no) DO NOTHING RETURNING id"));
    /// # }
    /// # Ok::<(), sqlx::Error>(())
    /// ```
    pub fn returning(self, columns: &[&str]) -> Result<InsertReturning<DB>, sqlx::Error> {
        if columns.is_empty() {
            return Err(invalid(
                "returning needs the columns to hand back (or \"*\")".to_owned(),
            ));
        }
        for c in columns {
            if *c != "*" {
                identifier("returned column", c)?;
            }
        }
        let parts = parts(&self.insert)?;
        for key in &self.conflict_on {
            if !parts.columns.iter().any(|c| c.eq_ignore_ascii_case(key)) {
                return Err(invalid(format!(
                    "the conflict column {key:?} is not among the inserted columns: \
                     the row is read back by the values inserted into it"
                )));
            }
        }
        let returned = columns.join(", ");
        let keys = self.conflict_on.join(", ");
        let lookup = format!(
            "WITH idem_inserted ({}) AS ({}) SELECT {returned} FROM {} WHERE ({keys}) IN \
             (SELECT {keys} FROM idem_inserted){}",
            parts.columns.join(", "),
            parts.source,
            parts.table,
            DB::locking_read(),
        );
        let (insert, returns_new) = match DB::returning_clause(&returned) {
            Some(clause) => (format!("{}{clause}", self.sql), true),
            None => (self.sql, false),
        };
        Ok(InsertReturning {
            scope: self.scope,
            insert,
            returns_new,
            lookup,
            _db: PhantomData,
        })
    }
}

impl<DB: UniqueDialect> InsertReturning<DB> {
    /// The insert as it runs.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// let create = idem_runtime::unique::InsertOnce::<sqlx::Sqlite>::new(
    ///     "s", "INSERT INTO t (k, v) VALUES (?1, ?2)", &["k"],
    /// )?
    /// .returning(&["*"])?;
    /// assert_eq!(create.sql(), "INSERT INTO t (k, v) VALUES (?1, ?2) ON CONFLICT (k) DO NOTHING RETURNING *");
    /// # }
    /// # Ok::<(), sqlx::Error>(())
    /// ```
    pub fn sql(&self) -> &str {
        &self.insert
    }

    /// The read of the row by the inserted key values, as it runs.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// let create = idem_runtime::unique::InsertOnce::<sqlx::Sqlite>::new(
    ///     "s", "INSERT INTO t (k, v) VALUES (?1, ?2)", &["k"],
    /// )?
    /// .returning(&["v"])?;
    /// assert_eq!(
    ///     create.lookup_sql(),
    ///     "WITH idem_inserted (k, v) AS (SELECT ?1, ?2) SELECT v FROM t WHERE (k) IN (SELECT k FROM idem_inserted)"
    /// );
    /// # }
    /// # Ok::<(), sqlx::Error>(())
    /// ```
    pub fn lookup_sql(&self) -> &str {
        &self.lookup
    }

    /// Runs the insert with the values `bind` adds, in placeholder order, and
    /// hands back the row's columns as `T` (a `sqlx::FromRow`: a struct
    /// deriving it, or a tuple). [`Found::New`]: this call inserted it.
    /// [`Found::Existing`]: the key already had its row, read in the same
    /// call (counted in `idem_unique_conflicts_total`).
    ///
    /// `conn` is anything sqlx can take a connection from: a pool (each
    /// statement commits alone), a connection, or the caller's transaction
    /// (`&mut tx`), which a duplicate leaves usable.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use idem_runtime::unique::{Found, InsertOnce};
    ///
    /// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// sqlx::query("CREATE TABLE ledger (id INTEGER PRIMARY KEY, no TEXT UNIQUE, delta INTEGER)")
    ///     .execute(&pool)
    ///     .await?;
    /// let ledger = InsertOnce::<sqlx::Sqlite>::new(
    ///     "orders.ledger",
    ///     "INSERT INTO ledger (no, delta) VALUES (?1, ?2)",
    ///     &["no"],
    /// )?
    /// .returning(&["id"])?;
    /// let mut tx = pool.begin().await?;
    /// let (id,) = match ledger.run(&mut tx, |q| q.bind("A-1").bind(-2)).await? {
    ///     Found::New(row) => row, // move the stock here, in the same transaction
    ///     Found::Existing(row) => row,
    /// };
    /// tx.commit().await?;
    /// let _: i64 = id;
    /// # Ok::<(), sqlx::Error>(())
    /// # }).unwrap();
    /// ```
    pub fn run<'q, 'a, A, T, F>(
        &'q self,
        conn: A,
        bind: F,
    ) -> BoxFuture<'q, Result<Found<T>, sqlx::Error>>
    where
        'a: 'q,
        A: Acquire<'a, Database = DB> + Send + 'q,
        F: FnOnce(
            Query<'q, DB, <DB as Database>::Arguments<'q>>,
        ) -> Query<'q, DB, <DB as Database>::Arguments<'q>>,
        <DB as Database>::Arguments<'q>: IntoArguments<'q, DB> + Clone,
        for<'c> &'c mut <DB as Database>::Connection: Executor<'c, Database = DB>,
        T: for<'r> FromRow<'r, <DB as Database>::Row> + Send + Unpin + 'q,
    {
        // The insert and the read take the same arguments: bound once, each
        // statement gets a copy.
        let args = bind(sqlx::query(&self.insert))
            .take_arguments()
            .map(Option::unwrap_or_default);
        // Boxed: the future of a generic `async fn` with these higher-ranked
        // bounds is one rustc cannot prove `Send` inside a caller's own
        // future (an `#[idempotent]` or `#[step]` body), where a box of a
        // `Send` future is plainly `Send`.
        Box::pin(async move {
            let args = args.map_err(sqlx::Error::Encode)?;
            let mut conn = conn.acquire().await?;
            for _ in 0..ROUNDS {
                let new = if self.returns_new {
                    let row = sqlx::query_with(&self.insert, args.clone())
                        .fetch_optional(&mut *conn)
                        .await?;
                    if let Some(row) = row {
                        return Ok(Found::New(T::from_row(&row)?));
                    }
                    false
                } else {
                    let done = sqlx::query_with(&self.insert, args.clone())
                        .execute(&mut *conn)
                        .await?;
                    DB::inserted(&done)
                };
                let mut rows = sqlx::query_with(&self.lookup, args.clone())
                    .fetch_all(&mut *conn)
                    .await?;
                match rows.len() {
                    1 => {
                        let row = T::from_row(&rows.remove(0))?;
                        if new {
                            return Ok(Found::New(row));
                        }
                        conflict(&self.scope);
                        return Ok(Found::Existing(row));
                    }
                    // Our own row, just inserted, is not found by its key:
                    // inserting again would only add rows. A NULL in a key
                    // column does this (NULLs are never duplicates, so no
                    // unique key stops the next insert either).
                    0 if new => {
                        return Err(super::invalid(format!(
                            "{}: the insert wrote a row that no read by its `conflict_on` values finds: a key column was NULL (NULLs are never duplicates, so such a key does not name one row), or the values were converted on the way in; nothing was inserted again",
                            self.scope
                        )));
                    }
                    // Deleted between the insert and the read: insert again.
                    0 => {}
                    // Several rows hold the values: they are not a unique key
                    // (MySQL has no conflict target to refuse it), and any one
                    // of them could be another caller's.
                    n => {
                        return Err(super::invalid(format!(
                            "{}: {n} rows hold the `conflict_on` values: they must be a unique key of the table on their own",
                            self.scope
                        )));
                    }
                }
            }
            tracing::warn!(
                scope = %self.scope,
                rounds = ROUNDS,
                "the insert met a duplicate but no row holds its key: on MySQL a duplicate \
                 on another unique key of the table (it has no conflict target), or the \
                 row deleted between the insert and the read each time"
            );
            Err(sqlx::Error::RowNotFound)
        })
    }
}

/// What the read of an [`InsertReturning`] needs from its statement.
struct Parts<'a> {
    table: &'a str,
    columns: Vec<&'a str>,
    /// The values as a `SELECT`, placeholders as written.
    source: String,
}

/// `INSERT INTO table (columns) VALUES (…)` or `… SELECT …`, taken apart.
fn parts(insert: &str) -> Result<Parts<'_>, sqlx::Error> {
    let unsupported = |why: &str| {
        invalid(format!(
            "returning needs `INSERT INTO table (columns) VALUES (…)` or `… SELECT …`: {why}"
        ))
    };
    let rest = word(insert, "INSERT")
        .and_then(|r| word(r, "INTO"))
        .ok_or_else(|| unsupported("no INSERT INTO"))?
        .trim_start();
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '(')
        .ok_or_else(|| unsupported("no column list"))?;
    let table = &rest[..end];
    identifier("table", table)?;
    let rest = rest[end..]
        .trim_start()
        .strip_prefix('(')
        .ok_or_else(|| unsupported("no column list after the table"))?;
    let close = rest
        .find(')')
        .ok_or_else(|| unsupported("the column list is not closed"))?;
    let columns: Vec<&str> = rest[..close].split(',').map(str::trim).collect();
    for c in &columns {
        identifier("inserted column", c)?;
    }
    let rest = rest[close + 1..].trim();
    let source = if let Some(values) = word(rest, "VALUES") {
        let inner = values
            .trim_start()
            .strip_prefix('(')
            .ok_or_else(|| unsupported("VALUES without `(`"))?;
        let close = closing(inner).ok_or_else(|| unsupported("VALUES (… is not closed"))?;
        if !inner[close + 1..].trim().is_empty() {
            return Err(unsupported("it writes one row, a single VALUES (…)"));
        }
        let values = &inner[..close];
        // The read runs the values again as a SELECT, where DEFAULT means
        // nothing: the insert would work and every duplicate's read fail.
        if items(values).any(|v| v.eq_ignore_ascii_case("DEFAULT")) {
            return Err(unsupported(
                "DEFAULT among the VALUES: leave that column out of the list instead",
            ));
        }
        format!("SELECT {values}")
    } else if word(rest, "SELECT").is_some() {
        rest.to_owned()
    } else {
        return Err(unsupported("neither VALUES nor SELECT after the columns"));
    };
    Ok(Parts {
        table,
        columns,
        source,
    })
}

/// The comma-separated items of a VALUES list, past nested parentheses and
/// quoted text, each trimmed.
fn items(values: &str) -> impl Iterator<Item = &str> {
    let mut depth = 0usize;
    let mut quote = None;
    let mut start = 0;
    let mut cuts = Vec::new();
    for (at, c) in values.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"' | '`') => quote = Some(c),
            (None, '(') => depth += 1,
            (None, ')') => depth = depth.saturating_sub(1),
            (None, ',') if depth == 0 => {
                cuts.push(&values[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    cuts.push(&values[start..]);
    cuts.into_iter().map(str::trim)
}

/// `text` after its leading `keyword` (any case) and the space after it.
fn word<'a>(text: &'a str, keyword: &str) -> Option<&'a str> {
    let text = text.trim_start();
    let head = text.get(..keyword.len())?;
    let rest = &text[keyword.len()..];
    (head.eq_ignore_ascii_case(keyword)
        && rest.starts_with(|c: char| c.is_whitespace() || c == '('))
    .then_some(rest)
}

/// Where the parenthesis opened just before `text` closes, past nested ones
/// and quoted text (`'…'`, `"…"`, `` `…` ``).
fn closing(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut quote = None;
    for (at, c) in text.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"' | '`') => quote = Some(c),
            (None, '(') => depth += 1,
            (None, ')') if depth == 0 => return Some(at),
            (None, ')') => depth -= 1,
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_and_select_sources_are_taken_apart() {
        let p = parts("INSERT INTO shop.t (a, b,c) VALUES ($1, lower('x)('), f($2, 3))").unwrap();
        assert_eq!(p.table, "shop.t");
        assert_eq!(p.columns, ["a", "b", "c"]);
        assert_eq!(p.source, "SELECT $1, lower('x)('), f($2, 3)");
        let p = parts("insert into t(a) select ?1 from dual").unwrap();
        assert_eq!((p.table, p.source.as_str()), ("t", "select ?1 from dual"));
        for bad in [
            "INSERT INTO t VALUES (?1)",
            "INSERT INTO t (a) VALUES (?1), (?2)",
            "INSERT INTO t (a) DEFAULT VALUES",
            "INSERT INTO t (\"a\") VALUES (?1)",
            "INSERT INTO t (a) VALUES (?1",
        ] {
            assert!(parts(bad).is_err(), "{bad}");
        }
    }
}
