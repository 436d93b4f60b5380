// One file by design, like examples/overhead: the sides compared (the bare
// route, the layer on memory and on Redis) and the layer's steps timed alone
// are measured by the same loops in one place. The step timings use copies of
// private pieces of `idem-runtime/src/http/` (marked where they are): they
// time what the layer did at the commit the README's figures name, and go
// stale when the layer changes, so update them with it.
//! The `Idempotency-Key` layer's own cost: an axum route under
//! `IdempotencyLayer` against the same route bare, over loopback HTTP/1.1
//! keep-alive, and then its pieces timed alone, without sockets.
//!
//! Run by hand, in release mode (CI builds it under clippy and never runs it):
//!
//! ```sh
//! cargo bench -p idem-benches --bench http
//! # a quick run:
//! IDEM_BENCH_REQUESTS=2000 IDEM_BENCH_ROUNDS=1 cargo bench -p idem-benches --bench http
//! # knobs: IDEM_BENCH_REQUESTS (100000 per cell) IDEM_BENCH_REQUESTS_C1 (20000)
//! #        IDEM_BENCH_ROUNDS (3) IDEM_BENCH_CONCURRENCY (1,16) IDEM_BENCH_SIDES (a,b,c,d)
//! #        IDEM_BENCH_SERVER_THREADS (2) IDEM_BENCH_CLIENT_THREADS (2) IDEM_REDIS_URL
//! #        IDEM_BENCH_ONLY=http|stages (both) IDEM_BENCH_STAGE_ITERS (50000)
//! #        IDEM_BENCH_STAGE_ONLY=a|b|c (one stage loop alone, for callgrind)
//! # one side alone, for a profiler (perf record -p <pid>):
//! #        IDEM_BENCH_PROFILE=a|b|c|d IDEM_BENCH_PROFILE_C (16) IDEM_BENCH_PROFILE_SECS (20)
//! ```
//!
//! The server is axum on 127.0.0.1 with one JSON POST handler (reads
//! `{"user_id", "sku", "qty"}`, answers 201 with the order it built); the
//! clients are one reqwest `Client` (keep-alive, a connection per concurrent
//! caller), closed loop. Sides:
//!
//! - (a) the bare route;
//! - (b) the route under `IdempotencyLayer` on `MemoryStore`, a fresh
//!   `Idempotency-Key` per request (the first execution);
//! - (c) the same layer, every request a key already used (a replay: 1 024
//!   keys, used once before the first cell, sent again in turn);
//! - (d) (b) on `RedisStore` (a key prefix of its own, records kept 10 min).
//!
//! Server and clients are in this process but on two tokio runtimes, so the
//! server's CPU is read apart from the clients': every thread of the server's
//! runtime registers its CPU clock at start, and a cell's server CPU is the
//! sum of their advance; "process" is `getrusage(RUSAGE_SELF)`. The server's
//! CPU per request of (a) is the floor the layer adds to (axum, hyper, the
//! handler). Rounds alternate the order of the sides; cells are medians, the
//! spread is the lowest and highest per-round ratio.
//!
//! The stages (`IDEM_BENCH_ONLY=stages`) run on one thread with no sockets:
//! the router driven with `tower::ServiceExt::oneshot`, and each step the
//! layer takes, copied from `idem-runtime/src/http/layer.rs` and `stored.rs`
//! with the same crates, timed alone in the thread's CPU time.
//!
//! The medians go to `benchmarks/data/http.csv` (see `figures.rs`;
//! `IDEM_BENCH_CSV=off` for a quick run): the table `sockets`, and `stages`.
//!
//! Machines are noisy: read the ratios, not the absolute numbers.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{
    HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, header,
};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, body::Bytes};
use http_body_util::{BodyExt, Either, Full, Limited};
use idem_runtime::http::{IdempotencyLayer, KeyRules};
use idem_runtime::protocol::{self, Kind, Spec, StoredForm};
use idem_runtime::store::StoreRef;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::{Fingerprint, Key};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tower::ServiceExt;

#[path = "knobs.rs"]
mod knobs;
use knobs::*;
#[path = "figures.rs"]
mod figures;
use figures::Csv;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

// ---------------------------------------------------------------------------
// The service
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize, Deserialize)]
struct NewOrder {
    user_id: u64,
    sku: String,
    qty: u32,
}

#[derive(Debug, Serialize, Deserialize)]
struct Order {
    id: u64,
    user_id: u64,
    sku: String,
    qty: u32,
    status: &'static str,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn build_order(req: NewOrder) -> Order {
    Order {
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        user_id: req.user_id,
        sku: req.sku,
        qty: req.qty,
        status: "placed",
    }
}

async fn create(Json(req): Json<NewOrder>) -> (StatusCode, Json<Order>) {
    (StatusCode::CREATED, Json(build_order(req)))
}

