//! Consumers: one runner that turns what an idempotent handler did into what
//! the broker does with the message, the same way for every broker.
//!
//! | what the handler's call did | broker action | counts toward `max_deliveries` |
//! |---|---|---|
//! | ran and recorded `Ok`, or a stored final error (`final_err`) | ack | — |
//! | replayed a recorded outcome (a duplicate) | ack | — |
//! | `InProgress`: another delivery of the same key is running | redeliver after `in_progress_delay` | no |
//! | a retryable `Err`, or the store could not claim or record | redeliver after a backoff; park at `max_deliveries` | yes |
//! | recorded or replayed `Ok`, then the handler returned `Err` | the same: what failed after the call is in no record | yes |
//! | the handler panicked | the same | yes |
//! | `KeyReuse`, a stored result that no longer decodes | park at once | — |
//! | the payload does not decode into the message type | park at once | — |
//! | nothing yet: the delivery's count is already past `max_deliveries` | park without running the handler | — |
//!
//! The ack is sent only after the store has recorded the outcome: "process,
//! then mark". Marking first would lose the message for good if the process
//! died in between; acking after means a crash redelivers it, and the record
//! turns the redelivery into a replay. An `Err` is acked only when the record
//! holds that very error.
//!
//! A delivery that ends without a verdict (the process crashed or was killed,
//! or the handler hung past the broker's redelivery timeout) still counts, so
//! a message that takes its consumer down every time reaches
//! `max_deliveries` and is parked before it can take the next one down.
//!
//! The runner learns what the annotated call did from the protocol itself
//! (the outcome it also counts in `idem_calls_total`), so the handler's error
//! type needs nothing beyond `Debug`: no trait to implement, no wrapper to
//! return. Write the handler as the attribute already wants it:
//!
//! ```
//! use idem_runtime::consumer::{Acked, Action, Runner, testing::Memory};
//! use idem_runtime::idempotent;
//! use idem_runtime::store::memory::MemoryStore;
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPaid { order_id: String }
//!
//! #[derive(Debug)]
//! enum SettleError { Idem(idem_runtime::Error) }
//! impl From<idem_runtime::Error> for SettleError {
//!     fn from(e: idem_runtime::Error) -> Self { SettleError::Idem(e) }
//! }
//!
//! #[idempotent(consumer, event = "SETTLE", key = "e.order_id", scope = "doc.settle")]
//! async fn settle(e: OrderPaid) -> Result<(), SettleError> {
//!     Ok(()) // write the settlement
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! idem_runtime::install(MemoryStore::new());
//! let runner = Runner::new("doc.settle", "SETTLE");
//! let msg = br#"{"order_id":"o-1"}"#;
//! let first = runner.process(Memory::new(msg), &settle).await.unwrap();
//! let again = runner.process(Memory::new(msg), &settle).await.unwrap();
//! assert_eq!(first, Action::Acked(Acked::Processed));
//! assert_eq!(again, Action::Acked(Acked::Deduplicated));
//! # });
//! ```
//!
//! Each broker is a [`Source`] of [`Delivery`]s: `redis_streams` (feature
//! `redis-streams`), `rabbitmq` (feature `rabbitmq`) and `jetstream` (feature
//! `jetstream`). Another broker needs only those two traits.

#[cfg(feature = "jetstream")]
#[cfg_attr(docsrs, doc(cfg(feature = "jetstream")))]
pub mod jetstream;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;
#[cfg(feature = "redis-streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-streams")))]
pub mod redis_streams;

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use serde::de::DeserializeOwned;

use crate::error::CodecError;
use crate::observe::CallOutcome;
use crate::protocol::report::{self, Noted};

