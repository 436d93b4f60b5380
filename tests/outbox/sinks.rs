//! Each broker's sink, end to end on PostgreSQL: the relay publishes, the id
//! travels with the message, a consumer keyed on it (`Envelope`) applies a
//! re-published message once.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem_runtime::consumer::jetstream::JetStreamSource;
use idem_runtime::consumer::rabbitmq::{self, RabbitMqSource};
use idem_runtime::consumer::redis_streams::RedisStreamsSource;
use idem_runtime::consumer::{Acked, Action, Envelope, Runner, Source};
use idem_runtime::idempotent;
use idem_runtime::outbox::sink::{JetStreamSink, RabbitMqSink, RedisStreamsSink, Sink};
use idem_runtime::outbox::{self, Message, Relay};
use idem_tests::services;
use redis::AsyncCommands;
use sqlx::PgPool;

use super::{metric, postgres, recorder, redis, tag, until};

/// Applications per message id (ids are unique per test).
pub static APPLIED: LazyLock<Mutex<HashMap<String, u32>>> = LazyLock::new(Mutex::default);

#[idempotent(consumer, key = "m.id", scope = "tests.outbox.apply", event = "APPLY")]
pub async fn apply(m: Envelope<serde_json::Value>) -> Result<(), idem_runtime::Error> {
    assert!(m.body.is_object());
    *APPLIED.lock().unwrap().entry(m.id.to_string()).or_default() += 1;
    Ok(())
}

pub fn applied(id: &str) -> u32 {
    APPLIED.lock().unwrap().get(id).copied().unwrap_or(0)
}

pub fn runner() -> Runner {
    super::scenarios::install_memory_store();
    Runner::new()
}

/// Processes `n` deliveries from `source`.
pub async fn consume<S: Source>(source: &mut S, n: usize) -> Vec<Action> {
    let runner = runner();
    let mut actions = Vec::new();
    while actions.len() < n {
        let delivery = tokio::time::timeout(Duration::from_secs(20), source.next())
            .await
            .expect("a delivery within 20 s")
            .expect("the broker");
        actions.push(runner.process(delivery, &apply).await.expect("the broker"));
    }
    actions
}

