//! Micro-benchmarks of the client side of one call, no server involved.
//!
//! Run by hand (CI builds it under clippy but never runs it):
//!
//! ```sh
//! cargo bench -p idem-benches --bench hot_path
//! # knobs: IDEM_BENCH_ROUNDS (1): the whole suite that many times, each
//! #        figure the median of its rounds (the spread their lowest and highest)
//! # criterion's own options after `--`, e.g. `-- --warm-up-time 1 --measurement-time 3 call/`
//! ```
//!
//! - `key/3 fields`: deriving a key from three business fields (SHA-256);
//! - `memory store/claim+complete`: one claim and one completion on the
//!   in-memory store, a fresh key each, through the `Store` trait object;
//! - `call/bare async fn` and `call/#[idempotent] on memory`: the same body
//!   called bare and under `#[idempotent]` on the memory store (fresh key per
//!   call: the first-execution path), so their difference is what the
//!   attribute costs per call on the client; the same with a body that
//!   waits once (`yields once`), which arms the heartbeat's timer; and once
//!   more with the store held as a `StoreRef` (its futures boxed).
//!
//! Times are the bench thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), not
//! wall time: the runtimes are single-threaded, so all the work is on that
//! thread, and on a shared, loaded machine CPU time does not count the time
//! the thread waited for a core.
//!
//! Each figure (criterion's estimate: its slope, or its mean where it has
//! none) goes to `benchmarks/data/hot_path.csv` (see `figures.rs`;
//! `IDEM_BENCH_CSV=off` for none), with `call/#[idempotent] on memory −
//! bare`: what the attribute adds, per round.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use criterion::{Criterion, Throughput, criterion_group};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::{AsStore, Store as _, StoreRef};
use idem_runtime::store::{ClaimRequest, Completion, StoredOutcome, Token};
use idem_runtime::{Key, idempotent};
use serde::{Deserialize, Serialize};

#[path = "figures.rs"]
mod figures;
#[path = "knobs.rs"]
mod knobs;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: u64,
    sku: String,
    qty: u32,
}

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
}

/// CPU time this thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant
    // every Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn order(id: u64) -> Order {
    Order {
        id,
        sku: "SKU-17".into(),
        qty: 1,
    }
}

async fn bare(id: u64) -> Result<Order, BenchError> {
    Ok(order(id))
}

/// A body that waits once, as one doing I/O does: under `#[idempotent]` its
/// first `Pending` is what arms the heartbeat.
async fn bare_yielding(id: u64) -> Result<Order, BenchError> {
    tokio::task::yield_now().await;
    Ok(order(id))
}

/// The store as a service holds it: its own type (the claim's and the
/// completion's futures are polled in place), or a `StoreRef` (each boxed).
struct Svc<S> {
    store: S,
}

impl<S: AsStore> Svc<S> {
    #[idempotent(key = "run|id", scope = "bench.memory", store = self.store)]
    async fn create(&self, run: u64, id: u64) -> Result<Order, BenchError> {
        Ok(order(id))
    }

    #[idempotent(key = "run|id", scope = "bench.memory.yield", store = self.store)]
    async fn create_yielding(&self, run: u64, id: u64) -> Result<Order, BenchError> {
        tokio::task::yield_now().await;
        Ok(order(id))
    }
}

fn key_derivation(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    g.throughput(Throughput::Elements(1));
    let mut n = 0u64;
    g.bench_function("3 fields", |b| {
        b.iter_custom(|iters| {
            let start = thread_cpu();
            for _ in 0..iters {
                n += 1;
                black_box(
                    Key::builder("orders::create")
                        .part(&black_box(n))
                        .part(black_box("SKU-17"))
                        .part(&black_box(3u32))
                        .finish(),
                );
            }
            thread_cpu() - start
        })
    });
    g.finish();
}

fn memory_store(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let n = AtomicU64::new(0);
    let n = &n;
    let mut g = c.benchmark_group("memory store");
    g.throughput(Throughput::Elements(1));
    g.bench_function("claim+complete", |b| {
        b.to_async(&rt).iter_custom(|iters| async move {
            // A store per sample: fresh keys pile up (nothing expires within
            // the hour), and one store for the whole run would end up
            // measuring a map of millions of records.
            let store = StoreRef::new(MemoryStore::new());
            let keys: Vec<Key> = (0..iters)
                .map(|_| {
                    Key::builder("bench")
                        .part(&n.fetch_add(1, Ordering::Relaxed))
                        .finish()
                })
                .collect();
            let start = thread_cpu();
            for key in &keys {
                let token = Token::random();
                let req = ClaimRequest {
                    key,
                    token,
                    fingerprint: None,
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_secs(3600),
                };
                black_box(store.claim(req).await.unwrap());
                let completion = Completion {
                    outcome: StoredOutcome::Success,
                    payload: b"{\"id\":1}",
                    ttl: Duration::from_secs(3600),
                };
                black_box(store.complete(key, token, completion).await.unwrap());
            }
            let took = thread_cpu() - start;
            drop(store);
            took
        })
    });
    g.finish();
}

