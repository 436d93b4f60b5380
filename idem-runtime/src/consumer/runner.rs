//! The [`Runner`]: one delivery through the handler, its outcome mapped to
//! one broker action, counted.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;

use crate::observe::CallOutcome;
use crate::protocol::report::{self, Labels, Noted};

use super::{Acked, Action, BrokerError, Delivery, FromDelivery, Source};

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
/// The metrics (`idem_consumer_*_total{scope, event}`) are labelled with the
/// `scope` and `event` of the handler's own `#[idempotent]` call, as that
/// call reports them: nothing to repeat here, so nothing can disagree. A
/// delivery that never reaches the call (a payload that does not decode, a
/// count already past `max_deliveries`) carries the labels of the last call
/// this runner saw, or `scope="unknown"` before the first. Cloning shares the
/// counters.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::consumer::Runner;
///
/// let runner = Runner::new()
///     .max_deliveries(5)
///     .backoff(Duration::from_secs(1), Duration::from_secs(30))
///     .in_progress_delay(Duration::from_secs(2))
///     .concurrency(16);
/// assert_eq!(runner.stats().delivered, 0);
/// ```
#[derive(Clone)]
pub struct Runner {
    /// The labels of the last call a delivery reached, for the deliveries
    /// that reach none.
    labels: Arc<Mutex<Labels>>,
    pub(super) concurrency: usize,
    max_deliveries: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    in_progress_delay: Duration,
    counters: Arc<Counters>,
}

impl Runner {
    /// A runner with the defaults: one delivery at a time, 5 counted
    /// deliveries, backoff from 1 s doubling to 30 s, `InProgress` redelivered
    /// after 2 s.
    pub fn new() -> Runner {
        Runner {
            labels: Arc::new(Mutex::new(UNKNOWN)),
            concurrency: 1,
            max_deliveries: 5,
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            in_progress_delay: Duration::from_secs(2),
            counters: Arc::default(),
        }
    }

