//! The transactional outbox end to end, on PostgreSQL (`IDEM_POSTGRES_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`) and Redis Streams
//! (`IDEM_REDIS_URL`, default `redis://127.0.0.1:6379`):
//!
//! 1. a producer commits each order together with its "order created"
//!    message (`outbox::put` in the order's transaction);
//! 2. a relay process publishes them to a Redis stream and is killed with
//!    SIGKILL in the middle of a batch: what it published in that batch is on
//!    the stream but not marked sent;
//! 3. a second relay publishes the rest, and the killed relay's batch again
//!    once its lease runs out, so the stream holds duplicates;
//! 4. a consumer process, keyed on the message id (`Envelope`), applies each
//!    order once: the effect and idem's record commit in one PostgreSQL
//!    transaction (`tx = tx`).
//!
//! The program exits with status 1 if an order was applied twice or not at
//! all. Everything lives in a schema of its own (dropped at the end) and a
//! stream named after the run.
//!
//! Run: `cargo run -p example-outbox --example outbox`

use std::process::{Child, Command, ExitCode};
use std::str::FromStr;
use std::time::{Duration, Instant};

use idem_runtime::consumer::redis_streams::RedisStreamsSource;
use idem_runtime::consumer::{BrokerError, Envelope, Runner, Source};
use idem_runtime::idempotent;
use idem_runtime::outbox::sink::{RedisStreamsSink, Sink};
use idem_runtime::outbox::{self, Message, Outgoing, Relay};
use idem_runtime::store::sql::PgStore;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Transaction};

const ORDERS: i64 = 200;
/// Small enough that the relay is killed in its second or third batch.
const BATCH: usize = 50;
/// The killed relay's batch waits this long before another relay takes it.
const LEASE: Duration = Duration::from_secs(3);
/// Per message in the first relay, so a batch takes long enough to be cut.
const SLOW_PUBLISH: Duration = Duration::from_millis(10);
const GROUP: &str = "shipping";

type BoxError = Box<dyn std::error::Error>;

#[derive(Debug, Serialize, Deserialize)]
struct OrderCreated {
    order_id: i64,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error)]
enum ShipError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Applies an order once per message id. A plain INSERT with no unique key,
/// so a second application would show up as a second row.
#[idempotent(consumer, event = "SHIP", key = "m.id", scope = "example.outbox.ship", tx = tx)]
async fn ship(
    tx: &mut Transaction<'_, Postgres>,
    m: Envelope<OrderCreated>,
) -> Result<(), ShipError> {
    sqlx::query("INSERT INTO effects (order_id, message_id) VALUES ($1, $2)")
        .bind(m.body.order_id)
        .bind(m.id.as_str())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn pg_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A pool whose connections see only the run's schema.
async fn pool(schema: &str, max: u32) -> Result<PgPool, BoxError> {
    let options = PgConnectOptions::from_str(&pg_url())?.options([("search_path", schema)]);
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .connect_with(options)
        .await?)
}

/// Publishes one message at a time with a pause after each, so the parent
/// sees a batch half on the stream and can kill the relay right there.
struct SlowSink {
    inner: RedisStreamsSink,
}

#[async_trait::async_trait]
impl Sink for SlowSink {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn publish(&self, batch: &[Outgoing]) -> Vec<Result<(), BrokerError>> {
        let mut out = Vec::with_capacity(batch.len());
        for m in batch {
            out.extend(self.inner.publish(std::slice::from_ref(m)).await);
            tokio::time::sleep(SLOW_PUBLISH).await;
        }
        out
    }
}

/// The first relay, as a process of its own: relays until it is killed.
async fn relay_process(schema: &str) -> Result<(), BoxError> {
    let pool = pool(schema, 2).await?;
    let client = redis::Client::open(redis_url())?;
    let sink = SlowSink {
        inner: RedisStreamsSink::connect(&client).await?,
    };
    let relay = Relay::builder(pool, sink).batch(BATCH).lease(LEASE).build();
    relay.run().await;
    Ok(())
}

