//! What the transactional outbox costs and how fast it drains, on loopback
//! PostgreSQL, Redis Streams, NATS JetStream and Kafka (any Kafka-protocol
//! broker; the tests' Tansu on 9092).
//!
//! Run by hand, in release mode (CI builds it under clippy and never runs it):
//!
//! ```sh
//! cargo bench -p idem-benches --bench outbox
//! # a quick run:
//! IDEM_BENCH_WRITE_TX=500 IDEM_BENCH_ROUNDS=1 IDEM_BENCH_RELAY_MESSAGES=10000 \
//!   IDEM_BENCH_LATENCY_SECONDS=2 cargo bench -p idem-benches --bench outbox
//! # knobs: IDEM_BENCH_ONLY=write|relay|latency (default: all three)
//! #        IDEM_BENCH_WRITE_TX (4000 transactions per cell) IDEM_BENCH_ROUNDS (3)
//! #        IDEM_BENCH_RELAY_MESSAGES (100000) IDEM_BENCH_RELAY_BATCHES (1000,500)
//! #        IDEM_BENCH_RELAY_ROUNDS (1: drains per row, brokers taking turns; median)
//! #        IDEM_BENCH_LATENCY_RATE (1000 messages/s) IDEM_BENCH_LATENCY_SECONDS (10)
//! #        IDEM_BENCH_BROKERS (redis,nats,kafka)
//! #        IDEM_POSTGRES_URL IDEM_REDIS_URL IDEM_NATS_URL IDEM_KAFKA_BROKERS
//! ```
//!
//! - **(a) writing**: closed-loop writers at concurrency 1, 16 and 64, each
//!   transaction on a pool connection of its own (the pool holds 64). The
//!   baseline transaction inserts one business row; the others add
//!   `outbox::put` of one message, `put_all` of three, and (the bound of a
//!   `put`: its round trip and a row of its size) a plain `INSERT` of the
//!   message's columns into a table with one index. Each cell is the
//!   median of several rounds, the sides alternating which goes first, so
//!   drift on a noisy machine cancels out; the spread is the lowest and
//!   highest per-round ratio to the baseline.
//! - **(b) relaying**: committed messages (written with `put_all`, 1000 per
//!   transaction) drained by one `Relay`, to Redis Streams, to JetStream
//!   (a file-backed stream) and to Kafka (a topic of 3 partitions, the
//!   idempotent producer, `acks=all`). The time inside the sink's `publish` is measured,
//!   the rest is the relay's claim and mark statements.
//! - **(c) latency**: one message per transaction at a steady rate (open
//!   loop: a transaction starts on schedule, whatever the previous ones did),
//!   `Relay::run` woken by PostgreSQL's LISTEN; from the moment the writer's
//!   commit returned to the moment the broker confirmed the message.
//!
//! The medians go to `benchmarks/data/outbox.csv` (see `figures.rs`;
//! `IDEM_BENCH_CSV=off` for a quick run), the charts' data.
//!
//! Machines are noisy: read the ratios, not the absolute numbers.

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::consumer::BrokerError;
use idem_runtime::consumer::kafka;
use idem_runtime::outbox::sink::{JetStreamSink, KafkaSink, RedisStreamsSink, Sink};
use idem_runtime::outbox::{self, Message, Outgoing, Relay};
use idem_runtime::store::sql::PgStore;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[path = "knobs.rs"]
mod knobs;
use knobs::*;
#[path = "figures.rs"]
mod figures;
use figures::Csv;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SCHEMA: &str = "idem_bench_outbox";
const NATS_STREAM: &str = "IDEM_BENCH_OUTBOX";
const NATS_SUBJECT: &str = "idem.bench.outbox";

/// About the size of a real event (an order id, a sku, amounts, a timestamp).
fn payload(n: u64) -> Vec<u8> {
    format!(
        r#"{{"order_id":{n},"user_id":{},"sku":"SKU-{}","qty":2,"amount_cents":{},"created_at":"2026-12-01T17:00:00Z"}}"#,
        n % 10_000,
        n % 97,
        1000 + n % 5000
    )
    .into_bytes()
}