fn request_body(i: u64) -> String {
    format!(r#"{{"user_id":{i},"sku":"A-{}","qty":2}}"#, i % 97)
}

const SCOPE: &str = "bench.http.orders";

fn layer(store: StoreRef) -> IdempotencyLayer {
    IdempotencyLayer::new()
        .store(store)
        .scope(SCOPE)
        .ttl(Duration::from_secs(600))
}

/// `/bare`, `/mem` and `/redis`: the same handler, bare and under the layer
/// on each store.
fn app(memory: StoreRef, redis: Option<StoreRef>) -> Router {
    let mut app = Router::new().route("/bare", post(create)).merge(
        Router::new()
            .route("/mem", post(create))
            .layer(layer(memory)),
    );
    if let Some(redis) = redis {
        app = app.merge(
            Router::new()
                .route("/redis", post(create))
                .layer(layer(redis)),
        );
    }
    app
}

// ---------------------------------------------------------------------------
// CPU clocks
// ---------------------------------------------------------------------------

fn clock(id: libc::clockid_t) -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; an id of a thread that has
    // exited makes the call fail, which is answered with `None`.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    (rc == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

fn thread_cpu() -> Duration {
    clock(libc::CLOCK_THREAD_CPUTIME_ID).expect("CLOCK_THREAD_CPUTIME_ID")
}

/// The CPU clocks of one runtime's threads, registered as each starts.
#[derive(Default)]
struct RuntimeClocks(Mutex<Vec<libc::clockid_t>>);

impl RuntimeClocks {
    fn register(&self) {
        let mut id: libc::clockid_t = 0;
        // SAFETY: asks for the calling thread's own CPU clock.
        let rc = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) };
        if rc == 0 {
            self.0.lock().unwrap().push(id);
        }
    }

    fn read(&self) -> Vec<Option<Duration>> {
        self.0.lock().unwrap().iter().map(|&id| clock(id)).collect()
    }

    /// How far the threads' clocks moved since `before`: a thread started
    /// since counts whole; one that exited (an idle blocking thread) is lost,
    /// which the runtime's workers never do.
    fn since(&self, before: &[Option<Duration>]) -> Duration {
        self.read()
            .iter()
            .enumerate()
            .map(|(i, now)| match (before.get(i).copied().flatten(), now) {
                (Some(b), Some(n)) => n.saturating_sub(b),
                (None, Some(n)) if i >= before.len() => *n,
                _ => Duration::ZERO,
            })
            .sum()
    }
}

// ---------------------------------------------------------------------------
// Over HTTP
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Bare,
    First,
    Replay,
    Redis,
}

impl Side {
    fn letter(self) -> &'static str {
        match self {
            Side::Bare => "a",
            Side::First => "b",
            Side::Replay => "c",
            Side::Redis => "d",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Side::Bare => "(a) bare route",
            Side::First => "(b) layer, memory, first",
            Side::Replay => "(c) layer, memory, replay",
            Side::Redis => "(d) layer, Redis, first",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Side::Bare => "/bare",
            Side::First | Side::Replay => "/mem",
            Side::Redis => "/redis",
        }
    }
}

const REPLAY_KEYS: u64 = 1024;

/// One request of `side`: the `i`-th of the cell tagged `tag`.
async fn send(client: &reqwest::Client, base: &str, side: Side, tag: &str, i: u64) {
    let (key, body) = match side {
        Side::Bare => (None, request_body(i)),
        Side::Replay => {
            let j = i % REPLAY_KEYS;
            (Some(format!("replay-{j}")), request_body(j))
        }
        Side::First | Side::Redis => (Some(format!("{tag}-{i}")), request_body(i)),
    };
    let mut rb = client
        .post(format!("{base}{}", side.path()))
        .header(header::CONTENT_TYPE, "application/json")
        .body(body);
    if let Some(key) = key {
        rb = rb.header("idempotency-key", key);
    }
    let res = rb.send().await.expect("the server answers");
    assert_eq!(res.status(), StatusCode::CREATED, "{side:?}");
    let replayed = res.headers().contains_key("idempotent-replayed");
    assert_eq!(
        replayed,
        side == Side::Replay,
        "{side:?}: replayed or not, as sent"
    );
    black_box(res.bytes().await.expect("the body"));
}

/// Sends each of the replay side's keys once, so that side only replays.
async fn use_replay_keys(client: &reqwest::Client, base: &str) -> Result<(), BoxError> {
    for j in 0..REPLAY_KEYS {
        let res = client
            .post(format!("{base}/mem"))
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", format!("replay-{j}"))
            .body(request_body(j))
            .send()
            .await?;
        assert_eq!(res.status(), StatusCode::CREATED);
        res.bytes().await?;
    }
    Ok(())
}

struct Cell {
    rate: f64,
    p50: Duration,
    p99: Duration,
    process_us: f64,
    server_us: f64,
}

