//! Micro-benchmarks of the client side of one call, no server involved.
//!
//! Run by hand (CI builds it under clippy but never runs it):
//!
//! ```sh
//! cargo bench -p idem-benches --bench hot_path
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

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::{AsStore, Store as _, StoreRef};
use idem_runtime::store::{ClaimRequest, Completion, StoredOutcome, Token};
use idem_runtime::{Key, idempotent};
use serde::{Deserialize, Serialize};

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
criterion_main!(benches);
