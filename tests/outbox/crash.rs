//! Processes killed with SIGKILL (`src/bin/outbox_proc.rs`): a producer right
//! after its commit, a relay in the middle of a batch. What was committed is
//! published at least once, and applied once by a consumer keyed on the id.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idem_runtime::consumer::redis_streams::RedisStreamsSource;
use idem_runtime::outbox::sink::RedisStreamsSink;
use idem_runtime::outbox::{self, Message, Relay};
use idem_tests::services;
use redis::AsyncCommands;

use super::sinks::{applied, consume};
use super::{postgres, redis, tag, until};

/// The schema the pool's `search_path` names.
async fn schema(pool: &sqlx::PgPool) -> String {
    sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Runs `relay` until nothing is pending: the dead relay's batch, once its
/// lease ran out, included.
async fn take_over(relay: &Relay<sqlx::Postgres>, pool: &sqlx::PgPool) {
    until(
        "the next relay to take the dead one's batch over",
        30,
        || async {
            relay.run_once().await.unwrap();
            outbox::backlog(pool, false)
                .await
                .unwrap()
                .iter()
                .all(|b| b.pending == 0)
        },
    )
    .await;
}

fn spawn(args: &[&str]) -> (Child, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox_proc"))
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start outbox_proc");
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn wait_for(rx: &std::sync::mpsc::Receiver<String>, line: &str) {
    loop {
        let got = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("no `{line}` from outbox_proc: {e}"));
        if got == line {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_producer_killed_after_its_commit_still_publishes_and_is_applied_once() {
    let Some(db) = postgres().await else { return };
    let Some(client) = redis().await else { return };
    let stream = format!("idem-test-outbox-kill-{}", tag());
    let id = format!("{stream}-order");
    let schema = schema(&db.pool).await;
    let (mut child, lines) = spawn(&["produce", &schema, &stream, &id]);
    wait_for(&lines, "committed");
    child.kill().unwrap(); // SIGKILL: no destructor, no graceful close
    child.wait().unwrap();

    let relay = Relay::builder(
        db.pool.clone(),
        RedisStreamsSink::connect(&client).await.unwrap(),
    )
    .build();
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    let mut source = RedisStreamsSource::builder(&stream, "apply", "c1")
        .block(Duration::from_millis(200))
        .connect(&client)
        .await
        .unwrap();
    consume(&mut source, 1).await;
    assert_eq!(applied(&id), 1);
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: () = conn.del(&stream).await.unwrap();
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_mid_batch_publishes_everything_at_least_once_and_each_applies_once() {
    let Some(db) = postgres().await else { return };
    let Some(client) = redis().await else { return };
    let stream = format!("idem-test-outbox-relaykill-{}", tag());
    const N: usize = 40;
    let ids: Vec<String> = (0..N).map(|i| format!("{stream}-{i}")).collect();
    let mut tx = db.pool.begin().await.unwrap();
    outbox::put_all(
        &mut tx,
        ids.iter()
            .map(|id| Message::bytes(stream.as_str(), b"{\"n\":1}".to_vec()).id(id.as_str())),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let schema = schema(&db.pool).await;
    let url = services::redis_url();
    let (mut child, lines) = spawn(&["relay", &schema, &url]);
    wait_for(&lines, "relaying");
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    until("the relay to publish part of its batch", 30, || {
        let mut conn = conn.clone();
        let stream = stream.clone();
        async move { conn.xlen::<_, usize>(&stream).await.unwrap() >= 5 }
    })
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    let before: usize = conn.xlen(&stream).await.unwrap();
    assert!(before < N, "killed mid-batch ({before} of {N} published)");

    let relay = Relay::builder(
        db.pool.clone(),
        RedisStreamsSink::connect(&client).await.unwrap(),
    )
    .lease(Duration::from_secs(1))
    .build();
    take_over(&relay, &db.pool).await;
    let total: usize = conn.xlen(&stream).await.unwrap();
    assert!(
        total >= N + before,
        "the dead relay's batch was published again: {total}"
    );

    let mut source = RedisStreamsSource::builder(&stream, "apply", "c1")
        .block(Duration::from_millis(200))
        .connect(&client)
        .await
        .unwrap();
    let actions = consume(&mut source, total).await;
    let mut counts: HashMap<&str, u32> = HashMap::new();
    for id in &ids {
        counts.insert(id, applied(id));
    }
    assert!(
        counts.values().all(|&n| n == 1),
        "each applied once: {counts:?}"
    );
    assert_eq!(actions.len(), total);
    let _: () = conn.del(&stream).await.unwrap();
    db.drop().await;
}

/// The same into Kafka: a relay killed with SIGKILL in the middle of its
/// batch, a second relay taking the batch over, and a Kafka consumer keyed
/// on the id (`Envelope`): every message applied once, the ones the dead
/// relay had sent answered as replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_into_kafka_killed_mid_batch_has_each_message_applied_once() {
    use idem_runtime::consumer::Source;
    use idem_runtime::consumer::kafka::KafkaSource;
    use idem_runtime::consumer::{Acked, Action};
    use idem_runtime::outbox::sink::KafkaSink;

    let Some(db) = postgres().await else { return };
    let Some((brokers, topic)) = super::sinks::kafka_topic(3).await else {
        return;
    };
    const N: usize = 40;
    let ids: Vec<String> = (0..N).map(|i| format!("{topic}-{i}")).collect();
    let mut tx = db.pool.begin().await.unwrap();
    outbox::put_all(
        &mut tx,
        ids.iter()
            .map(|id| Message::bytes(topic.as_str(), b"{\"n\":1}".to_vec()).id(id.as_str())),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    let schema = schema(&db.pool).await;
    let (mut child, lines) = spawn(&["relay-kafka", &schema, &brokers]);
    wait_for(&lines, "relaying");
    let mut sent_before = 0;
    while sent_before < 5 {
        let line = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("the relay publishes");
        sent_before += usize::from(line.starts_with("published "));
    }
    child.kill().unwrap();
    child.wait().unwrap();

    let relay = Relay::builder(db.pool.clone(), KafkaSink::connect(&brokers).unwrap())
        .lease(Duration::from_secs(1))
        .build();
    take_over(&relay, &db.pool).await;

    let mut source = KafkaSource::builder(&brokers, &topic, &format!("{topic}-apply"))
        .store(idem_runtime::store::memory::MemoryStore::new())
        .set("session.timeout.ms", "6000")
        .connect()
        .await
        .unwrap();
    // Kafka says nothing of how many there are (and Tansu's high-water
    // marks are not to be trusted): read until every id is applied and
    // nothing more comes for a few seconds.
    let runner = super::sinks::runner();
    let mut actions = Vec::new();
    loop {
        let wait = if ids.iter().all(|id| applied(id) >= 1) {
            5
        } else {
            60
        };
        let Ok(next) = tokio::time::timeout(Duration::from_secs(wait), source.next()).await else {
            break;
        };
        let delivery = next.expect("the broker");
        actions.push(
            runner
                .process(delivery, &super::sinks::apply)
                .await
                .unwrap(),
        );
    }
    let counts: HashMap<&str, u32> = ids.iter().map(|id| (id.as_str(), applied(id))).collect();
    assert!(
        counts.values().all(|&n| n == 1),
        "each applied once: {counts:?}"
    );
    let replays = actions
        .iter()
        .filter(|a| **a == Action::Acked(Acked::Deduplicated))
        .count();
    assert!(
        replays >= sent_before,
        "the {sent_before} the dead relay sent came again, as replays: {actions:?}"
    );
    db.drop().await;
}