async fn cell(
    client: &reqwest::Client,
    base: &str,
    server: &RuntimeClocks,
    side: Side,
    c: usize,
    n: u64,
    tag: &str,
) -> Cell {
    let next = Arc::new(AtomicU64::new(0));
    let (cpu0, server0) = (process_cpu(), server.read());
    let start = Instant::now();
    let tasks: Vec<_> = (0..c)
        .map(|_| {
            let (client, base, tag, next) = (
                client.clone(),
                base.to_owned(),
                tag.to_owned(),
                next.clone(),
            );
            tokio::spawn(async move {
                let mut lat = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return lat;
                    }
                    let t = Instant::now();
                    send(&client, &base, side, &tag, i).await;
                    lat.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut lat = Vec::with_capacity(n as usize);
    for t in tasks {
        lat.extend(t.await.expect("a client task"));
    }
    let elapsed = start.elapsed();
    let (cpu, server_cpu) = (process_cpu() - cpu0, server.since(&server0));
    lat.sort();
    let per = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
    Cell {
        rate: n as f64 / elapsed.as_secs_f64(),
        p50: lat[lat.len() / 2],
        p99: lat[lat.len() * 99 / 100],
        process_us: per(cpu),
        server_us: per(server_cpu),
    }
}

struct Server {
    base: String,
    clocks: Arc<RuntimeClocks>,
    has_redis: bool,
    // Kept alive for as long as the clients send.
    _rt: tokio::runtime::Runtime,
}

fn start_server() -> Result<Server, BoxError> {
    let clocks = Arc::new(RuntimeClocks::default());
    let registry = clocks.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(env("IDEM_BENCH_SERVER_THREADS", 2))
        .thread_name("bench-server")
        .on_thread_start(move || registry.register())
        .enable_all()
        .build()?;
    // Built on the server's runtime, so the Redis connection's driver runs
    // there and its CPU is the server's.
    let (base, has_redis) = rt.block_on(async {
        let url =
            std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let prefix = format!(
            "idem-bench-http:{}-{}:",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis()
        );
        let redis = match RedisStore::builder().key_prefix(prefix).connect(&url).await {
            Ok(store) => Some(StoreRef::new(store)),
            Err(e) => {
                println!("Redis at {url} not reachable ({e}): side (d) skipped");
                None
            }
        };
        let has_redis = redis.is_some();
        let app = app(StoreRef::new(MemoryStore::new()), redis);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await.expect("the server runs") });
        Ok::<_, BoxError>((format!("http://{addr}"), has_redis))
    })?;
    Ok(Server {
        base,
        clocks,
        has_redis,
        _rt: rt,
    })
}

fn client(c: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(c.max(16))
        .build()
        .expect("a reqwest client")
}

async fn over_http(server: &Server, csv: &mut Csv) -> Result<(), BoxError> {
    let n: u64 = env("IDEM_BENCH_REQUESTS", 100_000);
    let n1: u64 = env("IDEM_BENCH_REQUESTS_C1", 20_000);
    let rounds: usize = env("IDEM_BENCH_ROUNDS", 3).max(1);
    let concurrencies: Vec<usize> = list("IDEM_BENCH_CONCURRENCY", "1,16")
        .iter()
        .filter_map(|c| c.parse().ok())
        .collect();
    let on = list("IDEM_BENCH_SIDES", "a,b,c,d");
    let sides: Vec<Side> = [Side::Bare, Side::First, Side::Replay, Side::Redis]
        .into_iter()
        .filter(|s| on.iter().any(|o| o == s.letter()))
        .filter(|s| *s != Side::Redis || server.has_redis)
        .collect();
    let client = client(concurrencies.iter().copied().max().unwrap_or(16));
    let base = server.base.as_str();

    // The replay side's keys, used once; and every side warmed up on every
    // connection the largest concurrency opens.
    use_replay_keys(&client, base).await?;
    let warm_c = concurrencies.iter().copied().max().unwrap_or(1);
    for &side in &sides {
        cell(
            &client,
            base,
            &server.clocks,
            side,
            warm_c,
            2_000,
            &format!("warm-{}", side.letter()),
        )
        .await;
    }

    println!("load average at start: {}", load());
    println!(
        "{n} requests per cell ({n1} at c=1), median of {rounds} alternating round(s); server runtime {} worker(s), client runtime {} worker(s)",
        env("IDEM_BENCH_SERVER_THREADS", 2),
        env("IDEM_BENCH_CLIENT_THREADS", 2)
    );
    println!(
        "{:<27} {:>3} {:>9} {:>18} {:>8} {:>8} {:>12} {:>11} {:>15}",
        "side",
        "c",
        "req/s",
        "÷ (a) [spread]",
        "p50 µs",
        "p99 µs",
        "process µs",
        "server µs",
        "server − (a) µs"
    );
    let mut serial = 0;
    for &c in &concurrencies {
        let n = if c == 1 { n1 } else { n };
        let mut cells: Vec<Vec<Cell>> = sides.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            let mut order: Vec<usize> = (0..sides.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for k in order {
                serial += 1;
                let tag = format!("r{serial}-c{c}");
                cells[k].push(cell(&client, base, &server.clocks, sides[k], c, n, &tag).await);
            }
        }
        let bare = sides.iter().position(|s| *s == Side::Bare);
        for (k, side) in sides.iter().enumerate() {
            let of = |f: fn(&Cell) -> f64| median(cells[k].iter().map(f).collect());
            let (rate, server_us) = (of(|c| c.rate), of(|c| c.server_us));
            let vs = bare.map_or(String::from("—"), |b| {
                let ratios: Vec<f64> = (0..rounds)
                    .map(|r| cells[k][r].rate / cells[b][r].rate)
                    .collect();
                let (lo, hi) = (
                    ratios.iter().copied().fold(f64::INFINITY, f64::min),
                    ratios.iter().copied().fold(0.0, f64::max),
                );
                let bare_rate = median(cells[b].iter().map(|c| c.rate).collect());
                format!("{:.2} [{lo:.2}–{hi:.2}]", rate / bare_rate)
            });
            let x = c.to_string();
            let series = side.name();
            if let Some(b) = bare.filter(|&b| b != k) {
                let ratios: Vec<f64> = (0..rounds)
                    .map(|r| cells[k][r].rate / cells[b][r].rate)
                    .collect();
                let bare_rate = median(cells[b].iter().map(|c| c.rate).collect());
                let bare_server = median(cells[b].iter().map(|c| c.server_us).collect());
                let ratio_series = format!("{series} ÷ (a)");
                let added = format!("{series}: server CPU over (a)");
                let ratio = rate / bare_rate;
                csv.row(
                    "sockets",
                    &ratio_series,
                    &x,
                    ratio,
                    Some(spread(&ratios)),
                    "ratio",
                    rounds,
                );
                csv.row(
                    "sockets",
                    &added,
                    &x,
                    server_us - bare_server,
                    None,
                    "µs/req",
                    rounds,
                );
            }
            csv.row("sockets", series, &x, rate, None, "req/s", rounds);
            csv.row(
                "sockets",
                &format!("{series}: process CPU"),
                &x,
                of(|c| c.process_us),
                None,
                "µs/req",
                rounds,
            );
            csv.row(
                "sockets",
                &format!("{series}: server CPU"),
                &x,
                server_us,
                None,
                "µs/req",
                rounds,
            );
            let extra = bare.map_or(String::from("—"), |b| {
                format!(
                    "{:.1}",
                    server_us - median(cells[b].iter().map(|c| c.server_us).collect())
                )
            });
            println!(
                "{:<27} {c:>3} {rate:>9.0} {vs:>18} {:>8.0} {:>8.0} {:>12.1} {server_us:>11.1} {extra:>15}",
                side.name(),
                of(|c| c.p50.as_secs_f64() * 1e6),
                of(|c| c.p99.as_secs_f64() * 1e6),
                of(|c| c.process_us),
            );
        }
    }
    println!("load average at end: {}", load());
    println!(
        "process µs: CPU (user+system) of this process per request, server and clients; server µs: the server runtime's threads alone (Redis's own CPU not counted)"
    );
    Ok(())
}

async fn profile(server: &Server) -> Result<(), BoxError> {
    let side = match std::env::var("IDEM_BENCH_PROFILE").as_deref() {
        Ok("a") => Side::Bare,
        Ok("c") => Side::Replay,
        Ok("d") => Side::Redis,
        _ => Side::First,
    };
    let c: usize = env("IDEM_BENCH_PROFILE_C", 16);
    let secs: u64 = env("IDEM_BENCH_PROFILE_SECS", 20);
    let client = client(c);
    if side == Side::Replay {
        use_replay_keys(&client, &server.base).await?;
    }
    println!(
        "pid {}: {} at c={c} for {secs} s",
        std::process::id(),
        side.name()
    );
    let until = Instant::now() + Duration::from_secs(secs);
    let mut batch = 0;
    while Instant::now() < until {
        batch += 1;
        let r = cell(
            &client,
            &server.base,
            &server.clocks,
            side,
            c,
            20_000,
            &format!("p{batch}"),
        )
        .await;
        println!("{:.0} req/s, server {:.1} µs/req", r.rate, r.server_us);
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The stages, without sockets
// ---------------------------------------------------------------------------

/// Copies of `idem-runtime/src/http/stored.rs`'s stored form (private
/// there), to time encoding and decoding it alone: the layer's `encode` and
/// `decode`, and the owned `StoredResponse` it encoded with before.
mod stored {
    use super::*;

    const DESCRIBE_BODY: [HeaderName; 3] =
        [header::CONTENT_TYPE, header::CONTENT_ENCODING, header::VARY];

    fn never_replayed(name: &HeaderName) -> bool {
        const NAMES: [&str; 13] = [
            "set-cookie",
            "set-cookie2",
            "connection",
            "keep-alive",
            "proxy-connection",
            "transfer-encoding",
            "te",
            "trailer",
            "upgrade",
            "proxy-authenticate",
            "content-length",
            "date",
            "idempotent-replayed",
        ];
        NAMES.contains(&name.as_str())
    }

    #[derive(Serialize)]
    pub struct StoredResponse {
        status: u16,
        headers: Vec<(String, String)>,
        body: StoredBody,
    }

    #[derive(Serialize)]
    #[serde(rename_all = "snake_case")]
    enum StoredBody {
        Text(String),
        Hex(String),
    }

    impl StoredResponse {
        pub fn new(
            status: StatusCode,
            headers: &HeaderMap,
            keep: &[HeaderName],
            body: &Bytes,
        ) -> Self {
            let mut names: Vec<&HeaderName> = DESCRIBE_BODY.iter().collect();
            for name in keep {
                if !names.contains(&name) {
                    names.push(name);
                }
            }
            let headers = names
                .into_iter()
                .filter(|name| !never_replayed(name))
                .flat_map(|name| headers.get_all(name).iter().map(move |v| (name, v)))
                .filter_map(|(name, v)| {
                    Some((name.as_str().to_owned(), v.to_str().ok()?.to_owned()))
                })
                .collect();
            let body = match std::str::from_utf8(body) {
                Ok(s) => StoredBody::Text(s.to_owned()),
                Err(_) => StoredBody::Hex(hex::encode(body)),
            };
            StoredResponse {
                status: status.as_u16(),
                headers,
                body,
            }
        }

        /// The layer's encoding now: the same JSON, from borrowed headers
        /// and body.
        pub fn encode(
            status: StatusCode,
            headers: &HeaderMap,
            keep: &[HeaderName],
            body: &Bytes,
        ) -> Vec<u8> {
            #[derive(Serialize)]
            struct Borrowed<'a> {
                status: u16,
                headers: Vec<(&'a str, &'a str)>,
                body: BorrowedBody<'a>,
            }
            #[derive(Serialize)]
            #[serde(rename_all = "snake_case")]
            enum BorrowedBody<'a> {
                Text(&'a str),
                Hex(String),
            }
            let extra = keep
                .iter()
                .enumerate()
                .filter(|&(i, name)| !DESCRIBE_BODY.contains(name) && !keep[..i].contains(name))
                .map(|(_, name)| name);
            let headers = DESCRIBE_BODY
                .iter()
                .chain(extra)
                .filter(|name| !never_replayed(name))
                .flat_map(|name| headers.get_all(name).iter().map(move |v| (name, v)))
                .filter_map(|(name, v)| Some((name.as_str(), v.to_str().ok()?)))
                .collect();
            let body = match std::str::from_utf8(body) {
                Ok(s) => BorrowedBody::Text(s),
                Err(_) => BorrowedBody::Hex(hex::encode(body)),
            };
            serde_json::to_vec(&Borrowed {
                status: status.as_u16(),
                headers,
                body,
            })
            .expect("strings only")
        }
    }

    /// `stored.rs`'s `decode`: the response straight from the record's
    /// bytes, strings borrowed where JSON did not escape them.
    pub fn decode(record: &[u8]) -> Result<Response<Full<Bytes>>, serde_json::Error> {
        use std::borrow::Cow;
        #[derive(Deserialize)]
        struct Reading<'a> {
            status: u16,
            #[serde(borrow)]
            headers: Vec<(Text<'a>, Text<'a>)>,
            #[serde(borrow)]
            body: ReadingBody<'a>,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "snake_case")]
        enum ReadingBody<'a> {
            Text(#[serde(borrow)] Text<'a>),
            Hex(#[serde(borrow)] Text<'a>),
        }
        struct Text<'a>(Cow<'a, str>);
        impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Visit;
                impl<'de> serde::de::Visitor<'de> for Visit {
                    type Value = Cow<'de, str>;
                    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                        f.write_str("a string")
                    }
                    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                        Ok(Cow::Borrowed(v))
                    }
                    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                        Ok(Cow::Owned(v.to_owned()))
                    }
                }
                d.deserialize_str(Visit).map(Text)
            }
        }
        let stored: Reading<'_> = serde_json::from_slice(record)?;
        let body = match stored.body {
            ReadingBody::Text(Text(Cow::Borrowed(s))) => Bytes::copy_from_slice(s.as_bytes()),
            ReadingBody::Text(Text(Cow::Owned(s))) => Bytes::from(s),
            ReadingBody::Hex(h) => Bytes::from(hex::decode(&*h.0).unwrap_or_default()),
        };
        let mut res = Response::new(Full::new(body));
        *res.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
        let headers = res.headers_mut();
        for (Text(name), Text(value)) in stored.headers {
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(&value),
            ) && !never_replayed(&n)
            {
                headers.append(n, v);
            }
        }
        Ok(res)
    }
}

