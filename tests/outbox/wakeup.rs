//! PostgreSQL's wake-up of a relay waiting in `LISTEN`, for every shape of
//! write (`put` with and without an ordering key, `put_all`), and an outbox
//! table of an earlier schema upgraded in place by opening a store.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::outbox::{self, Message, Relay};
use idem_runtime::store::sql::PgStore;
use idem_tests::services;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener};

use super::{backlog_of, postgres, tag, until};

/// A write of each shape: its name, what it puts, and the ids of those.
fn writes(topic: &str, round: &str) -> Vec<(&'static str, Vec<Message>, Vec<String>)> {
    let id = |n: &str| format!("{round}-{n}");
    let m = |n: &str| Message::bytes(topic, format!("{{\"n\":\"{n}\"}}")).id(id(n));
    vec![
        (
            "put without an ordering key",
            vec![m("plain")],
            vec![id("plain")],
        ),
        (
            "put with an ordering key",
            vec![m("keyed").ordering_key("k")],
            vec![id("keyed")],
        ),
        (
            "put_all without ordering keys",
            vec![m("a"), m("b")],
            vec![id("a"), id("b")],
        ),
        (
            "put_all with one ordering key",
            vec![m("c"), m("d").ordering_key("k")],
            vec![id("c"), id("d")],
        ),
    ]
}

async fn write(pool: &PgPool, messages: Vec<Message>) {
    let mut tx = pool.begin().await.unwrap();
    if messages.len() == 1 {
        outbox::put(&mut tx, messages.into_iter().next().unwrap())
            .await
            .unwrap();
    } else {
        outbox::put_all(&mut tx, messages).await.unwrap();
    }
    tx.commit().await.unwrap();
}