    /// How many deliveries [`Runner::run`] keeps in flight at once (default
    /// 1, at least 1). Each is acked, redelivered or parked on its own, after
    /// its own outcome is recorded, so messages finish out of order. Two
    /// deliveries of one key in flight together still run the body once: the
    /// second meets the first's claim and is redelivered as `InProgress`
    /// (with `tx = tx` on a SQL store it waits for the first transaction
    /// instead, and replays it).
    ///
    /// The broker must hand out that many unacked messages: on RabbitMQ set
    /// `RabbitMqBuilder::prefetch` (feature `rabbitmq`) to at least `n`; on Redis Streams and JetStream a `batch` of about `n` fetches them
    /// in one round trip. With [`Runner::run`] the handler is shared by
    /// reference, not spawned: the deliveries run concurrently on the task
    /// that runs `run`, so a multi-threaded runtime spreads them over its
    /// threads only through the I/O they wait on. [`Runner::run_spawned`]
    /// puts each delivery on a task of its own (a `'static` handler), or run
    /// more runners (more consumers) to use more cores.
    ///
    /// ```
    /// # use idem_runtime::consumer::Runner;
    /// let runner = Runner::new().concurrency(16);
    /// # let _ = runner;
    /// ```
    pub fn concurrency(mut self, n: usize) -> Runner {
        self.concurrency = n.max(1);
        self
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
        M: FromDelivery,
        H: Fn(M) -> Fut + ?Sized,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Debug,
    {
        let mut delivery = delivery;
        loop {
            let attempt = delivery.attempt();
            let mut call: Option<Labels> = None;
            let decision = match M::from_delivery(&delivery) {
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
                Err(reason) => Decision::Park(reason),
                Ok(message) => {
                    // Inside the async block, so a panic while making the
                    // future is caught too.
                    let run = AssertUnwindSafe(async { handler(message).await }).catch_unwind();
                    let (result, noted, labels) = report::observed(run).await;
                    call = labels;
                    match result {
                        Ok(result) => self.decide(&result, noted, attempt),
                        Err(panic) => {
                            let why = panic_message(&*panic);
                            let labels = self.labels(call);
                            tracing::error!(
                                scope = labels.scope,
                                event = labels.event,
                                attempt,
                                panic = why,
                                "the handler panicked"
                            );
                            self.failed(attempt, format!("the handler panicked: {why}"))
                        }
                    }
                }
            };
            let labels = self.labels(call);
            self.count(
                &labels,
                &self.counters.delivered,
                "idem_consumer_delivered_total",
            );
            match decision {
                Decision::Ack(why) => {
                    delivery.ack().await?;
                    self.count(&labels, &self.counters.acked, "idem_consumer_acked_total");
                    let (counter, name) = match why {
                        Acked::Processed => {
                            (&self.counters.processed, "idem_consumer_processed_total")
                        }
                        Acked::Deduplicated => (
                            &self.counters.deduplicated,
                            "idem_consumer_deduplicated_total",
                        ),
                        Acked::FinalError => (
                            &self.counters.final_errors,
                            "idem_consumer_final_errors_total",
                        ),
                    };
                    self.count(&labels, counter, name);
                    return Ok(Action::Acked(why));
                }
                Decision::Retry(after) => {
                    delivery.retry(after).await?;
                    self.counters.retried.fetch_add(1, Ordering::Relaxed);
                    redelivered(&labels, "failed");
                    return Ok(Action::Retried { after, attempt });
                }
                Decision::Defer(after) => {
                    self.counters.deferred.fetch_add(1, Ordering::Relaxed);
                    redelivered(&labels, "in_progress");
                    match delivery.defer(after).await? {
                        None => return Ok(Action::Deferred { after }),
                        Some(kept) => delivery = kept,
                    }
                }
                Decision::Park(reason) => {
                    tracing::warn!(scope = labels.scope, event = labels.event, attempt, %reason, "parking a message");
                    delivery.park(&reason).await?;
                    self.count(&labels, &self.counters.parked, "idem_consumer_parked_total");
                    return Ok(Action::Parked { reason });
                }
            }
        }
    }

    /// Takes deliveries from `source` and processes up to
    /// [`concurrency`](Runner::concurrency) of them at once, until the broker
    /// fails.
    ///
    /// A new delivery is asked for only while fewer than `concurrency` are in
    /// flight, so the broker's flow control (prefetch, pending entries, ack
    /// waits) sees exactly the messages being worked on plus what the source
    /// buffers. On the first broker error (from the source or from acking,
    /// redelivering or parking one delivery) no new delivery is taken; the
    /// ones in flight run to their end, each acked if the broker still takes
    /// it, and then the first error is returned. A delivery whose ack fails is
    /// handed out again by the broker, and its record makes that a replay.
    /// [`Runner::run_until`] also ends, the same way, on a shutdown signal.
    pub async fn run<S, M, T, E, H, Fut>(&self, source: S, handler: H) -> BrokerError
    where
        S: Source,
        M: FromDelivery,
        H: Fn(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Debug,
    {
        let handler = &handler;
        let never = std::future::pending::<()>();
        match self
            .drive(source, |delivery| self.process(delivery, handler), never)
            .await
        {
            Err(e) => e,
            Ok(()) => unreachable!("a runner without a stop ends only on a broker error"),
        }
    }

    /// [`Runner::run`], with each delivery processed on a tokio task of its
    /// own, so up to [`concurrency`](Runner::concurrency) handlers run on as
    /// many threads as the runtime has, not only on the task that runs
    /// `run_spawned`: for handlers whose CPU, not their I/O, sets the pace.
    /// The handler and what it returns must be `Send + 'static` (share a
    /// pool by cloning it into the closure). Everything else is as `run`: the
    /// same outcomes, acks, retries and parking, in flight at most
    /// `concurrency`; a panic that escapes a delivery's processing unwinds
    /// through `run_spawned`, as it would through `run`; and dropping its
    /// future aborts the deliveries' tasks, each stopping at its `.await` as
    /// under `run` (none goes on unwatched to its ack).
    ///
    /// ```no_run
    /// use idem_runtime::consumer::{Runner, Source};
    ///
    /// # #[derive(serde::Deserialize)] struct OrderPaid { order_id: String }
    /// # #[derive(Clone)] struct Pool;
    /// # async fn settle(pool: Pool, e: OrderPaid) -> Result<(), std::io::Error> { Ok(()) }
    /// async fn consume<S: Source<Delivery: 'static>>(source: S, pool: Pool) {
    ///     let err = Runner::new()
    ///         .concurrency(16)
    ///         .run_spawned(source, move |e: OrderPaid| settle(pool.clone(), e))
    ///         .await;
    ///     eprintln!("the broker failed: {err}");
    /// }
    /// ```
    pub async fn run_spawned<S, M, T, E, H, Fut>(&self, source: S, handler: H) -> BrokerError
    where
        S: Source,
        S::Delivery: 'static,
        M: FromDelivery + Send + 'static,
        H: Fn(M) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: fmt::Debug + Send + 'static,
    {
        match self
            .run_spawned_until(source, handler, std::future::pending::<()>())
            .await
        {
            Err(e) => e,
            Ok(()) => unreachable!("a runner without a stop ends only on a broker error"),
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

    /// The labels of this delivery: its own call's, remembered for the
    /// deliveries that reach none; else the last call's.
    fn labels(&self, call: Option<Labels>) -> Labels {
        let mut last = self.labels.lock().unwrap_or_else(|p| p.into_inner());
        match call {
            Some(labels) => {
                *last = labels;
                labels
            }
            None => *last,
        }
    }

    fn count(&self, labels: &Labels, counter: &AtomicU64, name: &'static str) {
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(name, "scope" => labels.scope, "event" => labels.event.unwrap_or(""))
            .increment(1);
    }
}

impl Default for Runner {
    fn default() -> Runner {
        Runner::new()
    }
}

/// Before any delivery reached a call.
const UNKNOWN: Labels = Labels {
    scope: "unknown",
    event: None,
};

fn redelivered(labels: &Labels, reason: &'static str) {
    metrics::counter!(
        "idem_consumer_redelivered_total",
        "scope" => labels.scope,
        "event" => labels.event.unwrap_or(""),
        "reason" => reason
    )
    .increment(1);
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
