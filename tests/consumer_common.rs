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
    /// The parked messages: each one's body and reason, leaving them parked.
    async fn parked(&self) -> Vec<(Vec<u8>, String)>;
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
}

impl Ledger {
    pub fn new(store: impl idem_runtime::Store + 'static) -> Arc<Ledger> {
        Arc::new(Ledger {
            store: StoreRef::new(store),
            effects: Mutex::default(),
            calls: AtomicU32::new(0),
            started: Semaphore::new(0),
            release: Semaphore::new(0),
            notifications: Mutex::default(),
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
    let mut reasons: Vec<String> = broker.parked().await.into_iter().map(|(_, r)| r).collect();
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

/// A handler that calls `settle`, gets `Ok`, and then fails its own next
/// effect (a notification) is redelivered, not acked: the record holds the
/// settlement, not the notification. The redelivery replays the settlement
/// and sends the notification.
pub async fn effect_after_the_call_is_not_lost<B: Broker>(broker: B) {
    let ledger = Ledger::new(MemoryStore::new());
    let runner = runner();
    publish(&broker, &order("notify-1")).await;
    let handler = {
        let ledger = ledger.clone();
        move |e: OrderPaid| {
            let ledger = ledger.clone();
            async move {
                let id = e.order_id.clone();
                settle(ledger.clone(), e).await?;
                ledger.notify(&id)
            }
        }
    };
    let task = spawn_with::<B, _, _, _>(broker.consumer("c1").await, &runner, handler);
    eventually("the message is acked", || async {
        runner.stats().acked == 1 && broker.drained().await
    })
    .await;
    task.abort();
    assert_eq!(ledger.effects("notify-1"), 1);
    assert_eq!(
        ledger.notified("notify-1"),
        1,
        "the notification after the settlement was lost: {:?}",
        runner.stats()
    );
    let stats = runner.stats();
    assert_eq!(
        (
            stats.retried,
            stats.deduplicated,
            stats.final_errors,
            stats.parked
        ),
        (1, 1, 0, 0),
        "{stats:?}"
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

/// `src/bin/consumer_crash.rs`: a consumer process the fault scenario kills.
const CHILD: &str = env!("CARGO_BIN_EXE_consumer_crash");

/// The consumer processes of the fault scenario, one at a time, as a
/// supervisor runs them: one that ends, killed or not, is replaced by a fresh
/// one.
struct Supervisor {
    args: Vec<String>,
    prefix: String,
    started: u32,
    current: Option<Consumer>,
    /// The orders at whose crash point a process was SIGKILLed, in order.
    killed: Vec<String>,
    /// Processes that ended on their own, with their status and stderr.
    died: Vec<String>,
    /// What the processes said, for failure messages.
    log: Vec<String>,
    /// The log's times count from here.
    since: Instant,
}

struct Consumer {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Supervisor {
    fn new(broker_args: Vec<String>, prefix: &str) -> Supervisor {
        let mut s = Supervisor {
            args: broker_args,
            prefix: prefix.to_owned(),
            started: 0,
            current: None,
            killed: Vec::new(),
            died: Vec::new(),
            log: Vec::new(),
            since: Instant::now(),
        };
        s.start();
        s
    }

    fn start(&mut self) {
        use std::io::{BufRead, BufReader, Read};
        use std::process::{Command, Stdio};

        self.started += 1;
        let mut child = Command::new(CHILD)
            .arg(format!("consumer-{}", self.started))
            .arg(&self.prefix)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start consumer_crash");
        let stdout = child.stdout.take().expect("stdout");
        let mut stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        self.current = Some(Consumer {
            child,
            lines,
            stderr: Some(stderr),
        });
    }

    /// SIGKILLs the process that reports standing at a crash point (`at
    /// <order>`), and replaces a process that is gone.
    fn tend(&mut self) {
        let c = self.current.as_mut().expect("a consumer runs");
        while let Ok(line) = c.lines.try_recv() {
            self.log.push(format!(
                "{:?} {}: {line}",
                self.since.elapsed(),
                self.started
            ));
            if let Some(order) = line.strip_prefix("at ") {
                // SIGKILL: no destructor, no release, no ack, no goodbye.
                c.child.kill().expect("SIGKILL the consumer");
                c.child.wait().expect("reap the consumer");
                self.killed.push(order.to_owned());
                self.log.push(format!("{:?} killed", self.since.elapsed()));
                self.start();
                return;
            }
        }
        if let Some(status) = c.child.try_wait().expect("poll the consumer") {
            let stderr = c.stderr.take().map(|h| h.join().unwrap_or_default());
            // The panic's own line, not the backtrace under it.
            let stderr = stderr.unwrap_or_default();
            let why = stderr
                .lines()
                .find(|l| l.contains("panicked") || l.starts_with("consumer_crash:"))
                .unwrap_or("");
            self.died.push(format!(
                "consumer-{} ended with {status}: {why}",
                self.started
            ));
            self.start();
        }
    }

    /// Tends the processes until `cond` holds, failing after a deadline far
    /// above what the scenario needs.
    async fn tend_until<F, Fut>(&mut self, what: &str, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            self.tend();
            if cond().await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}: killed inside {:?}, {} ended on their own, \
                 the first: {:?}; the consumers said:\n{}",
                self.killed,
                self.died.len(),
                self.died.first(),
                self.log.join("\n")
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether the current process is alive (not ended since the last
    /// `tend`).
    fn alive(&mut self) -> bool {
        let c = self.current.as_mut().expect("a consumer runs");
        c.child.try_wait().expect("poll the consumer").is_none()
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        if let Some(c) = self.current.as_mut() {
            let _ = c.child.kill();
            let _ = c.child.wait();
        }
    }
}

fn order_id(body: &[u8]) -> String {
    serde_json::from_slice::<OrderPaid>(body).map_or_else(|_| format!("{body:?}"), |o| o.order_id)
}

/// The fault scenario, across real processes, one message at a time: one
/// that panics its handler's body on every delivery; one whose process is
/// SIGKILLed inside the body (the key claimed) on every delivery; one whose
/// process is SIGKILLed in the handler before it calls the body (no claim);
/// then a normal one. Each of the first three is parked once, after exactly
/// `max_deliveries` (3) runs, and takes no effect; no process ends but by the
/// kills; and the fresh process after the last kill still consumes: the
/// normal message is processed once.
///
/// One message at a time keeps a kill away from another message's due
/// redelivery: a NATS server before the 2.10 series can then hand a message
/// out again with its count gone back (nats-server#5305), as the README says.
pub async fn crash_and_panic_are_parked<B: Broker>(broker: B) {
    let url = idem_tests::services::redis_url();
    let connected = async {
        redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection()
            .await
    };
    let Some(redis) = idem_tests::services::reachable("Redis", &url, connected.await) else {
        broker.cleanup().await;
        return;
    };
    let prefix = format!("idem-test-consumer-crash-{}:", suffix());
    let counts = async |what: &str| -> HashMap<String, u32> {
        redis::cmd("HGETALL")
            .arg(format!("{prefix}{what}"))
            .query_async(&mut redis.clone())
            .await
            .unwrap()
    };
    let parked = async || -> Vec<(String, String)> {
        let mut all: Vec<_> = broker
            .parked()
            .await
            .into_iter()
            .map(|(body, reason)| (order_id(&body), reason))
            .collect();
        all.sort();
        all
    };
    let is_parked = async |id: &str| parked().await.iter().any(|(o, _)| o == id);

    let mut consumers = Supervisor::new(broker.child_args(), &prefix);
    publish(&broker, &order("panic-1")).await;
    consumers
        .tend_until("panic-1 is parked", || is_parked("panic-1"))
        .await;
    for id in ["crash-body-1", "crash-early-1"] {
        publish(&broker, &order(id)).await;
        consumers
            .tend_until(&format!("{id} is parked"), || is_parked(id))
            .await;
    }
    publish(&broker, &order("after-1")).await;
    consumers
        .tend_until("after-1 is processed", || async {
            counts("effects").await.get("after-1") == Some(&1) && broker.drained().await
        })
        .await;
    // Long enough for a stray redelivery of a parked message to show up.
    tokio::time::sleep(Duration::from_secs(1)).await;
    consumers.tend();
    let alive = consumers.alive();
    let (calls, effects, parked) = (
        counts("calls").await,
        counts("effects").await,
        parked().await,
    );
    let seen = format!(
        "bodies started {calls:?}, parked {parked:?}, the consumers said:\n{}",
        consumers.log.join("\n")
    );
    let (killed, died) = (consumers.killed.clone(), consumers.died.clone());
    drop(consumers);

    assert!(
        died.is_empty(),
        "processes ended on their own: {died:?}\n{seen}"
    );
    assert!(
        alive,
        "the last consumer process must still be running\n{seen}"
    );
    let mut expected_kills = vec!["crash-body-1"; 3];
    expected_kills.extend(["crash-early-1"; 3]);
    assert_eq!(killed, expected_kills, "{seen}");
    assert_eq!(calls.get("panic-1"), Some(&3), "{seen}");
    assert_eq!(calls.get("crash-body-1"), Some(&3), "{seen}");
    assert_eq!(calls.get("crash-early-1"), None, "{seen}");
    assert_eq!(
        effects,
        HashMap::from([("after-1".to_owned(), 1)]),
        "only the normal message takes effect, once\n{seen}"
    );
    let ids: Vec<&str> = parked.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        ["crash-body-1", "crash-early-1", "panic-1"],
        "each is parked once\n{seen}"
    );
    for (_, reason) in &parked[..2] {
        assert!(
            reason.starts_with("delivered 4 times, over max_deliveries (3)")
                && reason.contains("not run"),
            "{seen}"
        );
    }
    assert!(
        parked[2].1.starts_with("failed 3 counted deliveries")
            && parked[2]
                .1
                .contains("the handler panicked: settling panic-1 broke the handler"),
        "{seen}"
    );

    let mut redis = redis;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut redis)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(keys)
            .query_async(&mut redis)
            .await
            .unwrap();
    }
    broker.cleanup().await;
}