/// The consumer process: applies messages until it is killed, and keeps its
/// counters in a table the parent reads.
async fn consumer_process(schema: &str, stream: &str) -> Result<(), BoxError> {
    let pool = pool(schema, 2).await?;
    let client = redis::Client::open(redis_url())?;
    let mut source = RedisStreamsSource::builder(stream, GROUP, "shipper-1")
        .block(Duration::from_millis(200))
        .connect(&client)
        .await?;
    let runner = Runner::new();
    loop {
        let delivery = source.next().await?;
        // The runner begins the transaction, commits it, and only then acks.
        runner
            .process_in_tx(delivery, &pool, &|tx, m| Box::pin(ship(tx, m)))
            .await?;
        let s = runner.stats();
        sqlx::query(
            "UPDATE consumer_stats SET delivered = $1, processed = $2, deduplicated = $3, parked = $4",
        )
        .bind(s.delivered as i64)
        .bind(s.processed as i64)
        .bind(s.deduplicated as i64)
        .bind(s.parked as i64)
        .execute(&pool)
        .await?;
    }
}

/// A child process, killed if the parent returns early.
struct Process(Child);

impl Process {
    fn spawn(args: &[&str]) -> std::io::Result<Process> {
        Ok(Process(
            Command::new(std::env::current_exe()?).args(args).spawn()?,
        ))
    }

