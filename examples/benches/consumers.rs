//! Consumers in parallel: `Runner::concurrency` against a hand-written
//! consumer on the same broker client, on loopback PostgreSQL, Redis Streams,
//! RabbitMQ, NATS JetStream and Kafka (any Kafka-protocol broker; the tests'
//! Tansu on 9092).
//!
//! Run by hand, in release mode (CI builds it under clippy and never runs it):
//!
//! ```sh
//! cargo bench -p idem-benches --bench consumers
//! # a quick run:
//! IDEM_BENCH_MESSAGES=2000 IDEM_BENCH_ROUNDS=1 cargo bench -p idem-benches --bench consumers
//! # knobs: IDEM_BENCH_MESSAGES (20000 per cell) IDEM_BENCH_ROUNDS (1)
//! #        IDEM_BENCH_CONCURRENCY (1,16) IDEM_BENCH_BROKERS (redis,rabbitmq,nats,kafka)
//! #        IDEM_BENCH_KAFKA_PARTITIONS (16) IDEM_BENCH_KAFKA_COUNTS (postgres|redis)
//! #        IDEM_BENCH_KAFKA_HAND (spawn|inline: the hand-written side's partitions
//! #        on tasks of their own, or polled by one task as the runner's are)
//! #        IDEM_BENCH_SPAWN=1: idem's side with `Runner::run_spawned` (each
//! #        delivery on a task of its own) instead of `Runner::run`
//! #        IDEM_POSTGRES_URL IDEM_REDIS_URL IDEM_RABBITMQ_URL IDEM_NATS_URL IDEM_KAFKA_BROKERS
//! ```
//!
//! Each cell publishes the messages first, then one consumer drains them: the
//! clock runs from the consumer's first fetch to its last ack. Every message
//! is one PostgreSQL transaction:
//!
//! - **idem**: `Runner::new().concurrency(c).run(source, handler)`, the
//!   handler `BEGIN`, an `#[idempotent(consumer, tx = tx)]` call inserting the
//!   settlement, `COMMIT` (4 statements: the handler returns `()`, so the claim
//!   writes the record DONE at once, in place of the dedup row);
//! - **hand-written**: the same client's stream of messages driven by
//!   `for_each_concurrent(c)`, each `BEGIN`, the reference notes' dedup row
//!   (`INSERT … ON CONFLICT DO NOTHING`; no row inserted means already done),
//!   the settlement, `COMMIT`, then the ack (4 statements).
//!
//! Both sides fetch alike: Redis `XREADGROUP COUNT max(c, 10)` (acks on a
//! second connection), RabbitMQ prefetch `max(c, 10)`, JetStream pull batches
//! of `max(c, 10)` with `double_ack` (the ack the server confirms, as idem's).
//! Rounds alternate which side goes first; cells are medians.
//!
//! Kafka keeps order per partition, so both sides run one message of a
//! partition at a time, up to `c` partitions at once (the topic has
//! `IDEM_BENCH_KAFKA_PARTITIONS`, keys spread over them), and commit one
//! past each message (`CommitMode::Async`) once its transaction committed.
//! The hand-written side reads one `StreamConsumer` and hands each partition
//! to a task of its own (or, with `IDEM_BENCH_KAFKA_HAND=inline`, to a future
//! its one task polls), a semaphore of `c` permits around the transactions.
//! idem's side also counts each delivery in an idem store before running it
//! (Kafka keeps no delivery count; `IDEM_BENCH_KAFKA_COUNTS`: PostgreSQL, the
//! same database, or Redis): the hand-written side has no count, so a message
//! that kills it every time stops its partition for good. A group's first
//! join waits out the broker's pause, so on Kafka each side's clock starts at
//! its first finished message and the rate counts the `n - 1` after it.
//!
//! Each cell also gives the CPU a message cost, this process's (both sides'
//! consumers and clients) and PostgreSQL's (every `postgres` process): where
//! a commit waits on a slow disk, the rate follows the disk and the CPU
//! still tells the sides apart.
//!
//! The medians go to `benchmarks/data/consumers.csv` (see `figures.rs`;
//! `IDEM_BENCH_CSV=off` for a quick run), one table per broker and mode.
//!
//! Machines are noisy: read the ratios, not the absolute numbers.

