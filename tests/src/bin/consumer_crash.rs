//! One consumer process of `tests/consumer_common.rs`'s fault scenario: it
//! runs the consumer runner on a real broker until the parent kills it, so a
//! message can crash a whole process, not just a task.
//!
//! ```text
//! consumer_crash <consumer name> <redis key prefix> redis <stream> <group>
//! consumer_crash <consumer name> <redis key prefix> rabbitmq <queue>
//! consumer_crash <consumer name> <redis key prefix> nats <stream> <parking subject>
//! consumer_crash <consumer name> <redis key prefix> kafka <topic> <group>
//! consumer_crash <consumer name> <redis key prefix> kafka-tx <topic> <group> <table>
//! ```
//!
//! `kafka-tx` is the Kafka consumer the way a payment service runs it: each
//! message one PostgreSQL transaction (`IDEM_POSTGRES_URL`) holding idem's
//! claim and a row in `<table>` (the parent's to create and read), the
//! deliveries counted in a `PgStore` on the same database, `concurrency(3)`.
//! A kill can then land anywhere and the row is still there once or not at
//! all; the parent reads it against the group's committed offsets.
//!
//! The handler's idem records and what it did live in Redis under the prefix
//! (`IDEM_REDIS_URL`), which every process of a scenario shares: the hash
//! `<prefix>calls` counts body starts per order, `<prefix>effects` finished
//! settlements. Orders `panic-*` panic in the body; orders `crash-body-*`
//! print `at <order>` in the body, and `crash-early-*` before the handler
//! calls it, and block there for the parent to SIGKILL the process; every
//! other order settles. `ready` is printed once the consumer is connected,
//! `got <order> <attempt>` for every delivery.
//! The process runs until the runner returns (a broker failure: status 1).

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use idem_runtime::consumer::jetstream::JetStreamSource;
use idem_runtime::consumer::kafka::KafkaSource;
use idem_runtime::consumer::rabbitmq::{self, RabbitMqSource};
use idem_runtime::consumer::redis_streams::RedisStreamsSource;
use idem_runtime::consumer::{BrokerError, Delivery, Runner, Source};
use idem_runtime::idempotent;
use idem_runtime::store::StoreRef;
use idem_runtime::store::redis::RedisStore;
use idem_tests::services;
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct OrderPaid {
    order_id: String,
    amount: u64,
}