async fn write(pool: &PgPool, topic: &str, ids: &[String]) {
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(
        &mut tx,
        ids.iter().map(|id| {
            Message::json(topic, &serde_json::json!({ "id": id }))
                .unwrap()
                .id(id.as_str())
                .header("tenant", "acme")
        }),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// As if a relay died after the broker took the message and before it was
/// marked sent: the next relay publishes it again.
async fn unmark(pool: &PgPool, id: &str) {
    sqlx::query("UPDATE idem_outbox SET state = 0, next_attempt_at = 0 WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
}

async fn relay_all(pool: &PgPool, sink: impl Sink + 'static, n: usize) {
    let relay = Relay::builder(pool.clone(), sink).build();
    let round = relay.run_once().await.unwrap();
    assert_eq!(round.published, n, "{round:?}");
}

/// The one message left pending after a round, with the reason it failed.
async fn the_one_pending(pool: &PgPool) -> (String, String) {
    let pending = outbox::list(pool, outbox::MessageState::Pending, 10)
        .await
        .unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");
    let reason = pending[0].last_error.clone().unwrap_or_default();
    (pending[0].id.clone(), reason)
}

fn dedup_count(actions: &[Action]) -> (usize, usize) {
    let processed = actions
        .iter()
        .filter(|a| **a == Action::Acked(Acked::Processed))
        .count();
    let dedup = actions
        .iter()
        .filter(|a| **a == Action::Acked(Acked::Deduplicated))
        .count();
    (processed, dedup)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_streams_carry_the_id_and_a_republished_message_is_applied_once() {
    let Some(db) = postgres().await else { return };
    let Some(client) = redis().await else { return };
    let stream = format!("idem-test-outbox-{}", tag());
    let ids: Vec<String> = (0..3).map(|i| format!("{stream}-{i}")).collect();
    write(&db.pool, &stream, &ids).await;
    relay_all(
        &db.pool,
        RedisStreamsSink::connect(&client).await.unwrap(),
        3,
    )
    .await;
    unmark(&db.pool, &ids[0]).await;
    relay_all(
        &db.pool,
        RedisStreamsSink::connect(&client).await.unwrap(),
        1,
    )
    .await;

    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let entries: redis::streams::StreamRangeReply = conn.xrange_all(&stream).await.unwrap();
    assert_eq!(entries.ids.len(), 4, "three messages, one published twice");
    assert_eq!(
        entries.ids[0].get::<String>("message-id").as_deref(),
        Some(ids[0].as_str())
    );
    assert_eq!(
        entries.ids[0].get::<String>("h:tenant").as_deref(),
        Some("acme")
    );

    let mut source = RedisStreamsSource::builder(&stream, "apply", "c1")
        .block(Duration::from_millis(200))
        .connect(&client)
        .await
        .unwrap();
    let actions = consume(&mut source, 4).await;
    assert_eq!(dedup_count(&actions), (3, 1), "{actions:?}");
    assert!(ids.iter().all(|id| applied(id) == 1));
    let _: () = conn.del(&stream).await.unwrap();
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_into_redis_publish_each_message_once_on_the_broker() {
    let Some(db) = postgres().await else { return };
    let Some(client) = redis().await else { return };
    let stream = format!("idem-test-outbox-{}", tag());
    let ids: Vec<String> = (0..300).map(|i| format!("{stream}-{i}")).collect();
    for chunk in ids.chunks(100) {
        write(&db.pool, &stream, chunk).await;
    }
    let relays: Vec<_> = (0..2)
        .map(|_| {
            let (pool, client) = (db.pool.clone(), client.clone());
            tokio::spawn(async move {
                let sink = RedisStreamsSink::connect(&client).await.unwrap();
                let relay = Relay::builder(pool.clone(), sink).batch(20).build();
                while outbox::backlog(&pool, false)
                    .await
                    .unwrap()
                    .iter()
                    .any(|b| b.pending > 0)
                {
                    if relay.run_once().await.unwrap().claimed == 0 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                relay.stats().published
            })
        })
        .collect();
    for r in relays {
        assert!(r.await.unwrap() > 0, "both relays took part");
    }
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let entries: redis::streams::StreamRangeReply = conn.xrange_all(&stream).await.unwrap();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for e in &entries.ids {
        *seen
            .entry(e.get::<String>("message-id").unwrap())
            .or_default() += 1;
    }
    assert_eq!(seen.len(), 300);
    assert!(
        seen.values().all(|&n| n == 1),
        "each message once on the broker"
    );
    let _: () = conn.del(&stream).await.unwrap();
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_drops_a_republish_by_nats_msg_id() {
    let Some(db) = postgres().await else { return };
    let url = services::nats_url();
    let Some(client) = services::reachable("NATS", &url, async_nats::connect(url.as_str()).await)
    else {
        return;
    };
    let js = jetstream::new(client);
    let name = format!("IDEM_OUTBOX_{}", tag().to_uppercase());
    let subject = format!("idem-outbox.{name}");
    for (stream, subject) in [
        (name.clone(), subject.clone()),
        (format!("{name}_PARKED"), format!("{subject}.parked")),
    ] {
        js.create_stream(stream::Config {
            name: stream,
            subjects: vec![subject],
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let ids: Vec<String> = (0..3).map(|i| format!("{name}-{i}")).collect();
    write(&db.pool, &subject, &ids).await;
    relay_all(&db.pool, JetStreamSink::new(js.clone()), 3).await;
    unmark(&db.pool, &ids[1]).await;
    relay_all(&db.pool, JetStreamSink::new(js.clone()), 1).await;
    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        3,
        "the server dropped the re-publish inside its duplicate window"
    );

    let mut source = JetStreamSource::builder(&name, "apply", &format!("{subject}.parked"))
        .connect(&js)
        .await
        .unwrap();
    let actions = consume(&mut source, 3).await;
    assert_eq!(dedup_count(&actions), (3, 0), "{actions:?}");
    assert!(ids.iter().all(|id| applied(id) == 1));
    let _ = js.delete_stream(&name).await;
    let _ = js.delete_stream(format!("{name}_PARKED")).await;
    db.drop().await;
}

/// A stream of its own for one test, on `idem-outbox.<name>`.
async fn jetstream_stream(js: &jetstream::Context) -> (String, String) {
    let name = format!("IDEM_OUTBOX_{}", tag().to_uppercase());
    let subject = format!("idem-outbox.{name}");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .unwrap();
    (name, subject)
}

/// `JetStreamSink::create_stream` (issue 34, item 6): the stream is created
/// when missing and the relay publishes into it; asked again, or for a
/// subject it already captures, it is used as it is; asked for subjects it
/// does not capture, it is an error that names them, and the stream keeps
/// its subjects and its messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_sink_creates_its_stream_on_request() {
    let Some(db) = postgres().await else { return };
    let url = services::nats_url();
    let Some(client) = services::reachable("NATS", &url, async_nats::connect(url.as_str()).await)
    else {
        return;
    };
    let js = jetstream::new(client);
    let name = format!("IDEM_OUTBOX_{}", tag().to_uppercase());
    let subject = format!("idem-outbox.{name}");
    let sink = JetStreamSink::new(js.clone())
        .create_stream(&name, [format!("{subject}.>")])
        .await
        .expect("the stream created");
    let ids: Vec<String> = (0..2).map(|i| format!("{name}-{i}")).collect();
    write(&db.pool, &format!("{subject}.created"), &ids).await;
    relay_all(&db.pool, sink, 2).await;

    for subjects in [
        vec![format!("{subject}.>")],
        vec![format!("{subject}.created")],
    ] {
        JetStreamSink::new(js.clone())
            .create_stream(&name, subjects)
            .await
            .expect("an existing compatible stream is used as it is");
    }
    let err = JetStreamSink::new(js.clone())
        .create_stream(
            &name,
            [
                format!("{subject}.created"),
                "idem-outbox-elsewhere".to_owned(),
            ],
        )
        .await
        .err()
        .expect("a subject the stream does not capture is an error");
    let text = err.to_string();
    assert!(
        text.contains(&format!("the stream `{name}` exists on the subjects"))
            && text.contains("which do not capture [\"idem-outbox-elsewhere\"]"),
        "{text}"
    );
    let mut stream = js.get_stream(&name).await.unwrap();
    let info = stream.info().await.unwrap();
    assert_eq!(info.config.subjects, [format!("{subject}.>")]);
    assert_eq!(info.state.messages, 2);
    let _ = js.delete_stream(&name).await;
    db.drop().await;
}

/// Regression (issue 30, item 3): a batch above async-nats' pending-ack cap
/// (5 000) waited on permits only acks free: nothing was confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_a_batch_over_the_clients_in_flight_cap_is_published() {
    let Some(db) = postgres().await else { return };
    let url = services::nats_url();
    let Some(client) = services::reachable("NATS", &url, async_nats::connect(url.as_str()).await)
    else {
        return;
    };
    let js = jetstream::new(client);
    let (name, subject) = jetstream_stream(&js).await;
    let n = 6_000;
    let ids: Vec<String> = (0..n).map(|i| format!("{name}-{i}")).collect();
    write(&db.pool, &subject, &ids).await;
    let relay = Relay::builder(db.pool.clone(), JetStreamSink::new(js.clone()))
        .batch(n)
        .build();
    let round = tokio::time::timeout(Duration::from_secs(60), relay.run_once())
        .await
        .expect("the batch is confirmed within 60 s")
        .unwrap();
    assert_eq!((round.published, round.failed), (n, 0), "{round:?}");
    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, n as u64);
    let _ = js.delete_stream(&name).await;
    db.drop().await;
}

/// Regression (issue 30, item 9): a payload over the server's `max_payload`
/// made it close the connection, and the small messages batched with it
/// failed too. It fails alone now, with the reason; a message exactly at the
/// limit (headers counted) is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_a_payload_over_max_payload_fails_alone() {
    let Some(db) = postgres().await else { return };
    let url = services::nats_url();
    let Some(client) = services::reachable("NATS", &url, async_nats::connect(url.as_str()).await)
    else {
        return;
    };
    let max = client.server_info().max_payload;
    let js = jetstream::new(client);
    let (name, subject) = jetstream_stream(&js).await;
    let small: Vec<String> = (0..3).map(|i| format!("{name}-small-{i}")).collect();
    write(&db.pool, &subject, &small).await;
    let (at, over) = (format!("{name}-at"), format!("{name}-over"));
    let mut tx = db.pool.begin().await.unwrap();
    // The header block NATS counts: `NATS/1.0\r\n`, each header line, the
    // blank line; `Nats-Msg-Id` is the only header here.
    let header_bytes = "NATS/1.0\r\n".len() + "Nats-Msg-Id: ".len() + at.len() + 2 + 2;
    outbox::put(
        &mut tx,
        Message::bytes(subject.as_str(), vec![b'x'; max - header_bytes]).id(at.as_str()),
    )
    .await
    .unwrap();
    outbox::put(
        &mut tx,
        Message::bytes(subject.as_str(), vec![b'x'; max - header_bytes + 1]).id(over.as_str()),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::builder(db.pool.clone(), JetStreamSink::new(js.clone()))
        .batch(10)
        .build();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (4, 1), "{round:?}");
    let (id, reason) = the_one_pending(&db.pool).await;
    assert_eq!(id, over);
    assert!(reason.contains("max_payload"), "{reason}");
    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 4);
    let _ = js.delete_stream(&name).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_carries_the_id_and_an_unroutable_message_is_not_marked_sent() {
    let Some(db) = postgres().await else { return };
    let url = services::rabbitmq_url();
    let Some(conn) = services::reachable("RabbitMQ", &url, rabbitmq::connect(&url).await) else {
        return;
    };
    let queue = format!("idem-test-outbox-{}", tag());
    // A message published before its queue exists would come back unroutable.
    RabbitMqSource::declare(&conn.create_channel().await.unwrap(), &queue)
        .await
        .unwrap();
    let mut source = RabbitMqSource::builder(&queue, "c1")
        .connect(conn.create_channel().await.unwrap())
        .await
        .unwrap();
    let ids: Vec<String> = (0..3).map(|i| format!("{queue}-{i}")).collect();
    write(&db.pool, &queue, &ids).await;
    let sink = RabbitMqSink::new(conn.create_channel().await.unwrap())
        .await
        .unwrap();
    relay_all(&db.pool, sink.clone(), 3).await;
    unmark(&db.pool, &ids[2]).await;
    relay_all(&db.pool, sink.clone(), 1).await;
    let actions = consume(&mut source, 4).await;
    assert_eq!(dedup_count(&actions), (3, 1), "{actions:?}");
    assert!(ids.iter().all(|id| applied(id) == 1));

    // No queue for this routing key: the broker returns it, the relay keeps it.
    let nowhere = format!("idem-test-outbox-nowhere-{}", tag());
    write(&db.pool, &nowhere, &[format!("{nowhere}-0")]).await;
    let relay = Relay::builder(db.pool.clone(), sink).build();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (0, 1));
    let (_, reason) = the_one_pending(&db.pool).await;
    assert!(reason.contains("no queue is bound"), "{reason}");
    delete_queues(&conn, &queue).await;
    db.drop().await;
}

/// Regression (issue 30, item 1): lapin hands a returned message to whichever
/// confirm completes next, so in a batch mixing routable and unroutable
/// messages the return must be matched by its message id, not by its confirm.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_returns_in_a_mixed_batch_are_matched_to_their_own_messages() {
    let Some(db) = postgres().await else { return };
    let url = services::rabbitmq_url();
    let Some(conn) = services::reachable("RabbitMQ", &url, rabbitmq::connect(&url).await) else {
        return;
    };
    let queue = format!("idem-test-outbox-mixed-{}", tag());
    let nowhere = format!("idem-test-outbox-mixed-nowhere-{}", tag());
    RabbitMqSource::declare(&conn.create_channel().await.unwrap(), &queue)
        .await
        .unwrap();
    let (mut routed, mut returned) = (Vec::new(), Vec::new());
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..300 {
        // Runs of unroutable messages between routable ones, so the broker
        // acks several at once (`multiple`) with returns queued in between.
        let (topic, ids) = if i % 3 == 0 {
            (&queue, &mut routed)
        } else {
            (&nowhere, &mut returned)
        };
        let id = format!("{topic}-{i}");
        outbox::put(
            &mut tx,
            Message::json(topic, &serde_json::json!({ "id": id }))
                .unwrap()
                .id(id.as_str()),
        )
        .await
        .unwrap();
        ids.push(id);
    }
    tx.commit().await.unwrap();
    let sink = RabbitMqSink::new(conn.create_channel().await.unwrap())
        .await
        .unwrap();
    let relay = Relay::builder(db.pool.clone(), sink).batch(500).build();
    let round = relay.run_once().await.unwrap();
    assert_eq!(
        (round.published, round.failed),
        (routed.len(), returned.len()),
        "{round:?}"
    );
    let mut pending: Vec<String> = outbox::list(&db.pool, outbox::MessageState::Pending, 500)
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.id.to_string())
        .collect();
    pending.sort();
    returned.sort();
    let kept_routed: Vec<_> = pending.iter().filter(|id| routed.contains(id)).collect();
    let sent_returned: Vec<_> = returned.iter().filter(|id| !pending.contains(id)).collect();
    assert!(
        kept_routed.is_empty() && sent_returned.is_empty(),
        "routed but kept pending: {kept_routed:?}; returned but marked sent: {sent_returned:?}"
    );
    let mut source = RabbitMqSource::builder(&queue, "c1")
        .connect(conn.create_channel().await.unwrap())
        .await
        .unwrap();
    let actions = consume(&mut source, routed.len()).await;
    assert_eq!(dedup_count(&actions), (routed.len(), 0), "{actions:?}");
    assert!(routed.iter().all(|id| applied(id) == 1));
    delete_queues(&conn, &queue).await;
    db.drop().await;
}

/// Regression (issue 30, item 9): a routing key over 255 bytes broke the
/// AMQP frame and the broker closed the channel, failing its neighbours. A
/// row holding one (written before `put` refused them) fails alone now.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_a_routing_key_over_255_bytes_fails_alone() {
    let Some(db) = postgres().await else { return };
    let Some((conn, queue)) = rabbitmq_queue(&services::rabbitmq_url(), "long").await else {
        return;
    };
    let ids: Vec<String> = (0..3).map(|i| format!("{queue}-{i}")).collect();
    write(&db.pool, &queue, &ids).await;
    // 128 characters, 256 bytes: what `put` counted as fine before.
    let long = "é".repeat(128);
    assert_eq!(long.len(), 256);
    sqlx::query("UPDATE idem_outbox SET topic = $1 WHERE id = $2")
        .bind(&long)
        .bind(&ids[1])
        .execute(&db.pool)
        .await
        .unwrap();
    let sink = RabbitMqSink::new(conn.create_channel().await.unwrap())
        .await
        .unwrap();
    let relay = Relay::builder(db.pool.clone(), sink).build();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (2, 1), "{round:?}");
    let (id, reason) = the_one_pending(&db.pool).await;
    assert_eq!(id, ids[1]);
    assert!(reason.contains("over AMQP's 255"), "{reason}");
    delete_queues(&conn, &queue).await;
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_down_then_back_the_backlog_drains_and_nothing_is_lost() {
    recorder();
    let Some(db) = postgres().await else { return };
    let Some(direct) = redis().await else { return };
    let url = services::redis_url();
    let upstream = url
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let proxy = idem_tests::proxy::Proxy::start(upstream).await;
    let via_proxy = redis::Client::open(format!("redis://127.0.0.1:{}", proxy.port())).unwrap();
    let sink = RedisStreamsSink::connect(&via_proxy).await.unwrap();
    let relay = std::sync::Arc::new(
        Relay::builder(db.pool.clone(), sink)
            .backoff(Duration::from_millis(50), Duration::from_millis(200))
            .max_attempts(1_000)
            .lease(Duration::from_secs(2))
            .stats_interval(Duration::from_millis(50))
            .build(),
    );
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let running = {
        let (relay, stop) = (relay.clone(), stop.clone());
        tokio::spawn(async move { relay.run_until(stop.notified()).await })
    };
    proxy.set_down(true).await;
    let stream = format!("idem-test-outbox-outage-{}", tag());
    let ids: Vec<String> = (0..5).map(|i| format!("{stream}-{i}")).collect();
    write(&db.pool, &stream, &ids).await;
    until("publishes to fail while Redis is unreachable", 30, || {
        std::future::ready(relay.stats().failed >= 5)
    })
    .await;
    until("the backlog gauge to show the messages", 30, || async {
        metric("idem_outbox_backlog", &stream) == Some(5.0)
    })
    .await;
    let mut conn = direct.get_multiplexed_async_connection().await.unwrap();
    assert_eq!(conn.xlen::<_, usize>(&stream).await.unwrap(), 0);
    assert_eq!(
        outbox::backlog(&db.pool, false).await.unwrap()[0].pending,
        5,
        "nothing lost while Redis was down"
    );

    proxy.set_down(false).await;
    until("the backlog to drain once Redis is back", 30, || async {
        outbox::backlog(&db.pool, false)
            .await
            .unwrap()
            .iter()
            .all(|b| b.pending == 0)
    })
    .await;
    let entries: redis::streams::StreamRangeReply = conn.xrange_all(&stream).await.unwrap();
    let mut got: Vec<String> = entries
        .ids
        .iter()
        .map(|e| e.get::<String>("message-id").unwrap())
        .collect();
    got.sort();
    got.dedup();
    assert_eq!(got, ids, "every message published after the outage");
    stop.notify_one();
    running.await.unwrap();
    let _: () = conn.del(&stream).await.unwrap();
    db.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_wakes_a_waiting_relay_at_commit_and_a_busy_one_costs_writers_no_notify() {
    let Some(db) = postgres().await else { return };
    let topic = format!("woken.{}", tag());
    let schema: String = sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // Other tests' outboxes notify on the same channel, with their schema.
    let mut listener = sqlx::postgres::PgListener::connect_with(&db.pool)
        .await
        .unwrap();
    listener.listen("idem_outbox").await.unwrap();
    // Nobody waits: a writer's commit sends no notification.
    write(&db.pool, &topic, &[format!("{topic}-quiet")]).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(500), ours(&mut listener, &schema))
            .await
            .is_err(),
        "no relay waits, so no NOTIFY"
    );
    sqlx::query("DELETE FROM idem_outbox")
        .execute(&db.pool)
        .await
        .unwrap();

    // A relay that would poll only once a minute: a commit must wake it.
    let (sink, mut rx) = outbox::sink::MemorySink::channel(10);
    let relay = std::sync::Arc::new(
        Relay::builder(db.pool.clone(), sink)
            .poll_interval(Duration::from_secs(60))
            .build(),
    );
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let running = {
        let (relay, stop) = (relay.clone(), stop.clone());
        tokio::spawn(async move { relay.run_until(stop.notified()).await })
    };
    until("the relay to wait", 10, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem_outbox_sleepers")
            .fetch_one(&db.pool)
            .await
            .unwrap()
            == 1
    })
    .await;
    // Past its own second look after arming: now it is blocked in LISTEN.
    tokio::time::sleep(Duration::from_millis(300)).await;
    write(&db.pool, &topic, &[format!("{topic}-woken")]).await;
    let got = tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("the commit woke the relay long before its 60 s poll")
        .unwrap();
    assert_eq!(got.id.as_str(), format!("{topic}-woken"));
    assert!(
        tokio::time::timeout(Duration::from_secs(5), ours(&mut listener, &schema))
            .await
            .is_ok(),
        "a relay waits, so the writer notified"
    );
    stop.notify_one();
    running.await.unwrap();
    db.drop().await;
}

