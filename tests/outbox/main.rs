//! The transactional outbox on real databases: every scenario in
//! `scenarios.rs` runs unchanged on SQLite, PostgreSQL and MariaDB; the
//! brokers' sinks in `sinks.rs`; processes killed with SIGKILL in `crash.rs`.
//!
//! A relay claims across the whole table, so each test gets a table of its
//! own: a private schema on PostgreSQL, a private database on MariaDB, a
//! file on SQLite. Nothing asserts a duration: conditions are polled with
//! generous deadlines.

mod crash;
mod scenarios;
mod sinks;

use std::collections::HashMap;
use std::future::Future;
use std::str::FromStr;
use std::sync::{LazyLock, Mutex, OnceLock};
use std::time::{Duration, Instant};

use idem_runtime::outbox::{self, Backlog, OutboxDatabase};
use idem_runtime::store::Token;
use idem_runtime::store::sql::{MySqlStore, PgStore, SqliteStore};
use idem_tests::services;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use sqlx::mysql::MySqlConnectOptions;
use sqlx::postgres::PgConnectOptions;
use sqlx::{MySql, Pool, Postgres, Sqlite};

/// A database of one's own with the outbox table, and how to remove it.
pub struct Db<DB: OutboxDatabase> {
    pub pool: Pool<DB>,
    drop_sql: Option<(String, AdminPool)>,
    _dir: Option<TempDir>,
}

enum AdminPool {
    Pg(Pool<Postgres>),
    My(Pool<MySql>),
}

impl<DB: OutboxDatabase> Db<DB> {
    pub async fn drop(self) {
        self.pool.close().await;
        if let Some((sql, admin)) = self.drop_sql {
            match admin {
                AdminPool::Pg(p) => sqlx::query(&sql).execute(&p).await.map(|_| ()),
                AdminPool::My(p) => sqlx::query(&sql).execute(&p).await.map(|_| ()),
            }
            .expect("drop the test's schema");
        }
    }
}

pub struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn tag() -> String {
    format!(
        "{:08x}",
        u32::from_le_bytes(Token::random().as_bytes()[..4].try_into().unwrap())
    )
}

pub async fn sqlite() -> Option<Db<Sqlite>> {
    let dir = std::env::temp_dir().join(format!("idem-outbox-{}", tag()));
    std::fs::create_dir_all(&dir).unwrap();
    let store = SqliteStore::open(dir.join("outbox.db"))
        .await
        .expect("open sqlite");
    Some(Db {
        pool: store.pool().clone(),
        drop_sql: None,
        _dir: Some(TempDir(dir)),
    })
}

pub async fn postgres() -> Option<Db<Postgres>> {
    let url = services::postgres_url();
    let admin = services::reachable("PostgreSQL", &url, sqlx::PgPool::connect(&url).await)?;
    let schema = format!("idem_outbox_{}", tag());
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(&url)
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let store = PgStore::builder()
        .connect_with(options)
        .await
        .expect("open postgres");
    Some(Db {
        pool: store.pool().clone(),
        drop_sql: Some((
            format!("DROP SCHEMA {schema} CASCADE"),
            AdminPool::Pg(admin),
        )),
        _dir: None,
    })
}

pub async fn mysql() -> Option<Db<MySql>> {
    let url = services::mysql_url();
    let admin = services::reachable("MariaDB", &url, sqlx::MySqlPool::connect(&url).await)?;
    let name = format!("idem_outbox_{}", tag());
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&admin)
        .await
        .unwrap();
    let options = MySqlConnectOptions::from_str(&url).unwrap().database(&name);
    let store = MySqlStore::builder()
        .connect_with(options)
        .await
        .expect("open mysql");
    Some(Db {
        pool: store.pool().clone(),
        drop_sql: Some((format!("DROP DATABASE {name}"), AdminPool::My(admin))),
        _dir: None,
    })
}

/// Polls `check` until it holds, failing after `secs` seconds.
pub async fn until<F, Fut>(what: &str, secs: u64, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The topic's line of the backlog (zeros when it has none).
pub async fn backlog_of<DB: OutboxDatabase>(pool: &Pool<DB>, topic: &str) -> Backlog {
    outbox::backlog(pool, true)
        .await
        .expect("backlog")
        .into_iter()
        .find(|b| b.topic == topic)
        .unwrap_or(Backlog {
            topic: topic.to_owned(),
            pending: 0,
            parked: 0,
            sent: 0,
            oldest_pending_ms: 0,
        })
}

/// A recorder for the whole binary: relays set gauges from their own tasks,
/// which a thread-local recorder would not see. Tests read their own topic's
/// labels only.
pub fn recorder() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("install the test recorder");
        snapshotter
    })
}

/// The gauge's last value, or the counter's total, for `name` labelled
/// `topic`. A snapshot hands out counters' increments since the last one, so
/// totals are kept here.
pub fn metric(name: &str, topic: &str) -> Option<f64> {
    static TOTALS: LazyLock<Mutex<HashMap<(String, String), f64>>> = LazyLock::new(Mutex::default);
    let mut totals = TOTALS.lock().unwrap();
    for (key, _, _, value) in recorder().snapshot().into_vec() {
        let Some(label) = key.key().labels().find(|l| l.key() == "topic") else {
            continue;
        };
        let slot = (key.key().name().to_owned(), label.value().to_owned());
        match value {
            DebugValue::Gauge(g) => {
                totals.insert(slot, g.into_inner());
            }
            DebugValue::Counter(c) => *totals.entry(slot).or_default() += c as f64,
            DebugValue::Histogram(_) => {}
        }
    }
    totals.get(&(name.to_owned(), topic.to_owned())).copied()
}

/// Declares `#[tokio::test]`s running a scenario on each dialect.
macro_rules! on_every_database {
    ($($name:ident),* $(,)?) => {
        mod sqlite_db {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let Some(db) = super::sqlite().await else { return };
                    super::scenarios::$name(&db.pool).await;
                    db.drop().await;
                }
            )*
        }
        mod postgres_db {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let Some(db) = super::postgres().await else { return };
                    super::scenarios::$name(&db.pool).await;
                    db.drop().await;
                }
            )*
        }
        mod mysql_db {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let Some(db) = super::mysql().await else { return };
                    super::scenarios::$name(&db.pool).await;
                    db.drop().await;
                }
            )*
        }
    };
}

on_every_database!(
    rollback_publishes_nothing_and_commit_publishes_exactly_the_committed,
    a_retried_flow_writes_each_message_once,
    outside_a_call_a_message_needs_an_id_and_a_repeated_id_is_one_row,
    two_relays_publish_each_message_once,
    a_broker_outage_keeps_the_backlog_and_it_drains_after,
    one_ordering_key_is_published_in_commit_order,
    a_message_is_parked_after_max_attempts_and_retry_sends_it,
    a_relay_that_dies_holding_a_batch_leaves_it_to_the_next,
    sent_messages_are_purged_after_the_retention,
);
