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
mod statements;
mod wakeup;

use std::future::Future;
use std::str::FromStr;
use std::sync::OnceLock;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idem_runtime::outbox::{self, Backlog, OutboxDatabase};
use idem_runtime::store::Token;
use idem_runtime::store::sql::{MySqlStore, SqliteStore};
use idem_tests::services;
use metrics::Key;
use metrics_util::registry::{AtomicStorage, Registry};
use sqlx::mysql::MySqlConnectOptions;
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
    let store = idem_tests::sql::pg_store_in_schema(&admin, &url, &schema).await;
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

/// The Redis the sinks publish to, once it answered (`Client::open` alone
/// connects to nothing).
pub async fn redis() -> Option<redis::Client> {
    let url = services::redis_url();
    let client = redis::Client::open(url.as_str()).expect("a redis:// URL");
    let answered = client.get_multiplexed_async_connection().await.map(drop);
    services::reachable("Redis", &url, answered)?;
    Some(client)
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
/// labels only. Values are read, never reset (`DebuggingRecorder` resets each
/// one it reports, so one test's read would zero another's gauge).
pub fn recorder() -> &'static Registry<Key, AtomicStorage> {
    static REGISTRY: OnceLock<&'static Registry<Key, AtomicStorage>> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry: &'static Registry<Key, AtomicStorage> =
            Box::leak(Box::new(Registry::atomic()));
        metrics::set_global_recorder(Reading(registry)).expect("install the test recorder");
        registry
    })
}

struct Reading(&'static Registry<Key, AtomicStorage>);

impl metrics::Recorder for Reading {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, key: &Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        self.0
            .get_or_create_counter(key, |c| metrics::Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        self.0
            .get_or_create_gauge(key, |g| metrics::Gauge::from_arc(g.clone()))
    }

    fn register_histogram(&self, key: &Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        self.0
            .get_or_create_histogram(key, |h| metrics::Histogram::from_arc(h.clone()))
    }
}

fn labelled(key: &Key, name: &str, topic: &str) -> bool {
    key.name() == name
        && key
            .labels()
            .any(|l| l.key() == "topic" && l.value() == topic)
}

/// The gauge's value, or the counter's, for `name` labelled `topic`.
pub fn metric(name: &str, topic: &str) -> Option<f64> {
    let registry = recorder();
    let counter = registry
        .get_counter_handles()
        .into_iter()
        .find(|(k, _)| labelled(k, name, topic))
        .map(|(_, c)| c.load(Ordering::SeqCst) as f64);
    counter.or_else(|| {
        registry
            .get_gauge_handles()
            .into_iter()
            .find(|(k, _)| labelled(k, name, topic))
            .map(|(_, g)| f64::from_bits(g.load(Ordering::SeqCst)))
    })
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
    a_retry_that_writes_another_message_sends_it_too,
    a_transaction_tried_again_inside_the_call_writes_one_row,
    outside_a_call_a_message_needs_an_id_and_a_repeated_id_is_one_row,
    a_callers_id_held_by_another_message_is_refused,
    names_that_differ_only_in_case_accent_or_trailing_space_are_distinct,
    a_batch_past_every_statement_cap_is_written_whole,
    two_relays_publish_each_message_once,
    a_broker_outage_keeps_the_backlog_and_it_drains_after,
    one_ordering_key_is_published_in_commit_order,
    a_message_is_parked_after_max_attempts_and_retry_sends_it,
    a_relay_that_dies_holding_a_batch_leaves_it_to_the_next,
    sent_messages_are_purged_after_the_retention,
    a_relay_that_finishes_after_its_lease_marks_nothing,
    a_relay_that_finishes_late_counts_the_rows_it_marked,
    a_running_relay_purges_sent_messages_after_the_retention,
);

/// One message larger than MariaDB's `max_allowed_packet` cannot be cut:
/// the write fails with the server's reason, not a bare I/O error (a batch
/// of many smaller messages past it is written whole, in statements under
/// it: `a_batch_past_every_statement_cap_is_written_whole`).
#[tokio::test]
async fn mysql_one_message_over_max_allowed_packet_names_the_limit() {
    let Some(db) = mysql().await else { return };
    let limit: u64 = sqlx::query_scalar("SELECT @@max_allowed_packet")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let topic = format!("huge.{}", tag());
    let mut tx = db.pool.begin().await.unwrap();
    // Under: half the limit goes.
    let half = usize::try_from(limit / 2).unwrap();
    idem_runtime::outbox::put(
        &mut tx,
        idem_runtime::outbox::Message::bytes(topic.as_str(), vec![b'x'; half]).id("half"),
    )
    .await
    .expect("a message of half max_allowed_packet");
    tx.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let over = usize::try_from(limit).unwrap() + 1;
    let err = idem_runtime::outbox::put(
        &mut tx,
        idem_runtime::outbox::Message::bytes(topic.as_str(), vec![b'x'; over]).id("over"),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("max_allowed_packet"), "{err}");
    drop(tx);
    assert_eq!(backlog_of(&db.pool, &topic).await.pending, 1);
    db.drop().await;
}
