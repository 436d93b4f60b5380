//! How long the explorer (`idem_runtime::testing`) takes over a flow of
//! three steps on the memory store: the number of schedules and the time of
//! a whole run, its median over several runs, against one clean call of the
//! same flow measured in the same run.
//!
//! Run by hand, in release mode (CI builds it under clippy and never runs it):
//!
//! ```sh
//! cargo bench -p idem-bench-explorer
//! # knobs: IDEM_BENCH_ROUNDS (20)
//! ```
//!
//! The flow: deduct stock (a ledger row unique per order), insert the order
//! (conflict is success), charge a provider that deduplicates on the step's
//! key; the snapshot is the tables. The medians go to
//! `benchmarks/data/explorer.csv` (`IDEM_BENCH_CSV=off` for none). Machines
//! are noisy: read the ratio.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::store::StoreRef;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::testing::Explorer;
use idem_runtime::{idempotent, step};

#[path = "../knobs.rs"]
mod knobs;
use knobs::*;
#[path = "../figures.rs"]
mod figures;
use figures::Csv;

#[derive(Debug, Default, Clone, PartialEq)]
struct Tables {
    stock: i64,
    ledger: BTreeSet<String>,
    orders: BTreeMap<String, u64>,
    charges: BTreeSet<String>,
}

struct Shop {
    store: StoreRef,
    tables: Mutex<Tables>,
}

impl Shop {
    fn new(store: StoreRef) -> Arc<Shop> {
        Arc::new(Shop {
            store,
            tables: Mutex::new(Tables {
                stock: 10,
                ..Tables::default()
            }),
        })
    }

    #[idempotent(scope = "bench.explorer.place", key = "order_no", store = self.store.clone())]
    async fn place(&self, order_no: String) -> Result<u64, idem_runtime::Error> {
        self.deduct_stock(&order_no).await?;
        let id = self.insert_order(&order_no).await?;
        self.charge(id).await?;
        Ok(id)
    }

    #[step("deduct_stock")]
    async fn deduct_stock(&self, order_no: &str) -> Result<(), idem_runtime::Error> {
        let mut t = self.tables.lock().unwrap();
        if t.ledger.insert(order_no.to_owned()) {
            t.stock -= 1;
        }
        Ok(())
    }

    #[step("insert_order")]
    async fn insert_order(&self, order_no: &str) -> Result<u64, idem_runtime::Error> {
        let mut t = self.tables.lock().unwrap();
        let next = t.orders.len() as u64 + 1;
        Ok(*t.orders.entry(order_no.to_owned()).or_insert(next))
    }

    #[step("charge")]
    async fn charge(&self, id: u64) -> Result<u64, idem_runtime::Error> {
        let key = idem_runtime::current_key().expect("in a step").to_hex();
        self.tables.lock().unwrap().charges.insert(key);
        Ok(id)
    }
}

async fn explore() -> (usize, Duration) {
    let started = Instant::now();
    let report = Explorer::new(
        |store| async move { Shop::new(store) },
        |shop: Arc<Shop>| async move { shop.place("order-7".to_owned()).await },
        |shop: Arc<Shop>| async move { shop.tables.lock().unwrap().clone() },
    )
    .run()
    .await;
    report.assert_passed();
    (report.explored(), started.elapsed())
}

async fn one_call() -> Duration {
    let started = Instant::now();
    let shop = Shop::new(StoreRef::new(MemoryStore::new()));
    shop.place("order-7".to_owned())
        .await
        .expect("a clean call");
    started.elapsed()
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let rounds: usize = env("IDEM_BENCH_ROUNDS", 20).max(1);
    rt.block_on(async {
        // Warm both paths once.
        explore().await;
        one_call().await;
        let (mut whole, mut single) = (Vec::new(), Vec::new());
        let mut schedules = 0;
        for _ in 0..rounds {
            let (n, t) = explore().await;
            schedules = n;
            whole.push(t.as_secs_f64());
            single.push(one_call().await.as_secs_f64());
        }
        let (lo, hi) = (
            whole.iter().copied().fold(f64::MAX, f64::min),
            whole.iter().copied().fold(0.0, f64::max),
        );
        let (whole, single) = (median(whole), median(single));
        let mut csv = Csv::new("explorer");
        let (table, x) = ("explorer, 3 steps, memory store", "");
        csv.row(table, "schedules", x, schedules as f64, None, "count", rounds);
        csv.row(table, "whole run", x, whole * 1e3, Some((lo * 1e3, hi * 1e3)), "ms", rounds);
        csv.row(table, "one clean call", x, single * 1e6, None, "µs", rounds);
        // One clean call takes microseconds, too short to time alone: the
        // ratio of the medians, with no per-round spread.
        let ratio = whole / single;
        csv.row(table, "whole run ÷ one clean call", x, ratio, None, "ratio", rounds);
        println!("load average: {}", load());
        println!(
            "explorer over a flow of 3 steps on the memory store: {schedules} schedules in {:.2} ms (median of {rounds}; {:.2}–{:.2} ms), {:.0}× one clean call ({:.1} µs)",
            whole * 1e3,
            lo * 1e3,
            hi * 1e3,
            whole / single,
            single * 1e6
        );
        csv.write();
    });
}
