//! Consumers on a real broker (Redis Streams at `IDEM_REDIS_URL`, default
//! `redis://127.0.0.1:6379`): a producer publishes `OrderPaid` events with
//! deliberate duplicates, two consumer processes share one consumer group, and
//! one of them is killed with SIGKILL mid-stream. Its pending entries are
//! taken over by the other (`XAUTOCLAIM`). At the end the `settlements` table
//! (SQLite, deliberately without a unique key on the order: only idem keeps
//! an order to one row) must hold exactly one row per order; anything else
//! makes the program exit with status 1.
//!
//! The settlement and idem's record commit in one SQLite transaction
//! (`tx = tx`), so a kill between the two cannot happen: that is what makes
//! the effect exactly-once rather than at-least-once. The runner begins,
//! commits or rolls back that transaction itself (`Runner::process_in_tx`).
//!
//! The same on Kafka (a consumer group on a topic of 3 partitions at
//! `IDEM_KAFKA_BROKERS`, default `127.0.0.1:9092`; `scripts/test` starts one):
//! the killed process's partitions go to the other once the group's session
//! timeout (6 s here) has passed, and that one starts from the last
//! committed offsets. Right after the kill the program checks what Kafka
//! users rely on: every message below a committed offset was applied, so
//! committed offsets never run ahead of the settlements.
//!
//! Run: `cargo run -p example-consumer --example consumer` (Redis Streams),
//! `cargo run -p example-consumer --example consumer -- kafka`

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use idem_runtime::consumer::kafka::{self, KafkaSource};
use idem_runtime::consumer::redis_streams::{self, RedisStreamsSource};
use idem_runtime::consumer::{Runner, Source};
use idem_runtime::idempotent;
use idem_runtime::store::sql::SqliteStore;
use serde::{Deserialize, Serialize};
use sqlx::{Sqlite, SqlitePool, Transaction};

const ORDERS: usize = 150;
const DUPLICATES: usize = 50;
const GROUP: &str = "settlement";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: String,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error)]
enum SettleError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Settles an order once: the row and idem's record commit together.
#[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "example.settle", tx = tx)]
async fn settle(
    tx: &mut Transaction<'_, Sqlite>,
    e: OrderPaid,
    worker: &str,
) -> Result<(), SettleError> {
    // A plain INSERT and no unique key: a second settlement of an order would
    // be a second row, which the verdict below counts.
    sqlx::query("INSERT INTO settlements (order_id, amount_cents, worker) VALUES (?1, ?2, ?3)")
        .bind(&e.order_id)
        .bind(e.amount_cents)
        .bind(worker)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A little work per message, so the kill lands mid-stream.
async fn settle_slowly(
    tx: &mut Transaction<'_, Sqlite>,
    e: OrderPaid,
    worker: &str,
) -> Result<(), SettleError> {
    tokio::time::sleep(Duration::from_millis(15)).await;
    settle(tx, e, worker).await
}

fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn kafka_brokers() -> String {
    std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

#[derive(Clone, Copy, PartialEq)]
enum Broker {
    Redis,
    Kafka,
}

impl Broker {
    fn arg(self) -> &'static str {
        match self {
            Broker::Redis => "redis",
            Broker::Kafka => "kafka",
        }
    }
}

/// One consumer process: settles until killed, writing its counters after
/// every message.
async fn worker(
    name: String,
    topic: String,
    dir: PathBuf,
    broker: Broker,
) -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::open(dir.join("settle.db")).await?;
    match broker {
        Broker::Redis => {
            let client = redis::Client::open(redis_url())?;
            let source = RedisStreamsSource::builder(&topic, GROUP, &name)
                // A dead consumer's entries move on after 2 s of silence.
                .claim_idle(Duration::from_secs(2))
                .block(Duration::from_millis(200))
                .connect(&client)
                .await?;
            consume(source, &store, &name, &dir).await
        }
        Broker::Kafka => {
            let source = KafkaSource::builder(&kafka_brokers(), &topic, GROUP)
                // Kafka keeps no delivery count: idem keeps it in this store.
                .store(store.clone())
                // A dead member's partitions move on after 6 s of silence.
                .set("session.timeout.ms", "6000")
                .set("heartbeat.interval.ms", "500")
                .connect()
                .await?;
            consume(source, &store, &name, &dir).await
        }
    }
}