async fn current_schema(pool: &PgPool) -> String {
    sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Whether a notification of the outbox in `schema` arrives within `wait`.
async fn notified(listener: &mut PgListener, schema: &str, wait: Duration) -> bool {
    let ours = async { while listener.recv().await.unwrap().payload() != schema {} };
    tokio::time::timeout(wait, ours).await.is_ok()
}

/// With no relay waiting (one whose wait ran out counts as none), no write
/// notifies; with one waiting (polling once a
/// minute), each shape of write wakes it at its commit.
async fn every_write_wakes_a_waiting_relay_and_only_then_notifies(pool: &PgPool) {
    let topic = format!("woken.{}", tag());
    let schema = current_schema(pool).await;
    // Other tests' outboxes notify on the same channel, with their schema.
    let mut listener = PgListener::connect_with(pool).await.unwrap();
    listener.listen("idem_outbox").await.unwrap();
    // A relay that waited once and stopped: its registration has run out.
    sqlx::query("INSERT INTO idem_outbox_sleepers (relay, until) VALUES ('\\x00', 0)")
        .execute(pool)
        .await
        .unwrap();
    for (shape, messages, _) in writes(&topic, "quiet") {
        write(pool, messages).await;
        assert!(
            !notified(&mut listener, &schema, Duration::from_millis(300)).await,
            "{shape}: no relay waits, so no NOTIFY"
        );
    }
    for table in ["idem_outbox", "idem_outbox_sleepers"] {
        sqlx::query(&format!("DELETE FROM {table}"))
            .execute(pool)
            .await
            .unwrap();
    }

    let (sink, mut rx) = outbox::sink::MemorySink::channel(10);
    let relay = Arc::new(
        Relay::builder(pool.clone(), sink)
            .poll_interval(Duration::from_secs(60))
            .build(),
    );
    let stop = Arc::new(tokio::sync::Notify::new());
    let running = {
        let (relay, stop) = (relay.clone(), stop.clone());
        tokio::spawn(async move { relay.run_until(stop.notified()).await })
    };
    for (shape, messages, mut expected) in writes(&topic, "woken") {
        until("the relay to wait", 10, || async {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem_outbox_sleepers")
                .fetch_one(pool)
                .await
                .unwrap()
                == 1
                && backlog_of(pool, &topic).await.pending == 0
        })
        .await;
        // Past its own second look after arming: now it is blocked in LISTEN.
        tokio::time::sleep(Duration::from_millis(500)).await;
        write(pool, messages).await;
        let mut got = Vec::new();
        while got.len() < expected.len() {
            let m = tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .unwrap_or_else(|_| panic!("{shape}: the commit did not wake the relay"))
                .unwrap();
            got.push(m.id.as_str().to_owned());
        }
        got.sort();
        expected.sort();
        assert_eq!(got, expected, "{shape}");
        assert!(
            notified(&mut listener, &schema, Duration::from_secs(5)).await,
            "{shape}: a relay waits, so the writer notified"
        );
    }
    stop.notify_one();
    running.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_every_write_wakes_a_waiting_relay_and_only_then_notifies() {
    let Some(db) = postgres().await else { return };
    every_write_wakes_a_waiting_relay_and_only_then_notifies(&db.pool).await;
    db.drop().await;
}

/// A schema made by the migrations before the outbox's writers checked for
/// waiting relays themselves (its table has the statement trigger that did
/// it), with a message pending: opening a store upgrades it in place. The
/// message is kept, the trigger is gone, and every write still wakes a
/// waiting relay (and notifies only then).
/// A schema of its own at migration 4 (the outbox's writers woke relays with
/// a statement trigger then), one message pending: the admin pool, the
/// schema's name and the options that open it.
async fn schema_at_migration_4() -> Option<(PgPool, String, PgConnectOptions)> {
    let url = services::postgres_url();
    let admin = services::reachable("PostgreSQL", &url, PgPool::connect(&url).await)?;
    let schema = format!("idem_outbox_old_{}", tag());
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(&url)
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let old = PgPool::connect_with(options.clone()).await.unwrap();
    let mut tx = old.begin().await.unwrap();
    sqlx::query(
        "CREATE TABLE idem_schema_migrations (version BIGINT NOT NULL PRIMARY KEY, description TEXT NOT NULL, applied_at BIGINT NOT NULL)",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let earlier = [
        (
            1,
            "create idem_records",
            include_str!("../../idem-runtime/migrations/postgres/0001_create_records.sql"),
        ),
        (
            2,
            "create idem_outbox",
            include_str!("../../idem-runtime/migrations/postgres/0002_create_outbox.sql"),
        ),
        (
            3,
            "create idem_recovery",
            include_str!("../../idem-runtime/migrations/postgres/0003_recovery.sql"),
        ),
        (
            4,
            "leave room for completions in idem_records",
            include_str!("../../idem-runtime/migrations/postgres/0004_records_fillfactor.sql"),
        ),
    ];
    for (version, description, sql) in earlier {
        sqlx::raw_sql(sql).execute(&mut *tx).await.unwrap();
        sqlx::query("INSERT INTO idem_schema_migrations VALUES ($1, $2, 0)")
            .bind(version as i64)
            .bind(description)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    // Written the way the earlier writers did, the trigger's NOTIFY and all.
    sqlx::query(
        "INSERT INTO idem_outbox (id, topic, payload, created_at, next_attempt_at) VALUES ('before', 'old', 'x', 0, 0)",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    old.close().await;
    Some((admin, schema, options))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_an_outbox_of_the_earlier_schema_is_upgraded_in_place() {
    let Some((admin, schema, options)) = schema_at_migration_4().await else {
        return;
    };

    let store = PgStore::builder()
        .connect_with(options)
        .await
        .expect("open and migrate");
    let pool = store.pool().clone();
    let triggers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'idem_outbox'::regclass AND NOT tgisinternal",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(triggers, 0, "the insert trigger is dropped");
    assert_eq!(backlog_of(&pool, "old").await.pending, 1);
    every_write_wakes_a_waiting_relay_and_only_then_notifies(&pool).await;
    pool.close().await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await
        .unwrap();
}

/// Migration 5 drops a trigger, which takes an ACCESS EXCLUSIVE lock on
/// `idem_outbox`: behind a transaction that wrote a message and stays open,
/// it waits, and every writer would queue behind it. Its wait is bounded:
/// the store's start fails with PostgreSQL's lock timeout after about 5 s,
/// the schema stays at migration 4 with the message kept, and a start once
/// that transaction has ended migrates it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_migration_5_gives_up_behind_a_long_outbox_transaction() {
    let Some((admin, schema, options)) = schema_at_migration_4().await else {
        return;
    };
    let holder = PgPool::connect_with(options.clone()).await.unwrap();
    let mut open = holder.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO idem_outbox (id, topic, payload, created_at, next_attempt_at) VALUES ('open', 'old', 'x', 0, 0)",
    )
    .execute(&mut *open)
    .await
    .unwrap();

    let started = std::time::Instant::now();
    let refused = tokio::time::timeout(
        Duration::from_secs(30),
        PgStore::builder().connect_with(options.clone()),
    )
    .await
    .expect("the migration waited behind the open transaction with no bound")
    .expect_err("a migration behind an open outbox transaction");
    let waited = started.elapsed();
    assert!(
        refused.to_string().contains("lock timeout"),
        "not the lock timeout: {refused}"
    );
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(30),
        "waited {waited:?}"
    );
    let version: i64 = sqlx::query_scalar(&format!(
        "SELECT max(version) FROM {schema}.idem_schema_migrations"
    ))
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(version, 4, "nothing of migration 5 stayed");

    open.rollback().await.unwrap();
    holder.close().await;
    let store = PgStore::builder()
        .connect_with(options)
        .await
        .expect("migrates once the transaction ended");
    assert_eq!(backlog_of(store.pool(), "old").await.pending, 1);
    store.pool().close().await;
    sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&admin)
        .await
        .unwrap();
}