/// Tells the runner that what the handler's annotated call recorded did not
/// last: the caller's transaction carrying the record (`tx = tx`) failed to
/// commit. The delivery then counts as a retryable failure instead of being
/// acked on a record that does not exist.
///
/// ```
/// # struct Tx; impl Tx { async fn commit(self) -> Result<(), std::io::Error> { Ok(()) } }
/// # async fn handler(tx: Tx) -> Result<(), std::io::Error> {
/// // let mut tx = pool.begin().await?;
/// // settle(&mut tx, e).await?;   // #[idempotent(consumer, tx = tx, …)]
/// if let Err(e) = tx.commit().await {
///     idem_runtime::consumer::mark_rolled_back();
///     return Err(e);
/// }
/// # Ok(()) }
/// ```
pub fn mark_rolled_back() {
    report::rolled_back();
}

/// A broker failed to take an ack, a redelivery or a parked copy (or to hand
/// out the next message). The message is then redelivered by the broker, and
/// the record turns that redelivery into a replay.
#[derive(Debug)]
pub struct BrokerError {
    broker: &'static str,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl BrokerError {
    /// Wraps a client error.
    ///
    /// ```
    /// let e = idem_runtime::consumer::BrokerError::new("redis", std::io::Error::other("reset"));
    /// assert_eq!(e.to_string(), "broker redis: reset");
    /// ```
    pub fn new(
        broker: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        BrokerError {
            broker,
            source: source.into(),
        }
    }

    /// The broker's name.
    pub fn broker(&self) -> &'static str {
        self.broker
    }
}

impl fmt::Display for BrokerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "broker {}: {}", self.broker, self.source)
    }
}

impl std::error::Error for BrokerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// One delivered message and what the broker can do with it: the page of
/// code a broker adapter is.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::consumer::{BrokerError, Delivery};
///
/// /// A queue that is a `Vec`: enough to show the shape.
/// struct VecDelivery { body: Vec<u8>, attempt: u32, log: std::sync::Arc<std::sync::Mutex<Vec<String>>> }
///
/// #[async_trait::async_trait]
/// impl Delivery for VecDelivery {
///     fn payload(&self) -> Option<&[u8]> { Some(&self.body) }
///     fn attempt(&self) -> u32 { self.attempt }
///     async fn ack(self) -> Result<(), BrokerError> { self.log.lock().unwrap().push("ack".into()); Ok(()) }
///     async fn retry(self, after: Duration) -> Result<(), BrokerError> {
///         self.log.lock().unwrap().push(format!("retry in {after:?}")); Ok(())
///     }
///     async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
///         self.log.lock().unwrap().push(format!("defer {after:?}")); Ok(None)
///     }
///     async fn park(self, reason: &str) -> Result<(), BrokerError> {
///         self.log.lock().unwrap().push(format!("park: {reason}")); Ok(())
///     }
/// }
/// ```
#[async_trait::async_trait]
pub trait Delivery: Send + Sized {
    /// The message body (JSON of the handler's message type), or `None` when
    /// the message has no body this adapter recognises (it is parked).
    fn payload(&self) -> Option<&[u8]>;

    /// The counted delivery this is, from 1: failed attempts and crashes of a
    /// consumer holding it count, `InProgress` redeliveries do not. A crash
    /// must count even when no handler saw the message's verdict: the runner
    /// parks a delivery past `max_deliveries` without running the handler.
    fn attempt(&self) -> u32;

    /// The outcome is recorded: remove the message for good.
    async fn ack(self) -> Result<(), BrokerError>;

    /// A counted failure: deliver it again, to any consumer, no sooner than
    /// `after` (never an immediate requeue, which turns a hot failure into a
    /// busy loop).
    async fn retry(self, after: Duration) -> Result<(), BrokerError>;

    /// `InProgress`: deliver it again no sooner than `after` without counting
    /// a failure. A broker that cannot delay a redelivery without counting it
    /// keeps the message instead, waits `after` (telling the broker it is still
    /// being worked on) and returns it, and the runner runs it again.
    async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError>;

    /// Move it where an operator sees it (a dead-letter queue, a parking
    /// stream), with the reason, and remove it from the live queue.
    async fn park(self, reason: &str) -> Result<(), BrokerError>;
}

/// Where deliveries come from: a consumer in a group, a queue subscription.
#[async_trait::async_trait]
pub trait Source: Send {
    /// What this source hands out.
    type Delivery: Delivery;