// ---------------------------------------------------------------------------
// (a) writing
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Base,
    Put,
    PutAll,
    Plain,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Base => "(a) INSERT order",
            Side::Put => "(b) + put (1 message)",
            Side::PutAll => "(c) + put_all (3 messages)",
            Side::Plain => "(d) + plain INSERT (1 row)",
        }
    }

    /// The side's name in the CSV.
    fn series(self) -> &'static str {
        match self {
            Side::Base => "INSERT alone",
            Side::Put => "INSERT + put",
            Side::PutAll => "INSERT + put_all of 3",
            Side::Plain => "INSERT + plain INSERT",
        }
    }

    // By construction, from the code paths: BEGIN, the business INSERT, the
    // outbox's one INSERT … SELECT FROM (VALUES …) whatever the number of
    // messages, COMMIT.
    fn statements(self) -> &'static str {
        match self {
            Side::Base => "3",
            Side::Put | Side::PutAll | Side::Plain => "4",
        }
    }
}

async fn write_tx(pool: &PgPool, side: Side, run: &str, n: u64) -> Result<(), BoxError> {
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO bench_orders (run, id, sku) VALUES ($1, $2, $3)")
        .bind(run)
        .bind(n as i64)
        .bind(format!("SKU-{}", n % 97))
        .execute(&mut *tx)
        .await?;
    match side {
        Side::Base => {}
        Side::Put => {
            let m = Message::bytes("orders.created", payload(n)).id(format!("{run}-{n}"));
            outbox::put(&mut tx, m).await?;
        }
        Side::PutAll => {
            let messages = ["orders.created", "stock.reserved", "coupons.owed"]
                .into_iter()
                .map(|topic| Message::bytes(topic, payload(n)).id(format!("{run}-{n}-{topic}")));
            outbox::put_all(&mut tx, messages).await?;
        }
        Side::Plain => {
            sqlx::query(concat!(
                "INSERT INTO bench_events (id, topic, payload, created_at) ",
                "VALUES ($1, $2, $3, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)"
            ))
            .bind(format!("{run}-{n}"))
            .bind("orders.created")
            .bind(payload(n))
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

struct Cell {
    calls: u64,
    elapsed: Duration,
    p50: Duration,
    p99: Duration,
}

impl Cell {
    fn throughput(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

/// `calls` transactions from `concurrency` closed-loop writers.
async fn measure(pool: &PgPool, side: Side, run: String, concurrency: usize, calls: u64) -> Cell {
    let next = Arc::new(AtomicU64::new(0));
    let run = Arc::new(run);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (pool, next, run) = (pool.clone(), next.clone(), run.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= calls {
                    break;
                }
                let t = Instant::now();
                write_tx(&pool, side, &run, n).await.expect("transaction");
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("writer panicked"));
    }
    let elapsed = started.elapsed();
    lat.sort_unstable();
    Cell {
        calls: lat.len() as u64,
        elapsed,
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
    }
}

async fn writing(pool: &PgPool, calls: u64, rounds: usize, csv: &mut Csv) -> Result<(), BoxError> {
    println!(
        "\n(a) writing: one transaction per call, {calls} transactions per cell, median of {rounds} rounds"
    );
    println!(
        "{:<28} {:>3} {:>8} {:>9} {:>9} {:>20} {:>6}",
        "", "c", "tx/s", "p50", "p99", "vs (a) [spread]", "stmts"
    );
    let sides = [Side::Base, Side::Put, Side::PutAll, Side::Plain];
    for (ci, c) in [1usize, 16, 64].into_iter().enumerate() {
        let mut cells: Vec<Vec<Cell>> = sides.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            let order: Vec<usize> = if round % 2 == 0 {
                vec![0, 1, 2, 3]
            } else {
                vec![3, 2, 1, 0]
            };
            for i in order {
                let run = format!("w{ci}{round}{i}");
                cells[i].push(measure(pool, sides[i], run, c, calls).await);
            }
        }
        // Per-round ratios to the baseline, then medians.
        let ratios: Vec<Vec<f64>> = cells
            .iter()
            .map(|side| {
                side.iter()
                    .zip(&cells[0])
                    .map(|(s, b)| s.throughput() / b.throughput())
                    .collect()
            })
            .collect();
        let base = median_cell(&cells[0]).throughput();
        for (i, side) in sides.iter().enumerate() {
            let m = median_cell(&cells[i]);
            let lo = ratios[i].iter().copied().fold(f64::INFINITY, f64::min);
            let hi = ratios[i].iter().copied().fold(0.0, f64::max);
            let vs = format!("{:.3} [{lo:.2}-{hi:.2}]", m.throughput() / base);
            let x = c.to_string();
            csv.row(
                "write",
                side.series(),
                &x,
                m.throughput(),
                None,
                "tx/s",
                rounds,
            );
            if i > 0 {
                let ratio = m.throughput() / base;
                let series = format!("{} ÷ INSERT alone", side.series());
                csv.row("write", &series, &x, ratio, Some((lo, hi)), "ratio", rounds);
            }
            println!(
                "{:<28} {c:>3} {:>8.0} {:>9.2?} {:>9.2?} {vs:>20} {:>6}",
                side.name(),
                m.throughput(),
                m.p50,
                m.p99,
                side.statements()
            );
        }
    }
    println!(
        "stmts: statements per transaction, from the code: put and put_all are one INSERT each \
         (ON CONFLICT (id) DO NOTHING; a LATERAL advisory lock per ordering key; the statement \
         itself NOTIFYs, at commit, only while a relay waits)"
    );
    Ok(())
}

fn median_cell(cells: &[Cell]) -> &Cell {
    let mut by: Vec<&Cell> = cells.iter().collect();
    by.sort_by(|x, y| x.throughput().total_cmp(&y.throughput()));
    by[by.len() / 2]
}

// ---------------------------------------------------------------------------
// The sink under measurement
// ---------------------------------------------------------------------------

#[derive(Default)]
struct SinkStats {
    publish_nanos: AtomicU64,
    /// When the broker confirmed each message (kept only when asked for).
    confirmed: Mutex<Vec<(String, Instant)>>,
}

/// Wraps a sink: times its publishes and, for the latency run, notes when
/// each message was confirmed.
struct Observed {
    inner: Box<dyn Sink>,
    stats: Arc<SinkStats>,
    keep_ids: bool,
}

#[async_trait::async_trait]
impl Sink for Observed {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let t = Instant::now();
        let results = self.inner.publish(batch).await;
        let now = Instant::now();
        self.stats
            .publish_nanos
            .fetch_add((now - t).as_nanos() as u64, Ordering::Relaxed);
        if self.keep_ids {
            let mut confirmed = self.stats.confirmed.lock().expect("confirmed lock");
            for (m, r) in batch.iter().zip(&results) {
                if r.is_ok() {
                    confirmed.push((m.id.as_str().to_owned(), now));
                }
            }
        }
        results
    }
}

#[derive(Clone, Copy)]
enum Broker {
    Redis,
    Nats,
    Kafka,
}

struct Brokers {
    redis: redis::Client,
    js: async_nats::jetstream::Context,
    kafka: String,
    /// The brokers `IDEM_BENCH_BROKERS` names, in this order.
    on: Vec<Broker>,
}

impl Brokers {
    fn topic(&self, broker: Broker, run: &str) -> String {
        match broker {
            Broker::Redis => format!("idem-bench-outbox-{run}"),
            Broker::Nats => format!("{NATS_SUBJECT}.{run}"),
            Broker::Kafka => format!("idem-bench-outbox-{run}-{}", std::process::id()),
        }
    }

    /// What the relay publishes to, `topic` made on the broker where it
    /// must exist first.
    async fn sink(&self, broker: Broker, topic: &str) -> Result<Box<dyn Sink>, BoxError> {
        Ok(match broker {
            Broker::Redis => Box::new(RedisStreamsSink::connect(&self.redis).await?),
            Broker::Nats => Box::new(JetStreamSink::new(self.js.clone())),
            Broker::Kafka => {
                let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                    .set("bootstrap.servers", &self.kafka)
                    .create()?;
                let created = admin
                    .create_topics(
                        &[NewTopic::new(topic, 3, TopicReplication::Fixed(1))],
                        &AdminOptions::new(),
                    )
                    .await?;
                for r in created {
                    r.map_err(|(t, e)| format!("creating {t}: {e}"))?;
                }
                Box::new(KafkaSink::connect(&self.kafka)?)
            }
        })
    }

    /// Entries the broker holds for `topic`, and then drops them.
    async fn count_and_clear(&self, broker: Broker, topic: &str) -> Result<u64, BoxError> {
        match broker {
            Broker::Redis => {
                let mut conn = self.redis.get_multiplexed_async_connection().await?;
                let n: u64 = redis::cmd("XLEN").arg(topic).query_async(&mut conn).await?;
                let _: () = redis::cmd("DEL").arg(topic).query_async(&mut conn).await?;
                Ok(n)
            }
            Broker::Nats => {
                let stream = self.js.get_stream(NATS_STREAM).await?;
                let n = stream.get_info().await?.state.messages;
                stream.purge().await?;
                Ok(n)
            }
            Broker::Kafka => {
                // Read back (Tansu's memory engine reports wrong high-water
                // marks). The topic stays: deleting one made librdkafka crash
                // in its metadata cache against Tansu (the consumers bench).
                Ok(
                    kafka::parked(&self.kafka, topic, usize::MAX, Duration::from_secs(3))
                        .await?
                        .len() as u64,
                )
            }
        }
    }
}

fn label(b: Broker) -> &'static str {
    match b {
        Broker::Redis => "redis",
        Broker::Nats => "nats",
        Broker::Kafka => "kafka",
    }
}

fn broker_name(b: Broker) -> &'static str {
    match b {
        Broker::Redis => "Redis Streams",
        Broker::Nats => "JetStream (file)",
        Broker::Kafka => "Kafka (Tansu)",
    }
}

