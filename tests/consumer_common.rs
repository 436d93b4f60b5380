//! The consumer scenarios every broker runs unchanged, against the real
//! broker: each `consumer_<broker>.rs` implements [`Broker`] and calls these.
//!
//! Nothing asserts a duration: conditions are polled with generous deadlines,
//! and the delays are short only so the suite is quick.

#![allow(dead_code)] // each broker's file uses what it needs

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_runtime::consumer::{Runner, Source, Stats};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{ManualClock, StoreRef, idempotent};
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
    /// Publishes raw bytes.
    async fn publish_raw(&self, body: Vec<u8>);
    /// A consumer in the shared group, on a connection of its own.
    async fn consumer(&self, name: &str) -> Self::Src;
    /// The reasons of the parked messages.
    async fn parked(&self) -> Vec<String>;
    /// No message waits to be delivered, redelivered or acked.
    async fn drained(&self) -> bool;
    /// Deletes what the test created.
    async fn cleanup(&self);
    /// Cuts a dead consumer's connection (after its task was aborted).
    async fn kill(&self, _name: &str) {}
}

pub async fn publish<B: Broker>(broker: &B, order: &OrderPaid) {
    broker.publish_raw(serde_json::to_vec(order).unwrap()).await;
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
}

impl Ledger {
    pub fn new(store: impl idem_runtime::Store + 'static) -> Arc<Ledger> {
        Arc::new(Ledger {
            store: StoreRef::new(store),
            effects: Mutex::default(),
            calls: AtomicU32::new(0),
            started: Semaphore::new(0),
            release: Semaphore::new(0),
        })
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
    Runner::new(SCOPE, EVENT)
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
    let runner = runner.clone();
    let ledger = ledger.clone();
    tokio::spawn(async move {
        let err = runner
            .run(source, move |e: OrderPaid| settle(ledger.clone(), e))
            .await;
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

/// A duplicate publish is processed once, and acked twice.
pub async fn duplicate_publish_is_processed_once<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner();
    let o = order("dup-1");
    publish(&broker, &o).await;
    publish(&broker, &o).await;
    let task = spawn::<B>(broker.consumer("c1").await, &runner, &ledger);
    eventually("both copies are acked", || async {
        runner.stats().acked == 2 && broker.drained().await
    })
    .await;
    task.abort();
    let stats = runner.stats();
    assert_eq!(ledger.effects("dup-1"), 1);
    assert_eq!(
        ledger.calls.load(SeqCst),
        1,
        "the duplicate must not run the body"
    );
    assert_eq!((stats.processed, stats.deduplicated), (1, 1), "{stats:?}");
    assert_eq!(stats.parked, 0);
    broker.cleanup().await;
}

/// A consumer that dies mid-message (its task gone, its connection cut,
/// nothing acked) leaves the message to another consumer, and the effect
/// happens once.
pub async fn dead_consumer_is_taken_over<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let (r1, r2) = (runner(), runner());
    let o = order("hang-1");
    publish(&broker, &o).await;
    let doomed = spawn::<B>(broker.consumer("doomed").await, &r1, &ledger);
    ledger.started.acquire().await.unwrap().forget();
    doomed.abort();
    let _ = doomed.await;
    broker.kill("doomed").await;
    // The survivor is a healthy process: same scope, event and key, a body
    // that does not hang.
    let survivor = {
        let runner = r2.clone();
        let ledger = ledger.clone();
        let src = broker.consumer("survivor").await;
        tokio::spawn(async move {
            let err = runner
                .run(src, move |e: OrderPaid| settle_healthy(ledger.clone(), e))
                .await;
            panic!("the consumer stopped: {err}");
        })
    };
    eventually("the survivor acks the message", || async {
        r2.stats().acked == 1 && broker.drained().await
    })
    .await;
    survivor.abort();
    assert_eq!(ledger.effects("hang-1"), 1, "the effect happens once");
    let stats = r2.stats();
    assert_eq!(stats.processed, 1, "{stats:?}");
    assert_eq!(stats.parked, 0, "{stats:?}");
    broker.cleanup().await;
}

/// `settle` for a process that does not hang: same scope, event and key, so it
/// meets the dead consumer's claim.
#[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "tests.consumer.settle", store = ledger.store, lease = "2s")]
pub async fn settle_healthy(ledger: Arc<Ledger>, e: OrderPaid) -> Result<(), SettleError> {
    ledger.calls.fetch_add(1, SeqCst);
    *ledger
        .effects
        .lock()
        .unwrap()
        .entry(e.order_id.clone())
        .or_default() += 1;
    Ok(())
}

/// A redelivery a day later (on the store's clock) is deduplicated: the
/// consumer ttl (7 days) outlives it.
pub async fn replay_a_day_later_is_deduplicated<B: Broker>(broker: B) {
    let clock = ManualClock::new(1_700_000_000_000);
    let ledger = Ledger::new(MemoryStore::builder().clock(clock.clone()).build());
    let runner = runner();
    let o = order("late-1");
    publish(&broker, &o).await;
    let task = spawn::<B>(broker.consumer("c1").await, &runner, &ledger);
    eventually("the first copy is acked", || async {
        runner.stats().acked == 1
    })
    .await;
    clock.advance(Duration::from_secs(24 * 3600));
    publish(&broker, &o).await;
    eventually("the replay is acked", || async {
        runner.stats().acked == 2 && broker.drained().await
    })
    .await;
    task.abort();
    assert_eq!(ledger.effects("late-1"), 1);
    assert_eq!(runner.stats().deduplicated, 1, "{:?}", runner.stats());
    broker.cleanup().await;
}

/// A message that always fails is parked after the configured deliveries
/// (3), with its reason, and not retried after that; an undecodable one is
/// parked at once without reaching the handler.
pub async fn poison_is_parked<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner();
    publish(&broker, &order("poison-1")).await;
    broker.publish_raw(b"{\"order_id\": 7".to_vec()).await;
    let task = spawn::<B>(broker.consumer("c1").await, &runner, &ledger);
    eventually("both are parked", || async {
        runner.stats().parked == 2 && broker.drained().await
    })
    .await;
    // Long enough for a fourth delivery to show up if parking did not stop it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    task.abort();
    assert_eq!(
        ledger.calls.load(SeqCst),
        3,
        "three deliveries, then parked"
    );
    let stats = runner.stats();
    assert_eq!((stats.retried, stats.parked), (2, 2), "{stats:?}");
    let mut reasons = broker.parked().await;
    reasons.sort();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[0].starts_with("failed 3 counted deliveries") && reasons[0].contains("LedgerDown"),
        "{reasons:?}"
    );
    assert!(reasons[1].starts_with("undecodable: "), "{reasons:?}");
    assert!(
        !reasons[1].contains('7'),
        "a reason never quotes the message"
    );
    broker.cleanup().await;
}

