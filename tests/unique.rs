//! The unique-constraint backstop helpers (`idem_runtime::unique`) on SQLite,
//! PostgreSQL (a private schema) and MySQL/MariaDB (a private database): an
//! insert answers "new" exactly once per unique key, concurrent duplicates
//! included, a duplicate inside a transaction leaves it usable, the state
//! guard moves a row once, and every "already done" is counted in
//! `idem_unique_conflicts_total{scope}`.

use std::str::FromStr;

use idem_runtime::store::Token;
use idem_runtime::unique::{InsertOnce, Transition, UniqueDialect};
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