    /// The next delivery, waiting for one.
    async fn next(&mut self) -> Result<Self::Delivery, BrokerError>;
}

/// Why a message was acked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acked {
    /// The handler's body ran and its result was recorded.
    Processed,
    /// A recorded outcome was replayed: a duplicate or a redelivery.
    Deduplicated,
    /// The body ran and returned an error its `final_err` stores: recorded
    /// like a success, and replayed to duplicates.
    FinalError,
}

/// What the runner did with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Acked after the outcome was recorded.
    Acked(Acked),
    /// A counted failure, redelivered after `after`.
    Retried {
        /// The backoff.
        after: Duration,
        /// The counted delivery that failed.
        attempt: u32,
    },
    /// `InProgress`: redelivered after `after`, not counted as a failure.
    Deferred {
        /// The delay.
        after: Duration,
    },
    /// Parked where an operator sees it.
    Parked {
        /// Why.
        reason: String,
    },
}

#[derive(Default)]
struct Counters {
    delivered: AtomicU64,
    acked: AtomicU64,
    processed: AtomicU64,
    deduplicated: AtomicU64,
    final_errors: AtomicU64,
    retried: AtomicU64,
    deferred: AtomicU64,
    parked: AtomicU64,
}

/// What one [`Runner`] (and its clones) did so far; the same numbers go to the
/// `metrics` facade.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Deliveries taken from the broker (a delivery kept and run again after
    /// `InProgress` counts again).
    pub delivered: u64,
    /// Messages acked.
    pub acked: u64,
    /// Acked after the body ran.
    pub processed: u64,
    /// Acked after a replay.
    pub deduplicated: u64,
    /// Acked after a stored final error.
    pub final_errors: u64,
    /// Redelivered after a counted failure.
    pub retried: u64,
    /// Redelivered after `InProgress`, not counted as failures.
    pub deferred: u64,
    /// Parked.
    pub parked: u64,
}

impl Stats {
    /// Redeliveries of either kind.
    pub fn redelivered(&self) -> u64 {
        self.retried + self.deferred
    }
}

/// Maps a handler's outcome to a broker action, counts it, and carries it out.
///
/// `scope` and `event` label the metrics (`idem_consumer_*_total{scope,
/// event}`); give the attribute's. Cloning shares the counters.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::consumer::Runner;
///
/// let runner = Runner::new("settlement.on_order_paid", "SETTLE")
///     .max_deliveries(5)
///     .backoff(Duration::from_secs(1), Duration::from_secs(30))
///     .in_progress_delay(Duration::from_secs(2));
/// assert_eq!(runner.stats().delivered, 0);
/// ```
#[derive(Clone)]
pub struct Runner {
    scope: &'static str,
    event: &'static str,
    max_deliveries: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    in_progress_delay: Duration,
    counters: Arc<Counters>,
}

impl Runner {
    /// A runner with the defaults: 5 counted deliveries, backoff from 1 s
    /// doubling to 30 s, `InProgress` redelivered after 2 s.
    pub fn new(scope: &'static str, event: &'static str) -> Runner {
        Runner {
            scope,
            event,
            max_deliveries: 5,
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            in_progress_delay: Duration::from_secs(2),
            counters: Arc::default(),
        }
    }

    /// How many counted deliveries a message gets before it is parked (at
    /// least 1).
    pub fn max_deliveries(mut self, n: u32) -> Runner {
        self.max_deliveries = n.max(1);
        self
    }

    /// The delay after the first failure, doubling per failure up to `max`.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Runner {
        self.first_backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// How long an `InProgress` message waits before it is delivered again:
    /// about as long as the handler usually takes.
    pub fn in_progress_delay(mut self, delay: Duration) -> Runner {
        self.in_progress_delay = delay;
        self
    }