async fn consume<S: Source>(
    mut source: S,
    store: &SqliteStore,
    name: &str,
    dir: &Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let pool = store.pool().clone();
    let name = name.to_owned();
    let runner = Runner::new().in_progress_delay(Duration::from_millis(300));
    let stats_file = dir.join(format!("stats-{name}"));
    loop {
        let delivery = source.next().await?;
        // The runner begins the transaction, commits it on `Ok` (then acks)
        // and rolls it back on `Err` (then redelivers): no begin/commit here.
        runner
            .process_in_tx(delivery, &pool, &|tx, e| {
                // The future outlives this closure's borrows: it owns its copy.
                let name = name.clone();
                Box::pin(async move { settle_slowly(tx, e, &name).await })
            })
            .await?;
        let s = runner.stats();
        std::fs::write(
            &stats_file,
            format!(
                "{} {} {} {} {}",
                s.delivered,
                s.processed,
                s.deduplicated,
                s.redelivered(),
                s.parked
            ),
        )?;
    }
}

fn spawn_worker(name: &str, topic: &str, dir: &Path, broker: Broker) -> std::io::Result<Child> {
    Command::new(std::env::current_exe()?)
        .args(["worker", name, topic])
        .arg(dir)
        .arg(broker.arg())
        .spawn()
}

async fn settled(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM settlements")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

fn read_stats(dir: &Path, name: &str) -> [u64; 5] {
    let text = std::fs::read_to_string(dir.join(format!("stats-{name}"))).unwrap_or_default();
    let mut out = [0; 5];
    for (slot, n) in out.iter_mut().zip(text.split_whitespace()) {
        *slot = n.parse().unwrap_or(0);
    }
    out
}

/// The events: every 3rd order is published twice, so 50 of the 200 events
/// are duplicates.
fn events() -> Vec<OrderPaid> {
    let mut events: Vec<OrderPaid> = (0..ORDERS)
        .map(|i| OrderPaid {
            order_id: format!("order-{i:04}"),
            amount_cents: 1000 + i as i64,
        })
        .collect();
    let dups: Vec<OrderPaid> = events
        .iter()
        .step_by(ORDERS / DUPLICATES)
        .take(DUPLICATES)
        .cloned()
        .collect();
    for (n, d) in dups.into_iter().enumerate() {
        events.insert((n * 4 + 3).min(events.len()), d);
    }
    events
}

/// Waits until a quarter of the orders are settled, then SIGKILLs `a`.
async fn kill_mid_stream(a: &mut Child, pool: &SqlitePool) -> std::io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(45);
    while settled(pool).await < (ORDERS / 4) as i64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.kill()?; // SIGKILL: no ack, no commit, no goodbye
    a.wait()?;
    println!(
        "killed consumer a (SIGKILL) after {} settlements",
        settled(pool).await
    );
    Ok(())
}

/// The verdict: one settlement row per order, none parked.
async fn verdict(pool: &SqlitePool, dir: &Path, parked: i64) -> Result<bool, sqlx::Error> {
    let [ad, ap, ax, ar, aparked] = read_stats(dir, "a");
    let [bd, bp, bx, br, bparked] = read_stats(dir, "b");
    println!("            delivered processed deduplicated redelivered parked");
    println!(
        "consumer a  {ad:>9} {ap:>9} {ax:>12} {ar:>11} {aparked:>6}   (its last report before the kill)"
    );
    println!("consumer b  {bd:>9} {bp:>9} {bx:>12} {br:>11} {bparked:>6}");

    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, COUNT(*) FROM settlements GROUP BY order_id")
            .fetch_all(pool)
            .await?;
    let expected: BTreeSet<String> = (0..ORDERS).map(|i| format!("order-{i:04}")).collect();
    let got: BTreeSet<String> = rows.iter().map(|(o, _)| o.clone()).collect();
    let missing = expected.difference(&got).count();
    let twice = rows.iter().filter(|(_, n)| *n != 1).count();
    println!(
        "settlements: {} rows for {ORDERS} orders; missing {missing}, settled twice {twice}, parked {parked}",
        rows.len()
    );
    Ok(missing == 0 && twice == 0 && parked == 0 && rows.len() == ORDERS)
}

