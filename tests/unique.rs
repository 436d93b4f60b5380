//! The unique-constraint backstop helpers (`idem_runtime::unique`) on SQLite,
//! PostgreSQL (a private schema) and MySQL/MariaDB (a private database): an
//! insert answers "new" exactly once per unique key, concurrent duplicates
//! included, a duplicate inside a transaction leaves it usable, the state
//! guard moves a row once, and every "already done" is counted in
//! `idem_unique_conflicts_total{scope}`. `InsertOnce::returning` hands back
//! the row, new or existing, under the concurrency each dialect has: an
//! insert waiting on an uncommitted one, a row deleted between the insert and
//! the read (a TCP proxy holds the read), MySQL's snapshot and its lack of a
//! conflict target.

use std::str::FromStr;

use idem_runtime::store::Token;
use idem_runtime::unique::{Found, InsertOnce, InsertReturning, Transition, UniqueDialect};
use idem_tests::services;
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Database, SqlitePool};

fn random_name(prefix: &str) -> String {
    let t = *Token::random().as_bytes();
    let hex: String = t[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}_{hex}")
}

/// One snapshot: taking it resets the counters.
type Counts = Vec<(
    metrics_util::CompositeKey,
    Option<metrics::Unit>,
    Option<metrics::SharedString>,
    DebugValue,
)>;

fn conflicts(counts: &Counts, scope: &str) -> u64 {
    counts
        .iter()
        .filter(|(key, ..)| {
            key.kind() == MetricKind::Counter
                && key.key().name() == "idem_unique_conflicts_total"
                && key
                    .key()
                    .labels()
                    .any(|l| l.key() == "scope" && l.value() == scope)
        })
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum()
}

/// Runs `body` on a current-thread runtime with a recorder of its own, so the
/// counts are this test's alone.
fn with_metrics<F: std::future::Future<Output = ()>>(body: impl FnOnce() -> F) -> Counts {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(body());
    });
    snapshotter.snapshot().into_vec()
}

/// The same story on every dialect: a ledger insert new once, then a
/// duplicate; a status moved once, then refused; each refusal counted.
async fn story<DB>(pool: &sqlx::Pool<DB>, insert: &str, count: impl AsyncFnOnce() -> i64)
where
    DB: UniqueDialect,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let ledger = InsertOnce::<DB>::new("test.ledger", insert, &["order_no"]).unwrap();
    assert!(
        ledger
            .run(pool, |q| q.bind("A-1").bind(-2i64))
            .await
            .unwrap()
    );
    assert!(
        !ledger
            .run(pool, |q| q.bind("A-1").bind(-2i64))
            .await
            .unwrap()
    );
    assert!(
        !ledger
            .run(pool, |q| q.bind("A-1").bind(-5i64))
            .await
            .unwrap()
    );
    assert!(
        ledger
            .run(pool, |q| q.bind("A-2").bind(-1i64))
            .await
            .unwrap()
    );
    assert_eq!(count().await, 2);

    let pay = Transition::<DB>::new("test.pay", "orders_t", "id", "status").unwrap();
    assert!(pay.run(pool, 7i64, "unpaid", "paid").await.unwrap());
    assert!(!pay.run(pool, 7i64, "unpaid", "paid").await.unwrap());
    assert!(
        !pay.run(pool, 8i64, "unpaid", "paid").await.unwrap(),
        "an absent row moved"
    );
    assert!(pay.run(pool, 7i64, "paid", "shipped").await.unwrap());
}

#[test]
fn sqlite_conflicts_are_answers_and_counted() {
    let snapshotter = with_metrics(|| async {
        let pool = SqlitePool::connect("sqlite::memory:").await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE ledger (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL UNIQUE, delta INTEGER NOT NULL);
             CREATE TABLE orders_t (id INTEGER PRIMARY KEY, status TEXT NOT NULL);
             INSERT INTO orders_t VALUES (7, 'unpaid');",
        )
        .execute(&pool)
        .await
        .unwrap();
        let p = pool.clone();
        story(
            &pool,
            "INSERT INTO ledger (order_no, delta) VALUES (?1, ?2)",
            async move || {
                sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
                    .fetch_one(&p)
                    .await
                    .unwrap()
            },
        )
        .await;
    });
    assert_eq!(conflicts(&snapshotter, "test.ledger"), 2);
    assert_eq!(conflicts(&snapshotter, "test.pay"), 2);
}