    /// The counters so far.
    pub fn stats(&self) -> Stats {
        let c = &*self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            delivered: get(&c.delivered),
            acked: get(&c.acked),
            processed: get(&c.processed),
            deduplicated: get(&c.deduplicated),
            final_errors: get(&c.final_errors),
            retried: get(&c.retried),
            deferred: get(&c.deferred),
            parked: get(&c.parked),
        }
    }

    /// The backoff after the `attempt`-th counted failure.
    fn backoff_for(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.first_backoff
            .saturating_mul(1u32 << doublings)
            .min(self.max_backoff)
    }

    /// Runs `handler` on one delivery and does with the message what its
    /// outcome says (see the module documentation). The handler is the
    /// annotated function itself, or a closure around it.
    ///
    /// An `Err` is only a broker failure; the handler's own errors and panics
    /// become redeliveries or parked messages.
    ///
    /// Dropping the returned future (a timeout around it, an aborted task)
    /// acks nothing and releases nothing: the message comes back as after a
    /// crash, counted, and the key stays claimed until its lease runs out
    /// (with `tx = tx`, until the dropped transaction rolls back).
    pub async fn process<D, M, T, E, H, Fut>(
        &self,
        delivery: D,
        handler: &H,
    ) -> Result<Action, BrokerError>
    where
        D: Delivery,
        M: DeserializeOwned,
        H: Fn(M) -> Fut + ?Sized,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Debug,
    {
        let mut delivery = delivery;
        loop {
            self.count(&self.counters.delivered, "idem_consumer_delivered_total");
            let attempt = delivery.attempt();
            let decision = match delivery.payload().map(serde_json::from_slice::<M>) {
                // Counted deliveries past the limit that never got a verdict
                // from this runner: each ended with its consumer (a crash, a
                // kill, a hang past the broker's timeout). Running the handler
                // again would most likely end this consumer too.
                _ if attempt > self.max_deliveries => Decision::Park(format!(
                    "delivered {attempt} times, over max_deliveries ({}): the handler was not run; \
                     the deliveries before ended without an outcome (the consumer crashed, \
                     was killed or hung)",
                    self.max_deliveries
                )),
                None => Decision::Park("undecodable: the message has no payload".to_owned()),
                // The reason keeps serde's category and position, not the
                // value: message bodies hold customers' data and reasons end
                // up in logs and parking streams.
                Some(Err(e)) => Decision::Park(format!("undecodable: {}", CodecError::from(e))),
                Some(Ok(message)) => {
                    // Inside the async block, so a panic while making the
                    // future is caught too.
                    let run = AssertUnwindSafe(async { handler(message).await }).catch_unwind();
                    match report::observed(run).await {
                        (Ok(result), noted) => self.decide(&result, noted, attempt),
                        (Err(panic), _) => {
                            let why = panic_message(&*panic);
                            tracing::error!(
                                scope = self.scope,
                                event = self.event,
                                attempt,
                                panic = why,
                                "the handler panicked"
                            );
                            self.failed(attempt, format!("the handler panicked: {why}"))
                        }
                    }
                }
            };
            match decision {
                Decision::Ack(why) => {
                    delivery.ack().await?;
                    self.count(&self.counters.acked, "idem_consumer_acked_total");
                    match why {
                        Acked::Processed => {
                            self.count(&self.counters.processed, "idem_consumer_processed_total")
                        }
                        Acked::Deduplicated => self.count(
                            &self.counters.deduplicated,
                            "idem_consumer_deduplicated_total",
                        ),
                        Acked::FinalError => self.count(
                            &self.counters.final_errors,
                            "idem_consumer_final_errors_total",
                        ),
                    }
                    return Ok(Action::Acked(why));
                }
                Decision::Retry(after) => {
                    delivery.retry(after).await?;
                    self.counters.retried.fetch_add(1, Ordering::Relaxed);
                    self.redelivered("failed");
                    return Ok(Action::Retried { after, attempt });
                }
                Decision::Defer(after) => {
                    self.counters.deferred.fetch_add(1, Ordering::Relaxed);
                    self.redelivered("in_progress");
                    match delivery.defer(after).await? {
                        None => return Ok(Action::Deferred { after }),
                        Some(kept) => delivery = kept,
                    }
                }
                Decision::Park(reason) => {
                    tracing::warn!(scope = self.scope, event = self.event, attempt, %reason, "parking a message");
                    delivery.park(&reason).await?;
                    self.count(&self.counters.parked, "idem_consumer_parked_total");
                    return Ok(Action::Parked { reason });
                }
            }
        }
    }

    /// Takes deliveries from `source` and processes them one at a time, until
    /// the broker fails.
    pub async fn run<S, M, T, E, H, Fut>(&self, mut source: S, handler: H) -> BrokerError
    where
        S: Source,
        M: DeserializeOwned,
        H: Fn(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Debug,
    {
        loop {
            let step = match source.next().await {
                Ok(delivery) => self.process(delivery, &handler).await,
                Err(e) => Err(e),
            };
            if let Err(e) = step {
                return e;
            }
        }
    }

    /// A counted failure: another delivery after a backoff, or parked at the
    /// limit.
    fn failed(&self, attempt: u32, why: String) -> Decision {
        if attempt >= self.max_deliveries {
            Decision::Park(format!(
                "failed {attempt} counted deliveries; the last: {why}"
            ))
        } else {
            Decision::Retry(self.backoff_for(attempt))
        }
    }

    fn decide<T, E: fmt::Debug>(
        &self,
        result: &Result<T, E>,
        noted: Option<Noted>,
        attempt: u32,
    ) -> Decision {
        use CallOutcome as O;
        let failed = |why: String| self.failed(attempt, why);
        match (noted, result) {
            // The handler's call got `Ok` (ran or replayed), and the handler
            // failed after it: what failed is in no record, and only a
            // redelivery runs it again (the call then replays).
            (
                Some(
                    Noted::Call {
                        outcome: O::Executed | O::Replayed,
                        recorded_err: false,
                    }
                    | Noted::Fenced { final_err: false },
                ),
                Err(e),
            ) => failed(format!("{e:?} (after the idempotent call had succeeded)")),
            (
                Some(Noted::Call {
                    outcome: O::Replayed | O::ReplayedUnstored,
                    ..
                }),
                _,
            ) => Decision::Ack(Acked::Deduplicated),
            (
                Some(Noted::Call {
                    outcome: O::Executed,
                    recorded_err,
                }),
                _,
            ) => Decision::Ack(if recorded_err {
                Acked::FinalError
            } else {
                Acked::Processed
            }),
            // The body ran and a newer owner holds the record: it acks its own
            // delivery, and this one is done.
            (Some(Noted::Fenced { .. }), _) => Decision::Ack(Acked::Processed),
            (Some(Noted::RolledBack), r) => failed(match r {
                Err(e) => format!("{e:?}"),
                Ok(_) => "the handler's transaction was rolled back".to_owned(),
            }),
            (
                Some(Noted::Call {
                    outcome: O::InProgress,
                    ..
                }),
                _,
            ) => Decision::Defer(self.in_progress_delay),
            // Never going to succeed as it is: an operator has to look.
            (
                Some(Noted::Call {
                    outcome: O::KeyReuse | O::CodecError | O::NotInTransaction,
                    ..
                }),
                r,
            ) => Decision::Park(match r {
                Err(e) => format!("{e:?}"),
                Ok(_) => "the handler's idempotent call refused it".to_owned(),
            }),
            // Not recorded (the store failed to claim or to complete): no ack,
            // or a crash now would lose the record and the message together.
            (
                Some(Noted::Call {
                    outcome: O::StoreError,
                    ..
                }),
                r,
            ) => failed(match r {
                Err(e) => format!("{e:?}"),
                Ok(_) => "the store could not record the outcome".to_owned(),
            }),
            // A handler without the attribute, or one whose call released its
            // claim (a retryable `Err`) but which recovered: its own result
            // decides.
            (_, Ok(_)) => Decision::Ack(Acked::Processed),
            (_, Err(e)) => failed(format!("{e:?}")),
        }
    }

    fn count(&self, counter: &AtomicU64, name: &'static str) {
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(name, "scope" => self.scope, "event" => self.event).increment(1);
    }

    fn redelivered(&self, reason: &'static str) {
        metrics::counter!("idem_consumer_redelivered_total", "scope" => self.scope, "event" => self.event, "reason" => reason)
            .increment(1);
    }
}

