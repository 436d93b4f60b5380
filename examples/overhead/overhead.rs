// One file by design: every side of every table (idem, the design's floor,
// the notes' reference flow, on Redis, PostgreSQL and MySQL) is measured by the
// same loop in the same process, so a reader checks the comparison in one
// place; splitting it would put the sides being compared in different files.
//! What idempotency costs, against the reference notes' hand-written flows,
//! on loopback Redis, PostgreSQL and MySQL (MariaDB).
//!
//! Run by hand, in release mode (it is no test and CI does not run it), best
//! against a Redis of its own so that the server counters see only this run:
//!
//! ```sh
//! redis-server --port 7399 --save '' --appendonly no --daemonize yes
//! IDEM_BENCH_REDIS_URL=redis://127.0.0.1:7399 cargo run --release -p example-overhead --example overhead
//! # knobs: IDEM_BENCH_CALLS (100000) IDEM_BENCH_CALLS_C1 (calls at c=1, default IDEM_BENCH_CALLS)
//! #        IDEM_BENCH_ROUNDS (5)
//! #        IDEM_BENCH_SQL_CALLS (10000) IDEM_BENCH_SQL_ROUNDS (3)
//! #        IDEM_BENCH_ONLY=redis|sql|pg|mysql (sql: both SQL sections)
//! #        IDEM_BENCH_MYSQL_DB (idem_bench; the scratch database, dropped before and after)
//! # one side alone, for `perf record` or a floor, printing calls/s and client CPU:
//! #        IDEM_BENCH_PROFILE=idem|floor|reference (Redis, body `pure`, or `incr` with
//! #        IDEM_BENCH_PROFILE_BODY=incr; floor = the
//! #        store's two commands with nothing around them) IDEM_BENCH_PROFILE_C (64)
//! #        IDEM_BENCH_PROFILE_SQL=a|r|b|s|p with IDEM_BENCH_ONLY=pg|mysql, IDEM_BENCH_PROFILE_C (16)
//! ```
//!
//! Every measurement is a fixed number of calls made by closed-loop callers at
//! concurrency 1, 16 and 64, every call with a fresh key (the first-execution
//! path, the one every intent takes once). Each cell is the median of several
//! rounds, the two sides of a comparison alternating which goes first so that
//! drift on a noisy machine cancels out; the ratio's spread is the lowest and
//! highest of the per-round ratios.
//!
//! - Redis, two bodies: `pure` (builds the order, no I/O) and `incr` (one real
//!   Redis round trip, an `INCR`). (a) the body alone; (b) the body under
//!   `#[idempotent]` on the Redis store; (c) a faithful port of the reference
//!   notes' Redis flow (SET NX, GET on a duplicate, SET result, SET DONE);
//!   (f) the design's floor, the store's two commands with nothing around
//!   them (`SET … NX PX … GET`, then `SET … IFEQ … PX` on Valkey ≥ 8.1 /
//!   Redis ≥ 8.4 or `complete.lua` elsewhere). The three sides take turns
//!   going first.
//!   Columns: client CPU per call (this process, user+system), server CPU per
//!   call (the redis-server process, when it runs on this machine), and round
//!   trips per call counted by the server with `MONITOR` on a separate sample
//!   (commands sent by clients; those a script runs inside the server are not
//!   round trips). `INFO commandstats` per call, by command, follows each
//!   table (a script's usec include the commands it runs, which commandstats
//!   also counts under their own names).
//! - PostgreSQL and MySQL: (a) a bare transaction inserting the order; (r) the
//!   reference's same-transaction flow (a dedup row inserted with ON CONFLICT
//!   DO NOTHING / INSERT IGNORE inside the business transaction, then the
//!   order); (b) `#[idempotent(tx = tx)]`; (s) the reference's separate-table
//!   flow on the pool (dedup row PROCESSING, the order, dedup row DONE with
//!   the result); (p) `#[idempotent]` on `PgStore` / `MySqlStore` with the
//!   order inserted on the pool. Statements per call are by construction, from
//!   the code paths each side runs on a first call.
//!
//! Machines are noisy: read the ratios, not the absolute numbers.

use std::collections::BTreeMap;
use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_runtime::idempotent;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sql::{MySqlStore, PgStore};
use redis::AsyncCommands;
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{MySql, MySqlPool, PgPool, Postgres, Transaction};

// What the benches read the same way (knobs, load, CPU from /proc).
#[path = "../benches/knobs.rs"]
mod knobs;
use knobs::{cpu_of, env, load};

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

/// The business work of the Redis cells: build the order a handler returns,
/// after one Redis round trip when `io` is set.
async fn body(io: Option<&ConnectionManager>, id: u64) -> Result<Order, BenchError> {
    if let Some(conn) = io {
        let _: u64 = conn.clone().incr("bench-body", 1).await?;
    }
    Ok(Order {
        id,
        user_id: id % 1000,
        sku: format!("SKU-{}", id % 97),
        qty: 1 + (id % 5) as u32,
        status: "CREATED".into(),
    })
}