/// The next notification of the outbox in `schema`.
async fn ours(listener: &mut sqlx::postgres::PgListener, schema: &str) {
    while listener.recv().await.unwrap().payload() != schema {}
}

/// The relay's database goes away and comes back: `run` logs the failed
/// rounds and keeps going, and what was committed meanwhile is published
/// once the database answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_outlives_a_database_outage() {
    let Some(db) = postgres().await else { return };
    let schema: String = sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let url = services::postgres_url();
    let options = <sqlx::postgres::PgConnectOptions as std::str::FromStr>::from_str(&url).unwrap();
    let proxy =
        idem_tests::proxy::Proxy::start(format!("{}:{}", options.get_host(), options.get_port()))
            .await;
    let through_proxy = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(
            options
                .host("127.0.0.1")
                .port(proxy.port())
                .options([("search_path", schema.as_str())]),
        )
        .await
        .unwrap();
    let (sink, mut rx) = outbox::sink::MemorySink::channel(10);
    let relay = std::sync::Arc::new(
        Relay::builder(through_proxy, sink)
            .poll_interval(Duration::from_millis(50))
            .build(),
    );
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let running = {
        let (relay, stop) = (relay.clone(), stop.clone());
        tokio::spawn(async move { relay.run_until(stop.notified()).await })
    };
    let topic = format!("outage.db.{}", tag());
    write(&db.pool, &topic, &[format!("{topic}-before")]).await;
    let first = tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("published before the outage")
        .unwrap();
    assert_eq!(first.id.as_str(), format!("{topic}-before"));

    proxy.set_down(true).await;
    write(&db.pool, &topic, &[format!("{topic}-during")]).await;
    // Rounds fail while it is down (the loop must not end on them).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!running.is_finished(), "the relay kept running");
    assert!(rx.try_recv().is_err());
    proxy.set_down(false).await;
    let after = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("published once the database answered again")
        .unwrap();
    assert_eq!(after.id.as_str(), format!("{topic}-during"));
    stop.notify_one();
    running.await.unwrap();
    db.drop().await;
}

