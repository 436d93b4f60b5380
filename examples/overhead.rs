//! What idempotency costs, measured on loopback Redis and PostgreSQL.
//!
//! Run by hand, in release mode (it is no test and CI does not run it):
//!
//! ```sh
//! cargo run --release --example overhead                # 3 rounds of 2 s per cell
//! IDEM_BENCH_SECS=5 IDEM_BENCH_ROUNDS=5 cargo run --release --example overhead
//! ```
//!
//! Each cell runs closed-loop callers at concurrency 1, 16 and 64 for a fixed
//! time, every call with a fresh key (the first-execution path, the one every
//! intent takes once), and reports throughput, p50 and p99 latency, and ratios
//! measured in the same run. Each cell is the median of several rounds, run in
//! alternating order, because this machine is noisy:
//!
//! - Redis: (a) the body alone; (b) the body under `#[idempotent]` on the Redis
//!   store; (c) the common hand-written Redis flow that idem replaces (SET NX
//!   a PROCESSING marker, GET on a duplicate, SET result, SET DONE). Round trips per call are
//!   counted by the server (`INFO commandstats`, client commands only), not assumed.
//! - PostgreSQL: (a) a bare transaction inserting the order; (b) the same
//!   transaction with the claim and the record inside it (`tx = tx`).
//!
//! Machines are noisy: read the ratios, not the absolute numbers.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_runtime::idempotent;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sql::postgres::PgStore;
use redis::AsyncCommands;
use serde::{Deserialize, Serialize};
use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Transaction};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: u64,
    user_id: u64,
    sku: String,
    qty: u32,
    status: String,
}

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("in progress")]
    InProgress,
}

/// The business work of the Redis cells: build the order a handler returns.
/// No I/O, so every difference between the cells is idempotency overhead.
fn body(id: u64) -> Order {
    Order {
        id,
        user_id: id % 1000,
        sku: format!("SKU-{}", id % 97),
        qty: 1 + (id % 5) as u32,
        status: "CREATED".into(),
    }
}

struct Svc {
    redis: RedisStore,
}

impl Svc {
    #[idempotent(key = "run|id", scope = "bench.create", store = self.redis.clone())]
    async fn create(&self, run: u64, id: u64) -> Result<Order, BenchError> {
        Ok(body(id))
    }
}

/// Measurement (c), the common hand-written flow: status and result in two
/// keys, written one after the other, with no fence.
async fn reference_flow(
    conn: &mut redis::aio::ConnectionManager,
    run: u64,
    id: u64,
) -> Result<Order, BenchError> {
    const TTL: u64 = 24 * 3600;
    let key = format!("bench-ref:{run}:{id}");
    let claimed: bool = redis::cmd("SET")
        .arg(&key)
        .arg("PROCESSING")
        .arg("NX")
        .arg("EX")
        .arg(TTL)
        .query_async::<Option<String>>(conn)
        .await?
        .is_some();
    if !claimed {
        let status: Option<String> = conn.get(&key).await?;
        if status.as_deref() == Some("PROCESSING") {
            return Err(BenchError::InProgress);
        }
        let result: String = conn.get(format!("{key}:result")).await?;
        return Ok(serde_json::from_str(&result).expect("stored order"));
    }
    let order = body(id);
    let json = serde_json::to_string(&order).expect("order encodes");
    let _: () = conn.set_ex(format!("{key}:result"), json, TTL).await?;
    let _: () = conn.set_ex(&key, "DONE", TTL).await?;
    Ok(order)
}

#[idempotent(key = "run|id", scope = "bench.pg.create", tx = tx)]
async fn insert_in_tx(
    tx: &mut Transaction<'_, Postgres>,
    run: i64,
    id: i64,
) -> Result<i64, BenchError> {
    insert_order(tx, run, id).await
}