struct Svc {
    redis: RedisStore,
    io: Option<ConnectionManager>,
}

impl Svc {
    #[idempotent(key = "run|id", scope = "bench.create", store = self.redis.clone())]
    async fn create(&self, run: u64, id: u64) -> Result<Order, BenchError> {
        body(self.io.as_ref(), id).await
    }
}

/// Measurement (c), the common hand-written flow: status and result in two
/// keys, written one after the other, with no fence.
async fn reference_flow(
    conn: &mut ConnectionManager,
    io: Option<&ConnectionManager>,
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
    let order = body(io, id).await?;
    let json = serde_json::to_string(&order).expect("order encodes");
    let _: () = conn.set_ex(format!("{key}:result"), json, TTL).await?;
    let _: () = conn.set_ex(&key, "DONE", TTL).await?;
    Ok(order)
}

/// Measurement (f), the design's floor: the store's two commands with
/// nothing around them, the claim's `SET … NX PX … GET` and the completion
/// (`SET … IFEQ … PX` where the server has it, `complete.lua` elsewhere, as
/// the store chooses). What the protocol adds is the distance from (f) to (b).
async fn floor_flow(
    conn: &mut ConnectionManager,
    io: Option<&ConnectionManager>,
    ifeq: bool,
    run: u64,
    id: u64,
) -> Result<(), BenchError> {
    static COMPLETE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
        redis::Script::new(include_str!(
            "../../idem-runtime/src/store/redis/complete.lua"
        ))
    });
    const TTL_MS: u64 = 86_400_000;
    let key = format!("bench-floor:{{{run}:{id}}}");
    let token = [7u8; 16];
    let mut rec = b"P1".to_vec();
    rec.extend_from_slice(&token);
    rec.extend_from_slice(b"-1:86400000:86370000");
    let found: Option<Vec<u8>> = redis::cmd("SET")
        .arg(&key)
        .arg(&rec)
        .arg("NX")
        .arg("PX")
        .arg(TTL_MS)
        .arg("GET")
        .query_async(conn)
        .await?;
    assert!(found.is_none());
    let order = body(io, id).await?;
    let json = serde_json::to_vec(&order).expect("order encodes");
    if ifeq {
        let mut done = b"D1".to_vec();
        done.extend_from_slice(&token);
        done.extend_from_slice(b"-1:0:");
        done.extend_from_slice(&json);
        let written: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(done)
            .arg("IFEQ")
            .arg(&rec)
            .arg("PX")
            .arg(TTL_MS)
            .query_async(conn)
            .await?;
        assert!(written.is_some());
    } else {
        let done: i64 = COMPLETE
            .key(&key)
            .arg(&token[..])
            .arg(0)
            .arg(json)
            .arg(TTL_MS)
            .invoke_async(conn)
            .await?;
        assert_eq!(done, 1);
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// SQL sides
// ---------------------------------------------------------------------------

#[idempotent(key = "run|id", scope = "bench.pg.create", tx = tx)]
async fn pg_in_tx(
    tx: &mut Transaction<'_, Postgres>,
    run: i64,
    id: i64,
) -> Result<i64, BenchError> {
    pg_insert(&mut **tx, run, id).await
}

async fn pg_insert<'e>(
    conn: impl sqlx::PgExecutor<'e>,
    run: i64,
    id: i64,
) -> Result<i64, BenchError> {
    let row: i64 = sqlx::query_scalar(
        "INSERT INTO bench_orders (run, id, sku) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(run)
    .bind(id)
    .bind(format!("SKU-{}", id % 97))
    .fetch_one(conn)
    .await?;
    Ok(row)
}

/// The reference's same-transaction flow: the dedup row and the order commit
/// together; a duplicate inserts nothing and stops.
async fn pg_reference_tx(pool: &PgPool, run: i64, id: i64) -> Result<(), BenchError> {
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query("INSERT INTO bench_dedup (k) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(format!("{run}:{id}"))
        .execute(&mut *tx)
        .await?
        .rows_affected()
        == 1;
    if !fresh {
        return Err(BenchError::InProgress);
    }
    pg_insert(&mut *tx, run, id).await?;
    tx.commit().await?;
    Ok(())
}

/// The reference's separate-table flow, on the pool: claim a dedup row, do
/// the work, store the result in it.
async fn pg_reference_separate(pool: &PgPool, run: i64, id: i64) -> Result<(), BenchError> {
    let k = format!("{run}:{id}");
    let fresh = sqlx::query(
        "INSERT INTO bench_dedup_sep (k, status) VALUES ($1, 'PROCESSING') ON CONFLICT DO NOTHING",
    )
    .bind(&k)
    .execute(pool)
    .await?
    .rows_affected()
        == 1;
    if !fresh {
        return Err(BenchError::InProgress);
    }
    let order = pg_insert(pool, run, id).await?;
    sqlx::query("UPDATE bench_dedup_sep SET status = 'DONE', result = $2 WHERE k = $1")
        .bind(&k)
        .bind(order.to_string())
        .execute(pool)
        .await?;
    Ok(())
}

struct PgSvc {
    store: PgStore,
    pool: PgPool,
}

impl PgSvc {
    #[idempotent(key = "run|id", scope = "bench.pg.store", store = self.store.clone())]
    async fn create(&self, run: i64, id: i64) -> Result<i64, BenchError> {
        pg_insert(&self.pool, run, id).await
    }
}

#[idempotent(key = "run|id", scope = "bench.my.create", tx = tx)]
async fn my_in_tx(tx: &mut Transaction<'_, MySql>, run: i64, id: i64) -> Result<i64, BenchError> {
    my_insert(&mut **tx, run, id).await
}

async fn my_insert<'e>(
    conn: impl sqlx::MySqlExecutor<'e>,
    run: i64,
    id: i64,
) -> Result<i64, BenchError> {
    sqlx::query("INSERT INTO bench_orders (run, id, sku) VALUES (?, ?, ?)")
        .bind(run)
        .bind(id)
        .bind(format!("SKU-{}", id % 97))
        .execute(conn)
        .await?;
    Ok(id)
}

async fn my_reference_tx(pool: &MySqlPool, run: i64, id: i64) -> Result<(), BenchError> {
    let mut tx = pool.begin().await?;
    let fresh = sqlx::query("INSERT IGNORE INTO bench_dedup (k) VALUES (?)")
        .bind(format!("{run}:{id}"))
        .execute(&mut *tx)
        .await?
        .rows_affected()
        == 1;
    if !fresh {
        return Err(BenchError::InProgress);
    }
    my_insert(&mut *tx, run, id).await?;
    tx.commit().await?;
    Ok(())
}

async fn my_reference_separate(pool: &MySqlPool, run: i64, id: i64) -> Result<(), BenchError> {
    let k = format!("{run}:{id}");
    let fresh =
        sqlx::query("INSERT IGNORE INTO bench_dedup_sep (k, status) VALUES (?, 'PROCESSING')")
            .bind(&k)
            .execute(pool)
            .await?
            .rows_affected()
            == 1;
    if !fresh {
        return Err(BenchError::InProgress);
    }
    let order = my_insert(pool, run, id).await?;
    sqlx::query("UPDATE bench_dedup_sep SET status = 'DONE', result = ? WHERE k = ?")
        .bind(order.to_string())
        .bind(&k)
        .execute(pool)
        .await?;
    Ok(())
}

struct MySvc {
    store: MySqlStore,
    pool: MySqlPool,
}

impl MySvc {
    #[idempotent(key = "run|id", scope = "bench.my.store", store = self.store.clone())]
    async fn create(&self, run: i64, id: i64) -> Result<i64, BenchError> {
        my_insert(&self.pool, run, id).await
    }
}

// ---------------------------------------------------------------------------
// Measuring
// ---------------------------------------------------------------------------

#[derive(Default, Clone)]
struct Cell {
    calls: u64,
    elapsed: Duration,
    p50: Duration,
    p99: Duration,
    client_cpu: Duration,
    server_cpu: Option<Duration>,
    /// commandstats deltas: name -> (calls, usec).
    commands: BTreeMap<String, (u64, u64)>,
}

impl Cell {
    fn throughput(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }

    fn per_call(&self, d: Duration) -> f64 {
        d.as_secs_f64() * 1e6 / self.calls as f64
    }
}

/// Runs `calls` calls from `concurrency` closed-loop callers; call `n` gets id `n`.
async fn measure<F, Fut>(concurrency: usize, calls: u64, call: F) -> Cell
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BenchError>> + Send,
{
    let call = Arc::new(call);
    let next = Arc::new(AtomicU64::new(0));
    let cpu_before = cpu_of("self");
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (call, next) = (call.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let id = next.fetch_add(1, Ordering::Relaxed);
                if id >= calls {
                    break;
                }
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
    let client_cpu = cpu_of("self")
        .zip(cpu_before)
        .map(|(a, b)| a - b)
        .unwrap_or_default();
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    Cell {
        calls: lat.len() as u64,
        elapsed,
        p50: pct(0.50),
        p99: pct(0.99),
        client_cpu,
        ..Cell::default()
    }
}

/// What the Redis server has done so far: its CPU (if it runs here) and its
/// commandstats.
struct ServerSnapshot {
    cpu: Option<Duration>,
    commands: BTreeMap<String, (u64, u64)>,
}

async fn server_snapshot(conn: &mut ConnectionManager, pid: &Option<String>) -> ServerSnapshot {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO");
    let mut commands = BTreeMap::new();
    for l in info.lines() {
        let Some((name, stats)) = l.strip_prefix("cmdstat_").and_then(|l| l.split_once(':')) else {
            continue;
        };
        let field = |f: &str| -> u64 {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(f)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        commands.insert(name.to_owned(), (field("calls"), field("usec")));
    }
    ServerSnapshot {
        cpu: pid.as_deref().and_then(cpu_of),
        commands,
    }
}

fn diff(before: &ServerSnapshot, after: &ServerSnapshot, cell: &mut Cell) {
    cell.server_cpu = after.cpu.zip(before.cpu).map(|(a, b)| a - b);
    for (name, (calls, usec)) in &after.commands {
        if matches!(name.as_str(), "info" | "echo" | "monitor" | "flushdb") {
            continue;
        }
        let (c0, u0) = before.commands.get(name).copied().unwrap_or_default();
        if calls > &c0 {
            cell.commands.insert(name.clone(), (calls - c0, usec - u0));
        }
    }
}

/// Counts the commands clients send while `work` runs, with a `MONITOR`
/// connection: what the server sees as requests, so the round trips. Commands
/// a script runs show up as `[db lua]` and are left out.
async fn round_trips<Fut: Future<Output = u64>>(
    addr: &str,
    marker: &mut ConnectionManager,
    work: Fut,
) -> f64 {
    let addr = addr.to_owned();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let counter = std::thread::spawn(move || {
        let mut stream = std::net::TcpStream::connect(&addr).expect("MONITOR connection");
        stream.write_all(b"MONITOR\r\n").expect("MONITOR");
        let mut lines = BufReader::new(stream).lines();
        let ok = lines
            .next()
            .expect("MONITOR answers")
            .expect("MONITOR reply");
        assert_eq!(ok, "+OK");
        ready_tx.send(()).expect("bench waits");
        let mut n = 0u64;
        for line in lines {
            let line = line.expect("MONITOR line");
            if line.contains("\"idem-bench-monitor-end\"") {
                break;
            }
            let from_script = line.split(']').next().is_some_and(|s| s.ends_with(" lua"));
            if !from_script {
                n += 1;
            }
        }
        n
    });
    ready_rx.recv().expect("MONITOR ready");
    let calls = work.await;
    let _: String = redis::cmd("ECHO")
        .arg("idem-bench-monitor-end")
        .query_async(marker)
        .await
        .expect("ECHO");
    let seen = counter.join().expect("MONITOR counter");
    seen as f64 / calls as f64
}

/// The median by throughput, and the spread of the per-round ratios of the
/// two sides.
fn median(mut cells: Vec<Cell>) -> Cell {
    cells.sort_by(|x, y| x.throughput().total_cmp(&y.throughput()));
    cells.swap_remove(cells.len() / 2)
}

fn median_of(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

fn ratio_spread(b: &[Cell], c: &[Cell]) -> (f64, f64) {
    let ratios: Vec<f64> = b
        .iter()
        .zip(c)
        .map(|(b, c)| b.throughput() / c.throughput())
        .collect();
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(0.0, f64::max);
    (lo, hi)
}

fn header(title: &str) {
    println!("\n{title}");
    println!(
        "{:<30} {:>3} {:>9} {:>9} {:>9} {:>6} {:>18} {:>9} {:>9} {:>7}",
        "",
        "c",
        "calls/s",
        "p50",
        "p99",
        "vs (a)",
        "vs ref [spread]",
        "cli us",
        "srv us",
        "RT/call"
    );
}

#[allow(clippy::too_many_arguments)]
fn row(
    name: &str,
    c: usize,
    cell: &Cell,
    base: f64,
    vs_ref: Option<(f64, (f64, f64))>,
    per_call: &str,
) {
    let vs_ref = vs_ref.map_or("-".into(), |(r, (lo, hi))| {
        format!("{r:.2} [{lo:.2}-{hi:.2}]")
    });
    let srv = cell
        .server_cpu
        .map_or("-".into(), |d| format!("{:.1}", cell.per_call(d)));
    println!(
        "{name:<30} {c:>3} {:>9.0} {:>9.1?} {:>9.1?} {:>6.3} {vs_ref:>18} {:>9.1} {srv:>9} {per_call:>7}",
        cell.throughput(),
        cell.p50,
        cell.p99,
        cell.throughput() / base,
        cell.per_call(cell.client_cpu),
    );
}

fn commands_line(name: &str, cell: &Cell) {
    let parts: Vec<String> = cell
        .commands
        .iter()
        .map(|(cmd, (calls, usec))| {
            format!(
                "{cmd} {:.2}x {:.2}us",
                *calls as f64 / cell.calls as f64,
                *usec as f64 / cell.calls as f64
            )
        })
        .collect();
    println!("    commandstats per call, {name}: {}", parts.join(", "));
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let calls: u64 = env("IDEM_BENCH_CALLS", 100_000);
    let rounds: usize = env("IDEM_BENCH_ROUNDS", 5);
    let sql_calls: u64 = env("IDEM_BENCH_SQL_CALLS", 10_000);
    let sql_rounds: usize = env("IDEM_BENCH_SQL_ROUNDS", 3);
    let only = std::env::var("IDEM_BENCH_ONLY").unwrap_or_default();
    // Keys of earlier runs must not replay into this one.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    println!("load average at start: {}", load());
    if matches!(only.as_str(), "" | "redis") {
        redis_section(run, calls, rounds).await?;
    }
    if matches!(only.as_str(), "" | "sql" | "pg") {
        pg_section(run, sql_calls, sql_rounds).await?;
    }
    if matches!(only.as_str(), "" | "sql" | "mysql") {
        mysql_section(run, sql_calls, sql_rounds).await?;
    }
    println!("\nload average at end: {}", load());
    println!(
        "ratios are throughput over (a) and over the reference; [spread] is the lowest and highest per-round ratio;\n\
         cli us / srv us: CPU microseconds per call of this process / of redis-server; RT/call: Redis requests or SQL statements per call"
    );
    Ok(())
}

async fn redis_section(
    run: u64,
    many: u64,
    rounds: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    // Concurrency 1 is the slowest cell: it may run fewer calls.
    let calls_c1: u64 = env("IDEM_BENCH_CALLS_C1", many);
    // A database of its own by default, flushed before and after: a run writes
    // hundreds of thousands of keys with a 24 h ttl.
    let redis_url =
        std::env::var("IDEM_BENCH_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/9".into());
    let client = redis::Client::open(redis_url.as_str())?;
    let addr = redis::IntoConnectionInfo::into_connection_info(redis_url.as_str())?
        .addr()
        .to_string();
    let mut admin = client.get_connection_manager().await?;
    let _: () = redis::cmd("FLUSHDB")
        .arg("ASYNC")
        .query_async(&mut admin)
        .await?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut admin)
        .await?;
    // Valkey says both; its own is the one that matters.
    let version = info
        .lines()
        .find_map(|l| {
            l.strip_prefix("valkey_version:")
                .map(|v| format!("Valkey {v}"))
        })
        .or_else(|| {
            info.lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .map(|v| format!("Redis {v}"))
        })
        .unwrap_or_else(|| "?".to_owned());
    // The server's CPU is read from /proc when it runs on this machine.
    let pid = info
        .lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .map(str::to_owned)
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.starts_with("redis-server") || c.starts_with("valkey-server"))
        });
    let io_conn = client.get_connection_manager().await?;
    let reference = client.get_connection_manager().await?;
    let store = RedisStore::connect(&redis_url).await?;

    // One side alone, for a profiler to attach to (`perf record -p`): the
    // tables above interleave both sides and cannot tell their costs apart.
    if let Ok(side) = std::env::var("IDEM_BENCH_PROFILE") {
        let c: usize = env("IDEM_BENCH_PROFILE_C", 64);
        // The body `pure` unless IDEM_BENCH_PROFILE_BODY=incr.
        let io = (std::env::var("IDEM_BENCH_PROFILE_BODY").as_deref() == Ok("incr"))
            .then(|| io_conn.clone());
        let svc = Arc::new(Svc {
            redis: store.clone(),
            io: io.clone(),
        });
        let cell = if side == "floor" {
            // The store's two commands with nothing around them: what the
            // protocol costs is the distance from here to `idem`.
            let (r, ifeq) = (reference.clone(), store.completes_with_set_ifeq());
            measure(c, many, move |id| {
                let (mut r, io) = (r.clone(), io.clone());
                async move { floor_flow(&mut r, io.as_ref(), ifeq, run, id).await }
            })
            .await
        } else if side == "reference" {
            let r = reference.clone();
            measure(c, many, move |id| {
                let (mut r, io) = (r.clone(), io.clone());
                async move { reference_flow(&mut r, io.as_ref(), run, id).await.map(drop) }
            })
            .await
        } else {
            measure(c, many, move |id| {
                let s = svc.clone();
                async move { s.create(run, id).await.map(drop) }
            })
            .await
        };
        println!(
            "{side} alone, c={c}: {:.0} calls/s, client {:.1} us/call",
            cell.throughput(),
            cell.per_call(cell.client_cpu)
        );
        return Ok(());
    }

    for (b, io) in [("pure", None), ("incr", Some(io_conn.clone()))]
        .into_iter()
        .enumerate()
    {
        let (body_name, io) = io;
        let svc = Arc::new(Svc {
            redis: store.clone(),
            io: io.clone(),
        });
        header(&format!(
            "{version} (loopback), body `{body_name}`, fresh key per call, {many} calls ({calls_c1} at c=1) x {rounds} rounds"
        ));
        let mut details = Vec::new();
        for (cell, c) in [1usize, 16, 64].into_iter().enumerate() {
            let calls = if c == 1 { calls_c1 } else { many };
            let io_a = io.clone();
            let a = measure(c, calls, move |id| {
                let io = io_a.clone();
                async move {
                    std::hint::black_box(body(io.as_ref(), id).await?);
                    Ok(())
                }
            })
            .await;
            let (mut bs, mut cs, mut fs) = (Vec::new(), Vec::new(), Vec::new());
            let ifeq = store.completes_with_set_ifeq();
            for round in 0..rounds {
                // Ids restart in every measurement: give each its own keys.
                let run = run * 1000 + b as u64 * 100 + cell as u64 * 10 + round as u64;
                // The three sides take turns going first.
                for which in [0usize, 1, 2].map(|k| (k + round) % 3) {
                    let before = server_snapshot(&mut admin, &pid).await;
                    let mut measured = match which {
                        0 => {
                            let s = svc.clone();
                            measure(c, calls, move |id| {
                                let s = s.clone();
                                async move { s.create(run, id).await.map(drop) }
                            })
                            .await
                        }
                        1 => {
                            let (r, io) = (reference.clone(), io.clone());
                            measure(c, calls, move |id| {
                                let (mut r, io) = (r.clone(), io.clone());
                                async move {
                                    reference_flow(&mut r, io.as_ref(), run, id).await.map(drop)
                                }
                            })
                            .await
                        }
                        _ => {
                            let (r, io) = (reference.clone(), io.clone());
                            measure(c, calls, move |id| {
                                let (mut r, io) = (r.clone(), io.clone());
                                async move { floor_flow(&mut r, io.as_ref(), ifeq, run, id).await }
                            })
                            .await
                        }
                    };
                    let after = server_snapshot(&mut admin, &pid).await;
                    diff(&before, &after, &mut measured);
                    match which {
                        0 => bs.push(measured),
                        1 => cs.push(measured),
                        _ => fs.push(measured),
                    }
                }
            }
            // Round trips on a sample of their own, at concurrency 1.
            let sample = 2000;
            let rt_run = run * 1000 + 900 + b as u64 * 10 + cell as u64;
            let s = svc.clone();
            let b_rt = round_trips(&addr, &mut admin, async move {
                for id in 0..sample {
                    s.create(rt_run, id).await.expect("call");
                }
                sample
            })
            .await;
            let (mut r, io_c) = (reference.clone(), io.clone());
            let c_rt = round_trips(&addr, &mut admin, async move {
                for id in 0..sample {
                    reference_flow(&mut r, io_c.as_ref(), rt_run, id)
                        .await
                        .expect("call");
                }
                sample
            })
            .await;
            let spread = ratio_spread(&bs, &cs);
            let floor_spread = ratio_spread(&bs, &fs);
            let fm_ref = ratio_spread(&fs, &cs);
            let b_over_f: Vec<f64> = bs
                .iter()
                .zip(&fs)
                .map(|(b, f)| b.throughput() / f.throughput())
                .collect();
            let f_over_c: Vec<f64> = fs
                .iter()
                .zip(&cs)
                .map(|(f, c)| f.throughput() / c.throughput())
                .collect();
            let (bm, cm, fm) = (median(bs), median(cs), median(fs));
            let (ta, tc) = (a.throughput(), cm.throughput());
            let body_rt = if io.is_some() { "1" } else { "0" };
            row("(a) body alone", c, &a, ta, None, body_rt);
            row(
                "(b) #[idempotent] + Redis",
                c,
                &bm,
                ta,
                Some((bm.throughput() / tc, spread)),
                &format!("{b_rt:.2}"),
            );
            row(
                "(c) reference Redis flow",
                c,
                &cm,
                ta,
                None,
                &format!("{c_rt:.2}"),
            );
            row(
                "(f) floor: the 2 commands",
                c,
                &fm,
                ta,
                Some((fm.throughput() / tc, fm_ref)),
                "2.00",
            );
            println!(
                "    (b) / (f) = {:.2} [{:.2}-{:.2}] (median of rounds {:.2}); (f) / (c) median of rounds {:.2}",
                bm.throughput() / fm.throughput(),
                floor_spread.0,
                floor_spread.1,
                median_of(b_over_f),
                median_of(f_over_c),
            );
            details.push((c, bm, cm, fm));
        }
        for (c, bm, cm, fm) in &details {
            commands_line(&format!("(b) c={c}"), bm);
            commands_line(&format!("(c) c={c}"), cm);
            commands_line(&format!("(f) c={c}"), fm);
        }
    }
    let _: () = redis::cmd("FLUSHDB")
        .arg("ASYNC")
        .query_async(&mut admin)
        .await?;
    Ok(())
}