/// Two consumers in one group, 200 messages of which 30% are duplicates:
/// every order settles exactly once.
pub async fn two_consumers_settle_each_order_once<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let (r1, r2) = (runner(), runner());
    let unique: Vec<OrderPaid> = (0..140).map(|i| order(format!("load-{i}"))).collect();
    let mut messages = unique.clone();
    // 60 duplicates spread over the run: every 7th order thrice, others twice.
    messages.extend((0..60).map(|i| unique[(i * 7) % 140].clone()));
    // Interleave so duplicates often meet their originals in flight.
    let mut order_of = (0..messages.len()).collect::<Vec<_>>();
    order_of.sort_by_key(|i| (i * 37) % messages.len());
    let t1 = spawn::<B>(broker.consumer("c1").await, &r1, &ledger);
    let t2 = spawn::<B>(broker.consumer("c2").await, &r2, &ledger);
    for i in order_of {
        publish(&broker, &messages[i]).await;
    }
    eventually("all 200 are acked", || async {
        sum(&[&r1, &r2], |s| s.acked) >= 200 && broker.drained().await
    })
    .await;
    t1.abort();
    t2.abort();
    let effects = ledger.all_effects();
    assert_eq!(effects.len(), 140);
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "settled more than once: {twice:?}");
    assert_eq!(sum(&[&r1, &r2], |s| s.processed), 140);
    assert_eq!(sum(&[&r1, &r2], |s| s.parked), 0);
    assert!(
        r1.stats().delivered > 0 && r2.stats().delivered > 0,
        "both consumers took part: {:?} {:?}",
        r1.stats(),
        r2.stats()
    );
    broker.cleanup().await;
}