async fn insert_order(
    tx: &mut Transaction<'_, Postgres>,
    run: i64,
    id: i64,
) -> Result<i64, BenchError> {
    let row: i64 = sqlx::query_scalar(
        "INSERT INTO bench_orders (run, id, sku) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(run)
    .bind(id)
    .bind(format!("SKU-{}", id % 97))
    .fetch_one(&mut **tx)
    .await?;
    Ok(row)
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

/// Runs `concurrency` closed-loop callers for `secs`; call `n` gets id `n`.
async fn measure<F, Fut>(concurrency: usize, secs: Duration, call: F) -> Cell
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BenchError>> + Send,
{
    let call = Arc::new(call);
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + secs;
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (call, next) = (call.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let id = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let t = Instant::now();
                call(id).await.expect("call failed");
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.expect("caller panicked"));
    }
    let elapsed = started.elapsed();
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    Cell {
        calls: lat.len() as u64,
        elapsed,
        p50: pct(0.50),
        p99: pct(0.99),
    }
}

/// Client requests the server has answered so far, by command name. Commands a
/// Lua script runs inside one EVALSHA are not round trips, so they are left out.
async fn round_trips(conn: &mut redis::aio::ConnectionManager) -> u64 {
    const CLIENT_COMMANDS: &[&str] = &["evalsha", "eval", "script", "set", "get", "setex"];
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    info.lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| l.split_once(':'))
        .filter(|(name, _)| CLIENT_COMMANDS.contains(name))
        .filter_map(|(_, stats)| {
            stats
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// The measurement with the median throughput, and its round trips per call.
fn median(mut cells: Vec<(Cell, f64)>) -> (Cell, f64) {
    cells.sort_by(|x, y| x.0.throughput().total_cmp(&y.0.throughput()));
    cells.swap_remove(cells.len() / 2)
}

fn row(name: &str, c: usize, cell: &Cell, base: f64, reference: Option<f64>, per_call: &str) {
    let vs_ref = reference.map_or("     -".into(), |r| {
        format!("{:6.2}", cell.throughput() / r)
    });
    println!(
        "{name:<28} {c:>3} {:>10.0} {:>9.1?} {:>9.1?} {:>7.3} {vs_ref} {per_call:>8}",
        cell.throughput(),
        cell.p50,
        cell.p99,
        cell.throughput() / base,
    );
}

fn header(title: &str) {
    println!("\n{title}");
    println!(
        "{:<28} {:>3} {:>10} {:>9} {:>9} {:>7} {:>6} {:>8}",
        "", "c", "calls/s", "p50", "p99", "vs (a)", "vs (c)", "RT/call"
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let secs = Duration::from_secs_f64(
        std::env::var("IDEM_BENCH_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2.0),
    );
    let rounds: usize = std::env::var("IDEM_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    // A database of its own on the shared server, flushed before and after: a
    // run writes hundreds of thousands of keys with a 24 h ttl.
    let redis_url =
        std::env::var("IDEM_BENCH_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/9".into());
    let pg_url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    // Keys of earlier runs must not replay into this one.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;

    let client = redis::Client::open(redis_url.as_str())?;
    let mut counter = client.get_connection_manager().await?;
    let _: () = redis::cmd("FLUSHDB")
        .arg("ASYNC")
        .query_async(&mut counter)
        .await?;
    let svc = Arc::new(Svc {
        redis: RedisStore::connect(&redis_url).await?,
    });
    let reference = client.get_connection_manager().await?;

    header("Redis (loopback), fresh key per call");
    for (cell, c) in [1usize, 16, 64].into_iter().enumerate() {
        let a = measure(c, secs, |id| async move {
            std::hint::black_box(body(id));
            Ok(())
        })
        .await;
        let (mut bs, mut cs) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            // Ids restart in every measurement: give each its own keys.
            let run = run * 100 + cell as u64 * 10 + round as u64;
            // Alternate which goes first, so drift on a noisy machine cancels out.
            for which in [round % 2, 1 - round % 2] {
                let before = round_trips(&mut counter).await;
                let measured = if which == 0 {
                    let s = svc.clone();
                    measure(c, secs, move |id| {
                        let s = s.clone();
                        async move { s.create(run, id).await.map(drop) }
                    })
                    .await
                } else {
                    let r = reference.clone();
                    measure(c, secs, move |id| {
                        let mut r = r.clone();
                        async move { reference_flow(&mut r, run, id).await.map(drop) }
                    })
                    .await
                };
                let trips = round_trips(&mut counter).await - before;
                let per_call = trips as f64 / measured.calls as f64;
                if which == 0 {
                    bs.push((measured, per_call));
                } else {
                    cs.push((measured, per_call));
                }
            }
        }
        let (b, b_trips) = median(bs);
        let (cref, c_trips) = median(cs);
        let (ta, tc) = (a.throughput(), cref.throughput());
        row("(a) body alone", c, &a, ta, None, "0");
        let b_trips = format!("{b_trips:.2}");
        let c_trips = format!("{c_trips:.2}");
        row("(b) #[idempotent] + Redis", c, &b, ta, Some(tc), &b_trips);
        row("(c) reference Redis flow", c, &cref, ta, Some(tc), &c_trips);
    }

    let _: () = redis::cmd("FLUSHDB")
        .arg("ASYNC")
        .query_async(&mut counter)
        .await?;

    // A schema of its own, dropped afterwards, for the same reason.
    let admin = PgPool::connect(&pg_url).await?;
    sqlx::query("DROP SCHEMA IF EXISTS idem_bench CASCADE")
        .execute(&admin)
        .await?;
    sqlx::query("CREATE SCHEMA idem_bench")
        .execute(&admin)
        .await?;
    let options = PgConnectOptions::from_str(&pg_url)?.options([("search_path", "idem_bench")]);
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await?;
    PgStore::builder().pool(pool.clone()).await?; // runs the idem migrations once
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_orders (
             run BIGINT NOT NULL, id BIGINT NOT NULL, sku TEXT NOT NULL, PRIMARY KEY (run, id))",
    )
    .execute(&pool)
    .await?;

    header("PostgreSQL (loopback), one order insert per transaction");
    for (cell, c) in [1usize, 16, 64].into_iter().enumerate() {
        let (mut bare, mut with_tx) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let pg_run = ((run * 100 + cell as u64 * 10 + round as u64) * 2) as i64;
            for which in [round % 2, 1 - round % 2] {
                let p = pool.clone();
                if which == 0 {
                    let m = measure(c, secs, move |id| {
                        let p = p.clone();
                        async move {
                            let mut tx = p.begin().await?;
                            insert_order(&mut tx, pg_run, id as i64).await?;
                            tx.commit().await?;
                            Ok(())
                        }
                    })
                    .await;
                    bare.push((m, 3.0));
                } else {
                    let m = measure(c, secs, move |id| {
                        let p = p.clone();
                        async move {
                            let mut tx = p.begin().await?;
                            insert_in_tx(&mut tx, pg_run + 1, id as i64).await?;
                            tx.commit().await?;
                            Ok(())
                        }
                    })
                    .await;
                    with_tx.push((m, 5.0));
                }
            }
        }
        let (bare, _) = median(bare);
        let (with_tx, _) = median(with_tx);
        let base = bare.throughput();
        // Statements per call, by construction: BEGIN, INSERT, COMMIT; with idem
        // the claim upsert and the completing UPDATE join them.
        row("(a) bare transaction", c, &bare, base, None, "3");
        row("(b) tx = tx (same tx)", c, &with_tx, base, None, "5");
    }
    println!(
        "\nratios are throughput over (a) and over (c); RT/call counts Redis commands or SQL statements"
    );
    Ok(())
}