/// RabbitMQ closes the sink's connection (a restart, a network cut) and comes
/// back: `RabbitMqSink::connect` opens a new one on the next publish, so a
/// long-running relay needs no restart. Cut and restored with a TCP proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_rabbitmq_sink_reconnects_after_the_broker_closed_its_connection() {
    let url = services::rabbitmq_url();
    let Some(direct) = services::reachable("RabbitMQ", &url, rabbitmq::connect(&url).await) else {
        return;
    };
    let queue = format!("idem-test-outbox-reconnect-{}", tag());
    RabbitMqSource::declare(&direct.create_channel().await.unwrap(), &queue)
        .await
        .unwrap();
    let proxy = idem_tests::proxy::Proxy::start("127.0.0.1:5672".to_owned()).await;
    let sink = RabbitMqSink::connect(&format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        proxy.port()
    ))
    .await
    .unwrap();
    let message = |n: usize| outbox::Outgoing {
        id: idem_runtime::consumer::MessageId::new(format!("{queue}-{n}")),
        topic: queue.clone(),
        ordering_key: None,
        headers: Default::default(),
        payload: b"{}".to_vec(),
        attempt: 1,
    };
    assert!(sink.publish(&[message(0)]).await[0].is_ok());
    proxy.set_down(true).await;
    until(
        "a publish to fail while the broker is unreachable",
        20,
        || async { sink.publish(&[message(1)]).await[0].is_err() },
    )
    .await;
    proxy.set_down(false).await;
    until("a publish to succeed on a new connection", 30, || async {
        sink.publish(&[message(2)]).await[0].is_ok()
    })
    .await;
    delete_queues(&direct, &queue).await;
}