/// What a panic said, for the reason a parked message carries.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

#[derive(Debug, PartialEq, Eq)]
enum Decision {
    Ack(Acked),
    Retry(Duration),
    Defer(Duration),
    Park(String),
}

/// In-process deliveries for examples and unit tests of handlers.
pub mod testing {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::{BrokerError, Delivery};

    /// A delivery that remembers what was done with it.
    ///
    /// ```
    /// use idem_runtime::consumer::testing::Memory;
    /// let d = Memory::new(b"{}");
    /// let log = d.log();
    /// assert!(log.lock().unwrap().is_empty());
    /// ```
    pub struct Memory {
        body: Vec<u8>,
        attempt: u32,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Memory {
        /// A first delivery of `body`.
        pub fn new(body: &[u8]) -> Memory {
            Memory {
                body: body.to_vec(),
                attempt: 1,
                log: Arc::default(),
            }
        }

        /// The same, as its `attempt`-th counted delivery.
        pub fn attempt(mut self, attempt: u32) -> Memory {
            self.attempt = attempt;
            self
        }

        /// What was done with it: `ack`, `retry <delay>`, `defer <delay>`,
        /// `park <reason>`.
        pub fn log(&self) -> Arc<Mutex<Vec<String>>> {
            self.log.clone()
        }

        fn push(&self, what: String) {
            self.log.lock().expect("log lock").push(what);
        }
    }