#[derive(Debug, thiserror::Error)]
enum SettleError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// The `kafka-tx` handler: the row and idem's record commit together.
#[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "tests.consumer.kafka_tx", tx = tx)]
async fn settle_in_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    table: &str,
    e: OrderPaid,
) -> Result<(), SettleError> {
    // A little work inside the transaction, so a kill lands mid-message.
    tokio::time::sleep(Duration::from_millis(3)).await;
    sqlx::query(&format!("INSERT INTO {table} (order_id) VALUES ($1)"))
        .bind(&e.order_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

struct Ledger {
    store: StoreRef,
    redis: MultiplexedConnection,
    prefix: String,
}

impl Ledger {
    async fn count(&self, what: &str, order_id: &str) -> Result<(), redis::RedisError> {
        let _: i64 = redis::cmd("HINCRBY")
            .arg(format!("{}{what}", self.prefix))
            .arg(order_id)
            .arg(1)
            .query_async(&mut self.redis.clone())
            .await?;
        Ok(())
    }
}

/// The scope and lease match `tests/consumer_common.rs`'s `settle`; the key
/// prefix keeps each scenario's records apart.
#[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "tests.consumer.crash", store = ledger.store, lease = "2s")]
async fn settle(ledger: Arc<Ledger>, e: OrderPaid) -> Result<(), SettleError> {
    ledger.count("calls", &e.order_id).await?;
    if e.order_id.starts_with("panic") {
        panic!("settling {} broke the handler", e.order_id);
    }
    if e.order_id.starts_with("crash-body") {
        block_for_the_kill(&e.order_id).await;
    }
    ledger.count("effects", &e.order_id).await?;
    Ok(())
}

async fn block_for_the_kill(order_id: &str) {
    say(&format!("at {order_id}"));
    std::future::pending::<()>().await;
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // The parent acts on each line as it arrives: nothing may wait in a buffer.
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The same runner settings as the in-process scenarios.
fn runner() -> Runner {
    Runner::new()
        .max_deliveries(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(400))
        .in_progress_delay(Duration::from_millis(300))
}

/// Says `got <order> <attempt>` for every delivery, for the parent's log.
struct Logged<S>(S);

#[async_trait::async_trait]
impl<S: Source> Source for Logged<S> {
    type Delivery = S::Delivery;

    async fn next(&mut self) -> Result<S::Delivery, BrokerError> {
        let d = self.0.next().await?;
        let order = d
            .payload()
            .and_then(|p| serde_json::from_slice::<OrderPaid>(p).ok())
            .map_or_else(|| "?".to_owned(), |o| o.order_id);
        say(&format!("got {order} {}", d.attempt()));
        Ok(d)
    }
}

async fn consume<S: Source>(source: S, ledger: Arc<Ledger>) -> BrokerError {
    let source = Logged(source);
    say("ready");
    runner()
        .run(source, move |e: OrderPaid| {
            let ledger = ledger.clone();
            async move {
                // Dies before the idempotent call claims the key: no claim
                // then holds the redelivery off for a lease.
                if e.order_id.starts_with("crash-early") {
                    block_for_the_kill(&e.order_id).await;
                }
                settle(ledger, e).await
            }
        })
        .await
}

async fn run(args: &[String]) -> Result<BrokerError, Box<dyn std::error::Error>> {
    let [name, prefix, broker, rest @ ..] = args else {
        return Err("usage: consumer_crash <name> <prefix> <broker> <broker args>".into());
    };
    let url = services::redis_url();
    let client = redis::Client::open(url.as_str())?;
    let store = RedisStore::builder()
        .key_prefix(prefix.as_str())
        .connect(&url)
        .await?;
    let ledger = Arc::new(Ledger {
        store: StoreRef::new(store),
        redis: client.get_multiplexed_async_connection().await?,
        prefix: prefix.clone(),
    });
    // The settings of the scenarios' own consumers (tests/consumer_*.rs).
    Ok(match (broker.as_str(), rest) {
        ("redis", [stream, group]) => {
            let source = RedisStreamsSource::builder(stream, group, name)
                .claim_idle(Duration::from_millis(1500))
                .block(Duration::from_millis(200))
                .connect(&client)
                .await?;
            consume(source, ledger).await
        }
        ("rabbitmq", [queue]) => {
            let conn = rabbitmq::connect(&services::rabbitmq_url()).await?;
            let source = RabbitMqSource::builder(queue, name)
                .connect(conn.create_channel().await?)
                .await?;
            consume(source, ledger).await
        }
        ("nats", [stream, parking]) => {
            let client = async_nats::connect(services::nats_url()).await?;
            let source = JetStreamSource::builder(stream, "settlement", parking)
                .ack_wait(Duration::from_secs(2))
                .connect(&async_nats::jetstream::new(client))
                .await?;
            consume(source, ledger).await
        }
        ("kafka", [topic, group]) => {
            // Deliveries are counted in the scenario's store, which every
            // process shares: a kill counts as the delivery it ended.
            let source = KafkaSource::builder(&services::kafka_brokers(), topic, group)
                .store(ledger.store.clone())
                .set("client.id", name.as_str())
                .set("session.timeout.ms", "6000")
                .set("heartbeat.interval.ms", "500")
                .connect()
                .await?;
            consume(source, ledger).await
        }
        ("kafka-tx", [topic, group, table]) => {
            let pool = sqlx::PgPool::connect(&services::postgres_url()).await?;
            let counts = idem_runtime::store::sql::PgStore::builder()
                .pool(pool.clone())
                .await?;
            let source = KafkaSource::builder(&services::kafka_brokers(), topic, group)
                .store(counts)
                .set("client.id", name.as_str())
                .set("session.timeout.ms", "6000")
                .set("heartbeat.interval.ms", "500")
                .connect()
                .await?;
            say("ready");
            // The handler's future may borrow only the transaction: the
            // name lives as long as the process.
            let table: &'static str = Box::leak(table.clone().into_boxed_str());
            runner()
                .concurrency(3)
                .run_in_tx(Logged(source), &pool, |tx, e: OrderPaid| {
                    Box::pin(settle_in_tx(tx, table, e))
                })
                .await
        }
        _ => return Err(format!("unknown broker arguments: {broker} {rest:?}").into()),
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args).await {
        Ok(stopped) => eprintln!("consumer_crash: the runner stopped: {stopped}"),
        Err(e) => eprintln!("consumer_crash: {e}"),
    }
    ExitCode::FAILURE
}