/// Deletes the queue a test declared and the ones the source declared beside it.
async fn delete_queues(conn: &lapin::Connection, queue: &str) {
    let channel = conn.create_channel().await.unwrap();
    for q in [
        queue.to_owned(),
        format!("{queue}.retry"),
        format!("{queue}.parked"),
        format!("{queue}.dlx"),
    ] {
        let _ = channel.queue_delete(&q, Default::default()).await;
    }
}

// ---- Limits of NATS JetStream (issue 30): subject syntax against the real
// ---- server, a row of the table in idem-runtime/src/consumer/jetstream.rs.

/// Topics the server refuses to publish on (whitespace, an empty token, a
/// wildcard; `put` refuses only control characters) fail alone, each with
/// its reason, and are never sent: a space would split the protocol line and
/// cost the connection, so the batch after them publishes on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_subjects_the_server_refuses_fail_alone() {
    let Some(db) = postgres().await else { return };
    let url = services::nats_url();
    let Some(client) = services::reachable("NATS", &url, async_nats::connect(url.as_str()).await)
    else {
        return;
    };
    let js = jetstream::new(client.clone());
    let name = format!("IDEM_OUTBOX_{}", tag().to_uppercase());
    let subject = format!("idem-outbox.{name}");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{subject}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    let topics = [
        format!("{subject}.x"),
        format!("{subject} x"),
        format!("{subject}..x"),
        format!("{subject}.*"),
    ];
    for (i, topic) in topics.iter().enumerate() {
        write(&db.pool, topic, &[format!("{name}-{i}")]).await;
    }
    let relay = Relay::builder(db.pool.clone(), JetStreamSink::new(js.clone()))
        .batch(10)
        .build();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (1, 3), "{round:?}");
    let pending = outbox::list(&db.pool, outbox::MessageState::Pending, 10)
        .await
        .unwrap();
    let mut reasons: Vec<_> = pending
        .iter()
        .map(|m| (m.topic.as_str(), m.last_error.clone().unwrap_or_default()))
        .collect();
    reasons.sort();
    assert_eq!(reasons.len(), 3, "{reasons:?}");
    for ((topic, reason), problem) in reasons.iter().zip([
        "it holds whitespace",
        "it holds a wildcard",
        "it has an empty token",
    ]) {
        assert!(
            reason.contains("is not a subject to publish on") && reason.contains(problem),
            "{topic}: {reason}"
        );
    }

    assert_eq!(
        client.connection_state(),
        async_nats::connection::State::Connected
    );
    write(&db.pool, &topics[0], &[format!("{name}-after")]).await;
    let round = relay.run_once().await.unwrap();
    assert_eq!(round.published, 1, "{round:?}");
    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 2);
    let _ = js.delete_stream(&name).await;
}