/// Another unique key of the table is not "already done": a CHECK or a second
/// unique column still fails loudly (PostgreSQL and SQLite have a conflict
/// target; only the named key is absorbed).
#[tokio::test]
async fn sqlite_other_constraints_still_fail() {
    let pool = SqlitePool::connect("sqlite::memory:").await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE t (order_no TEXT PRIMARY KEY, ref TEXT NOT NULL UNIQUE, qty INTEGER CHECK (qty >= 0))",
    )
    .execute(&pool)
    .await
    .unwrap();
    let ins = InsertOnce::<sqlx::Sqlite>::new(
        "test.other",
        "INSERT INTO t (order_no, ref, qty) VALUES (?1, ?2, ?3)",
        &["order_no"],
    )
    .unwrap();
    assert!(
        ins.run(&pool, |q| q.bind("A").bind("r1").bind(1))
            .await
            .unwrap()
    );
    assert!(
        ins.run(&pool, |q| q.bind("B").bind("r1").bind(1))
            .await
            .is_err()
    );
    assert!(
        ins.run(&pool, |q| q.bind("C").bind("r3").bind(-1))
            .await
            .is_err()
    );
}

struct PgSchema {
    name: String,
    pool: PgPool,
    admin: PgPool,
}

async fn pg_schema() -> Option<PgSchema> {
    let url = services::postgres_url();
    let admin = services::reachable(
        "PostgreSQL",
        "IDEM_POSTGRES_URL",
        PgPoolOptions::new().max_connections(2).connect(&url).await,
    )?;
    let name = random_name("idem_unique");
    sqlx::query(&format!("CREATE SCHEMA {name}"))
        .execute(&admin)
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(&url)
        .unwrap()
        .options([("search_path", name.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE ledger (id BIGSERIAL PRIMARY KEY, order_no TEXT NOT NULL UNIQUE, delta BIGINT NOT NULL);
         CREATE TABLE orders_t (id BIGINT PRIMARY KEY, status TEXT NOT NULL);
         INSERT INTO orders_t VALUES (7, 'unpaid');",
    )
    .execute(&pool)
    .await
    .unwrap();
    Some(PgSchema { name, pool, admin })
}

impl PgSchema {
    async fn drop(self) {
        self.pool.close().await;
        sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.name))
            .execute(&self.admin)
            .await
            .unwrap();
    }
}

#[test]
fn postgres_conflicts_are_answers_and_counted() {
    let snapshotter = with_metrics(|| async {
        let Some(schema) = pg_schema().await else {
            return;
        };
        let p = schema.pool.clone();
        story(
            &schema.pool,
            "INSERT INTO ledger (order_no, delta) VALUES ($1, $2)",
            async move || {
                sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
                    .fetch_one(&p)
                    .await
                    .unwrap()
            },
        )
        .await;
        schema.drop().await;
    });
    if services::required() || conflicts(&snapshotter, "test.ledger") > 0 {
        assert_eq!(conflicts(&snapshotter, "test.ledger"), 2);
        assert_eq!(conflicts(&snapshotter, "test.pay"), 2);
    }
}

/// A duplicate inside the caller's transaction is an answer, not an error: the
/// transaction is not aborted (no 25P02) and commits the rest of its work.
#[tokio::test]
async fn postgres_duplicate_inside_a_transaction_keeps_it_usable() {
    let Some(schema) = pg_schema().await else {
        return;
    };
    let ledger = InsertOnce::<sqlx::Postgres>::new(
        "test.tx",
        "INSERT INTO ledger (order_no, delta) VALUES ($1, $2)",
        &["order_no"],
    )
    .unwrap();
    assert!(
        ledger
            .run(&schema.pool, |q| q.bind("T-1").bind(-1i64))
            .await
            .unwrap()
    );
    let mut tx = schema.pool.begin().await.unwrap();
    assert!(
        !ledger
            .run(&mut *tx, |q| q.bind("T-1").bind(-1i64))
            .await
            .unwrap()
    );
    sqlx::query("UPDATE orders_t SET status = 'seen' WHERE id = 7")
        .execute(&mut *tx)
        .await
        .expect("the transaction is still usable after a duplicate");
    tx.commit().await.unwrap();
    let status: String = sqlx::query_scalar("SELECT status FROM orders_t WHERE id = 7")
        .fetch_one(&schema.pool)
        .await
        .unwrap();
    assert_eq!(status, "seen");
    schema.drop().await;
}