async fn settlements_table(dir: &Path) -> Result<SqliteStore, Box<dyn std::error::Error>> {
    let store = SqliteStore::open(dir.join("settle.db")).await?;
    sqlx::query(
        "CREATE TABLE settlements (order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL, worker TEXT NOT NULL)",
    )
    .execute(store.pool())
    .await?;
    Ok(store)
}

async fn run(broker: Broker) -> Result<bool, Box<dyn std::error::Error>> {
    match broker {
        Broker::Redis => run_redis().await,
        Broker::Kafka => run_kafka().await,
    }
}

async fn run_redis() -> Result<bool, Box<dyn std::error::Error>> {
    let suffix = format!("{:x}", std::process::id());
    let stream = format!("idem-example-orders-{suffix}");
    let dir = std::env::temp_dir().join(format!("idem-example-consumer-{suffix}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;

    let store = settlements_table(&dir).await?;
    let pool = store.pool().clone();

    let client = redis::Client::open(redis_url())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    // The group exists before the first event, and both workers join it.
    let _: redis::Value = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg(GROUP)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await?;

    let events = events();
    for e in &events {
        redis_streams::publish(&mut conn, &stream, e).await?;
    }
    println!(
        "published {} events for {ORDERS} orders on {stream}",
        events.len()
    );

    let mut a = spawn_worker("a", &stream, &dir, Broker::Redis)?;
    let mut b = spawn_worker("b", &stream, &dir, Broker::Redis)?;
    kill_mid_stream(&mut a, &pool).await?;
    let deadline = Instant::now() + Duration::from_secs(45);

    let parking = format!("{stream}:parked");
    loop {
        let pending: redis::streams::StreamPendingReply = redis::cmd("XPENDING")
            .arg(&stream)
            .arg(GROUP)
            .query_async(&mut conn)
            .await?;
        let groups: redis::streams::StreamInfoGroupsReply = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&stream)
            .query_async(&mut conn)
            .await?;
        let lag = groups.groups.first().and_then(|g| g.lag);
        if pending.count() == 0 && lag == Some(0) {
            break;
        }
        if Instant::now() > deadline {
            println!("gave up waiting: {} pending, lag {lag:?}", pending.count());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    b.kill()?;
    b.wait()?;

    let parked: i64 = redis::cmd("XLEN")
        .arg(&parking)
        .query_async(&mut conn)
        .await?;
    let ok = verdict(&pool, &dir, parked).await?;
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .arg(&parking)
        .query_async(&mut conn)
        .await?;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}

/// The group's committed offset per partition (partitions without one
/// left out).
fn committed(
    topic: &str,
    partitions: i32,
) -> Result<HashMap<i32, i64>, rdkafka::error::KafkaError> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{Offset, TopicPartitionList};

    let reader: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .set("group.id", GROUP)
        .create()?;
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition(topic, p);
    }
    let list = reader.committed_offsets(list, Duration::from_secs(5))?;
    Ok(list
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), o)),
            _ => None,
        })
        .collect())
}