// ---- Limits of RabbitMQ (issue 30): the sink's boundary tests of the
// `# Limits of RabbitMQ` table in `consumer/rabbitmq/mod.rs`. ----

/// A connection to RabbitMQ at `url` and a queue of this test's own
/// (`idem-test-outbox-<what>-…`), declared with its retry and parking
/// queues.
async fn rabbitmq_queue(url: &str, what: &str) -> Option<(lapin::Connection, String)> {
    let conn = services::reachable("RabbitMQ", url, rabbitmq::connect(url).await)?;
    let queue = format!("idem-test-outbox-{what}-{}", tag());
    RabbitMqSource::declare(&conn.create_channel().await.unwrap(), &queue)
        .await
        .unwrap();
    Some((conn, queue))
}

/// Messages ready in `queue`.
async fn rabbitmq_ready(conn: &lapin::Connection, queue: &str) -> u32 {
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    conn.create_channel()
        .await
        .unwrap()
        .queue_declare(queue, passive, Default::default())
        .await
        .unwrap()
        .message_count()
}

/// The pending messages' ids and reasons, by id.
async fn pending_reasons(pool: &PgPool) -> Vec<(String, String)> {
    let mut pending: Vec<_> = outbox::list(pool, outbox::MessageState::Pending, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|m| (m.id.to_string(), m.last_error.unwrap_or_default()))
        .collect();
    pending.sort();
    pending
}

/// Regression: AMQP sends a message's content header (its id and headers)
/// in one frame, unchecked by lapin; one past the broker's slack was a
/// connection error, and every message of the batch failed with it. The
/// sink checks it against the connection's `frame_max`: a header frame of
/// exactly `frame_max` bytes is published; one byte over (which RabbitMQ's
/// 8-byte slack would still take) and far over fail alone, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_a_content_header_over_frame_max_fails_alone() {
    let Some(db) = postgres().await else { return };
    let url = services::rabbitmq_url();
    // Frames of 8 KiB, negotiated by this connection (the broker's own is
    // 128 KiB, past what `put` lets headers take).
    let small_frames = format!(
        "{url}{}frame_max=8192",
        if url.contains('?') { '&' } else { '?' }
    );
    let Some((conn, queue)) = rabbitmq_queue(&small_frames, "frame").await else {
        return;
    };
    let frame_max = conn.configuration().frame_max() as usize;
    assert_eq!(frame_max, 8192, "the connection's frame_max");
    let small: Vec<String> = (0..3).map(|i| format!("{queue}-small-{i}")).collect();
    write(&db.pool, &queue, &small).await;
    let (at, over, far) = (
        format!("{queue}-at"),
        format!("{queue}-over"),
        format!("{queue}-far"),
    );
    let mut tx = db.pool.begin().await.unwrap();
    for (id, extra) in [(&at, 0), (&over, 1), (&far, 9)] {
        // The header frame, counted by hand: frame overhead 8; class, weight
        // and body size 12; property flags 2; `message-id` (1 + len); the
        // header table's length 4 and its one entry (name 1 + 1, type 1,
        // value 4 + len); `delivery-mode` 1.
        let value = "v".repeat(frame_max + extra - 35 - id.len());
        outbox::put(
            &mut tx,
            Message::bytes(queue.as_str(), b"{}".to_vec())
                .id(id.as_str())
                .header("h", value),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let sink = RabbitMqSink::new(conn.create_channel().await.unwrap())
        .await
        .unwrap()
        .frame_max(frame_max as u32);
    let relay = Relay::builder(db.pool.clone(), sink).batch(10).build();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (4, 2), "{round:?}");
    let pending = pending_reasons(&db.pool).await;
    assert_eq!(
        pending.iter().map(|(id, _)| id).collect::<Vec<_>>(),
        [&far, &over]
    );
    for ((_, reason), bytes) in pending.iter().zip([frame_max + 9, frame_max + 1]) {
        assert!(
            reason.contains(&format!(
                "a {bytes}-byte frame, over the connection's frame_max ({frame_max})"
            )),
            "{reason}"
        );
    }
    assert_eq!(rabbitmq_ready(&conn, &queue).await, 4);
    delete_queues(&conn, &queue).await;
    db.drop().await;
}