/// Sixteen concurrent inserts of one key: exactly one is new.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_concurrent_duplicates_one_new() {
    let Some(schema) = pg_schema().await else {
        return;
    };
    let ledger = std::sync::Arc::new(
        InsertOnce::<sqlx::Postgres>::new(
            "test.race",
            "INSERT INTO ledger (order_no, delta) VALUES ($1, $2)",
            &["order_no"],
        )
        .unwrap(),
    );
    let runs = (0..16).map(|_| {
        let (ledger, pool) = (ledger.clone(), schema.pool.clone());
        tokio::spawn(async move {
            ledger
                .run(&pool, |q| q.bind("R-1").bind(-1i64))
                .await
                .unwrap()
        })
    });
    let news = futures_util::future::join_all(runs)
        .await
        .into_iter()
        .filter(|r| *r.as_ref().unwrap())
        .count();
    assert_eq!(news, 1);
    schema.drop().await;
}

struct MyDb {
    name: String,
    pool: MySqlPool,
    admin: MySqlPool,
}

async fn mysql_db() -> Option<MyDb> {
    let url = services::mysql_url();
    let admin = services::reachable(
        "MySQL",
        "IDEM_MYSQL_URL",
        MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await,
    )?;
    let name = random_name("idem_unique");
    sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
        .execute(&admin)
        .await
        .unwrap();
    let options = MySqlConnectOptions::from_str(&url).unwrap().database(&name);
    let pool = MySqlPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE ledger (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_no VARCHAR(32) NOT NULL UNIQUE, delta BIGINT NOT NULL);
         CREATE TABLE plain (order_no VARCHAR(32) NOT NULL PRIMARY KEY, delta BIGINT NOT NULL);
         CREATE TABLE orders_t (id BIGINT PRIMARY KEY, status VARCHAR(16) NOT NULL);
         INSERT INTO orders_t VALUES (7, 'unpaid');",
    )
    .execute(&pool)
    .await
    .unwrap();
    Some(MyDb { name, pool, admin })
}

impl MyDb {
    async fn drop(self) {
        self.pool.close().await;
        sqlx::raw_sql(&format!("DROP DATABASE `{}`", self.name))
            .execute(&self.admin)
            .await
            .unwrap();
    }
}

/// With an AUTO_INCREMENT id (the insert id is the new row's) and without one
/// (the insert id is 0): the no-op `ON DUPLICATE KEY UPDATE` is told apart
/// from an insert either way, although sqlx's `CLIENT_FOUND_ROWS` reports one
/// affected row for both.
#[test]
fn mysql_conflicts_are_answers_and_counted() {
    let snapshotter = with_metrics(|| async {
        let Some(db) = mysql_db().await else { return };
        let p = db.pool.clone();
        story(
            &db.pool,
            "INSERT INTO ledger (order_no, delta) VALUES (?, ?)",
            async move || {
                sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
                    .fetch_one(&p)
                    .await
                    .unwrap()
            },
        )
        .await;
        let plain = InsertOnce::<sqlx::MySql>::new(
            "test.plain",
            "INSERT INTO plain (order_no, delta) VALUES (?, ?)",
            &["order_no"],
        )
        .unwrap();
        assert!(
            plain
                .run(&db.pool, |q| q.bind("P-1").bind(1i64))
                .await
                .unwrap()
        );
        assert!(
            !plain
                .run(&db.pool, |q| q.bind("P-1").bind(1i64))
                .await
                .unwrap()
        );
        assert!(
            plain
                .run(&db.pool, |q| q.bind("P-2").bind(1i64))
                .await
                .unwrap()
        );
        // The duplicate left the row as it was.
        let delta: i64 = sqlx::query_scalar("SELECT delta FROM ledger WHERE order_no = 'A-1'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        assert_eq!(delta, -2);
        db.drop().await;
    });
    if services::required() || conflicts(&snapshotter, "test.ledger") > 0 {
        assert_eq!(conflicts(&snapshotter, "test.ledger"), 2);
        assert_eq!(conflicts(&snapshotter, "test.pay"), 2);
        assert_eq!(conflicts(&snapshotter, "test.plain"), 1);
    }
}

/// Sixteen concurrent inserts of one key on MySQL: exactly one is new.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_concurrent_duplicates_one_new() {
    let Some(db) = mysql_db().await else { return };
    let ledger = std::sync::Arc::new(
        InsertOnce::<sqlx::MySql>::new(
            "test.race",
            "INSERT INTO ledger (order_no, delta) VALUES (?, ?)",
            &["order_no"],
        )
        .unwrap(),
    );
    let runs = (0..16).map(|_| {
        let (ledger, pool) = (ledger.clone(), db.pool.clone());
        tokio::spawn(async move {
            ledger
                .run(&pool, |q| q.bind("R-1").bind(-1i64))
                .await
                .unwrap()
        })
    });
    let news = futures_util::future::join_all(runs)
        .await
        .into_iter()
        .filter(|r| *r.as_ref().unwrap())
        .count();
    assert_eq!(news, 1);
    db.drop().await;
}