/// The layer's record as the protocol sees it: bytes already encoded, copied
/// once more by `to_stored` as the layer's `Recorded::First` does.
struct Encoded(Vec<u8>);

enum ViaBytes {}

impl StoredForm<ViaBytes> for Encoded {
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error> {
        Ok(self.0.clone())
    }

    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        Ok(Encoded(bytes.to_vec()))
    }
}

fn keep_headers() -> Vec<HeaderName> {
    vec![header::LOCATION, header::CONTENT_LOCATION, header::ETAG]
}

fn http_request(path: &str, key: Option<String>, body: String) -> Request<Body> {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    req.body(Body::from(body)).expect("a request")
}

/// Median over 3 runs of `iters` calls of `f(i)`: this thread's CPU per call.
async fn time<F, Fut>(iters: u64, mut f: F) -> Duration
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut runs = Vec::new();
    let mut i = 0;
    for _ in 0..3 {
        let t = thread_cpu();
        for _ in 0..iters {
            f(i).await;
            i += 1;
        }
        runs.push((thread_cpu() - t).as_secs_f64() / iters as f64);
    }
    Duration::from_secs_f64(median(runs))
}

/// Runs the replay keys' first executions, so later requests with them replay.
async fn store_replay_keys(router: &Router) -> Result<(), BoxError> {
    for j in 0..REPLAY_KEYS {
        let key = Some(format!("replay-{j}"));
        router
            .clone()
            .oneshot(http_request("/mem", key, request_body(j)))
            .await?;
    }
    Ok(())
}