    /// SIGKILL: no shutdown, no last mark.
    fn kill(&mut self) -> std::io::Result<()> {
        self.0.kill()?;
        self.0.wait().map(drop)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

async fn count(pool: &PgPool, sql: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(sql).fetch_one(pool).await
}

async fn xlen(conn: &mut redis::aio::MultiplexedConnection, stream: &str) -> Result<i64, BoxError> {
    Ok(redis::cmd("XLEN").arg(stream).query_async(conn).await?)
}

async fn scenario(schema: &str, stream: &str) -> Result<bool, BoxError> {
    let pool = pool(schema, 4).await?;
    // Opening the store applies idem's migrations: its records and the outbox.
    PgStore::builder().pool(pool.clone()).await?;
    for ddl in [
        "CREATE TABLE orders (id BIGINT PRIMARY KEY, amount_cents BIGINT NOT NULL)",
        "CREATE TABLE effects (seq BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL, message_id TEXT NOT NULL)",
        "CREATE TABLE consumer_stats (delivered BIGINT, processed BIGINT, deduplicated BIGINT, parked BIGINT)",
        "INSERT INTO consumer_stats VALUES (0, 0, 0, 0)",
    ] {
        sqlx::query(ddl).execute(&pool).await?;
    }
    let client = redis::Client::open(redis_url())?;
    let mut redis = client.get_multiplexed_async_connection().await?;

    for order_id in 1..=ORDERS {
        let mut tx = pool.begin().await?;
        let amount_cents = 1000 + order_id;
        sqlx::query("INSERT INTO orders (id, amount_cents) VALUES ($1, $2)")
            .bind(order_id)
            .bind(amount_cents)
            .execute(&mut *tx)
            .await?;
        // Outside an idempotent call the message needs an id of ours.
        let created = OrderCreated {
            order_id,
            amount_cents,
        };
        let message = Message::json(stream, &created)?.id(format!("order-{order_id}-created"));
        outbox::put(&mut tx, message).await?;
        tx.commit().await?;
    }
    println!("producer: {ORDERS} orders, each committed with its message in one transaction");

    let mut consumer = Process::spawn(&["consumer", schema, stream])?;
    let mut relay = Process::spawn(&["relay", schema])?;
    println!(
        "relay 1 (a process): batches of {BATCH}, lease {LEASE:?}, {SLOW_PUBLISH:?} per message"
    );
    // Killed once a third is out, between two messages of one batch.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let n = xlen(&mut redis, stream).await?;
        if n >= ORDERS / 3 && n % BATCH as i64 != 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err("relay 1 published too little in 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    relay.kill()?;
    let on_stream = xlen(&mut redis, stream).await?;
    let sent = count(&pool, "SELECT COUNT(*) FROM idem_outbox WHERE state = 1").await?;
    println!(
        "relay 1 killed (SIGKILL) mid-batch: {on_stream} entries on the stream, {sent} messages marked sent, \
         {} published but not marked",
        on_stream - sent
    );

    let started = Instant::now();
    let relay2 = Relay::builder(pool.clone(), RedisStreamsSink::connect(&client).await?)
        .batch(BATCH)
        .lease(LEASE)
        .build();
    loop {
        let round = relay2.run_once().await?;
        if count(&pool, "SELECT COUNT(*) FROM idem_outbox WHERE state <> 1").await? == 0 {
            break;
        }
        if Instant::now() > deadline + LEASE {
            return Err("relay 2 did not drain the outbox".into());
        }
        if round.claimed == 0 {
            // Only the killed relay's batch is left: due when its lease ends.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "relay 2 (in this process): published {} in {:.1?} (the killed batch once its lease ran out)",
        relay2.stats().published,
        started.elapsed()
    );

    let published = xlen(&mut redis, stream).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let stats = loop {
        let row: (i64, i64, i64, i64) =
            sqlx::query_as("SELECT delivered, processed, deduplicated, parked FROM consumer_stats")
                .fetch_one(&pool)
                .await?;
        if row.0 >= published || Instant::now() > deadline {
            break row;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    consumer.kill()?;
    let (delivered, processed, deduplicated, parked) = stats;
    println!(
        "consumer (a process): {delivered} delivered, {processed} applied, {deduplicated} deduplicated, {parked} parked"
    );

    let per_order: Vec<(i64, i64)> =
        sqlx::query_as("SELECT order_id, COUNT(*) FROM effects GROUP BY order_id")
            .fetch_all(&pool)
            .await?;
    let effects: i64 = per_order.iter().map(|(_, n)| n).sum();
    let twice = per_order.iter().filter(|(_, n)| *n > 1).count();
    let lost = ORDERS - per_order.len() as i64;
    println!("published entries: {published} for {ORDERS} orders (duplicates included)");
    println!("effects applied:   {effects} (applied twice: {twice}, lost: {lost})");
    pool.close().await;
    Ok(published >= ORDERS && effects == ORDERS && twice == 0 && lost == 0 && parked == 0)
}

async fn run() -> Result<bool, BoxError> {
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    let schema = format!("idem_example_outbox_{}", std::process::id());
    let stream = format!("idem-example-outbox-{run}");
    let admin = PgPool::connect(&pg_url()).await?;
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&admin)
        .await?;
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await?;
    let outcome = scenario(&schema, &stream).await;
    // Left behind only if the cleanup itself fails.
    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .execute(&admin)
        .await;
    if let Ok(client) = redis::Client::open(redis_url())
        && let Ok(mut conn) = client.get_multiplexed_async_connection().await
    {
        let _: Result<(), _> = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await;
    }
    outcome
}

fn main() -> ExitCode {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let args: Vec<String> = std::env::args().collect();
    let child = match args.get(1).map(String::as_str) {
        Some("relay") => Some(rt.block_on(relay_process(&args[2]))),
        Some("consumer") => Some(rt.block_on(consumer_process(&args[2], &args[3]))),
        _ => None,
    };
    if let Some(Err(e)) = child {
        eprintln!("{} failed: {e}", args[1]);
        return ExitCode::FAILURE;
    }
    if child.is_some() {
        return ExitCode::SUCCESS;
    }
    match rt.block_on(run()) {
        Ok(true) => {
            println!("OK: every order applied exactly once");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("FAILED: an order was applied twice or not at all");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!(
                "error: {e} (are PostgreSQL at {} and Redis at {} running?)",
                pg_url(),
                redis_url()
            );
            ExitCode::FAILURE
        }
    }
}