// ---- InsertOnce::returning: the row, new or existing, in one call.

/// The ledger's `(id, delta)` by order number, new or existing, on any
/// dialect: the existing row as it was written (a duplicate's values are
/// not applied), the transaction usable after a duplicate, by `&mut tx` and
/// by `&mut *tx`.
async fn returning_story<DB>(pool: &sqlx::Pool<DB>, insert: &str)
where
    DB: UniqueDialect,
    for<'c> &'c mut <DB as Database>::Connection:
        sqlx::Executor<'c, Database = DB> + sqlx::Acquire<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB> + Clone,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> (i64, i64): sqlx::FromRow<'r, <DB as Database>::Row>,
{
    let ledger = InsertOnce::<DB>::new("test.returning", insert, &["order_no"])
        .unwrap()
        .returning(&["id", "delta"])
        .unwrap();
    let first: Found<(i64, i64)> = ledger
        .run(pool, |q| q.bind("A-1").bind(-2i64))
        .await
        .unwrap();
    let Found::New((id, -2)) = first else {
        panic!("{first:?}")
    };
    let again: Found<(i64, i64)> = ledger
        .run(pool, |q| q.bind("A-1").bind(-5i64))
        .await
        .unwrap();
    assert_eq!(again, Found::Existing((id, -2)));
    let other: Found<(i64, i64)> = ledger
        .run(pool, |q| q.bind("A-2").bind(-1i64))
        .await
        .unwrap();
    assert!(other.is_new() && other.row().0 != id, "{other:?}");

    let mut tx = pool.begin().await.unwrap();
    let inside: Found<(i64, i64)> = ledger
        .run(&mut tx, |q| q.bind("A-1").bind(-9i64))
        .await
        .unwrap();
    assert_eq!(inside, Found::Existing((id, -2)));
    let next: Found<(i64, i64)> = ledger
        .run(&mut *tx, |q| q.bind("A-3").bind(-3i64))
        .await
        .expect("the transaction is still usable after a duplicate");
    assert!(next.is_new());
    tx.commit().await.unwrap();
}

fn ledger_returning<DB: UniqueDialect>(insert: &str, scope: &str) -> InsertReturning<DB> {
    InsertOnce::<DB>::new(scope, insert, &["order_no"])
        .unwrap()
        .returning(&["id", "delta"])
        .unwrap()
}

