//! The consumer scenarios every broker runs unchanged, against the real
//! broker: each `consumer_<broker>.rs` implements [`Broker`] and calls these.
//!
//! Nothing asserts a duration: conditions are polled with generous deadlines,
//! and the delays are short only so the suite is quick.
//!
//! - `mod.rs`: the [`Broker`] a test file implements, the handler and its
//!   ledger, the runner and polling helpers;
//! - `scenarios.rs`: the cases every broker runs;
//! - `parking.rs`: the adapters' `publish_raw` and `parked`, around a runner
//!   that parks;
//! - `crash.rs`: the fault case, with consumer processes it kills.

mod crash;
mod parking;
mod scenarios;

pub use crash::crash_and_panic_are_parked;
pub use parking::*;
pub use scenarios::*;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::consumer::{Parked, Runner, Source, Stats};
use idem_runtime::store::StoreRef;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{ManualClock, idempotent};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

pub const SCOPE: &str = "tests.consumer.settle";
pub const EVENT: &str = "SETTLE";

/// A broker under test: fresh names per test, so engineers sharing the broker
/// never see each other's messages.
#[async_trait::async_trait]
pub trait Broker: Send + Sync + 'static {
    type Src: Source + 'static;
    /// Publishes with the adapter's typed `publish`.
    async fn publish(&self, order: &OrderPaid);
    /// Publishes bytes as they are, with the adapter's `publish_raw`.
    async fn publish_raw(&self, body: &[u8], message_id: Option<&str>);
    /// A consumer in the shared group, on a connection of its own.
    async fn consumer(&self, name: &str) -> Self::Src;
    /// The same, set up to hand out `concurrency` deliveries at once (a
    /// prefetch or a batch at least that large).
    async fn consumer_for(&self, name: &str, concurrency: usize) -> Self::Src {
        let _ = concurrency;
        self.consumer(name).await
    }
    /// The parked messages, read with the adapter's `parked`, which leaves
    /// them parked.
    async fn parked(&self) -> Vec<Parked>;
    /// The stream or queue the consumers read: a parked message's origin.
    fn origin(&self) -> String;
    /// Whether parked messages wait in a stream, which gives each a time and
    /// a position (not in a queue).
    fn parking_is_a_stream(&self) -> bool {
        true
    }
    /// No message waits to be delivered, redelivered or acked.
    async fn drained(&self) -> bool;
    /// Deletes what the test created.
    async fn cleanup(&self);
    /// Cuts a dead consumer's connection (after its task was aborted).
    async fn kill(&self, _name: &str) {}
    /// How `src/bin/consumer_crash.rs` reaches this broker's messages: its
    /// arguments after the consumer name and the key prefix.
    fn child_args(&self) -> Vec<String>;
}

pub async fn publish<B: Broker>(broker: &B, order: &OrderPaid) {
    broker.publish(order).await;
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderPaid {
    pub order_id: String,
    pub amount: u64,
}

pub fn order(id: impl Into<String>) -> OrderPaid {
    OrderPaid {
        order_id: id.into(),
        amount: 100,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error("the ledger is down")]
    LedgerDown,
    #[error("the notifier is down")]
    NotifierDown,
}

/// The handler's world: its store, and what it did per order.
pub struct Ledger {
    pub store: StoreRef,
    /// Settlements made (the effect that must happen once).
    effects: Mutex<HashMap<String, u32>>,
    /// Times the body started.
    pub calls: AtomicU32,
    /// Permits handed out when a `hold-*` or `hang-*` body has started.
    pub started: Semaphore,
    /// Permits that let a `hold-*` body finish.
    pub release: Semaphore,
    /// Notifications attempted and sent per order (see [`Ledger::notify`]).
    notifications: Mutex<HashMap<String, (u32, u32)>>,
    /// Bodies running now, and the most that ever ran at once.
    pub running: AtomicU32,
    pub most_running: AtomicU32,
}

/// Counts a body in [`Ledger::running`] while it lives, whichever way it ends.
struct Running<'a>(&'a Ledger);