/// Runs the five sides in alternating order for `rounds` rounds at each
/// concurrency and prints them against the bare transaction; (b) is compared
/// with (r), (p) with (s).
async fn sql_table(
    title: &str,
    calls: u64,
    rounds: usize,
    base_run: i64,
    sides: [(&str, &str, Side); 5],
) {
    header(title);
    // One side alone, for a profiler (as IDEM_BENCH_PROFILE does for Redis).
    if let Ok(which) = std::env::var("IDEM_BENCH_PROFILE_SQL") {
        let c: usize = env("IDEM_BENCH_PROFILE_C", 16);
        for (name, _, f) in sides
            .iter()
            .filter(|s| s.0.starts_with(&format!("({which})")))
        {
            let f = f.clone();
            let m = measure(c, calls, move |id| f(base_run, id)).await;
            println!(
                "{name} alone, c={c}: {:.0} calls/s, client {:.1} us/call",
                m.throughput(),
                m.per_call(m.client_cpu)
            );
        }
        return;
    }
    for (cell, c) in [1usize, 16, 64].into_iter().enumerate() {
        let mut results: Vec<Vec<Cell>> = vec![Vec::new(); sides.len()];
        for round in 0..rounds {
            let order: Vec<usize> = if round % 2 == 0 {
                (0..sides.len()).collect()
            } else {
                (0..sides.len()).rev().collect()
            };
            for i in order {
                let run = base_run * 10_000 + (cell * 1000 + round * 10 + i) as i64;
                let f = sides[i].2.clone();
                let m = measure(c, calls, move |id| f(run, id)).await;
                results[i].push(m);
            }
        }
        let spreads = [
            ratio_spread(&results[2], &results[1]),
            ratio_spread(&results[4], &results[3]),
        ];
        let medians: Vec<Cell> = results.into_iter().map(median).collect();
        let base = medians[0].throughput();
        for (i, (name, statements, _)) in sides.iter().enumerate() {
            let vs = match i {
                2 => Some((
                    medians[2].throughput() / medians[1].throughput(),
                    spreads[0],
                )),
                4 => Some((
                    medians[4].throughput() / medians[3].throughput(),
                    spreads[1],
                )),
                _ => None,
            };
            row(name, c, &medians[i], base, vs, statements);
        }
    }
}