#[test]
fn sqlite_returning_hands_back_the_row_new_or_existing() {
    let counts = with_metrics(|| async {
        let pool = SqlitePool::connect("sqlite::memory:").await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE ledger (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL UNIQUE, delta INTEGER NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        returning_story(
            &pool,
            "INSERT INTO ledger (order_no, delta) VALUES (?1, ?2)",
        )
        .await;
        // `*` and an `INSERT … SELECT`.
        let all = InsertOnce::<sqlx::Sqlite>::new(
            "test.select",
            "INSERT INTO ledger (order_no, delta) SELECT ?1, ?2",
            &["order_no"],
        )
        .unwrap()
        .returning(&["*"])
        .unwrap();
        let row: Found<(i64, String, i64)> =
            all.run(&pool, |q| q.bind("A-1").bind(0i64)).await.unwrap();
        assert!(
            matches!(row, Found::Existing((_, ref no, -2)) if no == "A-1"),
            "{row:?}"
        );
    });
    assert_eq!(conflicts(&counts, "test.returning"), 2);
    assert_eq!(conflicts(&counts, "test.select"), 1);
}

/// What `returning` cannot read back is refused when it is made, not when
/// it runs.
#[test]
fn returning_refuses_what_it_cannot_read_back() {
    type S = InsertOnce<sqlx::Sqlite>;
    let make = |insert: &str, on: &[&str], columns: &[&str]| {
        S::new("s", insert, on).and_then(|i| i.returning(columns))
    };
    let values = "INSERT INTO t (a, b) VALUES (?1, ?2)";
    assert!(make(values, &["a"], &["id"]).is_ok());
    // DEFAULT inside a value is not the keyword on its own.
    assert!(
        make(
            "INSERT INTO t (a, b) VALUES (?1, 'DEFAULT')",
            &["a"],
            &["id"]
        )
        .is_ok()
    );
    assert!(
        make(
            "INSERT INTO t (a, b) VALUES (?1, coalesce(?2, 0))",
            &["a"],
            &["id"]
        )
        .is_ok()
    );
    for (insert, on, columns) in [
        (values, &["c"][..], &["id"][..]), // the key is not inserted
        (values, &["a"], &[]),
        (values, &["a"], &["id; DROP TABLE t"]),
        ("INSERT INTO t VALUES (?1, ?2)", &["a"], &["id"]),
        (
            "INSERT INTO t (a, b) VALUES (?1, ?2), (?3, ?4)",
            &["a"],
            &["id"],
        ),
        // The read runs the values as a SELECT, where DEFAULT is invalid:
        // the first call would work and every duplicate fail.
        ("INSERT INTO t (a, b) VALUES (?1, DEFAULT)", &["a"], &["id"]),
        (
            "INSERT INTO t (a, b) VALUES (?1, default )",
            &["a"],
            &["id"],
        ),
    ] {
        assert!(
            make(insert, on, columns).is_err(),
            "{insert} {on:?} {columns:?}"
        );
    }
}

/// SQLite has one writer: a call waits for the writer holding the database's
/// lock (`busy_timeout`), then meets its committed row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_returning_waits_for_the_writer_then_finds_its_row() {
    let path = std::env::temp_dir().join(format!("{}.db", random_name("idem_unique")));
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true);
    let pool = SqlitePool::connect_with(options).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE ledger (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL UNIQUE, delta INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut other = pool.begin().await.unwrap();
    let theirs: i64 =
        sqlx::query_scalar("INSERT INTO ledger (order_no, delta) VALUES ('W-1', 9) RETURNING id")
            .fetch_one(&mut *other)
            .await
            .unwrap();
    let call = tokio::spawn({
        let pool = pool.clone();
        async move {
            ledger_returning::<sqlx::Sqlite>(
                "INSERT INTO ledger (order_no, delta) VALUES (?1, ?2)",
                "test.wait",
            )
            .run::<_, (i64, i64), _>(&pool, |q| q.bind("W-1").bind(1i64))
            .await
            .unwrap()
        }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!call.is_finished(), "the insert did not wait");
    other.commit().await.unwrap();
    assert_eq!(call.await.unwrap(), Found::Existing((theirs, 9)));
    pool.close().await;
    let _ = std::fs::remove_file(&path);
}

/// Another unique key than the conflict target still fails loudly.
#[tokio::test]
async fn sqlite_returning_on_another_key_fails() {
    let pool = SqlitePool::connect("sqlite::memory:").await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE t (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL UNIQUE, ref TEXT NOT NULL UNIQUE)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let ins = InsertOnce::<sqlx::Sqlite>::new(
        "test.other",
        "INSERT INTO t (order_no, ref) VALUES (?1, ?2)",
        &["order_no"],
    )
    .unwrap()
    .returning(&["id"])
    .unwrap();
    let new: Found<(i64,)> = ins.run(&pool, |q| q.bind("A").bind("r1")).await.unwrap();
    assert!(new.is_new());
    let err = ins
        .run::<_, (i64,), _>(&pool, |q| q.bind("B").bind("r1"))
        .await
        .unwrap_err();
    assert!(err.as_database_error().is_some(), "{err}");
}

#[test]
fn postgres_returning_hands_back_the_row_new_or_existing() {
    let counts = with_metrics(|| async {
        let Some(schema) = pg_schema().await else {
            return;
        };
        returning_story(
            &schema.pool,
            "INSERT INTO ledger (order_no, delta) VALUES ($1, $2)",
        )
        .await;
        schema.drop().await;
    });
    if services::required() || conflicts(&counts, "test.returning") > 0 {
        assert_eq!(conflicts(&counts, "test.returning"), 2);
    }
}

/// Sixteen concurrent calls for one key: one new row, and every call hands
/// back that row.
async fn concurrent_returning<DB>(pool: &sqlx::Pool<DB>, insert: &str)
where
    DB: UniqueDialect,
    for<'c> &'c mut <DB as Database>::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB> + Clone,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> (i64, i64): sqlx::FromRow<'r, <DB as Database>::Row>,
{
    let ledger = ledger_returning::<DB>(insert, "test.race");
    let runs = (0..16i64).map(|i| {
        let ledger = &ledger;
        async move {
            ledger
                .run::<_, (i64, i64), _>(pool, |q| q.bind("R-1").bind(-i))
                .await
                .unwrap()
        }
    });
    let found = futures_util::future::join_all(runs).await;
    assert_eq!(found.iter().filter(|f| f.is_new()).count(), 1, "{found:?}");
    let winner = found.iter().find(|f| f.is_new()).unwrap().row();
    assert!(found.iter().all(|f| f.row() == winner), "{found:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_concurrent_returning_one_row() {
    let Some(schema) = pg_schema().await else {
        return;
    };
    concurrent_returning(
        &schema.pool,
        "INSERT INTO ledger (order_no, delta) VALUES ($1, $2)",
    )
    .await;
    schema.drop().await;
}

/// READ COMMITTED: the insert waits on another transaction's uncommitted
/// insert of the key. Committed, its row is the one handed back (the read is
/// a new statement, so it sees it); rolled back, the call's own row is new.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_returning_waits_on_an_uncommitted_insert() {
    let Some(schema) = pg_schema().await else {
        return;
    };
    for commit in [true, false] {
        let no = if commit { "W-commit" } else { "W-rollback" };
        let mut other = schema.pool.begin().await.unwrap();
        let theirs: i64 =
            sqlx::query_scalar("INSERT INTO ledger (order_no, delta) VALUES ($1, 9) RETURNING id")
                .bind(no)
                .fetch_one(&mut *other)
                .await
                .unwrap();
        let call = tokio::spawn({
            let pool = schema.pool.clone();
            async move {
                let ledger = ledger_returning::<sqlx::Postgres>(
                    "INSERT INTO ledger (order_no, delta) VALUES ($1, $2)",
                    "test.wait",
                );
                ledger
                    .run::<_, (i64, i64), _>(&pool, |q| q.bind(no).bind(1i64))
                    .await
                    .unwrap()
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(!call.is_finished(), "the insert did not wait");
        if commit {
            other.commit().await.unwrap();
            assert_eq!(call.await.unwrap(), Found::Existing((theirs, 9)));
        } else {
            other.rollback().await.unwrap();
            let found = call.await.unwrap();
            assert!(matches!(found, Found::New((_, 1))), "{found:?}");
        }
    }
    schema.drop().await;
}

/// REPEATABLE READ: a conflict with a row committed after the snapshot is
/// PostgreSQL's serialization failure (40001), from the insert itself.
#[tokio::test]
async fn postgres_returning_under_repeatable_read_fails_to_serialize() {
    let Some(schema) = pg_schema().await else {
        return;
    };
    let mut tx = schema.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap(); // the snapshot
    sqlx::query("INSERT INTO ledger (order_no, delta) VALUES ('RR-1', 9)")
        .execute(&schema.pool)
        .await
        .unwrap();
    let ledger = ledger_returning::<sqlx::Postgres>(
        "INSERT INTO ledger (order_no, delta) VALUES ($1, $2)",
        "test.rr",
    );
    let err = ledger
        .run::<_, (i64, i64), _>(&mut tx, |q| q.bind("RR-1").bind(1i64))
        .await
        .unwrap_err();
    let code = err.as_database_error().and_then(|e| e.code());
    assert_eq!(code.as_deref(), Some("40001"), "{err}");
    drop(tx);
    schema.drop().await;
}

/// A pool of one connection through a TCP proxy that holds the read of the
/// row (its statement names `idem_inserted`) until released.
async fn held_read<DB: Database>(
    upstream: String,
    connect: impl AsyncFnOnce(u16) -> sqlx::Pool<DB>,
) -> (idem_tests::proxy::Proxy, sqlx::Pool<DB>) {
    let proxy = idem_tests::proxy::Proxy::start(upstream).await;
    let pool = connect(proxy.port()).await;
    proxy.hold_requests_with(b"idem_inserted");
    (proxy, pool)
}

/// The row the insert met is deleted (and committed) before the read: the
/// call inserts again, and its row is new.
async fn deleted_between_insert_and_read<DB>(
    proxy: &idem_tests::proxy::Proxy,
    through_proxy: &sqlx::Pool<DB>,
    direct: &sqlx::Pool<DB>,
    insert: &str,
    delete: &str,
) where
    DB: UniqueDialect,
    for<'c> &'c mut <DB as Database>::Connection: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB> + Clone,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> (i64, i64): sqlx::FromRow<'r, <DB as Database>::Row>,
{
    let ledger = ledger_returning::<DB>(insert, "test.vanish");
    let before: Found<(i64, i64)> = ledger
        .run(direct, |q| q.bind("V-1").bind(-7i64))
        .await
        .unwrap();
    assert!(before.is_new());
    let call = ledger.run::<_, (i64, i64), _>(through_proxy, |q| q.bind("V-1").bind(-1i64));
    let delete = async {
        proxy.request_held().await; // the insert met the row; the read waits
        sqlx::query(delete).execute(direct).await.unwrap();
        proxy.release_requests();
    };
    let (found, ()) = tokio::join!(call, delete);
    let found = found.unwrap();
    assert!(
        matches!(found, Found::New((id, -1)) if id != before.row().0),
        "{found:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_returning_a_row_deleted_before_the_read_is_inserted_again() {
    let Some(schema) = pg_schema().await else {
        return;
    };
    let options = PgConnectOptions::from_str(&services::postgres_url())
        .unwrap()
        .options([("search_path", schema.name.as_str())]);
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let (proxy, pool) = held_read(upstream, async |port| {
        PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(options.port(port))
            .await
            .unwrap()
    })
    .await;
    deleted_between_insert_and_read(
        &proxy,
        &pool,
        &schema.pool,
        "INSERT INTO ledger (order_no, delta) VALUES ($1, $2)",
        "DELETE FROM ledger WHERE order_no = 'V-1'",
    )
    .await;
    pool.close().await;
    schema.drop().await;
}

#[test]
fn mysql_returning_hands_back_the_row_new_or_existing() {
    let counts = with_metrics(|| async {
        let Some(db) = mysql_db().await else { return };
        returning_story(
            &db.pool,
            "INSERT INTO ledger (order_no, delta) VALUES (?, ?)",
        )
        .await;
        db.drop().await;
    });
    if services::required() || conflicts(&counts, "test.returning") > 0 {
        assert_eq!(conflicts(&counts, "test.returning"), 2);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_concurrent_returning_one_row() {
    let Some(db) = mysql_db().await else { return };
    concurrent_returning(
        &db.pool,
        "INSERT INTO ledger (order_no, delta) VALUES (?, ?)",
    )
    .await;
    db.drop().await;
}

/// InnoDB's REPEATABLE READ (its default): a transaction whose snapshot is
/// older than the row the insert met still gets that row (a plain read would
/// see the snapshot, without it).
#[tokio::test]
async fn mysql_returning_reads_past_the_transactions_snapshot() {
    let Some(db) = mysql_db().await else { return };
    let mut tx = db.pool.begin().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
        .fetch_one(&mut *tx)
        .await
        .unwrap(); // the snapshot
    assert_eq!(n, 0);
    sqlx::query("INSERT INTO ledger (order_no, delta) VALUES ('RR-1', 9)")
        .execute(&db.pool)
        .await
        .unwrap();
    let theirs: i64 = sqlx::query_scalar("SELECT id FROM ledger WHERE order_no = 'RR-1'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let ledger = ledger_returning::<sqlx::MySql>(
        "INSERT INTO ledger (order_no, delta) VALUES (?, ?)",
        "test.rr",
    );
    let found: Found<(i64, i64)> = ledger
        .run(&mut tx, |q| q.bind("RR-1").bind(1i64))
        .await
        .unwrap();
    assert_eq!(found, Found::Existing((theirs, 9)));
    tx.commit().await.unwrap();
    db.drop().await;
}

/// MySQL has no conflict target: a duplicate on another unique key is
/// "already done" to the insert, but no row holds the conflict key's values,
/// so the call fails rather than hand back another row, and writes nothing.
#[tokio::test]
async fn mysql_returning_on_another_key_fails_without_writing() {
    let Some(db) = mysql_db().await else { return };
    sqlx::raw_sql(
        "CREATE TABLE two_keys (id BIGINT AUTO_INCREMENT PRIMARY KEY, order_no VARCHAR(32) NOT NULL UNIQUE, ref VARCHAR(32) NOT NULL UNIQUE)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let ins = InsertOnce::<sqlx::MySql>::new(
        "test.other",
        "INSERT INTO two_keys (order_no, ref) VALUES (?, ?)",
        &["order_no"],
    )
    .unwrap()
    .returning(&["id", "ref"])
    .unwrap();
    let first: Found<(i64, String)> = ins.run(&db.pool, |q| q.bind("A").bind("r1")).await.unwrap();
    assert!(first.is_new());
    let err = ins
        .run::<_, (i64, String), _>(&db.pool, |q| q.bind("B").bind("r1"))
        .await
        .unwrap_err();
    assert!(matches!(err, sqlx::Error::RowNotFound), "{err}");
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT order_no, ref FROM two_keys")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, [("A".to_owned(), "r1".to_owned())]);
    db.drop().await;
}

/// A NULL in a key column is never a duplicate on MySQL, so the row just
/// inserted is not found by its key: the call fails at once, having written
/// that one row, never inserting it again.
#[tokio::test]
async fn mysql_returning_with_a_null_key_fails_without_inserting_again() {
    let Some(db) = mysql_db().await else { return };
    sqlx::raw_sql(
        "CREATE TABLE coupons (id BIGINT AUTO_INCREMENT PRIMARY KEY, user_id BIGINT NOT NULL, code VARCHAR(32) NULL, UNIQUE KEY (user_id, code))",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let ins = InsertOnce::<sqlx::MySql>::new(
        "test.coupons",
        "INSERT INTO coupons (user_id, code) VALUES (?, ?)",
        &["user_id", "code"],
    )
    .unwrap()
    .returning(&["id"])
    .unwrap();
    let err = ins
        .run::<_, (i64,), _>(&db.pool, |q| q.bind(7_i64).bind(None::<String>))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("NULL"), "{err}");
    let (rows,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM coupons")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "the row is written once, not once per round");
    db.drop().await;
}

/// MySQL has no conflict target: `conflict_on` columns that are not a unique
/// key of their own match several rows, one of them another tenant's. The
/// call fails rather than hand back any of them.
#[tokio::test]
async fn mysql_returning_on_columns_that_are_no_unique_key_fails() {
    let Some(db) = mysql_db().await else { return };
    sqlx::raw_sql(
        "CREATE TABLE tenant_orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, tenant VARCHAR(32) NOT NULL, no VARCHAR(32) NOT NULL, UNIQUE KEY (tenant, no));
         INSERT INTO tenant_orders (tenant, no) VALUES ('acme', 'A-1'), ('initech', 'A-1')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let ins = InsertOnce::<sqlx::MySql>::new(
        "test.tenant_orders",
        "INSERT INTO tenant_orders (tenant, no) VALUES (?, ?)",
        &["no"],
    )
    .unwrap()
    .returning(&["id", "tenant"])
    .unwrap();
    let err = ins
        .run::<_, (i64, String), _>(&db.pool, |q| q.bind("globex").bind("A-1"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("unique key"), "{err}");
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_returning_a_row_deleted_before_the_read_is_inserted_again() {
    let Some(db) = mysql_db().await else { return };
    let options = MySqlConnectOptions::from_str(&services::mysql_url())
        .unwrap()
        .database(&db.name);
    let upstream = format!("{}:{}", options.get_host(), options.get_port());
    let (proxy, pool) = held_read(upstream, async |port| {
        MySqlPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(options.port(port))
            .await
            .unwrap()
    })
    .await;
    deleted_between_insert_and_read(
        &proxy,
        &pool,
        &db.pool,
        "INSERT INTO ledger (order_no, delta) VALUES (?, ?)",
        "DELETE FROM ledger WHERE order_no = 'V-1'",
    )
    .await;
    pool.close().await;
    db.drop().await;
}

/// A service holding these is `Clone` (a compensation runs on a clone of
/// `self`): none may ask its database type to be `Clone`, which sqlx's are not.
#[test]
fn the_helpers_are_clone_on_every_dialect() {
    fn clone<T: Clone>() {}
    use idem_runtime::unique::{InsertOnce, InsertReturning, Transition};
    use sqlx::{MySql, Postgres, Sqlite};
    clone::<InsertOnce<Postgres>>();
    clone::<InsertReturning<Postgres>>();
    clone::<Transition<Postgres>>();
    clone::<InsertOnce<MySql>>();
    clone::<InsertReturning<MySql>>();
    clone::<Transition<MySql>>();
    clone::<InsertOnce<Sqlite>>();
    clone::<InsertReturning<Sqlite>>();
    clone::<Transition<Sqlite>>();
}
