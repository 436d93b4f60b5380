//! Micro-benchmarks of the client side of one call, no server involved.
//!
//! Run by hand (CI builds it under clippy but never runs it):
//!
//! ```sh
//! cargo bench -p idem-examples --bench hot_path
//! ```
//!
//! - `key/3 fields`: deriving a key from three business fields (SHA-256);
//! - `memory store/claim+complete`: one claim and one completion on the
//!   in-memory store, a fresh key each, through the `Store` trait object;
//! - `call/bare async fn` and `call/#[idempotent] on memory`: the same body
//!   called bare and under `#[idempotent]` on the memory store (fresh key per
//!   call: the first-execution path), so their difference is what the
//!   attribute costs per call on the client.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{ClaimRequest, Completion, Key, Outcome, StoreRef, Token, idempotent};
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

struct Svc {
    store: StoreRef,
}

impl Svc {
    #[idempotent(key = "run|id", scope = "bench.memory", store = self.store.clone())]
    async fn create(&self, run: u64, id: u64) -> Result<Order, BenchError> {
        Ok(order(id))
    }
}

fn key_derivation(c: &mut Criterion) {
    let mut g = c.benchmark_group("key");
    g.throughput(Throughput::Elements(1));
    let mut n = 0u64;
    g.bench_function("3 fields", |b| {
        b.iter(|| {
            n += 1;
            black_box(
                Key::builder("orders::create")
                    .part(&black_box(n))
                    .part(black_box("SKU-17"))
                    .part(&black_box(3u32))
                    .finish(),
            )
        })
    });
    g.finish();
}

fn memory_store(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = StoreRef::new(MemoryStore::new());
    let n = AtomicU64::new(0);
    let mut g = c.benchmark_group("memory store");
    g.throughput(Throughput::Elements(1));
    g.bench_function("claim+complete", |b| {
        b.to_async(&rt).iter(|| async {
            let key = Key::builder("bench")
                .part(&n.fetch_add(1, Ordering::Relaxed))
                .finish();
            let token = Token::random();
            let req = ClaimRequest {
                key: &key,
                token,
                fingerprint: None,
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(3600),
            };
            black_box(store.claim(req).await.unwrap());
            let completion = Completion {
                outcome: Outcome::Success,
                payload: b"{\"id\":1}",
                ttl: Duration::from_secs(3600),
            };
            black_box(store.complete(&key, token, completion).await.unwrap())
        })
    });
    g.finish();
}

fn idempotent_call(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let svc = Svc {
        store: StoreRef::new(MemoryStore::new()),
    };
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let n = AtomicU64::new(0);
    let mut g = c.benchmark_group("call");
    g.throughput(Throughput::Elements(1));
    g.bench_function("bare async fn", |b| {
        b.to_async(&rt)
            .iter(|| async { black_box(bare(n.fetch_add(1, Ordering::Relaxed)).await.unwrap()) })
    });
    g.bench_function("#[idempotent] on memory", |b| {
        b.to_async(&rt).iter(|| async {
            black_box(
                svc.create(run, n.fetch_add(1, Ordering::Relaxed))
                    .await
                    .unwrap(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, key_derivation, memory_store, idempotent_call);
criterion_main!(benches);
