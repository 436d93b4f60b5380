//! The worker: its settings, and its passes, which find the claims whose
//! lease ran out with arguments stored and start a turn at each (`turn.rs`)
//! as its `concurrency` allows.

use std::collections::{BTreeSet, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::metrics;
use super::registry::Recovery;
use super::stats::{Outcome, Pass, WorkerStats};
use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::key::Key;
use crate::store::{Abandoned, AsStore, Store as _, StoreRef};

#[derive(Debug, Clone)]
pub(super) struct Settings {
    concurrency: usize,
    batch: usize,
    pub(super) max_attempts: u32,
    pub(super) first_backoff: Duration,
    pub(super) max_backoff: Duration,
    poll: Duration,
}

/// Settings of a [`Worker`].
#[derive(Debug)]
pub struct WorkerBuilder {
    store: StoreRef,
    recovery: Recovery,
    s: Settings,
}

impl WorkerBuilder {
    /// How many recoveries run at once (default 4).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.s.concurrency = n.max(1);
        self
    }

    /// How many abandoned claims of each scope one pass takes (default 64).
    pub fn batch(mut self, n: usize) -> Self {
        self.s.batch = n.max(1);
        self
    }

    /// How many recoveries a claim gets before it is parked for an operator
    /// (default 5).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.s.max_attempts = n.max(1);
        self
    }

    /// The wait before a claim's next recovery: `first` after the first
    /// attempt, doubling to at most `max` (defaults 10 s and 10 min). A
    /// recovery that ends with a retryable error also keeps the claim until
    /// its lease runs out.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.s.first_backoff = first;
        self.s.max_backoff = max.max(first);
        self
    }

    /// How long [`Worker::run`] waits between passes (default 5 s).
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.s.poll = every.max(Duration::from_millis(1));
        self
    }

    /// The worker.
    pub fn build(self) -> Worker {
        let concurrency = self.s.concurrency;
        Worker {
            store: self.store,
            recovery: Arc::new(self.recovery),
            s: self.s,
            stats: Arc::new(Mutex::new(WorkerStats::default())),
            clock: Arc::new(SystemClock),
            permits: Arc::new(Semaphore::new(concurrency)),
            running: Arc::new(Mutex::new(HashSet::new())),
            gauged: Arc::new(Mutex::new(BTreeSet::new())),
        }
    }
}

/// Finishes flows whose caller never came back.
///
/// Each pass asks the store for the claims of every registered scope whose
/// lease ran out with arguments stored (`#[idempotent(…, recover)]`), takes a
/// turn at each (so two workers never run the same claim at once, and each
/// claim's attempts are counted and spaced by a backoff), and runs the
/// registered function with the stored arguments. The function's own claim
/// takes the record over as any caller's would: finished steps replay, the
/// rest run, a final error compensates, and its result is stored for the
/// caller who comes back. After `max_attempts` recoveries that did not finish
/// it, the claim is parked for an operator (`idem inspect` shows it,
/// `idem recover` lets the worker try again).
///
/// A live claim, one whose owner still heartbeats, is never touched: only a
/// lease that ran out makes a claim abandoned.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::recovery::{Recovery, Worker};
/// use idem_runtime::store::memory::MemoryStore;
/// use idem_runtime::{idempotent, recoverable};
///
/// # #[derive(Debug)] struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// #[idempotent(scope = "orders.create", key = "order_no", recover)]
/// async fn create_order(order_no: String) -> Result<u64, AppError> {
///     Ok(7)
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// idem_runtime::install(store.clone());
/// let worker = Worker::builder(store, Recovery::new().register(recoverable!(create_order)))
///     .concurrency(8)
///     .max_attempts(5)
///     .build();
/// let pass = worker.run_once().await?;
/// assert_eq!(pass.found, 0); // nothing was abandoned
/// // In a service: tokio::spawn(async move { worker.run().await });
/// # Ok::<(), idem_runtime::StoreError>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone)]
pub struct Worker {
    pub(super) store: StoreRef,
    recovery: Arc<Recovery>,
    pub(super) s: Settings,
    stats: Arc<Mutex<WorkerStats>>,
    clock: Arc<dyn Clock>,
    /// `concurrency` turns at once, across passes: a pass of [`Worker::run`]
    /// starts what the free permits allow and leaves the rest for the next.
    permits: Arc<Semaphore>,
    /// The claims this worker is running a turn at: a later pass can find
    /// one abandoned again (its heartbeat late, a clock moved) and must not
    /// start a second turn on it.
    running: Arc<Mutex<HashSet<Key>>>,
    /// The scopes whose gauges the last pass set, so a scope that has gone
    /// from the store's answer is set back to 0 rather than left at its
    /// last value.
    gauged: Arc<Mutex<BTreeSet<String>>>,
}

