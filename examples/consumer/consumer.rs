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
//! Run: `cargo run -p example-consumer --example consumer`

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

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

/// One consumer process: settles until killed, writing its counters after
/// every message.
async fn worker(
    name: String,
    stream: String,
    dir: PathBuf,
) -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::open(dir.join("settle.db")).await?;
    let pool = store.pool().clone();
    let client = redis::Client::open(redis_url())?;
    let mut source = RedisStreamsSource::builder(&stream, GROUP, &name)
        // A dead consumer's entries move on after 2 s of silence.
        .claim_idle(Duration::from_secs(2))
        .block(Duration::from_millis(200))
        .connect(&client)
        .await?;
    let runner = Runner::new().in_progress_delay(Duration::from_millis(300));
    // The runner begins the transaction, commits it on `Ok` (then acks) and
    // rolls it back on `Err` (then redelivers): no begin/commit here.
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

fn spawn_worker(name: &str, stream: &str, dir: &Path) -> std::io::Result<Child> {
    Command::new(std::env::current_exe()?)
        .args(["worker", name, stream])
        .arg(dir)
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

async fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let suffix = format!("{:x}", std::process::id());
    let stream = format!("idem-example-orders-{suffix}");
    let dir = std::env::temp_dir().join(format!("idem-example-consumer-{suffix}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;

    let store = SqliteStore::open(dir.join("settle.db")).await?;
    let pool = store.pool().clone();
    sqlx::query(
        "CREATE TABLE settlements (order_id TEXT NOT NULL, amount_cents INTEGER NOT NULL, worker TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;

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

    // Every 3rd order is published twice, so 50 of the 200 events are duplicates.
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
    for e in &events {
        redis_streams::publish(&mut conn, &stream, e).await?;
    }
    println!(
        "published {} events for {ORDERS} orders on {stream}",
        events.len()
    );

    let mut a = spawn_worker("a", &stream, &dir)?;
    let mut b = spawn_worker("b", &stream, &dir)?;

    let deadline = Instant::now() + Duration::from_secs(45);
    while settled(&pool).await < (ORDERS / 4) as i64 {
        if Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.kill()?; // SIGKILL: no ack, no goodbye
    a.wait()?;
    println!(
        "killed consumer a (SIGKILL) after {} settlements",
        settled(&pool).await
    );

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

    let [ad, ap, ax, ar, aparked] = read_stats(&dir, "a");
    let [bd, bp, bx, br, bparked] = read_stats(&dir, "b");
    println!("            delivered processed deduplicated redelivered parked");
    println!(
        "consumer a  {ad:>9} {ap:>9} {ax:>12} {ar:>11} {aparked:>6}   (its last report before the kill)"
    );
    println!("consumer b  {bd:>9} {bp:>9} {bx:>12} {br:>11} {bparked:>6}");

    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, COUNT(*) FROM settlements GROUP BY order_id")
            .fetch_all(&pool)
            .await?;
    let parked: i64 = redis::cmd("XLEN")
        .arg(&parking)
        .query_async(&mut conn)
        .await?;
    let expected: std::collections::BTreeSet<String> =
        (0..ORDERS).map(|i| format!("order-{i:04}")).collect();
    let got: std::collections::BTreeSet<String> = rows.iter().map(|(o, _)| o.clone()).collect();
    let missing = expected.difference(&got).count();
    let twice = rows.iter().filter(|(_, n)| *n != 1).count();
    println!(
        "settlements: {} rows for {ORDERS} orders; missing {missing}, settled twice {twice}, parked {parked}",
        rows.len()
    );

    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .arg(&parking)
        .query_async(&mut conn)
        .await?;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(missing == 0 && twice == 0 && parked == 0 && rows.len() == ORDERS)
}

fn main() -> ExitCode {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        let (name, stream, dir) = (args[2].clone(), args[3].clone(), PathBuf::from(&args[4]));
        if let Err(e) = rt.block_on(worker(name, stream, dir)) {
            eprintln!("worker failed: {e}");
            return ExitCode::FAILURE;
        }
        return ExitCode::SUCCESS;
    }
    match rt.block_on(run()) {
        Ok(true) => {
            println!("OK: every order settled exactly once");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("FAILED: an order settled twice or not at all");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e} (is Redis running at {}?)", redis_url());
            ExitCode::FAILURE
        }
    }
}