use std::str::FromStr;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream;
use idem_runtime::consumer::jetstream::JetStreamSource;
use idem_runtime::consumer::kafka::{self, KafkaSource};
use idem_runtime::consumer::rabbitmq::{self, RabbitMqSource};
use idem_runtime::consumer::redis_streams::{PAYLOAD_FIELD, RedisStreamsSource};
use idem_runtime::consumer::{Runner, Source, mark_rolled_back};
use idem_runtime::idempotent;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sql::PgStore;
use idem_runtime::store::{AsStore, Store, StoreRef};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::OwnedMessage;
use rdkafka::{Message as _, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Transaction};

#[path = "knobs.rs"]
mod knobs;
use knobs::*;
#[path = "figures.rs"]
mod figures;
use figures::Csv;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SCHEMA: &str = "idem_bench_consumers";
const GROUP: &str = "settlement";

#[derive(Debug, Serialize, Deserialize)]
struct OrderPaid {
    order_id: String,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

// ---------------------------------------------------------------------------
// The two handlers
// ---------------------------------------------------------------------------

#[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "bench.consumers.settle", tx = tx)]
async fn settle(tx: &mut Transaction<'_, Postgres>, e: &OrderPaid) -> Result<(), BenchError> {
    insert_settlement(tx, e).await
}

async fn insert_settlement(
    tx: &mut Transaction<'_, Postgres>,
    e: &OrderPaid,
) -> Result<(), BenchError> {
    sqlx::query("INSERT INTO bench_settlements (order_id, amount_cents) VALUES ($1, $2)")
        .bind(&e.order_id)
        .bind(e.amount_cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn idem_handler(pool: &PgPool, e: OrderPaid) -> Result<(), BenchError> {
    let mut tx = pool.begin().await?;
    settle(&mut tx, &e).await?;
    if let Err(err) = tx.commit().await {
        mark_rolled_back();
        return Err(err.into());
    }
    Ok(())
}

/// The reference notes' flow: the dedup row and the effect in one
/// transaction; a dedup row already there means the message was processed.
async fn reference_handler(pool: &PgPool, body: &[u8]) -> Result<(), BenchError> {
    let e: OrderPaid = serde_json::from_slice(body).expect("a bench message");
    reference_tx(pool, &e).await
}

async fn reference_tx(pool: &PgPool, e: &OrderPaid) -> Result<(), BenchError> {
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query("INSERT INTO bench_dedup (msg_key) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(&e.order_id)
        .execute(&mut *tx)
        .await?
        .rows_affected()
        == 1;
    if fresh {
        insert_settlement(&mut tx, e).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Runs idem's consumer until `n` messages are acked; with `store` false its
/// handler is the hand-written transaction (the runner and the adapter alone).
/// With `from_first`, the clock starts at the first ack and the `n - 1`
/// after it are timed. Returns the time and how many messages it covers.
async fn idem_side<S: Source<Delivery: 'static>>(
    source: S,
    pool: &PgPool,
    c: usize,
    n: u64,
    store: bool,
    from_first: bool,
) -> (Duration, u64) {
    let runner = Runner::new().concurrency(c);
    let mut started = Instant::now();
    let spawned = env("IDEM_BENCH_SPAWN", 0) == 1;
    let run = async {
        if spawned {
            let pool = pool.clone();
            runner
                .run_spawned(source, move |e: OrderPaid| {
                    let pool = pool.clone();
                    async move {
                        if store {
                            idem_handler(&pool, e).await
                        } else {
                            reference_tx(&pool, &e).await
                        }
                    }
                })
                .await
        } else {
            runner
                .run(source, |e: OrderPaid| async move {
                    if store {
                        idem_handler(pool, e).await
                    } else {
                        reference_tx(pool, &e).await
                    }
                })
                .await
        }
    };
    // Polled every 5 ms: a wake-up per millisecond cost the consumer
    // measurable CPU on two cores; 5 ms is under 0.2 % of a default cell.
    let done = async {
        if from_first {
            while runner.stats().acked < 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            started = Instant::now();
        }
        while runner.stats().acked < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        err = run => panic!("the consumer stopped: {err}"),
        () = done => {}
    }
    let elapsed = started.elapsed();
    let stats = runner.stats();
    assert_eq!(
        (stats.processed, stats.parked, stats.redelivered()),
        (n, 0, 0),
        "{stats:?}"
    );
    (elapsed, if from_first { n - 1 } else { n })
}

fn batch(c: usize) -> usize {
    c.max(10)
}

// ---------------------------------------------------------------------------
// Brokers
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Broker {
    Redis,
    Rabbit,
    Nats,
    Kafka,
}

impl Broker {
    fn name(self) -> &'static str {
        match self {
            Broker::Redis => "Redis Streams",
            Broker::Rabbit => "RabbitMQ",
            Broker::Nats => "JetStream (file)",
            Broker::Kafka => "Kafka (Tansu)",
        }
    }
}

struct Brokers {
    redis: redis::Client,
    rabbit_url: String,
    rabbit: lapin::Connection,
    js: async_nats::jetstream::Context,
    kafka: String,
    kafka_partitions: i32,
    /// Where idem's Kafka side counts deliveries.
    kafka_counts: StoreRef,
    /// The hand-written Kafka side spawns a task per partition (else its
    /// lanes are polled by one task, as `Runner::run` polls deliveries).
    kafka_spawn: bool,
}

fn order_id(run: &str, i: u64) -> String {
    format!("{run}-{i}")
}

fn message(run: &str, i: u64) -> Vec<u8> {
    serde_json::to_vec(&OrderPaid {
        order_id: order_id(run, i),
        amount_cents: 1000 + (i % 5000) as i64,
    })
    .expect("json")
}

fn kafka_admin(brokers: &str) -> Result<AdminClient<DefaultClientContext>, BoxError> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?)
}

impl Brokers {
    /// Publishes `n` messages under `topic` (a stream, a queue, a subject).
    async fn fill(&self, broker: Broker, topic: &str, run: &str, n: u64) -> Result<(), BoxError> {
        match broker {
            Broker::Redis => {
                let mut conn = self.redis.get_multiplexed_async_connection().await?;
                let mut i = 0;
                while i < n {
                    let mut pipe = redis::pipe();
                    for j in i..(i + 1000).min(n) {
                        pipe.cmd("XADD")
                            .arg(topic)
                            .arg("*")
                            .arg(PAYLOAD_FIELD)
                            .arg(message(run, j))
                            .ignore();
                    }
                    let _: () = pipe.query_async(&mut conn).await?;
                    i += 1000;
                }
                let _: redis::Value = redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(topic)
                    .arg(GROUP)
                    .arg("0")
                    .query_async(&mut conn)
                    .await?;
            }
            Broker::Rabbit => {
                let channel = self.rabbit.create_channel().await?;
                RabbitMqSource::declare(&channel, topic).await?;
                channel.confirm_select(Default::default()).await?;
                let props = lapin::BasicProperties::default().with_delivery_mode(2);
                let mut i = 0;
                while i < n {
                    let mut confirms = Vec::new();
                    for j in i..(i + 1000).min(n) {
                        confirms.push(
                            channel
                                .basic_publish(
                                    "",
                                    topic,
                                    Default::default(),
                                    &message(run, j),
                                    props.clone(),
                                )
                                .await?,
                        );
                    }
                    for c in confirms {
                        c.await?;
                    }
                    i += 1000;
                }
                let _ = channel.close(200, "filled").await;
            }
            Broker::Nats => {
                self.js
                    .create_stream(async_nats::jetstream::stream::Config {
                        name: topic.to_owned(),
                        subjects: vec![format!("idem.bench.consumers.{topic}")],
                        ..Default::default()
                    })
                    .await?;
                let mut i = 0;
                while i < n {
                    let mut acks = Vec::new();
                    for j in i..(i + 1000).min(n) {
                        acks.push(
                            self.js
                                .publish(
                                    format!("idem.bench.consumers.{topic}"),
                                    message(run, j).into(),
                                )
                                .await?,
                        );
                    }
                    for a in acks {
                        a.await?;
                    }
                    i += 1000;
                }
            }
            Broker::Kafka => {
                let created = kafka_admin(&self.kafka)?
                    .create_topics(
                        &[NewTopic::new(
                            topic,
                            self.kafka_partitions,
                            TopicReplication::Fixed(1),
                        )],
                        &AdminOptions::new(),
                    )
                    .await?;
                for r in created {
                    r.map_err(|(t, e)| format!("creating {t}: {e}"))?;
                }
                let producer = kafka::producer(&self.kafka)?;
                let mut i = 0;
                while i < n {
                    let sends = (i..(i + 1000).min(n)).map(|j| {
                        let producer = &producer;
                        async move {
                            // Keyed, as an order's events are: the keys
                            // spread over the partitions.
                            let key = order_id(run, j);
                            kafka::publish_raw(producer, topic, Some(&key), &message(run, j), None)
                                .await
                        }
                    });
                    for sent in futures_util::future::join_all(sends).await {
                        sent?;
                    }
                    i += 1000;
                }
            }
        }
        Ok(())
    }

    async fn clear(&self, broker: Broker, topic: &str) -> Result<(), BoxError> {
        match broker {
            Broker::Redis => {
                let mut conn = self.redis.get_multiplexed_async_connection().await?;
                let _: () = redis::cmd("DEL").arg(topic).query_async(&mut conn).await?;
            }
            Broker::Rabbit => {
                let channel = self.rabbit.create_channel().await?;
                for q in ["", ".retry", ".parked"] {
                    channel
                        .queue_delete(&format!("{topic}{q}"), Default::default())
                        .await?;
                }
                channel
                    .exchange_delete(&format!("{topic}.dlx"), Default::default())
                    .await?;
                let _ = channel.close(200, "cleared").await;
            }
            Broker::Nats => {
                self.js.delete_stream(topic).await?;
            }
            // Left in place: deleting a topic made librdkafka crash in its
            // metadata cache (SIGSEGV in rd_kafka_metadata_cache_find) on
            // the next cell against Tansu; each cell's topic has a name of
            // its own, and the memory engine forgets them all on restart.
            Broker::Kafka => {}
        }
        Ok(())
    }

    /// idem's consumer on `topic`.
    async fn idem(
        &self,
        broker: Broker,
        topic: &str,
        pool: &PgPool,
        c: usize,
        n: u64,
        store: bool,
    ) -> (Duration, u64) {
        match broker {
            Broker::Redis => {
                let source = RedisStreamsSource::builder(topic, GROUP, "idem")
                    .batch(batch(c))
                    .connect(&self.redis)
                    .await
                    .expect("Redis source");
                idem_side(source, pool, c, n, store, false).await
            }
            Broker::Rabbit => {
                let conn = rabbitmq::connect(&self.rabbit_url).await.expect("RabbitMQ");
                let channel = conn.create_channel().await.expect("channel");
                let source = RabbitMqSource::builder(topic, "idem")
                    .prefetch(batch(c) as u16)
                    .connect(channel)
                    .await
                    .expect("RabbitMQ source");
                let t = idem_side(source, pool, c, n, store, false).await;
                let _ = conn.close(200, "done").await;
                t
            }
            Broker::Nats => {
                let source =
                    JetStreamSource::builder(topic, GROUP, &format!("idem.bench.parked.{topic}"))
                        .batch(batch(c))
                        .connect(&self.js)
                        .await
                        .expect("JetStream source");
                idem_side(source, pool, c, n, store, false).await
            }
            Broker::Kafka => {
                let source = KafkaSource::builder(&self.kafka, topic, &kafka_group(topic))
                    .store(self.kafka_counts.clone())
                    .set("session.timeout.ms", "6000")
                    .connect()
                    .await
                    .expect("Kafka source");
                idem_side(source, pool, c, n, store, true).await
            }
        }
    }

    /// The hand-written consumer on `topic`, on the same client.
    async fn reference(
        &self,
        broker: Broker,
        topic: &str,
        pool: &PgPool,
        c: usize,
        n: u64,
    ) -> (Duration, u64) {
        let take = n as usize;
        if broker == Broker::Kafka {
            return kafka_reference(&self.kafka, topic, pool, c, n, self.kafka_spawn).await;
        }
        let elapsed = match broker {
            Broker::Redis => {
                let read = self.redis.get_multiplexed_async_connection().await.unwrap();
                let ack = self.redis.get_multiplexed_async_connection().await.unwrap();
                let count = batch(c);
                let stream_name = topic.to_owned();
                let started = Instant::now();
                stream::unfold(read, move |mut read| {
                    let stream_name = stream_name.clone();
                    async move {
                        let reply: Option<redis::streams::StreamReadReply> =
                            redis::cmd("XREADGROUP")
                                .arg("GROUP")
                                .arg(GROUP)
                                .arg("reference")
                                .arg("COUNT")
                                .arg(count)
                                .arg("BLOCK")
                                .arg(1000)
                                .arg("STREAMS")
                                .arg(&stream_name)
                                .arg(">")
                                .query_async(&mut read)
                                .await
                                .expect("XREADGROUP");
                        let ids: Vec<_> = reply
                            .map(|r| r.keys.into_iter().flat_map(|k| k.ids).collect())
                            .unwrap_or_default();
                        Some((stream::iter(ids), read))
                    }
                })
                .flatten()
                .take(take)
                .for_each_concurrent(c, |entry| {
                    let mut ack = ack.clone();
                    async move {
                        let body: Vec<u8> = entry.get(PAYLOAD_FIELD).expect("payload");
                        reference_handler(pool, &body).await.expect("transaction");
                        let _: i64 = redis::cmd("XACK")
                            .arg(topic)
                            .arg(GROUP)
                            .arg(&entry.id)
                            .query_async(&mut ack)
                            .await
                            .expect("XACK");
                    }
                })
                .await;
                started.elapsed()
            }
            Broker::Rabbit => {
                let conn = rabbitmq::connect(&self.rabbit_url).await.expect("RabbitMQ");
                let channel = conn.create_channel().await.expect("channel");
                channel
                    .basic_qos(batch(c) as u16, Default::default())
                    .await
                    .expect("qos");
                let consumer = channel
                    .basic_consume(topic, "reference", Default::default(), Default::default())
                    .await
                    .expect("consume");
                let started = Instant::now();
                consumer
                    .take(take)
                    .for_each_concurrent(c, |d| async move {
                        let d = d.expect("a delivery");
                        reference_handler(pool, &d.data).await.expect("transaction");
                        d.ack(Default::default()).await.expect("ack");
                    })
                    .await;
                let elapsed = started.elapsed();
                let _ = conn.close(200, "done").await;
                elapsed
            }
            Broker::Nats => {
                use async_nats::jetstream::consumer::{AckPolicy, pull};
                let stream = self.js.get_stream(topic).await.expect("stream");
                let consumer = stream
                    .get_or_create_consumer(
                        "reference",
                        pull::Config {
                            durable_name: Some("reference".into()),
                            ack_policy: AckPolicy::Explicit,
                            ack_wait: Duration::from_secs(30),
                            ..Default::default()
                        },
                    )
                    .await
                    .expect("consumer");
                let started = Instant::now();
                let messages = consumer
                    .stream()
                    .max_messages_per_batch(batch(c))
                    .messages()
                    .await
                    .expect("pull");
                messages
                    .take(take)
                    .for_each_concurrent(c, |m| async move {
                        let m = m.expect("a message");
                        reference_handler(pool, &m.payload)
                            .await
                            .expect("transaction");
                        m.double_ack().await.expect("ack");
                    })
                    .await;
                started.elapsed()
            }
            Broker::Kafka => unreachable!("handled above"),
        };
        (elapsed, n)
    }
}

fn kafka_group(topic: &str) -> String {
    format!("{topic}.settlement")
}

/// The hand-written Kafka consumer: one `StreamConsumer`, each partition's
/// messages on a task of their own in offset order (order per partition, as
/// idem keeps it), at most `c` transactions at once, a commit one past each
/// message once its transaction committed.
async fn kafka_reference(
    brokers: &str,
    topic: &str,
    pool: &PgPool,
    c: usize,
    n: u64,
    spawn: bool,
) -> (Duration, u64) {
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let consumer: Arc<StreamConsumer> = Arc::new(
        ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", kafka_group(topic))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .set("session.timeout.ms", "6000")
            .create()
            .expect("Kafka consumer"),
    );
    consumer.subscribe(&[topic]).expect("subscribe");
    let permits = Arc::new(tokio::sync::Semaphore::new(c));
    let done = Arc::new(AtomicU64::new(0));
    let first = Arc::new(tokio::sync::Notify::new());
    let finished = Arc::new(tokio::sync::Notify::new());
    let mut lanes: HashMap<i32, tokio::sync::mpsc::UnboundedSender<OwnedMessage>> = HashMap::new();
    let mut spawned = Vec::new();
    // Polled by this task with the reading, as `Runner::run` polls its
    // deliveries, when the lanes are not spawned.
    let mut inline = futures_util::stream::FuturesUnordered::new();
    let reading = async {
        loop {
            let m = tokio::select! {
                m = consumer.recv() => m.expect("a Kafka message").detach(),
                Some(()) = inline.next(), if !inline.is_empty() => continue,
            };
            let lane = lanes.entry(m.partition()).or_insert_with(|| {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<OwnedMessage>();
                let (consumer, permits, pool) = (consumer.clone(), permits.clone(), pool.clone());
                let (done, first, finished) = (done.clone(), first.clone(), finished.clone());
                let worker = async move {
                    while let Some(m) = rx.recv().await {
                        let permit = permits.acquire().await.expect("open");
                        reference_handler(&pool, m.payload().expect("a payload"))
                            .await
                            .expect("transaction");
                        drop(permit);
                        let mut list = TopicPartitionList::new();
                        list.add_partition_offset(
                            m.topic(),
                            m.partition(),
                            Offset::Offset(m.offset() + 1),
                        )
                        .expect("an offset");
                        consumer.commit(&list, CommitMode::Async).expect("commit");
                        match done.fetch_add(1, Ordering::Relaxed) + 1 {
                            1 => first.notify_one(),
                            k if k == n => finished.notify_one(),
                            _ => {}
                        }
                    }
                };
                if spawn {
                    spawned.push(tokio::spawn(worker));
                } else {
                    inline.push(Box::pin(worker));
                }
                tx
            });
            lane.send(m).expect("a worker");
        }
    };
    let timed = async {
        first.notified().await;
        let started = Instant::now();
        finished.notified().await;
        started.elapsed()
    };
    let elapsed = tokio::select! {
        () = reading => unreachable!("the read loop never ends"),
        elapsed = timed => elapsed,
    };
    for w in spawned {
        w.abort();
    }
    (elapsed, n - 1)
}

// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Reference,
    Idem,
    /// idem's runner and adapter around the hand-written transaction.
    Runner,
}

async fn cell(
    brokers: &Brokers,
    pool: &PgPool,
    broker: Broker,
    side: Side,
    c: usize,
    n: u64,
    tag: &str,
) -> Result<Measured, BoxError> {
    for t in ["bench_settlements", "bench_dedup", "idem_records"] {
        sqlx::query(&format!("TRUNCATE {t}")).execute(pool).await?;
    }
    // The process id in the name: a run killed mid-way leaves its topic
    // behind (its consumer group, its undelivered messages), and the next
    // run's cells count from 1 again.
    let topic = format!("IDEM_BENCH_CONSUMERS_{}_{tag}", std::process::id());
    let run = tag.to_lowercase();
    brokers.fill(broker, &topic, &run, n).await?;
    // The /proc scan before the client's clock starts and after it stops,
    // so the client's figure does not count it.
    let server = cpu_by_process("postgres");
    let client = process_cpu();
    let (elapsed, timed) = match side {
        Side::Idem => brokers.idem(broker, &topic, pool, c, n, true).await,
        Side::Runner => brokers.idem(broker, &topic, pool, c, n, false).await,
        Side::Reference => brokers.reference(broker, &topic, pool, c, n).await,
    };
    let client = process_cpu() - client;
    let server = server.and_then(|before| cpu_since("postgres", &before));
    let per_message = |cpu: Duration| cpu.as_secs_f64() * 1e6 / n as f64;
    let measured = Measured {
        rate: timed as f64 / elapsed.as_secs_f64(),
        client_us: per_message(client),
        postgres_us: server.map(per_message),
    };
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM bench_settlements")
        .fetch_one(pool)
        .await?;
    assert_eq!(rows as u64, n, "one settlement per message");
    brokers.clear(broker, &topic).await?;
    Ok(measured)
}

/// One cell: messages a second, and the CPU a message cost this process
/// (the consumer, both sides' broker clients, sqlx) and PostgreSQL (every
/// `postgres` process: backends, WAL writer). CPU moves less than the rate
/// when the disk sets the pace of commits.
struct Measured {
    rate: f64,
    client_us: f64,
    /// `None` without /proc.
    postgres_us: Option<f64>,
}

/// The medians of a side's rounds.
fn medians(cells: &[Measured]) -> Measured {
    let of = |f: fn(&Measured) -> f64| median(cells.iter().map(f).collect());
    let postgres: Option<Vec<f64>> = cells.iter().map(|m| m.postgres_us).collect();
    Measured {
        rate: of(|m| m.rate),
        client_us: of(|m| m.client_us),
        postgres_us: postgres.map(median),
    }
}

async fn bench() -> Result<(), BoxError> {
    let n: u64 = env("IDEM_BENCH_MESSAGES", 20_000);
    let rounds: usize = env("IDEM_BENCH_ROUNDS", 1).max(1);
    let concurrencies: Vec<usize> = list("IDEM_BENCH_CONCURRENCY", "1,16")
        .iter()
        .filter_map(|c| c.parse().ok())
        .collect();
    let brokers_on = list("IDEM_BENCH_BROKERS", "redis,rabbitmq,nats,kafka");

    let pg_url = url(
        "IDEM_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    );
    let admin = PgPool::connect(&pg_url).await?;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        .execute(&admin)
        .await?;
    sqlx::query(&format!("CREATE SCHEMA {SCHEMA}"))
        .execute(&admin)
        .await?;
    let options = PgConnectOptions::from_str(&pg_url)?.options([("search_path", SCHEMA)]);
    // Connections kept open for the whole run: PostgreSQL's CPU is read per
    // process, and a backend that exits takes its count with it.
    let pool = PgPoolOptions::new()
        .max_connections(32)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_with(options)
        .await?;
    // Opening the store applies idem's migrations; `tx = tx` needs no store.
    PgStore::builder().pool(pool.clone()).await?;
    for ddl in [
        "CREATE TABLE bench_settlements (order_id TEXT PRIMARY KEY, amount_cents BIGINT NOT NULL)",
        "CREATE TABLE bench_dedup (msg_key TEXT PRIMARY KEY)",
    ] {
        sqlx::query(ddl).execute(&pool).await?;
    }

    let rabbit_url = url("IDEM_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let brokers = Brokers {
        redis: redis::Client::open(url("IDEM_REDIS_URL", "redis://127.0.0.1:6379"))?,
        rabbit: rabbitmq::connect(&rabbit_url).await?,
        rabbit_url,
        js: async_nats::jetstream::new(
            async_nats::connect(url("IDEM_NATS_URL", "nats://127.0.0.1:4222")).await?,
        ),
        kafka: url("IDEM_KAFKA_BROKERS", "127.0.0.1:9092"),
        kafka_partitions: env("IDEM_BENCH_KAFKA_PARTITIONS", 16),
        kafka_spawn: url("IDEM_BENCH_KAFKA_HAND", "spawn") != "inline",
        kafka_counts: match url("IDEM_BENCH_KAFKA_COUNTS", "postgres").as_str() {
            "redis" => RedisStore::connect(&url("IDEM_REDIS_URL", "redis://127.0.0.1:6379"))
                .await?
                .store_ref(),
            _ => PgStore::builder().pool(pool.clone()).await?.store_ref(),
        },
    };
    if brokers_on.iter().any(|b| b == "kafka") {
        println!(
            "Kafka: {} partitions, delivery counts in {}, the hand-written side's partitions {}",
            brokers.kafka_partitions,
            brokers.kafka_counts.backend(),
            if brokers.kafka_spawn {
                "on tasks of their own"
            } else {
                "polled by one task"
            }
        );
    }

    println!("load average at start: {}", load());
    let mut csv = Csv::new("consumers");
    println!(
        "{n} messages per cell, one PostgreSQL transaction each; median of {rounds} round(s); msgs/s, and CPU µs per message"
    );
    println!(
        "{:<18} {:>3} {:>12} {:>9} {:>18} {:>16} {:>9} {:>18} {:>22} {:>22}",
        "broker",
        "c",
        "hand-written",
        "idem",
        "idem ÷ hand",
        "idem ÷ idem c=1",
        "runner",
        "runner ÷ hand",
        "client µs hand/idem/run",
        "postgres µs hand/idem/run"
    );
    let mut serial = 0;
    for broker in [Broker::Redis, Broker::Rabbit, Broker::Nats, Broker::Kafka] {
        let key = match broker {
            Broker::Redis => "redis",
            Broker::Rabbit => "rabbitmq",
            Broker::Nats => "nats",
            Broker::Kafka => "kafka",
        };
        if !brokers_on.iter().any(|b| b == key) {
            continue;
        }
        let mut idem_c1 = None;
        for &c in &concurrencies {
            let (mut reference, mut idem, mut runner) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..rounds {
                let order = if round % 2 == 0 {
                    [Side::Reference, Side::Runner, Side::Idem]
                } else {
                    [Side::Idem, Side::Runner, Side::Reference]
                };
                for side in order {
                    serial += 1;
                    let tag = format!("{}_{serial}", key.to_uppercase());
                    let measured = cell(&brokers, &pool, broker, side, c, n, &tag).await?;
                    match side {
                        Side::Reference => reference.push(measured),
                        Side::Idem => idem.push(measured),
                        Side::Runner => runner.push(measured),
                    }
                }
            }
            let per_round = |side: &[Measured]| -> Vec<f64> {
                side.iter()
                    .zip(&reference)
                    .map(|(s, r)| s.rate / r.rate)
                    .collect()
            };
            let (idem_spread, runner_spread) =
                (spread(&per_round(&idem)), spread(&per_round(&runner)));
            let (reference, idem, runner) = (medians(&reference), medians(&idem), medians(&runner));
            let x = c.to_string();
            let mode = if env("IDEM_BENCH_SPAWN", 0) == 1 {
                "run_spawned"
            } else {
                "run"
            };
            let table = if broker == Broker::Kafka {
                format!(
                    "{key} ({mode}; hand-written {})",
                    if brokers.kafka_spawn {
                        "spawning"
                    } else {
                        "one task"
                    }
                )
            } else {
                format!("{key} ({mode})")
            };
            let ratio = |side: &Measured| side.rate / reference.rate;
            csv.row(
                &table,
                "idem ÷ hand-written",
                &x,
                ratio(&idem),
                Some(idem_spread),
                "ratio",
                rounds,
            );
            csv.row(
                &table,
                "runner ÷ hand-written",
                &x,
                ratio(&runner),
                Some(runner_spread),
                "ratio",
                rounds,
            );
            for (name, side) in [
                ("hand-written", &reference),
                ("idem", &idem),
                ("runner", &runner),
            ] {
                csv.row(&table, name, &x, side.rate, None, "msg/s", rounds);
                csv.row(
                    &table,
                    &format!("{name} client CPU"),
                    &x,
                    side.client_us,
                    None,
                    "µs/msg",
                    rounds,
                );
                if let Some(us) = side.postgres_us {
                    csv.row(
                        &table,
                        &format!("{name} PostgreSQL CPU"),
                        &x,
                        us,
                        None,
                        "µs/msg",
                        rounds,
                    );
                }
            }
            if c == 1 {
                idem_c1 = Some(idem.rate);
            }
            if let Some(one) = idem_c1.filter(|_| c != 1) {
                csv.row(
                    &table,
                    "idem ÷ its c=1",
                    &x,
                    idem.rate / one,
                    None,
                    "ratio",
                    rounds,
                );
            }
            let scale = idem_c1.filter(|_| c != 1).map_or(String::from("—"), |one| {
                format!("{:.2}×", idem.rate / one)
            });
            let cpu = |f: fn(&Measured) -> Option<f64>| {
                let show = |m| f(m).map_or(String::from("—"), |us| format!("{us:.0}"));
                format!("{} / {} / {}", show(&reference), show(&idem), show(&runner))
            };
            let with_spread = |r: f64, (lo, hi): (f64, f64)| format!("{r:.2} [{lo:.2}–{hi:.2}]");
            println!(
                "{:<18} {c:>3} {:>12.0} {:>9.0} {:>18} {scale:>16} {:>9.0} {:>18} {:>22} {:>22}",
                broker.name(),
                reference.rate,
                idem.rate,
                with_spread(idem.rate / reference.rate, idem_spread),
                runner.rate,
                with_spread(runner.rate / reference.rate, runner_spread),
                cpu(|m| Some(m.client_us)),
                cpu(|m| m.postgres_us),
            );
        }
    }
    println!("load average at end: {}", load());
    println!(
        "runner: idem's Runner and adapter around the hand-written transaction (no #[idempotent]): what the runner costs apart from the store"
    );
    println!(
        "statements per message: idem 4 (BEGIN, claim writing the record DONE, INSERT, COMMIT), hand-written 4 (BEGIN, dedup row, INSERT, COMMIT)"
    );
    println!("[spread]: the lowest and highest per-round ratio");
    csv.write();

    pool.close().await;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        .execute(&admin)
        .await?;
    Ok(())
}

fn main() {
    // `cargo bench` passes `--bench`; there is nothing to filter.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if let Err(e) = rt.block_on(bench()) {
        eprintln!(
            "error: {e} (PostgreSQL, Redis, RabbitMQ, NATS JetStream and a Kafka broker must be running)"
        );
        std::process::exit(1);
    }
}