/// The broker closes the channel on a payload over its `max_message_size`
/// (128 MiB here, a global setting this shared broker keeps), failing the
/// batch on it. The sink holds payloads to `max_message_bytes`, lowered here
/// to 1 KiB: exactly 1 KiB is published, one byte more fails alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_a_payload_over_max_message_bytes_fails_alone() {
    let Some(db) = postgres().await else { return };
    let Some((conn, queue)) = rabbitmq_queue(&services::rabbitmq_url(), "size").await else {
        return;
    };
    let small: Vec<String> = (0..3).map(|i| format!("{queue}-small-{i}")).collect();
    write(&db.pool, &queue, &small).await;
    let (at, over) = (format!("{queue}-at"), format!("{queue}-over"));
    let mut tx = db.pool.begin().await.unwrap();
    for (id, len) in [(&at, 1024), (&over, 1025)] {
        outbox::put(
            &mut tx,
            Message::bytes(queue.as_str(), vec![b'x'; len]).id(id.as_str()),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let sink = RabbitMqSink::new(conn.create_channel().await.unwrap())
        .await
        .unwrap()
        .max_message_bytes(1024);
    let relay = Relay::builder(db.pool.clone(), sink).batch(10).build();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (4, 1), "{round:?}");
    let (id, reason) = the_one_pending(&db.pool).await;
    assert_eq!(id, over);
    assert!(
        reason.contains("the payload is 1025 bytes, over the broker's max_message_size (1024"),
        "{reason}"
    );
    assert_eq!(rabbitmq_ready(&conn, &queue).await, 4);
    delete_queues(&conn, &queue).await;
    db.drop().await;
}

// ---- Redis Streams at Redis's limits (issue 30): `proto-max-bulk-len` and
// `MAXLEN ~` (the `# Limits of Redis Streams` table in
// `idem-runtime/src/consumer/redis_streams/mod.rs`). ----

/// A `redis-server` of the test's own on a free loopback port, started with
/// `args` (a limit lowered for one test, never on the shared server), killed
/// when dropped.
struct OwnRedis {
    child: std::process::Child,
    port: u16,
}

impl OwnRedis {
    fn start(args: &[&str]) -> Option<OwnRedis> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let binary = std::env::var("IDEM_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let child = std::process::Command::new(binary)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
        let child = services::reachable("redis-server (binary)", "PATH", child)?;
        let server = OwnRedis { child, port };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }

    fn client(&self) -> redis::Client {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port)).unwrap()
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A server whose `proto-max-bulk-len` is 1 MiB: a payload of exactly 1 MiB
/// is published with its batch, one of 1 MiB + 1 fails alone, named, and
/// stays pending (was: Redis closed the connection mid-pipeline and every
/// message of the batch failed, every round).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_streams_a_payload_over_proto_max_bulk_len_fails_alone() {
    const MIB: usize = 1024 * 1024;
    let Some(db) = postgres().await else { return };
    let Some(server) = OwnRedis::start(&["--proto-max-bulk-len", "1mb"]) else {
        return;
    };
    let client = server.client();
    let stream = format!("idem-test-outbox-{}", tag());
    let small: Vec<String> = (0..3).map(|i| format!("{stream}-small-{i}")).collect();
    write(&db.pool, &stream, &small).await;
    let (at, over) = (format!("{stream}-at"), format!("{stream}-over"));
    let mut tx = db.pool.begin().await.unwrap();
    outbox::put(
        &mut tx,
        Message::bytes(stream.as_str(), vec![b'x'; MIB]).id(at.as_str()),
    )
    .await
    .unwrap();
    outbox::put(
        &mut tx,
        Message::bytes(stream.as_str(), vec![b'x'; MIB + 1]).id(over.as_str()),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let sink = RedisStreamsSink::connect(&client).await.unwrap();
    let relay = Relay::builder(db.pool.clone(), sink).batch(10).build();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (4, 1), "{round:?}");
    let (id, reason) = the_one_pending(&db.pool).await;
    assert_eq!(id, over);
    assert!(reason.contains("proto-max-bulk-len"), "{reason}");

    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let entries: redis::streams::StreamRangeReply = conn.xrange_all(&stream).await.unwrap();
    let mut got: Vec<(String, usize)> = entries
        .ids
        .iter()
        .map(|e| {
            let payload: Vec<u8> = e.get("payload").unwrap();
            (e.get("message-id").unwrap(), payload.len())
        })
        .collect();
    got.sort();
    assert_eq!(
        got.len(),
        4,
        "{:?}",
        got.iter().map(|g| &g.0).collect::<Vec<_>>()
    );
    assert!(got.contains(&(at, MIB)), "the 1 MiB payload whole");
    db.drop().await;
}