async fn stages(csv: &mut Csv) -> Result<(), BoxError> {
    let iters: u64 = env("IDEM_BENCH_STAGE_ITERS", 50_000);
    let memory = StoreRef::new(MemoryStore::new());
    let router = app(memory.clone(), None);
    let run = std::process::id();
    println!("load average at start: {}", load());
    println!(
        "stages: one thread, no sockets, this thread's CPU per call, median of 3 runs of {iters}"
    );

    let collect = |res: axum::response::Response| async move {
        let status = res.status();
        black_box(res.into_body().collect().await.expect("a body").to_bytes());
        status
    };
    // One loop alone, for a profiler (`valgrind --tool=callgrind`): a, b or c.
    let only = std::env::var("IDEM_BENCH_STAGE_ONLY").ok();
    if let Some(side) = only.as_deref() {
        let (path, replay) = match side {
            "a" => ("/bare", false),
            "b" => ("/mem", false),
            "c" => ("/mem", true),
            other => return Err(format!("IDEM_BENCH_STAGE_ONLY={other}: a, b or c").into()),
        };
        if replay {
            store_replay_keys(&router).await?;
        }
        let took = time(iters, |i| {
            let router = router.clone();
            async move {
                let (key, body) = match (path, replay) {
                    ("/bare", _) => (None, i),
                    (_, false) => (Some(format!("st-{run}-{i}")), i),
                    (_, true) => (Some(format!("replay-{}", i % REPLAY_KEYS)), i % REPLAY_KEYS),
                };
                let res = router
                    .oneshot(http_request(path, key, request_body(body)))
                    .await
                    .unwrap();
                assert_eq!(
                    res.headers().contains_key("idempotent-replayed"),
                    replay,
                    "a replay exactly when asked for one"
                );
                assert_eq!(collect(res).await, StatusCode::CREATED);
            }
        })
        .await;
        println!("({side}) alone: {:.0} ns/call", took.as_secs_f64() * 1e9);
        return Ok(());
    }
    let bare = time(iters, |i| {
        let router = router.clone();
        async move {
            let res = router
                .oneshot(http_request("/bare", None, request_body(i)))
                .await
                .unwrap();
            assert_eq!(collect(res).await, StatusCode::CREATED);
        }
    })
    .await;
    let first = time(iters, |i| {
        let router = router.clone();
        async move {
            let key = Some(format!("st-{run}-{i}"));
            let res = router
                .oneshot(http_request("/mem", key, request_body(i)))
                .await
                .unwrap();
            assert_eq!(collect(res).await, StatusCode::CREATED);
        }
    })
    .await;
    store_replay_keys(&router).await?;
    let replay = time(iters, |i| {
        let router = router.clone();
        async move {
            let j = i % REPLAY_KEYS;
            let key = Some(format!("replay-{j}"));
            let res = router
                .oneshot(http_request("/mem", key, request_body(j)))
                .await
                .unwrap();
            assert!(res.headers().contains_key("idempotent-replayed"));
            assert_eq!(collect(res).await, StatusCode::CREATED);
        }
    })
    .await;

    // The layer's steps on a first execution, in its order.
    let sample_body = Bytes::from(request_body(12_345));
    let mut headers = HeaderMap::new();
    headers.insert(
        "idempotency-key",
        HeaderValue::from_static("st-0123456789abcdef"),
    );
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let rules = KeyRules::default();
    let key_header = time(iters, |_| {
        let k = rules.from_headers(&headers).unwrap();
        let caller = String::new();
        black_box((k, caller));
        async {}
    })
    .await;
    let body_plain = time(iters, |_| {
        drop(black_box(Body::from(sample_body.clone())));
        async {}
    })
    .await;
    let request_bytes = time(iters, |_| {
        let body = Body::from(sample_body.clone());
        async move {
            let bytes = Limited::new(body, 1024 * 1024)
                .collect()
                .await
                .unwrap()
                .to_bytes();
            drop(black_box(Body::from(bytes)));
        }
    })
    .await;
    let fingerprint = time(iters, |i| {
        let key = Key::builder(SCOPE)
            .part("")
            .part(&format!("st-{i}"))
            .finish();
        // As layer.rs's `request_fingerprint`: the digest's hex in a stack buffer.
        let mut digest_hex = [0u8; 64];
        hex::encode_to_slice(Sha256::digest(&sample_body), &mut digest_hex).unwrap();
        let fp = Fingerprint::builder()
            .part("POST")
            .part("/mem")
            .part(std::str::from_utf8(&digest_hex).unwrap())
            .finish();
        black_box((key, fp));
        async {}
    })
    .await;
    let handler_response = || {
        let order = build_order(NewOrder {
            user_id: 12_345,
            sku: "A-26".into(),
            qty: 2,
        });
        (StatusCode::CREATED, Json(order)).into_response()
    };
    let response_plain = time(iters, |_| {
        black_box(handler_response());
        async {}
    })
    .await;
    let response_bytes = time(iters, |_| {
        let res = handler_response();
        async move {
            let (parts, body) = res.into_parts();
            black_box(axum::body::HttpBody::size_hint(&body).exact());
            let bytes = Limited::new(body, 512 * 1024)
                .collect()
                .await
                .unwrap()
                .to_bytes();
            let res: Response<Either<Full<Bytes>, Body>> =
                Response::from_parts(parts, Full::new(bytes)).map(Either::Left);
            black_box(res);
        }
    })
    .await;
    let sample = handler_response();
    let (sample_parts, sample_res_body) = sample.into_parts();
    let sample_res_bytes = sample_res_body.collect().await?.to_bytes();
    let keep = keep_headers();
    let stored_form = time(iters, |_| {
        black_box(stored::StoredResponse::encode(
            sample_parts.status,
            &sample_parts.headers,
            &keep,
            &sample_res_bytes,
        ));
        async {}
    })
    .await;
    let stored_form_owned = time(iters, |_| {
        let stored = stored::StoredResponse::new(
            sample_parts.status,
            &sample_parts.headers,
            &keep,
            &sample_res_bytes,
        );
        black_box(serde_json::to_vec(&stored).unwrap());
        async {}
    })
    .await;
    assert_eq!(
        stored::StoredResponse::encode(
            sample_parts.status,
            &sample_parts.headers,
            &keep,
            &sample_res_bytes
        ),
        serde_json::to_vec(&stored::StoredResponse::new(
            sample_parts.status,
            &sample_parts.headers,
            &keep,
            &sample_res_bytes,
        ))?,
        "the borrowed encoding is the owned one's JSON"
    );
    let encoded = serde_json::to_vec(&stored::StoredResponse::new(
        sample_parts.status,
        &sample_parts.headers,
        &keep,
        &sample_res_bytes,
    ))?;
    let spec = Spec::new(SCOPE, Kind::Call).ttl(Duration::from_secs(600));
    let protocol_first = time(iters, |i| {
        let key = Key::builder(SCOPE)
            .part("")
            .part(&format!("pf-{run}-{i}"))
            .finish();
        let fp = Fingerprint::builder().part("POST").part("/mem").finish();
        let (spec, store, encoded) = (&spec, memory.clone(), encoded.clone());
        async move {
            let out: Result<Encoded, idem_runtime::Error> =
                protocol::execute(spec, Some(store), key, Some(fp), async move {
                    Ok(Encoded(encoded))
                })
                .await;
            black_box(out.unwrap());
        }
    })
    .await;
    // The same on an empty store: how much of step 6 is the size of the
    // store (side (b) above left `3 × iters` records in it).
    let empty = StoreRef::new(MemoryStore::new());
    let protocol_empty = time(iters / 10, |i| {
        let key = Key::builder(SCOPE)
            .part("")
            .part(&format!("pe-{run}-{i}"))
            .finish();
        let fp = Fingerprint::builder().part("POST").part("/mem").finish();
        let (spec, store, encoded) = (&spec, empty.clone(), encoded.clone());
        async move {
            let out: Result<Encoded, idem_runtime::Error> =
                protocol::execute(spec, Some(store), key, Some(fp), async move {
                    Ok(Encoded(encoded))
                })
                .await;
            black_box(out.unwrap());
        }
    })
    .await;
    let replay_key = |j: u64| {
        Key::builder(SCOPE)
            .part("")
            .part(&format!("pr-{run}-{j}"))
            .finish()
    };
    let fp = Fingerprint::builder().part("POST").part("/mem").finish();
    for j in 0..REPLAY_KEYS {
        let out: Result<Encoded, idem_runtime::Error> = protocol::execute(
            &spec,
            Some(memory.clone()),
            replay_key(j),
            Some(fp),
            async { Ok(Encoded(encoded.clone())) },
        )
        .await;
        out?;
    }
    let protocol_replay = time(iters, |i| {
        let (spec, store, key) = (&spec, memory.clone(), replay_key(i % REPLAY_KEYS));
        async move {
            let out: Result<Encoded, idem_runtime::Error> =
                protocol::execute(spec, Some(store), key, Some(fp), async {
                    Ok(Encoded(Vec::new()))
                })
                .await;
            assert!(!out.unwrap().0.is_empty(), "a replay, not a run");
        }
    })
    .await;
    let replay_rebuild = time(iters, |_| {
        let mut res = stored::decode(&encoded).unwrap();
        res.headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
        black_box(res);
        async {}
    })
    .await;

    let ns = |d: Duration| d.as_secs_f64() * 1e9;
    println!(
        "{:<66} {:>9}",
        "through the router (oneshot, response body collected)", "ns/call"
    );
    println!("{:<66} {:>9.0}", "(a) bare route", ns(bare));
    println!(
        "{:<66} {:>9.0}",
        "(b) layer on memory, first execution",
        ns(first)
    );
    println!("{:<66} {:>9.0}", "(c) layer on memory, replay", ns(replay));
    println!(
        "{:<66} {:>9.0}",
        "(b) − (a): the layer on a first execution",
        ns(first) - ns(bare)
    );
    println!(
        "{:<66} {:>9.0}",
        "(c) − (a): the layer on a replay (handler skipped)",
        ns(replay) - ns(bare)
    );
    println!(
        "the layer's steps on a first execution, each alone ({} B request, {} B response, {} B record):",
        sample_body.len(),
        sample_res_bytes.len(),
        encoded.len()
    );
    let steps = [
        (
            "1 key header + caller (KeyRules::from_headers)",
            ns(key_header),
        ),
        (
            "2 request body: Limited collect + Body::from (less making the Body)",
            ns(request_bytes) - ns(body_plain),
        ),
        (
            "3 key + fingerprint (Key, SHA-256 of body, hex, Fingerprint)",
            ns(fingerprint),
        ),
        (
            "4 response: size_hint, Limited collect, rebuild (less the handler)",
            ns(response_bytes) - ns(response_plain),
        ),
        (
            "5 stored form: StoredResponse::encode (borrowed)",
            ns(stored_form),
        ),
        (
            "6 protocol::execute on memory, first (claim, complete, copy)",
            ns(protocol_first),
        ),
    ];
    let stage = |csv: &mut Csv, what: &str, t: f64| csv.row("stages", what, "", t, None, "ns", 3);
    stage(csv, "(a) bare route", ns(bare));
    stage(csv, "(b) layer on memory, first execution", ns(first));
    stage(csv, "(c) layer on memory, replay", ns(replay));
    stage(
        csv,
        "(b) − (a): the layer, first execution",
        ns(first) - ns(bare),
    );
    stage(csv, "(c) − (a): the layer, replay", ns(replay) - ns(bare));
    let mut sum = 0.0;
    for (what, t) in steps {
        sum += t;
        println!("  {what:<64} {t:>9.0}");
        stage(csv, what, t);
    }
    stage(
        csv,
        "unattributed: (b) − (a) less 1–6",
        ns(first) - ns(bare) - sum,
    );
    println!("  {:<64} {sum:>9.0}", "sum of 1–6");
    println!(
        "  {:<64} {:>9.0}",
        format!(
            "(6 on an empty memory store, {} records at most)",
            3 * (iters / 10)
        ),
        ns(protocol_empty)
    );
    println!(
        "  {:<64} {:>9.0}",
        "(5 as it was: StoredResponse::new with owned Strings + to_vec)",
        ns(stored_form_owned)
    );
    println!(
        "  {:<64} {:>9.0}",
        "(b) − (a) less the sum: unattributed (boxing, clones, tracing…)",
        ns(first) - ns(bare) - sum
    );
    println!("the replay's own steps, each alone:");
    println!(
        "  {:<64} {:>9.0}",
        "protocol::execute on memory, replay (claim finds DONE, decode)",
        ns(protocol_replay)
    );
    println!(
        "  {:<64} {:>9.0}",
        "stored form: decode (borrowed) + header",
        ns(replay_rebuild)
    );
    println!(
        "  {:<64} {:>9.0}",
        "(the handler's response, built alone, for scale)",
        ns(response_plain)
    );
    println!("load average at end: {}", load());
    Ok(())
}

fn main() {
    // `cargo bench` passes `--bench`; there is nothing to filter.
    let only = std::env::var("IDEM_BENCH_ONLY").unwrap_or_default();
    let mut csv = Csv::new("http");
    let alone = std::env::var("IDEM_BENCH_STAGE_ONLY").is_ok()
        || std::env::var("IDEM_BENCH_PROFILE").is_ok();
    if only.is_empty() || only == "stages" {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        if let Err(e) = rt.block_on(stages(&mut csv)) {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        if only == "stages" {
            if !alone {
                csv.write();
            }
            return;
        }
        println!();
    }
    let server = match start_server() {
        Ok(server) => server,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(env("IDEM_BENCH_CLIENT_THREADS", 2))
        .thread_name("bench-client")
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let result = if std::env::var("IDEM_BENCH_PROFILE").is_ok() {
        rt.block_on(profile(&server))
    } else {
        rt.block_on(over_http(&server, &mut csv))
    };
    if result.is_ok() && !alone {
        csv.write();
    }
    if let Err(e) = result {
        eprintln!("error: {e} (side (d) needs Redis)");
        std::process::exit(1);
    }
}