/// A turn at one claim, spawned: its scope and how it went.
type Turns = JoinSet<(&'static str, Outcome)>;

impl Worker {
    /// A worker on `store` (the store the registered functions claim in)
    /// running the functions in `recovery`.
    pub fn builder(store: impl AsStore, recovery: Recovery) -> WorkerBuilder {
        WorkerBuilder {
            store: store.store_ref(),
            recovery,
            s: Settings {
                concurrency: 4,
                batch: 64,
                max_attempts: 5,
                first_backoff: Duration::from_secs(10),
                max_backoff: Duration::from_secs(600),
                poll: Duration::from_secs(5),
            },
        }
    }

    /// Counts since the worker was built, and what the last pass found.
    pub fn stats(&self) -> WorkerStats {
        lock(&self.stats).clone()
    }

    /// One pass: every abandoned claim found in a registered scope gets its
    /// turn (up to `batch` per scope, `concurrency` at once), and the pass
    /// returns once they all ended; abandoned claims of other scopes are
    /// counted and reported. `Err` only when the store failed (or keeps no
    /// recovery state); a recovery's own failure is counted, and the claim
    /// comes back after its backoff.
    pub async fn run_once(&self) -> Result<Pass, StoreError> {
        let mut turns = Turns::new();
        let scanned = self.scan(&mut turns, Permits::Wait).await;
        let mut pass = match scanned {
            Ok(pass) => pass,
            Err(e) => {
                // Turns started before the store failed still run to the end.
                while let Some(joined) = turns.join_next().await {
                    self.settle(joined);
                }
                self.passed(Err(&e));
                return Err(e);
            }
        };
        while let Some(joined) = turns.join_next().await {
            if let Some(outcome) = self.settle(joined) {
                pass.count(&outcome);
            }
        }
        self.passed(Ok(&pass));
        Ok(pass)
    }

    /// Finds the abandoned claims, spawns a turn at each into `turns` as
    /// permits allow, and sets the gauges. The outcomes are the caller's to
    /// collect (with [`Worker::settle`]).
    async fn scan(&self, turns: &mut Turns, permits: Permits) -> Result<Pass, StoreError> {
        let stored: BTreeSet<String> = self.store.recovery_scopes().await?.into_iter().collect();
        let now = self.clock.now_millis();
        let mut pass = Pass::default();
        let mut gauged = BTreeSet::new();
        for scope in self.recovery.scopes() {
            let found = self.store.abandoned(scope, self.s.batch).await?;
            let oldest = found.first().map_or(Duration::ZERO, |a| waited(a, now));
            metrics::oldest_abandoned(scope, oldest);
            gauged.insert(scope.to_owned());
            pass.found += found.len();
            if !found.is_empty() {
                pass.oldest_abandoned = pass.oldest_abandoned.max(Some(oldest));
            }
            let function = self
                .recovery
                .get(scope)
                .expect("a registered scope has its function")
                .clone();
            for abandoned in found {
                if lock(&self.running).contains(&abandoned.key) {
                    pass.deferred += 1;
                    continue;
                }
                let permit = match permits {
                    Permits::Wait => self
                        .permits
                        .clone()
                        .acquire_owned()
                        .await
                        .expect("the semaphore is never closed"),
                    Permits::Free => match self.permits.clone().try_acquire_owned() {
                        Ok(permit) => permit,
                        Err(_) => {
                            pass.deferred += 1;
                            continue;
                        }
                    },
                };
                // Checked again under the permit: a turn may have started
                // at it while this pass waited.
                if !lock(&self.running).insert(abandoned.key) {
                    pass.deferred += 1;
                    continue;
                }
                let running = Running {
                    key: abandoned.key,
                    set: Arc::clone(&self.running),
                    _permit: permit,
                };
                let worker = self.clone();
                let function = function.clone();
                turns.spawn(async move {
                    let outcome = worker.turn(&function, &abandoned).await;
                    drop(running);
                    (function.scope(), outcome)
                });
            }
        }
        // Claims the worker cannot run: found, reported, left for their owner.
        for scope in stored.iter().filter(|s| self.recovery.get(s).is_none()) {
            let found = self.store.abandoned(scope, self.s.batch).await?;
            metrics::unregistered(scope, found.len());
            gauged.insert(scope.clone());
            let oldest = found.first().map_or(Duration::ZERO, |a| waited(a, now));
            metrics::oldest_abandoned(scope, oldest);
            if found.is_empty() {
                continue;
            }
            pass.oldest_abandoned = pass.oldest_abandoned.max(Some(oldest));
            tracing::warn!(
                scope,
                abandoned = found.len(),
                oldest_secs = oldest.as_secs(),
                "abandoned claims with stored arguments and no function registered for their scope: register it in this worker (or run the worker of the service that owns it)"
            );
            pass.unregistered.insert(scope.clone(), found.len() as u64);
        }
        // A scope the store no longer lists has nothing abandoned left.
        let mut last = lock(&self.gauged);
        for gone in last.difference(&gauged) {
            metrics::unregistered(gone, 0);
            metrics::oldest_abandoned(gone, Duration::ZERO);
        }
        *last = gauged;
        Ok(pass)
    }

    /// One ended turn: its metrics and the worker's counts. `None` for a task
    /// that ended abnormally (counted as failed).
    fn settle(
        &self,
        joined: Result<(&'static str, Outcome), tokio::task::JoinError>,
    ) -> Option<Outcome> {
        let (scope, outcome) = match joined {
            Ok(done) => done,
            // `turn` itself does not panic; a panicking function is caught inside it.
            Err(e) => {
                tracing::error!(error = %e, "a recovery task ended abnormally");
                lock(&self.stats).failed += 1;
                return Some(Outcome::Failed);
            }
        };
        let mut stats = lock(&self.stats);
        match outcome {
            Outcome::Recovered => {
                metrics::recovered(scope, "ok");
                stats.recovered += 1;
            }
            Outcome::GaveUp => {
                metrics::recovered(scope, "final_error");
                stats.gave_up += 1;
            }
            Outcome::Failed => {
                metrics::failed(scope);
                stats.failed += 1;
            }
            Outcome::Parked => {
                metrics::parked(scope);
                stats.parked += 1;
            }
            Outcome::Busy => stats.busy += 1,
            Outcome::Gone => {}
        }
        Some(outcome)
    }

    /// A pass's scan ended: what it found goes into the stats.
    fn passed(&self, scanned: Result<&Pass, &StoreError>) {
        let mut stats = lock(&self.stats);
        stats.passes += 1;
        match scanned {
            Ok(pass) => {
                stats.unregistered = pass.unregistered.clone();
                stats.oldest_abandoned = pass.oldest_abandoned;
                stats.last_error = None;
            }
            Err(e) => stats.last_error = Some(e.to_string()),
        }
    }

    /// Passes until the process ends, `poll_interval` apart. A pass starts
    /// turns at what it found while fewer than `concurrency` run, and never
    /// waits for them: a flow that hangs in a step holds one turn, and the
    /// passes (and flows abandoned meanwhile) go on. Store errors are logged
    /// and retried next pass; they never end the loop.
    pub async fn run(&self) {
        self.run_until(std::future::pending::<()>()).await
    }

    /// [`Worker::run`] until `shutdown` completes. The turns in progress are
    /// finished first; dropping the returned future instead aborts them, as
    /// dropping any idempotent call's future does: their claims come back
    /// once their lease runs out.
    pub async fn run_until<F: Future>(&self, shutdown: F) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut turns = Turns::new();
        loop {
            match self.scan(&mut turns, Permits::Free).await {
                Ok(pass) => self.passed(Ok(&pass)),
                Err(e) => {
                    tracing::warn!(error = %e, "recovery pass failed; retrying next pass");
                    self.passed(Err(&e));
                }
            }
            let mut next = std::pin::pin!(tokio::time::sleep(self.s.poll));
            loop {
                tokio::select! {
                    () = &mut next => break,
                    Some(joined) = turns.join_next(), if !turns.is_empty() => {
                        self.settle(joined);
                    }
                    _ = &mut shutdown => {
                        while let Some(joined) = turns.join_next().await {
                            self.settle(joined);
                        }
                        return;
                    }
                }
            }
        }
    }
}

/// Whether a pass waits for a free turn ([`Worker::run_once`]) or leaves
/// what finds none for the next pass ([`Worker::run`]).
#[derive(Clone, Copy)]
enum Permits {
    Wait,
    Free,
}

/// A turn in flight: its permit, and its key in the worker's running set
/// until the turn ends (or its task is aborted).
struct Running {
    key: Key,
    set: Arc<Mutex<HashSet<Key>>>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Running {
    fn drop(&mut self) {
        lock(&self.set).remove(&self.key);
    }
}

fn waited(abandoned: &Abandoned, now: i64) -> Duration {
    Duration::from_millis(u64::try_from(now - abandoned.lease_until_millis).unwrap_or(0))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