type Side = Arc<
    dyn Fn(i64, u64) -> std::pin::Pin<Box<dyn Future<Output = Result<(), BenchError>> + Send>>
        + Send
        + Sync,
>;

fn side<F, Fut>(f: F) -> Side
where
    F: Fn(i64, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BenchError>> + Send + 'static,
{
    Arc::new(move |run, id| Box::pin(f(run, id)))
}

async fn pg_section(run: u64, calls: u64, rounds: usize) -> Result<(), Box<dyn std::error::Error>> {
    let pg_url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    // A schema of its own, dropped afterwards: a run inserts many rows.
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
    let store = PgStore::builder().pool(pool.clone()).await?; // runs the idem migrations once
    for ddl in [
        "CREATE TABLE bench_orders (run BIGINT NOT NULL, id BIGINT NOT NULL, sku TEXT NOT NULL, PRIMARY KEY (run, id))",
        "CREATE TABLE bench_dedup (k TEXT PRIMARY KEY)",
        "CREATE TABLE bench_dedup_sep (k TEXT PRIMARY KEY, status TEXT NOT NULL, result TEXT)",
    ] {
        sqlx::query(ddl).execute(&pool).await?;
    }
    let svc = Arc::new(PgSvc {
        store,
        pool: pool.clone(),
    });
    let p = pool.clone();
    let bare = side(move |run, id| {
        let p = p.clone();
        async move {
            let mut tx = p.begin().await?;
            pg_insert(&mut *tx, run, id as i64).await?;
            tx.commit().await?;
            Ok(())
        }
    });
    let p = pool.clone();
    let reference_tx = side(move |run, id| {
        let p = p.clone();
        async move { pg_reference_tx(&p, run, id as i64).await }
    });
    let p = pool.clone();
    let idem_tx = side(move |run, id| {
        let p = p.clone();
        async move {
            let mut tx = p.begin().await?;
            pg_in_tx(&mut tx, run, id as i64).await?;
            tx.commit().await?;
            Ok(())
        }
    });
    let p = pool.clone();
    let reference_sep = side(move |run, id| {
        let p = p.clone();
        async move { pg_reference_separate(&p, run, id as i64).await }
    });
    let s = svc.clone();
    let idem_store = side(move |run, id| {
        let s = s.clone();
        async move { s.create(run, id as i64).await.map(drop) }
    });
    sql_table(
        &format!("PostgreSQL (loopback), one order per call, {calls} calls x {rounds} rounds"),
        calls,
        rounds,
        run as i64 % 100_000_000,
        [
            // BEGIN, INSERT order, COMMIT
            ("(a) bare transaction", "3", bare),
            // BEGIN, INSERT dedup ON CONFLICT DO NOTHING, INSERT order, COMMIT
            ("(r) reference, same tx", "4", reference_tx),
            // BEGIN, claim upsert, INSERT order, complete UPDATE, COMMIT
            ("(b) tx = tx", "5", idem_tx),
            // INSERT dedup, INSERT order, UPDATE dedup (each autocommit)
            ("(s) reference, separate table", "3", reference_sep),
            // claim upsert, INSERT order, complete UPDATE (each autocommit)
            ("(p) #[idempotent] + PgStore", "3", idem_store),
        ],
    )
    .await;
    pool.close().await;
    sqlx::query("DROP SCHEMA IF EXISTS idem_bench CASCADE")
        .execute(&admin)
        .await?;
    Ok(())
}

async fn mysql_section(
    run: u64,
    calls: u64,
    rounds: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("IDEM_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    // A database of its own, dropped afterwards. Two runs at once on one
    // server need a name each (IDEM_BENCH_MYSQL_DB): each drops its own first.
    let db: String = env("IDEM_BENCH_MYSQL_DB", "idem_bench".to_owned());
    if db.is_empty() || !db.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("IDEM_BENCH_MYSQL_DB={db:?}: letters, digits and '_' only").into());
    }
    let admin = MySqlPool::connect(&url).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {db}"))
        .execute(&admin)
        .await?;
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&admin)
        .await?;
    let options = MySqlConnectOptions::from_str(&url)?.database(&db);
    let pool = MySqlPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await?;
    let store = MySqlStore::builder().pool(pool.clone()).await?;
    for ddl in [
        "CREATE TABLE bench_orders (run BIGINT NOT NULL, id BIGINT NOT NULL, sku VARCHAR(32) NOT NULL, PRIMARY KEY (run, id))",
        "CREATE TABLE bench_dedup (k VARCHAR(64) PRIMARY KEY)",
        "CREATE TABLE bench_dedup_sep (k VARCHAR(64) PRIMARY KEY, status VARCHAR(16) NOT NULL, result TEXT)",
    ] {
        sqlx::query(ddl).execute(&pool).await?;
    }
    let svc = Arc::new(MySvc {
        store,
        pool: pool.clone(),
    });
    let p = pool.clone();
    let bare = side(move |run, id| {
        let p = p.clone();
        async move {
            let mut tx = p.begin().await?;
            my_insert(&mut *tx, run, id as i64).await?;
            tx.commit().await?;
            Ok(())
        }
    });
    let p = pool.clone();
    let reference_tx = side(move |run, id| {
        let p = p.clone();
        async move { my_reference_tx(&p, run, id as i64).await }
    });
    let p = pool.clone();
    let idem_tx = side(move |run, id| {
        let p = p.clone();
        async move {
            let mut tx = p.begin().await?;
            my_in_tx(&mut tx, run, id as i64).await?;
            tx.commit().await?;
            Ok(())
        }
    });
    let p = pool.clone();
    let reference_sep = side(move |run, id| {
        let p = p.clone();
        async move { my_reference_separate(&p, run, id as i64).await }
    });
    let s = svc.clone();
    let idem_store = side(move |run, id| {
        let s = s.clone();
        async move { s.create(run, id as i64).await.map(drop) }
    });
    sql_table(
        &format!("MySQL/MariaDB (loopback), one order per call, {calls} calls x {rounds} rounds"),
        calls,
        rounds,
        run as i64 % 100_000_000,
        [
            // BEGIN, INSERT order, COMMIT
            ("(a) bare transaction", "3", bare),
            // BEGIN, INSERT IGNORE dedup, INSERT order, COMMIT
            ("(r) reference, same tx", "4", reference_tx),
            // BEGIN, read, claim upsert, INSERT order, complete UPDATE, COMMIT
            ("(b) tx = tx", "6", idem_tx),
            // INSERT IGNORE dedup, INSERT order, UPDATE dedup (each autocommit)
            ("(s) reference, separate table", "3", reference_sep),
            // read, claim upsert, INSERT order, complete UPDATE (each autocommit)
            ("(p) #[idempotent] + MySqlStore", "4", idem_store),
        ],
    )
    .await;
    pool.close().await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {db}"))
        .execute(&admin)
        .await?;
    Ok(())
}