async fn pending(pool: &PgPool) -> Result<i64, BoxError> {
    Ok(
        sqlx::query_scalar("SELECT COUNT(*) FROM idem_outbox WHERE state <> 1")
            .fetch_one(pool)
            .await?,
    )
}

// ---------------------------------------------------------------------------
// (b) relaying
// ---------------------------------------------------------------------------

async fn fill(pool: &PgPool, topic: &str, run: &str, messages: u64) -> Result<Duration, BoxError> {
    let started = Instant::now();
    let mut n = 0;
    while n < messages {
        let upto = (n + 1000).min(messages);
        let mut tx = pool.begin().await?;
        let batch = (n..upto).map(|i| Message::bytes(topic, payload(i)).id(format!("{run}-{i}")));
        outbox::put_all(&mut tx, batch).await?;
        tx.commit().await?;
        n = upto;
    }
    Ok(started.elapsed())
}

async fn relaying(
    pool: &PgPool,
    brokers: &Brokers,
    messages: u64,
    batches: &[usize],
    rounds: usize,
    csv: &mut Csv,
) -> Result<(), BoxError> {
    println!(
        "\n(b) relaying: {messages} committed messages drained by one relay, {rounds} round(s) per row"
    );
    println!(
        "{:<18} {:>6} {:>10} {:>9} {:>10} {:>9} {:>9} {:>8}",
        "broker", "batch", "written/s", "drain", "drained/s", "publish", "database", "on broker"
    );
    let mut drained: BTreeMap<(usize, usize), Vec<(f64, f64)>> = BTreeMap::new();
    for round in 0..rounds {
        // Brokers take turns going first.
        let mut order: Vec<usize> = (0..brokers.on.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for b in order {
            for (k, &batch) in batches.iter().enumerate() {
                let rate = relay_once(pool, brokers, brokers.on[b], batch, messages, round).await?;
                drained.entry((b, k)).or_default().push(rate);
            }
        }
    }
    for ((b, k), rates) in drained {
        let (broker, batch) = (brokers.on[b], batches[k]);
        let share = median(rates.iter().map(|r| r.1).collect());
        let rates: Vec<f64> = rates.into_iter().map(|r| r.0).collect();
        let rate = median(rates.clone());
        let series = format!("{} batch {batch}", broker_name(broker));
        csv.row(
            "relay",
            &series,
            "drained",
            rate,
            Some(spread(&rates)),
            "msg/s",
            rounds,
        );
        csv.row(
            "relay",
            &series,
            "publish share",
            share,
            None,
            "fraction",
            rounds,
        );
    }
    println!(
        "written/s: the fill (put_all of 1000 per transaction); publish: time inside the sink; \
         database: the rest of the drain (claim and mark statements, the relay's own work)"
    );
    Ok(())
}

/// One drain of `messages` committed messages into `broker`: messages a
/// second and the share of the time inside the sink.
async fn relay_once(
    pool: &PgPool,
    brokers: &Brokers,
    broker: Broker,
    batch: usize,
    messages: u64,
    round: usize,
) -> Result<(f64, f64), BoxError> {
    sqlx::query("TRUNCATE idem_outbox").execute(pool).await?;
    let run = format!("relay-{}-{batch}-{round}", label(broker));
    let topic = brokers.topic(broker, &run);
    let filled = fill(pool, &topic, &run, messages).await?;
    // The fill's dead tuples and fresh statistics, as a long-running
    // table would have them.
    sqlx::query("VACUUM ANALYZE idem_outbox")
        .execute(pool)
        .await?;
    let stats = Arc::new(SinkStats::default());
    let sink = Observed {
        inner: brokers.sink(broker, &topic).await?,
        stats: stats.clone(),
        keep_ids: false,
    };
    let relay = Relay::builder(pool.clone(), sink).batch(batch).build();
    let started = Instant::now();
    loop {
        let pass = relay.run_once().await?;
        if pass.claimed == 0 {
            break;
        }
    }
    let elapsed = started.elapsed();
    let published = relay.stats().published;
    let left = pending(pool).await?;
    let on_broker = brokers.count_and_clear(broker, &topic).await?;
    let publish = Duration::from_nanos(stats.publish_nanos.load(Ordering::Relaxed));
    let share = publish.as_secs_f64() / elapsed.as_secs_f64();
    println!(
        "{:<18} {batch:>6} {:>10.0} {:>9.2?} {:>10.0} {:>8.0}% {:>8.0}% {on_broker:>8}{}",
        broker_name(broker),
        messages as f64 / filled.as_secs_f64(),
        elapsed,
        published as f64 / elapsed.as_secs_f64(),
        share * 100.0,
        (1.0 - share) * 100.0,
        if left == 0 {
            String::new()
        } else {
            format!("  ({left} NOT SENT)")
        }
    );
    Ok((published as f64 / elapsed.as_secs_f64(), share))
}

// ---------------------------------------------------------------------------
// (c) latency
// ---------------------------------------------------------------------------

async fn latency(
    pool: &PgPool,
    brokers: &Brokers,
    rate: f64,
    seconds: f64,
    csv: &mut Csv,
) -> Result<(), BoxError> {
    println!(
        "\n(c) latency: {rate:.0} messages/s for {seconds:.0} s, one per transaction, Relay::run (LISTEN); commit returned -> broker confirmed"
    );
    println!(
        "{:<18} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "broker", "sent", "offered/s", "p50", "p90", "p99", "max", "claimed"
    );
    for &broker in &brokers.on {
        sqlx::query("TRUNCATE idem_outbox").execute(pool).await?;
        let run = format!("latency-{}", label(broker));
        let topic = brokers.topic(broker, &run);
        let stats = Arc::new(SinkStats::default());
        let sink = Observed {
            inner: brokers.sink(broker, &topic).await?,
            stats: stats.clone(),
            keep_ids: true,
        };
        let relay = Arc::new(Relay::builder(pool.clone(), sink).batch(1000).build());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let relaying = {
            let relay = relay.clone();
            tokio::spawn(async move { relay.run_until(stopped).await })
        };
        // LISTEN is set up before the first message.
        tokio::time::sleep(Duration::from_millis(200)).await;

        let total = (rate * seconds) as u64;
        let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let started = Instant::now();
        let mut writers = Vec::with_capacity(total as usize);
        for n in 0..total {
            let at = started + Duration::from_secs_f64(n as f64 / rate);
            tokio::time::sleep_until(at.into()).await;
            let (pool, committed, topic, run) =
                (pool.clone(), committed.clone(), topic.clone(), run.clone());
            writers.push(tokio::spawn(async move {
                let id = format!("{run}-{n}");
                let mut tx = pool.begin().await?;
                sqlx::query("INSERT INTO bench_orders (run, id, sku) VALUES ($1, $2, 'SKU-1')")
                    .bind(&run)
                    .bind(n as i64)
                    .execute(&mut *tx)
                    .await?;
                outbox::put(&mut tx, Message::bytes(topic, payload(n)).id(id.clone())).await?;
                tx.commit().await?;
                let done = Instant::now();
                committed.lock().expect("committed lock").insert(id, done);
                Ok::<(), BoxError>(())
            }));
        }
        let offered = total as f64 / started.elapsed().as_secs_f64();
        for w in writers {
            w.await??;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while stats.confirmed.lock().expect("confirmed lock").len() < total as usize
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop.send(());
        relaying.await?;
        let committed = std::mem::take(&mut *committed.lock().expect("committed lock"));
        let confirmed = std::mem::take(&mut *stats.confirmed.lock().expect("confirmed lock"));
        let mut lat: Vec<Duration> = confirmed
            .iter()
            .filter_map(|(id, at)| Some(at.saturating_duration_since(*committed.get(id)?)))
            .collect();
        lat.sort_unstable();
        let claimed = relay.stats().claimed;
        let _ = brokers.count_and_clear(broker, &topic).await?;
        let max = lat.last().copied().unwrap_or_default();
        for (x, at) in [
            ("p50", percentile(&lat, 0.5)),
            ("p90", percentile(&lat, 0.9)),
            ("p99", percentile(&lat, 0.99)),
            ("max", max),
        ] {
            let ms = at.as_secs_f64() * 1e3;
            csv.row("latency", broker_name(broker), x, ms, None, "ms", 1);
        }
        println!(
            "{:<18} {:>8} {offered:>10.0} {:>9.2?} {:>9.2?} {:>9.2?} {:>9.2?} {:>8}",
            broker_name(broker),
            lat.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.9),
            percentile(&lat, 0.99),
            lat.last().copied().unwrap_or_default(),
            claimed,
        );
    }
    println!(
        "sent: messages confirmed by the broker; claimed: claims by the relay (a message claimed twice counts twice)"
    );
    Ok(())
}

// ---------------------------------------------------------------------------

async fn bench() -> Result<(), BoxError> {
    let only = std::env::var("IDEM_BENCH_ONLY").unwrap_or_default();
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
    let pool = PgPoolOptions::new()
        .max_connections(66)
        .connect_with(options)
        .await?;
    // Opening the store applies idem's migrations, the outbox's table with them.
    PgStore::builder().pool(pool.clone()).await?;
    sqlx::query(
        "CREATE TABLE bench_orders (run TEXT NOT NULL, id BIGINT NOT NULL, sku TEXT NOT NULL, PRIMARY KEY (run, id))",
    )
    .execute(&pool)
    .await?;
    sqlx::query(
        "CREATE TABLE bench_events (id TEXT PRIMARY KEY, topic TEXT NOT NULL, headers TEXT, payload BYTEA NOT NULL, created_at BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await?;

    let redis = redis::Client::open(url("IDEM_REDIS_URL", "redis://127.0.0.1:6379"))?;
    let nats = async_nats::connect(url("IDEM_NATS_URL", "nats://127.0.0.1:4222")).await?;
    let js = async_nats::jetstream::new(nats);
    let _ = js.delete_stream(NATS_STREAM).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: NATS_STREAM.to_owned(),
        subjects: vec![format!("{NATS_SUBJECT}.>")],
        ..Default::default()
    })
    .await?;
    let on = list("IDEM_BENCH_BROKERS", "redis,nats,kafka")
        .iter()
        .filter_map(|b| match b.as_str() {
            "redis" => Some(Broker::Redis),
            "nats" => Some(Broker::Nats),
            "kafka" => Some(Broker::Kafka),
            _ => None,
        })
        .collect();
    let brokers = Brokers {
        redis,
        js,
        kafka: url("IDEM_KAFKA_BROKERS", "127.0.0.1:9092"),
        on,
    };

    println!("load average at start: {}", load());
    let mut csv = Csv::new("outbox");
    if matches!(only.as_str(), "" | "write") {
        writing(
            &pool,
            env("IDEM_BENCH_WRITE_TX", 4000),
            env("IDEM_BENCH_ROUNDS", 3),
            &mut csv,
        )
        .await?;
    }
    if matches!(only.as_str(), "" | "relay") {
        let batches: Vec<usize> = std::env::var("IDEM_BENCH_RELAY_BATCHES")
            .unwrap_or_else(|_| "1000,500".into())
            .split(',')
            .filter_map(|b| b.trim().parse().ok())
            .collect();
        relaying(
            &pool,
            &brokers,
            env("IDEM_BENCH_RELAY_MESSAGES", 100_000),
            &batches,
            env("IDEM_BENCH_RELAY_ROUNDS", 1).max(1),
            &mut csv,
        )
        .await?;
    }
    if matches!(only.as_str(), "" | "latency") {
        latency(
            &pool,
            &brokers,
            env("IDEM_BENCH_LATENCY_RATE", 1000.0),
            env("IDEM_BENCH_LATENCY_SECONDS", 10.0),
            &mut csv,
        )
        .await?;
    }
    println!("\nload average at end: {}", load());
    csv.write();

    pool.close().await;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        .execute(&admin)
        .await?;
    let _ = brokers.js.delete_stream(NATS_STREAM).await;
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
            "error: {e} (PostgreSQL, Redis, NATS JetStream and a Kafka broker must be running)"
        );
        std::process::exit(1);
    }
}