/// A duplicate that meets its original in progress is redelivered later, more
/// often than `max_deliveries`, and is still not parked: `InProgress` is not
/// a failure. The metrics say so too.
pub fn in_progress_is_not_a_failure<B: Broker>(make: impl Future<Output = Option<B>>) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let ran = metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let Some(broker) = make.await else {
                return false;
            };
            let ledger = Ledger::new(MemoryStore::new());
            let (r1, r2) = (runner(), runner());
            let o = order("hold-1");
            publish(&broker, &o).await;
            let t1 = spawn::<B>(broker.consumer("c1").await, &r1, &ledger);
            ledger.started.acquire().await.unwrap().forget();
            // c1 holds the claim (its heartbeat renews the lease) while c2
            // meets the duplicate.
            publish(&broker, &o).await;
            let t2 = spawn::<B>(broker.consumer("c2").await, &r2, &ledger);
            eventually("c2 deferred more often than max_deliveries", || async {
                r2.stats().deferred > 3
            })
            .await;
            ledger.release.add_permits(1);
            // At least both copies: a broker may also hand out a copy again
            // that waited past its ack deadline in a busy consumer's buffer.
            eventually("both are acked", || async {
                sum(&[&r1, &r2], |s| s.acked) >= 2 && broker.drained().await
            })
            .await;
            t1.abort();
            t2.abort();
            assert_eq!(ledger.effects("hold-1"), 1);
            assert_eq!(ledger.calls.load(SeqCst), 1);
            // Whichever consumer takes the deferred copy last replays it.
            assert!(sum(&[&r1, &r2], |s| s.deduplicated) >= 1);
            assert_eq!(sum(&[&r1, &r2], |s| s.parked + s.retried), 0);
            broker.cleanup().await;
            true
        })
    });
    if !ran {
        return;
    }
    let snapshot = snapshotter.snapshot().into_vec();
    let count = |name: &str, extra: &[(&str, &str)]| -> u64 {
        snapshot
            .iter()
            .filter(|(key, _, _, _)| {
                let key = key.key();
                key.name() == name
                    && key
                        .labels()
                        .any(|l| l.key() == "scope" && l.value() == SCOPE)
                    && key
                        .labels()
                        .any(|l| l.key() == "event" && l.value() == EVENT)
                    && extra
                        .iter()
                        .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
            })
            .map(|(_, _, _, v)| match v {
                DebugValue::Counter(n) => *n,
                _ => 0,
            })
            .sum()
    };
    assert!(
        count(
            "idem_consumer_redelivered_total",
            &[("reason", "in_progress")]
        ) > 3
    );
    assert_eq!(
        count("idem_consumer_redelivered_total", &[("reason", "failed")]),
        0
    );
    assert_eq!(count("idem_consumer_parked_total", &[]), 0);
    assert!(count("idem_consumer_acked_total", &[]) >= 2);
    assert!(count("idem_consumer_deduplicated_total", &[]) >= 1);
    assert!(count("idem_consumer_delivered_total", &[]) >= 6);
}

/// A random suffix for names.
pub fn suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{random:016x}")
}
