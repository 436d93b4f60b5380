//! The cases every database runs unchanged, through the `MemorySink` (the
//! brokers' own sinks are in `sinks.rs`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use idem_runtime::consumer::BrokerError;
use idem_runtime::outbox::sink::{MemorySink, Sink};
use idem_runtime::outbox::{
    self, Message, MessageState, OutboxDatabase, OutboxError, Outgoing, Relay,
};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{idempotent, step};
use sqlx::Pool;
use tokio::sync::mpsc::Receiver;

use super::{backlog_of, metric, recorder, tag, until};

fn msg(topic: &str, id: &str) -> Message {
    Message::bytes(topic, format!("{{\"n\":\"{id}\"}}").into_bytes()).id(id)
}

/// Everything the channel holds now.
fn drain(rx: &mut Receiver<Outgoing>) -> Vec<Outgoing> {
    let mut out = Vec::new();
    while let Ok(m) = rx.try_recv() {
        out.push(m);
    }
    out
}

fn ids(batch: &[Outgoing]) -> Vec<String> {
    batch.iter().map(|m| m.id.as_str().to_owned()).collect()
}

pub async fn rollback_publishes_nothing_and_commit_publishes_exactly_the_committed<
    DB: OutboxDatabase,
>(
    pool: &Pool<DB>,
) {
    let topic = format!("orders.{}", tag());
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(&mut tx, [msg(&topic, "rolled-1"), msg(&topic, "rolled-2")])
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    let written = outbox::put_all(
        &mut tx,
        [
            msg(&topic, "kept-1").header("tenant", "acme"),
            msg(&topic, "kept-2").ordering_key("order-9"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(written.len(), 2);
    // Not committed yet: a relay sees nothing.
    let (sink, mut rx) = MemorySink::channel(100);
    let relay = Relay::builder(pool.clone(), sink).build();
    let early = pool.clone();
    let peek = tokio::spawn(async move {
        let (sink, _rx) = MemorySink::channel(100);
        Relay::builder(early, sink)
            .build()
            .run_once()
            .await
            .unwrap()
    });
    // Neither relayed nor waited for: a relay round never queues behind a
    // writer's open transaction.
    let peeked = tokio::time::timeout(Duration::from_secs(5), peek)
        .await
        .expect("a relay round does not wait for an open transaction");
    assert_eq!(
        peeked.unwrap().claimed,
        0,
        "an open transaction's messages are not relayed"
    );
    tx.commit().await.unwrap();

    let round = relay.run_once().await.unwrap();
    assert_eq!((round.claimed, round.published), (2, 2));
    let got = drain(&mut rx);
    assert_eq!(ids(&got), ["kept-1", "kept-2"]);
    assert_eq!(
        got[0].headers.get("tenant").map(String::as_str),
        Some("acme")
    );
    assert_eq!(got[0].payload, br#"{"n":"kept-1"}"#);
    assert_eq!(got[0].attempt, 1);
    assert_eq!(relay.run_once().await.unwrap().claimed, 0, "sent once");
    let b = backlog_of(pool, &topic).await;
    assert_eq!((b.pending, b.sent, b.parked), (0, 2, 0));
}

/// Writes one message in a transaction of its own and commits it, noting
/// the id.
#[async_trait::async_trait]
pub trait Writes: Sync {
    async fn write(&self, topic: &str) -> Result<String, FlowError> {
        self.write_payload(topic, b"{}").await
    }

    async fn write_payload(&self, topic: &str, payload: &[u8]) -> Result<String, FlowError>;
}

pub struct Writer<DB: OutboxDatabase> {
    pool: Pool<DB>,
    written: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl<DB: OutboxDatabase> Writes for Writer<DB> {
    async fn write_payload(&self, topic: &str, payload: &[u8]) -> Result<String, FlowError> {
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(|e| FlowError::Db(e.to_string()))?;
        let id = outbox::put(&mut tx, Message::bytes(topic, payload.to_vec()))
            .await
            .map_err(|e| FlowError::Db(e.to_string()))?;
        tx.commit()
            .await
            .map_err(|e| FlowError::Db(e.to_string()))?;
        self.written.lock().unwrap().push(id.to_string());
        Ok(id.to_string())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FlowError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error("database: {0}")]
    Db(String),
    #[error("crashed before the flow finished")]
    Crashed,
}

#[step("reserve_stock")]
async fn reserve_stock(w: &dyn Writes) -> Result<String, FlowError> {
    w.write("stock.reserved").await
}

/// A flow that writes one message inside a step and one after it, then
/// fails (a crash before it finished) when told to.
#[idempotent(key = "order_id", scope = "tests.outbox.retried_flow")]
async fn create_order(
    order_id: u64,
    w: &dyn Writes,
    crash: &AtomicBool,
) -> Result<Vec<String>, FlowError> {
    let reserved = reserve_stock(w).await?;
    let created = w.write("orders.created").await?;
    if crash.swap(false, Ordering::SeqCst) {
        return Err(FlowError::Crashed);
    }
    Ok(vec![reserved, created])
}

pub fn install_memory_store() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| idem_runtime::install(MemoryStore::new()));
}

pub async fn a_retried_flow_writes_each_message_once<DB: OutboxDatabase>(pool: &Pool<DB>) {
    install_memory_store();
    let w = Writer {
        pool: pool.clone(),
        written: Mutex::new(Vec::new()),
    };
    let order_id = u64::from(u32::from_str_radix(&tag(), 16).unwrap());
    let crash = AtomicBool::new(true);
    assert!(matches!(
        create_order(order_id, &w, &crash).await,
        Err(FlowError::Crashed)
    ));
    let first_run = w.written.lock().unwrap().clone();
    assert_eq!(first_run.len(), 2);
    // The retry replays the step (its message is not written again) and
    // writes the second message again: under the same id, so no new row.
    let ids = create_order(order_id, &w, &crash).await.unwrap();
    assert_eq!(ids, first_run, "the retry derives the same ids");
    assert_eq!(
        w.written.lock().unwrap().len(),
        3,
        "the step's write was replayed, not re-run"
    );
    let total: u64 = outbox::backlog(pool, true)
        .await
        .unwrap()
        .iter()
        .map(|b| b.pending + b.sent + b.parked)
        .sum();
    assert_eq!(total, 2, "each message is one row");
    // A later call with another key writes other ids.
    let other = create_order(order_id + 1, &w, &AtomicBool::new(false))
        .await
        .unwrap();
    assert!(other.iter().all(|id| !ids.contains(id)));
    assert_ne!(ids[0], ids[1]);
}

/// A first run commits message A on `topic` and crashes; its retry (A
/// already out) writes message B on the same topic instead.
#[idempotent(key = "order_id", scope = "tests.outbox.changed_retry")]
async fn announce(
    order_id: u64,
    w: &dyn Writes,
    topic: &str,
    runs: &AtomicU32,
) -> Result<(), FlowError> {
    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
        w.write_payload(topic, b"A").await?;
        return Err(FlowError::Crashed);
    }
    w.write_payload(topic, b"B").await?;
    Ok(())
}

/// Regression (issue 30, item 2): ids from the call's key and the message's
/// position gave the retry's other message the first run's id, and the
/// conflict was taken for success: it was never sent.
pub async fn a_retry_that_writes_another_message_sends_it_too<DB: OutboxDatabase>(pool: &Pool<DB>) {
    install_memory_store();
    let w = Writer {
        pool: pool.clone(),
        written: Mutex::new(Vec::new()),
    };
    let topic = format!("changed.{}", tag());
    let order_id = u64::from(u32::from_str_radix(&tag(), 16).unwrap());
    let runs = AtomicU32::new(0);
    let crashed = announce(order_id, &w, &topic, &runs).await;
    assert!(matches!(crashed, Err(FlowError::Crashed)), "{crashed:?}");
    announce(order_id, &w, &topic, &runs).await.unwrap();
    let written = w.written.lock().unwrap().clone();
    assert_eq!(written.len(), 2);
    assert_ne!(
        written[0], written[1],
        "the second message has an id of its own"
    );
    assert_eq!(
        backlog_of(pool, &topic).await.pending,
        2,
        "A and B are both sent"
    );
}

/// Writes the same message twice, each in a transaction of its own: as a
/// call does whose commit reported a failure although the server committed
/// (the connection dropped during COMMIT) and which tries again.
#[idempotent(key = "order_id", scope = "tests.outbox.tx_tried_again")]
async fn commit_tried_again(order_id: u64, w: &dyn Writes, topic: &str) -> Result<(), FlowError> {
    w.write_payload(topic, b"once").await?;
    w.write_payload(topic, b"once").await?;
    Ok(())
}

/// Regression (issue 30, item 10): the second write took the next position
/// and a second row under another id, applied twice by a consumer keyed on
/// the id.
pub async fn a_transaction_tried_again_inside_the_call_writes_one_row<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) {
    install_memory_store();
    let w = Writer {
        pool: pool.clone(),
        written: Mutex::new(Vec::new()),
    };
    let topic = format!("tried-again.{}", tag());
    let order_id = u64::from(u32::from_str_radix(&tag(), 16).unwrap());
    commit_tried_again(order_id, &w, &topic).await.unwrap();
    let written = w.written.lock().unwrap().clone();
    assert_eq!(written[0], written[1], "the same message, the same id");
    assert_eq!(backlog_of(pool, &topic).await.pending, 1, "one row");
}

pub async fn outside_a_call_a_message_needs_an_id_and_a_repeated_id_is_one_row<
    DB: OutboxDatabase,
>(
    pool: &Pool<DB>,
) {
    let topic = format!("audit.{}", tag());
    let mut tx = pool.begin().await.unwrap();
    let err = outbox::put(&mut tx, Message::bytes(topic.as_str(), b"x".to_vec()))
        .await
        .unwrap_err();
    assert!(matches!(err, OutboxError::NoId { .. }), "{err}");
    assert!(err.to_string().contains("Message::id"), "{err}");
    let err = outbox::put(&mut tx, Message::bytes("", b"x".to_vec()).id("a"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("topic is empty"), "{err}");
    let err = outbox::put(&mut tx, msg(&topic, &"x".repeat(256)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("over 255"), "{err}");
    // Regression (issue 30, items 4 and 9): what no sink can carry is refused
    // here, before it is committed. An AMQP routing key is at most 255
    // bytes, not characters (one under and one over the limit).
    let wide = "é".repeat(127);
    outbox::put(&mut tx, msg(&format!("{wide}x"), "255-bytes"))
        .await
        .expect("a topic of 255 bytes");
    let err = outbox::put(&mut tx, msg(&format!("{wide}xy"), "256-bytes"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("256 bytes, over 255"), "{err}");
    // A header NATS would cut at CR/LF, never reaching a consumer.
    for (name, value) in [
        ("tenant", "acme\r\nNats-Msg-Id: forged"),
        ("tenant", "a\nb"),
    ] {
        let err = outbox::put(&mut tx, msg(&topic, "h").header(name, value))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("header `tenant`"), "{err}");
    }
    let long_name = "h".repeat(256);
    for name in ["", "a b", "x:y", "caf\u{e9}", long_name.as_str()] {
        let err = outbox::put(&mut tx, msg(&topic, "h").header(name, "v"))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("header name"), "{name:?}: {err}");
    }
    outbox::put(
        &mut tx,
        msg(&topic, "h-ok")
            .header("x-tenant_id.v2", "acme, inc. \t é")
            .header("h".repeat(255), "a name of 255 bytes"),
    )
    .await
    .expect("a token name and a value without CR, LF or NUL");
    // Headers as stored (a JSON object) up to 65 535 bytes, MySQL's TEXT:
    // `{"h":"…"}` is 8 bytes around the value. The same answer on every
    // database (was: MariaDB refused the second with "Data too long", the
    // others wrote it).
    outbox::put(
        &mut tx,
        msg(&topic, "headers-at-the-limit").header("h", "v".repeat(65_527)),
    )
    .await
    .expect("headers of 65 535 bytes");
    let err = outbox::put(
        &mut tx,
        msg(&topic, "headers-over").header("h", "v".repeat(65_528)),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("65536 bytes as stored"), "{err}");
    // NUL, which PostgreSQL's text refuses, in a name or a header value.
    let err = outbox::put(&mut tx, msg("orders\0created", "t"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("topic"), "{err}");
    let err = outbox::put(&mut tx, msg(&topic, "nul").header("tenant", "a\0b"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("header `tenant`"), "{err}");
    let err = outbox::put(&mut tx, msg("orders\ncreated", "t"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("topic"), "{err}");
    outbox::put(&mut tx, msg(&topic, "same")).await.unwrap();
    tx.commit().await.unwrap();
    // Written again by a retry that did not know: success, no second row.
    let mut tx = pool.begin().await.unwrap();
    let id = outbox::put(&mut tx, msg(&topic, "same")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(id.as_str(), "same");
    assert_eq!(
        backlog_of(pool, &topic).await.pending,
        3,
        "`same`, `h-ok` and `headers-at-the-limit`"
    );
}

/// Regression (issue 30, item 2): an id of the caller's held by another
/// message is refused, not taken as "already written" (was: success, and the
/// second message was never sent). The same message again is still success.
pub async fn a_callers_id_held_by_another_message_is_refused<DB: OutboxDatabase>(pool: &Pool<DB>) {
    let topic = format!("audit.{}", tag());
    let id = format!("taken-{}", tag());
    let first = || {
        Message::bytes(topic.as_str(), b"first".to_vec())
            .id(id.as_str())
            .ordering_key("k")
            .header("tenant", "acme")
    };
    let mut tx = pool.begin().await.unwrap();
    outbox::put(&mut tx, first()).await.unwrap();
    tx.commit().await.unwrap();

    let other_topic = format!("{topic}.other");
    let others = [
        (
            Message::bytes(other_topic.as_str(), b"first".to_vec())
                .id(id.as_str())
                .ordering_key("k")
                .header("tenant", "acme"),
            "topic",
        ),
        (first().ordering_key("j"), "ordering key"),
        (
            Message::bytes(topic.as_str(), b"first".to_vec())
                .id(id.as_str())
                .header("tenant", "acme"),
            "ordering key",
        ),
        (first().header("tenant", "globex"), "headers"),
        (
            Message::bytes(topic.as_str(), b"second".to_vec())
                .id(id.as_str())
                .ordering_key("k")
                .header("tenant", "acme"),
            "payload",
        ),
    ];
    for (other, part) in others {
        let mut tx = pool.begin().await.unwrap();
        let err = outbox::put(&mut tx, other).await.unwrap_err();
        let OutboxError::IdTaken {
            id: taken,
            part: differs,
        } = &err
        else {
            panic!("{part}: expected IdTaken, got {err}");
        };
        assert_eq!((taken.as_str(), *differs), (id.as_str(), part), "{err}");
        assert!(err.to_string().contains("id of its own"), "{err}");
        tx.rollback().await.unwrap();
    }
    // The same message again: success, one row.
    let mut tx = pool.begin().await.unwrap();
    outbox::put(&mut tx, first()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(backlog_of(pool, &topic).await.pending, 1);
    assert_eq!(backlog_of(pool, &other_topic).await.pending, 0);

    // Without an ordering key (PostgreSQL writes those with a statement of
    // their own): another message under a held id is refused, the same one
    // again is one row.
    let plain_id = format!("plain-{}", tag());
    let plain =
        |payload: &[u8]| Message::bytes(topic.as_str(), payload.to_vec()).id(plain_id.as_str());
    let mut tx = pool.begin().await.unwrap();
    outbox::put(&mut tx, plain(b"first")).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let err = outbox::put(&mut tx, plain(b"second")).await.unwrap_err();
    assert!(
        matches!(&err, OutboxError::IdTaken { id, part: "payload" } if *id == plain_id),
        "{err}"
    );
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    outbox::put(&mut tx, plain(b"first")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(backlog_of(pool, &topic).await.pending, 2);

    // Two messages of one put_all under one id: the second is refused too.
    let mut tx = pool.begin().await.unwrap();
    let twice = format!("twice-{}", tag());
    let err = outbox::put_all(
        &mut tx,
        [
            Message::bytes(topic.as_str(), b"a".to_vec()).id(twice.as_str()),
            Message::bytes(topic.as_str(), b"b".to_vec()).id(twice.as_str()),
        ],
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            err,
            OutboxError::IdTaken {
                part: "payload",
                ..
            }
        ),
        "{err}"
    );
    tx.rollback().await.unwrap();
}

/// Ids, topics and ordering keys are compared as bytes on every database
/// (was, on MariaDB: under the default `utf8mb4_general_ci` collation
/// `Order-1` = `order-1`, `e` = `é` and `a` = `a `, so the second message of
/// each pair was "already written" and never sent).
pub async fn names_that_differ_only_in_case_accent_or_trailing_space_are_distinct<
    DB: OutboxDatabase,
>(
    pool: &Pool<DB>,
) {
    let topic = format!("names.{}", tag());
    let pairs = [("order-1", "Order-1"), ("e-1", "\u{e9}-1"), ("a", "a ")];
    let mut tx = pool.begin().await.unwrap();
    for (one, other) in pairs {
        for id in [one, other] {
            let m = msg(&topic, id).ordering_key(format!("key-{id}"));
            assert_eq!(outbox::put(&mut tx, m).await.unwrap().as_str(), id);
        }
    }
    // Topics likewise: two topics, one message each.
    let upper = topic.to_uppercase();
    outbox::put(&mut tx, msg(&upper, "upper")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(backlog_of(pool, &topic).await.pending, 6);
    assert_eq!(backlog_of(pool, &upper).await.pending, 1);

    let (sink, mut rx) = MemorySink::channel(100);
    let relay = Relay::builder(pool.clone(), sink).build();
    assert_eq!(relay.run_once().await.unwrap().published, 7);
    let mut got = ids(&drain(&mut rx));
    got.sort();
    let mut want: Vec<String> = pairs
        .iter()
        .flat_map(|(a, b)| [a.to_string(), b.to_string()])
        .chain(["upper".to_owned()])
        .collect();
    want.sort();
    assert_eq!(got, want, "each id sent once, byte for byte");
}

/// One `put_all` past every database's cap on a statement: 13 108 messages
/// are 65 540 parameters or more (SQLite takes 32 766, PostgreSQL and MySQL
/// 65 535), and 17 messages of 1 MiB pass MariaDB's 16 MiB
/// `max_allowed_packet` (was: a database error, on MariaDB with the
/// connection and the caller's transaction gone). Written whole, ids in the
/// caller's order, keyed messages in their order.
pub async fn a_batch_past_every_statement_cap_is_written_whole<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) {
    let topic = format!("bulk.{}", tag());
    let n = 13_108;
    let mut tx = pool.begin().await.unwrap();
    let written = outbox::put_all(
        &mut tx,
        (0..n).map(|i| {
            // A few keyed ones, spread over the statements: a relay round
            // takes one message per key, so many would make a slow test.
            let m = msg(&topic, &format!("m-{i}"));
            if i % 1_000 == 0 {
                m.ordering_key(format!("k-{}", i % 3_000))
            } else {
                m
            }
        }),
    )
    .await
    .expect("a batch past the parameter caps");
    let want: Vec<String> = (0..n).map(|i| format!("m-{i}")).collect();
    assert_eq!(
        written.iter().map(|id| id.as_str()).collect::<Vec<_>>(),
        want,
        "ids in the caller's order"
    );
    let big = format!("big.{}", tag());
    let mib = vec![b'x'; 1 << 20];
    outbox::put_all(
        &mut tx,
        (0..17).map(|i| Message::bytes(big.as_str(), mib.clone()).id(format!("big-{i}"))),
    )
    .await
    .expect("17 MiB in one batch");
    tx.commit().await.unwrap();
    assert_eq!(backlog_of(pool, &topic).await.pending, n as u64);
    assert_eq!(backlog_of(pool, &big).await.pending, 17);

    // A key's messages go out in the order they were written.
    let (sink, mut rx) = MemorySink::channel(2 * n);
    let relay = Relay::builder(pool.clone(), sink).batch(5_000).build();
    let mut seen: Vec<Outgoing> = Vec::new();
    while seen.len() < n + 17 {
        let round = relay.run_once().await.unwrap();
        assert!(round.claimed > 0, "stalled at {}", seen.len());
        seen.extend(drain(&mut rx));
    }
    for k in [0, 1_000, 2_000] {
        let key = format!("k-{k}");
        let order: Vec<usize> = seen
            .iter()
            .filter(|m| m.ordering_key.as_deref() == Some(key.as_str()))
            .map(|m| m.id.as_str()[2..].parse().unwrap())
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{key}: {order:?}");
        assert!(!order.is_empty());
    }
}

pub async fn two_relays_publish_each_message_once<DB: OutboxDatabase>(pool: &Pool<DB>) {
    let topic = format!("bulk.{}", tag());
    const N: usize = 400;
    for chunk in 0..(N / 100) {
        let mut tx = pool.begin().await.unwrap();
        outbox::put_all(
            &mut tx,
            (0..100).map(|i| {
                let n = chunk * 100 + i;
                // Some with ordering keys, some without.
                let m = msg(&topic, &format!("m-{n}"));
                if n % 3 == 0 {
                    m.ordering_key(format!("k-{}", n % 7))
                } else {
                    m
                }
            }),
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let (sink, mut rx) = MemorySink::channel(N * 2);
    let relays: Vec<_> = (0..2)
        .map(|_| {
            let relay = Relay::builder(pool.clone(), sink.clone()).batch(25).build();
            let (pool, topic) = (pool.clone(), topic.clone());
            tokio::spawn(async move {
                while backlog_of(&pool, &topic).await.pending > 0 {
                    if relay.run_once().await.expect("a relay round").claimed == 0 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                relay.stats()
            })
        })
        .collect();
    let mut published = 0;
    for r in relays {
        let stats = r.await.expect("neither relay crashes");
        assert!(stats.published > 0, "both relays took part: {stats:?}");
        published += stats.published;
    }
    let mut seen: HashMap<String, usize> = HashMap::new();
    for m in drain(&mut rx) {
        *seen.entry(m.id.to_string()).or_default() += 1;
    }
    assert_eq!(seen.len(), N, "every message published");
    assert!(seen.values().all(|&n| n == 1), "none published twice");
    assert_eq!(published, N as u64);
    assert_eq!(backlog_of(pool, &topic).await.pending, 0);
}

pub async fn a_broker_outage_keeps_the_backlog_and_it_drains_after<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) {
    recorder();
    let topic = format!("outage.{}", tag());
    let (sink, mut rx) = MemorySink::channel(100);
    sink.set_down(true);
    let relay = Arc::new(
        Relay::builder(pool.clone(), sink.clone())
            .backoff(Duration::from_millis(20), Duration::from_millis(100))
            .max_attempts(1_000)
            .poll_interval(Duration::from_millis(20))
            .stats_interval(Duration::from_millis(20))
            .build(),
    );
    let stop = Arc::new(tokio::sync::Notify::new());
    let running = {
        let (relay, stop) = (relay.clone(), stop.clone());
        tokio::spawn(async move { relay.run_until(stop.notified()).await })
    };
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(&mut tx, (0..5).map(|i| msg(&topic, &format!("o-{i}"))))
        .await
        .unwrap();
    tx.commit().await.unwrap();

    until("failed publishes while the broker is down", 20, || async {
        metric("idem_outbox_failed_total", &topic).unwrap_or(0.0) >= 5.0
    })
    .await;
    until("the backlog gauge to show the 5 messages", 20, || async {
        metric("idem_outbox_backlog", &topic) == Some(5.0)
    })
    .await;
    until("the oldest message's age to grow", 20, || async {
        metric("idem_outbox_oldest_age_seconds", &topic).unwrap_or(0.0) > 0.0
    })
    .await;
    assert!(drain(&mut rx).is_empty());
    assert_eq!(
        backlog_of(pool, &topic).await.pending,
        5,
        "nothing lost while down"
    );

    sink.set_down(false);
    let mut got = Vec::new();
    until("the backlog to drain", 20, || {
        got.extend(ids(&drain(&mut rx)));
        std::future::ready(got.len() >= 5)
    })
    .await;
    got.sort();
    assert_eq!(got, ["o-0", "o-1", "o-2", "o-3", "o-4"]);
    until("the backlog gauge back to 0", 20, || async {
        metric("idem_outbox_backlog", &topic) == Some(0.0)
    })
    .await;
    assert_eq!(metric("idem_outbox_published_total", &topic), Some(5.0));
    stop.notify_one();
    running.await.unwrap();
    assert!(relay.stats().failed >= 5);
}

pub async fn one_ordering_key_is_published_in_commit_order<DB: OutboxDatabase>(pool: &Pool<DB>) {
    let topic = format!("ordered.{}", tag());
    // T1 writes first but commits after T2 tried: T2 waits for T1's commit,
    // so the key's order is T1 then T2, the order they committed in.
    let mut t1 = pool.begin().await.unwrap();
    outbox::put(&mut t1, msg(&topic, "first").ordering_key("order-1"))
        .await
        .unwrap();
    let t2 = {
        let (pool, topic) = (pool.clone(), topic.clone());
        tokio::spawn(async move {
            let mut t2 = pool.begin().await.unwrap();
            outbox::put(&mut t2, msg(&topic, "second").ordering_key("order-1"))
                .await
                .unwrap();
            t2.commit().await.unwrap();
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !t2.is_finished(),
        "a second writer of the key waits for the first's commit"
    );
    t1.commit().await.unwrap();
    t2.await.unwrap();
    // More of the same key, and another key, committed one by one.
    for (id, key) in [
        ("third", "order-1"),
        ("x1", "order-2"),
        ("fourth", "order-1"),
        ("x2", "order-2"),
    ] {
        let mut tx = pool.begin().await.unwrap();
        outbox::put(&mut tx, msg(&topic, id).ordering_key(key))
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let (sink, mut rx) = MemorySink::channel(100);
    let relay = Relay::builder(pool.clone(), sink).batch(100).build();
    let mut order: BTreeMap<String, Vec<String>> = BTreeMap::new();
    loop {
        let round = relay.run_once().await.unwrap();
        if round.claimed == 0 {
            break;
        }
        let batch = drain(&mut rx);
        let mut keys: Vec<_> = batch
            .iter()
            .map(|m| m.ordering_key.clone().unwrap())
            .collect();
        keys.sort();
        keys.dedup();
        assert_eq!(
            keys.len(),
            batch.len(),
            "one message per key per batch: {:?}",
            ids(&batch)
        );
        for m in batch {
            order
                .entry(m.ordering_key.unwrap())
                .or_default()
                .push(m.id.to_string());
        }
    }
    assert_eq!(order["order-1"], ["first", "second", "third", "fourth"]);
    assert_eq!(order["order-2"], ["x1", "x2"]);
}

pub async fn a_message_is_parked_after_max_attempts_and_retry_sends_it<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) {
    let topic = format!("parked.{}", tag());
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(
        &mut tx,
        [
            msg(&topic, "p-1").ordering_key("k"),
            msg(&topic, "p-2").ordering_key("k"),
            msg(&topic, "free"),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let (sink, mut rx) = MemorySink::channel(100);
    sink.set_down(true);
    let relay = Relay::builder(pool.clone(), sink.clone())
        .max_attempts(2)
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .build();
    let mut parked = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while parked < 2 {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for the parking"
        );
        parked += relay.run_once().await.unwrap().parked;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let listed = outbox::list(pool, MessageState::Parked, 10).await.unwrap();
    let mut parked_ids: Vec<_> = listed.iter().map(|m| m.id.as_str()).collect();
    parked_ids.sort();
    assert_eq!(
        parked_ids,
        ["free", "p-1"],
        "p-2 waits behind p-1 and is never tried"
    );
    assert!(listed.iter().all(|m| m.attempts == 2));
    let reason = listed[0].last_error.as_deref().unwrap_or_default();
    assert!(reason.contains("the sink is down"), "{reason}");
    assert_eq!(relay.stats().parked, 2);

    sink.set_down(false);
    assert_eq!(
        relay.run_once().await.unwrap().claimed,
        0,
        "a parked message blocks its key"
    );
    assert!(drain(&mut rx).is_empty());
    assert!(!outbox::retry(pool, "no-such-id").await.unwrap());
    assert!(outbox::retry(pool, "p-1").await.unwrap());
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    assert_eq!(ids(&drain(&mut rx)), ["p-1", "p-2"]);
    let b = backlog_of(pool, &topic).await;
    assert_eq!((b.pending, b.parked, b.sent), (0, 1, 2));
}

/// A broker that takes messages and never confirms them.
struct Hangs(Arc<AtomicBool>);

#[async_trait::async_trait]
impl Sink for Hangs {
    fn name(&self) -> &'static str {
        "hangs"
    }
    async fn publish(&self, _batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        self.0.store(true, Ordering::SeqCst);
        std::future::pending().await
    }
}

pub async fn a_relay_that_dies_holding_a_batch_leaves_it_to_the_next<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) {
    let topic = format!("died.{}", tag());
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(&mut tx, (0..3).map(|i| msg(&topic, &format!("d-{i}"))))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let lease = Duration::from_millis(600);
    let dying = |pool: Pool<DB>| {
        let publishing = Arc::new(AtomicBool::new(false));
        let relay = Relay::builder(pool, Hangs(publishing.clone()))
            .lease(lease)
            .build();
        (
            tokio::spawn(async move { relay.run_once().await }),
            publishing,
        )
    };
    let (task, publishing) = dying(pool.clone());
    until("the first relay to publish", 10, || {
        std::future::ready(publishing.load(Ordering::SeqCst))
    })
    .await;
    task.abort(); // it dies between the broker and marking the batch sent

    let (sink, mut rx) = MemorySink::channel(100);
    let next = Relay::builder(pool.clone(), sink).lease(lease).build();
    assert_eq!(
        next.run_once().await.unwrap().claimed,
        0,
        "the dead relay's lease still holds"
    );
    until("the next relay to take the batch over", 20, || async {
        next.run_once().await.unwrap().published == 3
    })
    .await;
    let got = drain(&mut rx);
    assert_eq!(ids(&got), ["d-0", "d-1", "d-2"]);
    assert!(
        got.iter().all(|m| m.attempt == 2),
        "the dead relay's claim counted"
    );

    // A message that every relay dies on is parked, not tried forever.
    let mut tx = pool.begin().await.unwrap();
    outbox::put(&mut tx, msg(&topic, "poison")).await.unwrap();
    tx.commit().await.unwrap();
    let (task, publishing) = dying(pool.clone());
    until("the relay to publish", 10, || {
        std::future::ready(publishing.load(Ordering::SeqCst))
    })
    .await;
    task.abort();
    let (sink, mut rx) = MemorySink::channel(100);
    let last = Relay::builder(pool.clone(), sink)
        .lease(lease)
        .max_attempts(1)
        .build();
    until("the poison message to be parked", 20, || async {
        last.run_once().await.unwrap().parked == 1
    })
    .await;
    assert!(drain(&mut rx).is_empty(), "parked without publishing");
    let parked = outbox::list(pool, MessageState::Parked, 10).await.unwrap();
    assert_eq!(parked.len(), 1);
    let reason = parked[0].last_error.as_deref().unwrap_or_default();
    assert!(reason.contains("died or hung"), "{reason}");
}

pub async fn sent_messages_are_purged_after_the_retention<DB: OutboxDatabase>(pool: &Pool<DB>) {
    let topic = format!("purged.{}", tag());
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(&mut tx, (0..3).map(|i| msg(&topic, &format!("s-{i}"))))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (sink, _rx) = MemorySink::channel(100);
    assert_eq!(
        Relay::builder(pool.clone(), sink)
            .build()
            .run_once()
            .await
            .unwrap()
            .published,
        3
    );
    let mut tx = pool.begin().await.unwrap();
    outbox::put(&mut tx, msg(&topic, "unsent")).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        outbox::purge(pool, Duration::from_secs(3600), 100)
            .await
            .unwrap(),
        0
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        outbox::purge(pool, Duration::ZERO, 2).await.unwrap(),
        2,
        "the limit holds"
    );
    assert_eq!(outbox::purge(pool, Duration::ZERO, 100).await.unwrap(), 1);
    let b = backlog_of(pool, &topic).await;
    assert_eq!(
        (b.sent, b.pending),
        (0, 1),
        "unsent messages are never purged"
    );
}

/// A broker that holds its answer until told: a relay stalled past its lease.
struct Stalls {
    publishing: Arc<AtomicBool>,
    release: Arc<tokio::sync::Notify>,
    inner: MemorySink,
}

#[async_trait::async_trait]
impl Sink for Stalls {
    fn name(&self) -> &'static str {
        "stalls"
    }
    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        self.publishing.store(true, Ordering::SeqCst);
        self.release.notified().await;
        self.inner.publish(batch).await
    }
}

/// A relay stalled with `ids` of `topic` in flight: it claimed and handed
/// them to a broker that holds its answer until `release` is notified. Its
/// lease is long (its own deadline is 80 % of it): the test ends the claim
/// by hand. Returns the relay, its pending round, `release` and what the
/// broker got.
async fn stalled_relay<DB: OutboxDatabase>(
    pool: &Pool<DB>,
    topic: &str,
    ids: &[String],
) -> (
    Arc<Relay<DB>>,
    tokio::task::JoinHandle<outbox::Round>,
    Arc<tokio::sync::Notify>,
    Receiver<Outgoing>,
) {
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(&mut tx, ids.iter().map(|id| msg(topic, id)))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (late_sink, late_rx) = MemorySink::channel(100);
    let publishing = Arc::new(AtomicBool::new(false));
    let release = Arc::new(tokio::sync::Notify::new());
    let stale = Relay::builder(
        pool.clone(),
        Stalls {
            publishing: publishing.clone(),
            release: release.clone(),
            inner: late_sink,
        },
    )
    .lease(Duration::from_secs(30))
    .build();
    let stale = Arc::new(stale);
    let first = {
        let stale = stale.clone();
        tokio::spawn(async move { stale.run_once().await.unwrap() })
    };
    until("the first relay to publish", 10, || {
        std::future::ready(publishing.load(Ordering::SeqCst))
    })
    .await;
    (stale, first, release, late_rx)
}

/// A stale relay acting late: its lease ran out while the broker held its
/// answer, another relay published and marked the batch, and then the
/// broker confirms to the first. It marks nothing and counts nothing: the
/// messages are sent once in the table, counted once.
pub async fn a_relay_that_finishes_after_its_lease_marks_nothing<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) {
    recorder();
    let topic = format!("stale.{}", tag());
    let batch: Vec<String> = (0..3).map(|i| format!("s-{i}")).collect();
    let (stale, first, release, mut late_rx) = stalled_relay(pool, &topic, &batch).await;
    // The first relay's claim ends as if its lease had run out (an
    // operator's `retry` makes the messages due at once, claims cleared).
    for i in 0..3 {
        assert!(outbox::retry(pool, &format!("s-{i}")).await.unwrap());
    }
    let (sink, mut rx) = MemorySink::channel(100);
    let next = Relay::builder(pool.clone(), sink).build();
    assert_eq!(next.run_once().await.unwrap().published, 3);
    release.notify_one();
    let late = first.await.unwrap();
    assert_eq!(late.claimed, 3);
    assert_eq!(
        late.published, 0,
        "the stale relay marked nothing: {late:?}"
    );
    assert_eq!(stale.stats().published, 0);
    assert_eq!(
        drain(&mut late_rx).len(),
        3,
        "it did publish (at least once)"
    );
    assert_eq!(ids(&drain(&mut rx)), ["s-0", "s-1", "s-2"]);
    let b = backlog_of(pool, &topic).await;
    assert_eq!((b.pending, b.sent, b.parked), (0, 3, 0));
    assert_eq!(
        metric("idem_outbox_published_total", &topic),
        Some(3.0),
        "counted once, by the relay that marked them"
    );
}

/// A stale relay that marks part of its batch late: the other relay took
/// back two of its three messages, the third was still its own. The one row
/// it marked is counted, per topic (was: nothing counted when fewer rows
/// than confirmed were marked, so `idem_outbox_published_total` stayed one
/// short forever).
pub async fn a_relay_that_finishes_late_counts_the_rows_it_marked<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) {
    recorder();
    let topic = format!("part-stale.{}", tag());
    let batch: Vec<String> = (0..3).map(|i| format!("p-{i}")).collect();
    let (_stale, first, release, _late_rx) = stalled_relay(pool, &topic, &batch).await;
    for i in 0..2 {
        assert!(outbox::retry(pool, &format!("p-{i}")).await.unwrap());
    }
    let (sink, _rx) = MemorySink::channel(100);
    let next = Relay::builder(pool.clone(), sink).build();
    assert_eq!(next.run_once().await.unwrap().published, 2);
    release.notify_one();
    let late = first.await.unwrap();
    assert_eq!(late.published, 1, "{late:?}");
    let b = backlog_of(pool, &topic).await;
    assert_eq!((b.pending, b.sent, b.parked), (0, 3, 0));
    assert_eq!(
        metric("idem_outbox_published_total", &topic),
        Some(3.0),
        "each sent row counted once"
    );
}

/// `run` purges what it sent once the retention is over, by itself; unsent
/// messages stay.
pub async fn a_running_relay_purges_sent_messages_after_the_retention<DB: OutboxDatabase>(
    pool: &Pool<DB>,
) {
    let topic = format!("retained.{}", tag());
    let mut tx = pool.begin().await.unwrap();
    outbox::put_all(&mut tx, (0..3).map(|i| msg(&topic, &format!("r-{i}"))))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (sink, rx) = MemorySink::channel(100);
    let relay = Arc::new(
        Relay::builder(pool.clone(), sink.clone())
            .poll_interval(Duration::from_millis(20))
            .retention(Duration::from_millis(1), Duration::from_millis(50))
            .build(),
    );
    let stop = Arc::new(tokio::sync::Notify::new());
    let running = {
        let (relay, stop) = (relay.clone(), stop.clone());
        tokio::spawn(async move { relay.run_until(stop.notified()).await })
    };
    until("the messages to be published", 20, || {
        std::future::ready(rx.len() == 3)
    })
    .await;
    sink.set_down(true);
    let mut tx = pool.begin().await.unwrap();
    outbox::put(&mut tx, msg(&topic, "kept")).await.unwrap();
    tx.commit().await.unwrap();
    until("the sent messages to be purged", 20, || async {
        backlog_of(pool, &topic).await.sent == 0
    })
    .await;
    stop.notify_one();
    running.await.unwrap();
    let b = backlog_of(pool, &topic).await;
    assert_eq!(b.pending, 1, "an unsent message is never purged");
}