    #[async_trait::async_trait]
    impl Delivery for Memory {
        fn payload(&self) -> Option<&[u8]> {
            Some(&self.body)
        }

        fn attempt(&self) -> u32 {
            self.attempt
        }

        async fn ack(self) -> Result<(), BrokerError> {
            self.push("ack".into());
            Ok(())
        }

        async fn retry(self, after: Duration) -> Result<(), BrokerError> {
            self.push(format!("retry {after:?}"));
            Ok(())
        }

        async fn defer(self, after: Duration) -> Result<Option<Self>, BrokerError> {
            self.push(format!("defer {after:?}"));
            Ok(None)
        }

        async fn park(self, reason: &str) -> Result<(), BrokerError> {
            self.push(format!("park {reason}"));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
    use std::time::Duration;

    use serde::{Deserialize, Serialize};

    use super::testing::Memory;
    use super::{Acked, Action, Runner};
    use crate::protocol::{Kind, Spec, execute_keeping_final};
    use crate::store::memory::MemoryStore;
    use crate::{Key, StoreRef};

    const SPEC: Spec = Spec::new("consumer.tests", Kind::Consumer);

    #[derive(Debug, Serialize, Deserialize)]
    enum Failure {
        Declined,
        Downstream,
        // Read through `Debug`, in failure messages.
        #[allow(dead_code)]
        #[serde(skip)]
        Idem(String),
    }

    impl From<crate::Error> for Failure {
        fn from(e: crate::Error) -> Self {
            Failure::Idem(e.to_string())
        }
    }

    fn runner() -> Runner {
        Runner::new("consumer.tests", "TEST")
            .max_deliveries(3)
            .backoff(Duration::from_millis(100), Duration::from_millis(400))
    }

    /// The annotated call: `Declined` is its final error, stored and replayed.
    async fn settle(store: &StoreRef, id: &str, declined: bool) -> Result<u32, Failure> {
        let key = Key::builder(SPEC.scope).part(id).finish();
        execute_keeping_final(
            &SPEC,
            Some(store.clone()),
            key,
            None,
            |e: &Failure| matches!(e, Failure::Declined),
            async move {
                if declined {
                    Err(Failure::Declined)
                } else {
                    Ok(7)
                }
            },
        )
        .await
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// A message that crashed every earlier consumer comes back with its
    /// count past the limit: it is parked before it can crash this one too.
    #[test]
    fn a_delivery_past_max_deliveries_is_parked_without_running_the_handler() {
        block_on(async {
            let calls = AtomicU32::new(0);
            let handler = |_: String| {
                calls.fetch_add(1, SeqCst);
                async { Ok::<(), Failure>(()) }
            };
            let d = Memory::new(br#""m-1""#).attempt(4);
            let log = d.log();
            let action = runner().process(d, &handler).await.unwrap();
            assert_eq!(calls.load(SeqCst), 0, "the handler must not run");
            let Action::Parked { reason } = action else {
                panic!("{action:?}")
            };
            assert!(
                reason.contains("delivered 4 times") && reason.contains("not run"),
                "{reason}"
            );
            assert_eq!(log.lock().unwrap().len(), 1, "{:?}", log.lock().unwrap());
        });
    }

    /// A panic is a counted failure: retried with backoff, parked at the
    /// limit, and the runner goes on.
    #[test]
    fn a_panicking_handler_is_retried_then_parked() {
        block_on(async {
            let handler = |_: String| async {
                if true {
                    panic!("the handler broke");
                }
                Ok::<(), Failure>(())
            };
            let first = runner()
                .process(Memory::new(br#""m-1""#), &handler)
                .await
                .unwrap();
            assert_eq!(
                first,
                Action::Retried {
                    after: Duration::from_millis(100),
                    attempt: 1
                }
            );
            let last = runner()
                .process(Memory::new(br#""m-1""#).attempt(3), &handler)
                .await
                .unwrap();
            let Action::Parked { reason } = last else {
                panic!("{last:?}")
            };
            assert!(
                reason.starts_with("failed 3 counted deliveries")
                    && reason.contains("the handler broke"),
                "{reason}"
            );
        });
    }

    /// The call recorded `Ok`, and the handler's own next effect failed: that
    /// effect is not recorded anywhere, so the message must come back.
    #[test]
    fn an_err_after_a_call_that_succeeded_is_retried() {
        block_on(async {
            let store = StoreRef::new(MemoryStore::new());
            let next_effect_fails = AtomicU32::new(1);
            let handler = |id: String| {
                let store = store.clone();
                let fail = next_effect_fails.load(SeqCst) > 0;
                async move {
                    settle(&store, &id, false).await?;
                    if fail {
                        return Err(Failure::Downstream);
                    }
                    Ok(())
                }
            };
            let r = runner();
            let first = r.process(Memory::new(br#""m-1""#), &handler).await.unwrap();
            assert_eq!(
                first,
                Action::Retried {
                    after: Duration::from_millis(100),
                    attempt: 1
                }
            );
            // The redelivery replays the recorded `Ok` and fails the same way:
            // a replay acks only what the record holds.
            let second = r
                .process(Memory::new(br#""m-1""#).attempt(2), &handler)
                .await
                .unwrap();
            assert!(
                matches!(second, Action::Retried { attempt: 2, .. }),
                "{second:?}"
            );
            next_effect_fails.store(0, SeqCst);
            let third = r
                .process(Memory::new(br#""m-1""#).attempt(3), &handler)
                .await
                .unwrap();
            assert_eq!(third, Action::Acked(Acked::Deduplicated));
            assert_eq!(r.stats().final_errors, 0, "{:?}", r.stats());
        });
    }

    /// The counterpart: an `Err` the call stored as final is acked, first
    /// time and on replay.
    #[test]
    fn a_stored_final_error_is_acked() {
        block_on(async {
            let store = StoreRef::new(MemoryStore::new());
            let handler = |id: String| {
                let store = store.clone();
                async move { settle(&store, &id, true).await.map(|_| ()) }
            };
            let r = runner();
            let first = r.process(Memory::new(br#""m-1""#), &handler).await.unwrap();
            assert_eq!(first, Action::Acked(Acked::FinalError));
            let again = r.process(Memory::new(br#""m-1""#), &handler).await.unwrap();
            assert_eq!(again, Action::Acked(Acked::Deduplicated));
        });
    }
}