async fn run_kafka() -> Result<bool, Box<dyn std::error::Error>> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;

    const PARTITIONS: i32 = 3;
    let suffix = format!("{:x}", std::process::id());
    let topic = format!("idem-example-orders-{suffix}");
    let dir = std::env::temp_dir().join(format!("idem-example-consumer-{suffix}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let store = settlements_table(&dir).await?;
    let pool = store.pool().clone();

    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .create()?;
    let parking = format!("{topic}.parked");
    let made = admin
        .create_topics(
            &[
                NewTopic::new(&topic, PARTITIONS, TopicReplication::Fixed(1)),
                NewTopic::new(&parking, 1, TopicReplication::Fixed(1)),
            ],
            &AdminOptions::new(),
        )
        .await?;
    for r in made {
        r.map_err(|(t, e)| format!("creating {t}: {e}"))?;
    }

    // Keyed by order, so an order's events stay in one partition, in order.
    // Where each one landed, from the broker's acknowledgements.
    let producer = kafka::producer(&kafka_brokers())?;
    let mut at: HashMap<(i32, i64), String> = HashMap::new();
    let events = events();
    for e in &events {
        let position = kafka::publish(&producer, &topic, Some(&e.order_id), e).await?;
        at.insert(position, e.order_id.clone());
    }
    println!(
        "published {} events for {ORDERS} orders on {topic} ({PARTITIONS} partitions)",
        events.len()
    );

    let mut a = spawn_worker("a", &topic, &dir, Broker::Kafka)?;
    let mut b = spawn_worker("b", &topic, &dir, Broker::Kafka)?;
    kill_mid_stream(&mut a, &pool).await?;

    // Nothing is committed past a message before it is applied: every
    // message below a committed offset has its settlement.
    let applied: BTreeSet<String> = sqlx::query_scalar("SELECT order_id FROM settlements")
        .fetch_all(&pool)
        .await?
        .into_iter()
        .collect();
    let after_kill = committed(&topic, PARTITIONS)?;
    let ahead: Vec<_> = at
        .iter()
        .filter(|((p, o), order)| {
            after_kill.get(p).is_some_and(|c| o < c) && !applied.contains(*order)
        })
        .collect();
    println!(
        "right after the kill: committed offsets {after_kill:?}; messages committed but not applied: {}",
        ahead.len()
    );

    // Until every order is settled and every partition committed past its
    // last message.
    let last: HashMap<i32, i64> = at.keys().fold(HashMap::new(), |mut m, (p, o)| {
        let top = m.entry(*p).or_insert(*o);
        *top = (*top).max(*o);
        m
    });
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let now = committed(&topic, PARTITIONS)?;
        let drained = last
            .iter()
            .all(|(p, top)| now.get(p).is_some_and(|c| c > top));
        if drained && settled(&pool).await >= ORDERS as i64 {
            break;
        }
        if Instant::now() > deadline {
            println!("gave up waiting: committed {now:?}, last offsets {last:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    b.kill()?;
    b.wait()?;

    let parked = kafka::parked(&kafka_brokers(), &parking, 1000, Duration::from_secs(2))
        .await?
        .len() as i64;
    let ok = verdict(&pool, &dir, parked).await? && ahead.is_empty();
    let _ = admin
        .delete_topics(&[&topic, &parking], &AdminOptions::new())
        .await;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ok)
}

fn main() -> ExitCode {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let args: Vec<String> = std::env::args().collect();
    let broker = |arg: Option<&String>| match arg.map(String::as_str) {
        Some("kafka") => Broker::Kafka,
        _ => Broker::Redis,
    };
    if args.get(1).map(String::as_str) == Some("worker") {
        let (name, topic, dir) = (args[2].clone(), args[3].clone(), PathBuf::from(&args[4]));
        if let Err(e) = rt.block_on(worker(name, topic, dir, broker(args.get(5)))) {
            eprintln!("worker failed: {e}");
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    let broker = broker(args.get(1));
    match rt.block_on(run(broker)) {
        Ok(true) => {
            println!("OK: every order settled exactly once");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!(
                "FAILED: an order settled twice or not at all, or an offset committed before its message was applied"
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            match broker {
                Broker::Redis => eprintln!("error: {e} (is Redis running at {}?)", redis_url()),
                Broker::Kafka => {
                    eprintln!("error: {e} (is a Kafka broker at {}?)", kafka_brokers())
                }
            }
            ExitCode::FAILURE
        }
    }
}