/// `MAXLEN ~` trims entries whether or not a group has read them. A group
/// that has read nothing yet, 250 messages relayed: with `max_len(1000)`
/// (above the backlog) it reads all 250; with `max_len(10)` (below it) the
/// relay still counts all 250 published, but the oldest are gone and the
/// group reads only what is left. What the table and `max_len`'s rustdoc
/// warn of: nothing counts or logs the trimmed entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_streams_max_len_below_the_backlog_trims_entries_no_group_has_read() {
    let Some(client) = redis().await else { return };
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for (max_len, trims) in [(1000, false), (10, true)] {
        let Some(db) = postgres().await else { return };
        let stream = format!("idem-test-outbox-maxlen-{}", tag());
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&stream)
            .arg("late")
            .arg("0")
            .arg("MKSTREAM")
            .query_async(&mut conn)
            .await
            .unwrap();
        let ids: Vec<String> = (0..250).map(|i| format!("{stream}-{i:03}")).collect();
        write(&db.pool, &stream, &ids).await;
        let sink = RedisStreamsSink::connect(&client)
            .await
            .unwrap()
            .max_len(max_len);
        relay_all(&db.pool, sink, 250).await;

        let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("late")
            .arg("c1")
            .arg("COUNT")
            .arg(1000)
            .arg("STREAMS")
            .arg(&stream)
            .arg(">")
            .query_async(&mut conn)
            .await
            .unwrap();
        let got: Vec<String> = read
            .keys
            .iter()
            .flat_map(|k| &k.ids)
            .map(|e| e.get("message-id").unwrap())
            .collect();
        let left: usize = conn.xlen(&stream).await.unwrap();
        assert_eq!(got.len(), left, "max_len {max_len}");
        if trims {
            assert!(
                (10..250).contains(&got.len()),
                "max_len {max_len}: {} read",
                got.len()
            );
            assert_eq!(got[..], ids[250 - got.len()..], "the newest are left");
        } else {
            assert_eq!(got, ids, "max_len {max_len}");
        }
        let _: () = conn.del(&stream).await.unwrap();
        db.drop().await;
    }
}

// ---- Kafka (issue 31): the sink into a Kafka-protocol broker (Tansu in
// `scripts/test`), read back by the Kafka consumer keyed on the id. ----

pub async fn kafka_topic(partitions: i32) -> Option<(String, String)> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let brokers = services::kafka_brokers();
    let topic = format!("idem-test-outbox-{}", tag());
    let created = async {
        let admin: AdminClient<rdkafka::client::DefaultClientContext> =
            rdkafka::config::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .create()
                .map_err(|e| e.to_string())?;
        let made = admin
            .create_topics(
                &[NewTopic::new(
                    &topic,
                    partitions,
                    TopicReplication::Fixed(1),
                )],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(|e| e.to_string())?;
        made.into_iter()
            .try_for_each(|r| r.map(drop).map_err(|(t, e)| format!("{t}: {e}")))
    };
    services::reachable("Kafka", &brokers, created.await)?;
    Some((brokers, topic))
}

/// The relay publishes into Kafka with the id in the `message-id` header and
/// the message's headers; a message published twice (its relay died before
/// marking it) is applied once by an `Envelope` consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_carries_the_id_and_a_republished_message_is_applied_once() {
    use idem_runtime::consumer::kafka::KafkaSource;
    use idem_runtime::outbox::sink::KafkaSink;

    let Some(db) = postgres().await else { return };
    let Some((brokers, topic)) = kafka_topic(3).await else {
        return;
    };
    let ids: Vec<String> = (0..3).map(|i| format!("{topic}-{i}")).collect();
    write(&db.pool, &topic, &ids).await;
    relay_all(&db.pool, KafkaSink::connect(&brokers).unwrap(), 3).await;
    unmark(&db.pool, &ids[0]).await;
    relay_all(&db.pool, KafkaSink::connect(&brokers).unwrap(), 1).await;

    let mut source = KafkaSource::builder(&brokers, &topic, &format!("{topic}-apply"))
        .store(idem_runtime::store::memory::MemoryStore::new())
        // Tansu holds a first join for about the session timeout.
        .set("session.timeout.ms", "6000")
        .connect()
        .await
        .unwrap();
    let actions = consume(&mut source, 4).await;
    assert_eq!(dedup_count(&actions), (3, 1), "{actions:?}");
    assert!(ids.iter().all(|id| applied(id) == 1));
    db.drop().await;
}

/// A message over the producer's `message.max.bytes` (1 000 000 bytes by
/// default) is refused by the client before it is sent: it fails alone, with
/// the reason, and the batch around it is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_a_message_over_message_max_bytes_fails_alone() {
    use idem_runtime::outbox::sink::KafkaSink;

    let Some(db) = postgres().await else { return };
    let Some((brokers, topic)) = kafka_topic(1).await else {
        return;
    };
    let small: Vec<String> = (0..3).map(|i| format!("{topic}-small-{i}")).collect();
    write(&db.pool, &topic, &small).await;
    let (under, over) = (format!("{topic}-under"), format!("{topic}-over"));
    let mut tx = db.pool.begin().await.unwrap();
    for (id, bytes) in [(&under, 900_000), (&over, 1_000_001)] {
        outbox::put(
            &mut tx,
            Message::bytes(topic.as_str(), vec![b'x'; bytes]).id(id.as_str()),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let relay = Relay::builder(db.pool.clone(), KafkaSink::connect(&brokers).unwrap())
        .batch(10)
        .build();
    let round = relay.run_once().await.unwrap();
    assert_eq!((round.published, round.failed), (4, 1), "{round:?}");
    let (id, reason) = the_one_pending(&db.pool).await;
    assert_eq!(id, over);
    assert!(reason.to_lowercase().contains("size"), "{reason}");
    db.drop().await;
}