impl<'a> Running<'a> {
    fn start(ledger: &'a Ledger) -> Running<'a> {
        let now = ledger.running.fetch_add(1, SeqCst) + 1;
        ledger.most_running.fetch_max(now, SeqCst);
        Running(ledger)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, SeqCst);
    }
}

impl Ledger {
    pub fn new(store: impl idem_runtime::store::Store + 'static) -> Arc<Ledger> {
        Arc::new(Ledger {
            store: StoreRef::new(store),
            effects: Mutex::default(),
            calls: AtomicU32::new(0),
            started: Semaphore::new(0),
            release: Semaphore::new(0),
            notifications: Mutex::default(),
            running: AtomicU32::new(0),
            most_running: AtomicU32::new(0),
        })
    }

    /// An effect of the handler's own after its idempotent call: no record
    /// covers it. The first attempt per order fails.
    pub fn notify(&self, order_id: &str) -> Result<(), SettleError> {
        let mut all = self.notifications.lock().unwrap();
        let (tried, sent) = all.entry(order_id.to_owned()).or_default();
        *tried += 1;
        if *tried == 1 {
            return Err(SettleError::NotifierDown);
        }
        *sent += 1;
        Ok(())
    }

    /// Notifications sent for `order_id`.
    pub fn notified(&self, order_id: &str) -> u32 {
        self.notifications
            .lock()
            .unwrap()
            .get(order_id)
            .map_or(0, |(_, sent)| *sent)
    }

    pub fn effects(&self, order_id: &str) -> u32 {
        self.effects
            .lock()
            .unwrap()
            .get(order_id)
            .copied()
            .unwrap_or(0)
    }

    pub fn all_effects(&self) -> HashMap<String, u32> {
        self.effects.lock().unwrap().clone()
    }
}

/// `poison-*` always fails, `hang-*` never finishes, `hold-*` waits for a
/// `release` permit; every other order settles.
#[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "tests.consumer.settle", store = ledger.store, lease = "2s")]
pub async fn settle(ledger: Arc<Ledger>, e: OrderPaid) -> Result<(), SettleError> {
    ledger.calls.fetch_add(1, SeqCst);
    let _running = Running::start(&ledger);
    if e.order_id.starts_with("poison") {
        return Err(SettleError::LedgerDown);
    }
    if e.order_id.starts_with("hang") {
        ledger.started.add_permits(1);
        std::future::pending::<()>().await;
    }
    if e.order_id.starts_with("hold") {
        ledger.started.add_permits(1);
        ledger.release.acquire().await.unwrap().forget();
    }
    *ledger
        .effects
        .lock()
        .unwrap()
        .entry(e.order_id.clone())
        .or_default() += 1;
    Ok(())
}

/// The runner the scenarios use: short delays so the suite is quick.
pub fn runner() -> Runner {
    Runner::new()
        .max_deliveries(3)
        .backoff(Duration::from_millis(100), Duration::from_millis(400))
        .in_progress_delay(Duration::from_millis(300))
}

/// A consumer task on `ledger`.
pub fn spawn<B: Broker>(
    source: B::Src,
    runner: &Runner,
    ledger: &Arc<Ledger>,
) -> tokio::task::JoinHandle<()>
where
    <B::Src as Source>::Delivery: 'static,
{
    let ledger = ledger.clone();
    spawn_with::<B, _, _, _>(source, runner, move |e: OrderPaid| {
        settle(ledger.clone(), e)
    })
}

/// A consumer task running `handler`.
pub fn spawn_with<B, H, Fut, T>(
    source: B::Src,
    runner: &Runner,
    handler: H,
) -> tokio::task::JoinHandle<()>
where
    B: Broker,
    <B::Src as Source>::Delivery: 'static,
    H: Fn(OrderPaid) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, SettleError>> + Send,
{
    let runner = runner.clone();
    tokio::spawn(async move {
        let err = runner.run(source, handler).await;
        panic!("the consumer stopped: {err}");
    })
}

/// Polls `cond` until it holds, failing after a deadline far above what any
/// scenario needs.
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(90);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn sum(runners: &[&Runner], f: impl Fn(&Stats) -> u64) -> u64 {
    runners.iter().map(|r| f(&r.stats())).sum()
}

/// A random suffix for names.
pub fn suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{random:016x}")
}