/// Runs `iters` calls of `call`, each with a fresh id, and returns the CPU
/// time they took.
async fn cpu_of_calls<F, Fut>(iters: u64, n: &AtomicU64, call: F) -> Duration
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = Result<Order, BenchError>>,
{
    let start = thread_cpu();
    for _ in 0..iters {
        black_box(call(n.fetch_add(1, Ordering::Relaxed)).await.unwrap());
    }
    thread_cpu() - start
}

fn idempotent_call(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let n = AtomicU64::new(0);
    let n = &n;
    // A store per sample, as above.
    let svc = || Svc {
        store: MemoryStore::new(),
    };
    let svc_ref = || Svc {
        store: StoreRef::new(MemoryStore::new()),
    };
    let mut g = c.benchmark_group("call");
    g.throughput(Throughput::Elements(1));
    g.bench_function("bare async fn", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| async move { cpu_of_calls(iters, n, bare).await })
    });
    g.bench_function("#[idempotent] on memory", |b| {
        b.to_async(&rt).iter_custom(|iters| async move {
            let svc = svc();
            cpu_of_calls(iters, n, |id| svc.create(run, id)).await
        })
    });
    g.bench_function("#[idempotent] on memory, through a StoreRef", |b| {
        b.to_async(&rt).iter_custom(|iters| async move {
            let svc = svc_ref();
            cpu_of_calls(iters, n, |id| svc.create(run, id)).await
        })
    });
    g.bench_function("bare async fn, yields once", |b| {
        b.to_async(&rt)
            .iter_custom(|iters| async move { cpu_of_calls(iters, n, bare_yielding).await })
    });
    g.bench_function("#[idempotent] on memory, yields once", |b| {
        b.to_async(&rt).iter_custom(|iters| async move {
            let svc = svc();
            cpu_of_calls(iters, n, |id| svc.create_yielding(run, id)).await
        })
    });
    g.finish();
}

criterion_group!(benches, key_derivation, memory_store, idempotent_call);

/// What `criterion_main!` does, `IDEM_BENCH_ROUNDS` times, then each
/// benchmark's estimates read back from criterion's files into the CSV.
fn main() {
    let rounds: usize = knobs::env("IDEM_BENCH_ROUNDS", 1).max(1);
    let dir = criterion_dir();
    let mut figures: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for _ in 0..rounds {
        let started = SystemTime::now();
        benches();
        let fresh = estimates(&dir, started);
        let call = |name: &str| fresh.get(&format!("call/{name}")).copied();
        if let (Some(idem), Some(bare)) = (call("#[idempotent] on memory"), call("bare async fn")) {
            figures
                .entry("call/#[idempotent] on memory − bare".to_owned())
                .or_default()
                .push(idem - bare);
        }
        for (id, ns) in fresh {
            figures.entry(id).or_default().push(ns);
        }
    }
    Criterion::default().configure_from_args().final_summary();
    if figures.is_empty() {
        eprintln!("no criterion estimates found under {}", dir.display());
        return;
    }
    let mut csv = figures::Csv::new("hot_path");
    println!("\nmedians of {rounds} round(s), ns per operation [lowest–highest round]:");
    for (id, ns) in figures {
        let (lo, hi) = knobs::spread(&ns);
        let m = knobs::median(ns);
        println!("  {id:<52} {m:>8.1} [{lo:.1}–{hi:.1}]");
        csv.row("ns per operation", &id, "", m, Some((lo, hi)), "ns", rounds);
    }
    csv.write();
}

/// Where criterion writes: `$CRITERION_HOME`, `$CARGO_TARGET_DIR/criterion`,
/// else the workspace's `target/criterion`.
fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"),
        PathBuf::from,
    );
    target.join("criterion")
}

/// Each benchmark criterion measured since `since`: its id and its time per
/// iteration in ns (the slope's estimate, else the mean's), from the
/// `new/benchmark.json` and `new/estimates.json` it left.
fn estimates(dir: &Path, since: SystemTime) -> BTreeMap<String, f64> {
    #[derive(Deserialize)]
    struct Benchmark {
        full_id: String,
    }
    #[derive(Deserialize)]
    struct Estimate {
        point_estimate: f64,
    }
    #[derive(Deserialize)]
    struct Estimates {
        mean: Estimate,
        slope: Option<Estimate>,
    }
    let mut found = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if !path.is_dir() {
                continue;
            }
            if path.file_name().is_some_and(|n| n != "new") {
                stack.push(path);
                continue;
            }
            let estimates = path.join("estimates.json");
            let fresh = std::fs::metadata(&estimates)
                .and_then(|m| m.modified())
                .is_ok_and(|at| at >= since);
            let read = |file: &Path| std::fs::read_to_string(file).ok();
            let (Some(b), Some(e)) = (read(&path.join("benchmark.json")), read(&estimates)) else {
                continue;
            };
            if let (true, Ok(b), Ok(e)) = (
                fresh,
                serde_json::from_str::<Benchmark>(&b),
                serde_json::from_str::<Estimates>(&e),
            ) {
                found.insert(b.full_id, e.slope.unwrap_or(e.mean).point_estimate);
            }
        }
    }
    found
}
