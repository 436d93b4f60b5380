//! One supervisor for the background parts of a service: the outbox's
//! `Relay` (SQL features), the consumers' [`Runner`](crate::consumer::Runner)s and the
//! recovery [`Worker`], run together until a shutdown signal, each finishing
//! its work in flight, each part's health readable at any time.
//!
//! ```
//! use std::time::Duration;
//! use idem_runtime::consumer::{BrokerError, Runner, Source, testing::Memory};
//! use idem_runtime::recovery::{Recovery, Worker};
//! use idem_runtime::store::memory::MemoryStore;
//! use idem_runtime::supervisor::Supervisor;
//!
//! # struct Quiet;
//! # #[async_trait::async_trait]
//! # impl Source for Quiet {
//! #     type Delivery = Memory;
//! #     async fn next(&mut self) -> Result<Memory, BrokerError> { std::future::pending().await }
//! # }
//! # async fn connect() -> Result<Quiet, BrokerError> { Ok(Quiet) }
//! # #[derive(serde::Deserialize)] struct OrderPaid { order_id: String }
//! # async fn settle(e: OrderPaid) -> Result<(), idem_runtime::Error> { Ok(()) }
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = MemoryStore::new();
//! let runner = Runner::new().concurrency(8);
//! let supervisor = Supervisor::new()
//!     .recovery("recovery", Worker::builder(store, Recovery::new()).build())
//!     // Called again for each restart: connect the source inside.
//!     .consumer("settlement", move |stop| {
//!         let runner = runner.clone();
//!         async move { runner.run_spawned_until(connect().await?, settle, stop).await }
//!     });
//! let health = supervisor.health(); // for a health route
//! # let shutdown = tokio::time::sleep(Duration::from_millis(20));
//! // In a service: `supervisor.run_until(async { tokio::signal::ctrl_c().await.ok(); })`
//! supervisor.run_until(shutdown).await?;
//! assert!(health.parts().iter().all(|p| p.state == idem_runtime::supervisor::PartState::Stopped));
//! # Ok::<(), idem_runtime::supervisor::PartFailed>(())
//! # }).unwrap();
//! ```
//!
//! **When a part fails** (its broker went away and the runner returned the
//! error, or a part panicked), the supervisor logs the error, shows it in
//! [`Health`] (the part `Restarting`, its `last_error`, its `restarts`), and
//! starts that part again after a backoff (1 s, doubling to 1 min by
//! default; a part that ran longer than the longest wait starts over from
//! the first), while the other parts go on. For a payment service that is
//! what keeps money moving: a broker's restart or failover is the common
//! failure and heals without a page, recovery of half-done payments and the
//! outbox do not stop because the consumers' broker did, and nothing a part
//! was doing is lost by restarting it (an unacked message comes back and
//! replays its record; an outbox batch or a recovery turn a part held comes
//! back when its lease runs out). A part that keeps failing never vanishes:
//! it stays out of `Running`, so [`Health::is_healthy`] is `false` (a
//! health route answers 503, an orchestrator's probe can act on it), the
//! gauge `idem_supervisor_part_up{part}` is 0 (alert on it staying 0), and
//! `idem_supervisor_restarts_total{part}` counts each restart.
//! [`stop_all_on_failure`](Supervisor::stop_all_on_failure) chooses instead
//! to stop every part at the first failure and return it from `run_until`,
//! for a process that should exit and be restarted whole.

mod health;
mod part;
mod stop;

use std::future::Future;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;

pub use health::{Health, PartState, PartStatus};
pub use part::PartFailed;
pub use stop::Stop;

use part::{PartError, Policy, Report, Start};

use crate::recovery::Worker;

/// Runs a service's background parts together until a shutdown signal (see
/// the [module documentation](self) for what happens when one fails).
///
/// Each part is added under a name, the one its [`PartStatus`] carries, and
/// started by [`run_until`](Supervisor::run_until) on a task of its own.
///
/// ```
/// use idem_runtime::supervisor::Supervisor;
/// use std::time::Duration;
///
/// let supervisor = Supervisor::new()
///     .restart_backoff(Duration::from_millis(500), Duration::from_secs(30))
///     .shutdown_timeout(Duration::from_secs(20));
/// assert!(supervisor.health().parts().is_empty());
/// ```
pub struct Supervisor {
    parts: Vec<(String, Start)>,
    policy: Policy,
    shutdown_timeout: Option<Duration>,
    health: watch::Sender<Vec<PartStatus>>,
}

impl Default for Supervisor {
    fn default() -> Supervisor {
        Supervisor::new()
    }
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("parts", &self.health.borrow())
            .field("policy", &self.policy)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .finish()
    }
}

impl Supervisor {
    /// A supervisor of no parts yet: failed parts restart after 1 s, doubling
    /// to 1 min; a shutdown waits for every part to finish its work in
    /// flight, however long that takes.
    pub fn new() -> Supervisor {
        Supervisor {
            parts: Vec::new(),
            policy: Policy::Restart {
                first: Duration::from_secs(1),
                max: Duration::from_secs(60),
            },
            shutdown_timeout: None,
            health: watch::Sender::new(Vec::new()),
        }
    }

    /// A failed part is started again after `first`, the wait doubling per
    /// failure up to `max` (the default policy, 1 s and 1 min).
    pub fn restart_backoff(mut self, first: Duration, max: Duration) -> Supervisor {
        self.policy = Policy::Restart {
            first,
            max: max.max(first),
        };
        self
    }

    /// At the first failure of a part, every other part is stopped as at a
    /// shutdown (finishing its work in flight) and `run_until` returns the
    /// failure: for a process an orchestrator restarts whole.
    pub fn stop_all_on_failure(mut self) -> Supervisor {
        self.policy = Policy::StopAll;
        self
    }

    /// How long a shutdown waits for the parts to finish their work in flight
    /// (default: as long as they take). A part still running after it is
    /// aborted, as a crash would end it (its messages come back, its claims
    /// and leases run out), reported `Failed`, and returned by `run_until`.
    /// Set it below the grace period before a `SIGKILL` (Kubernetes's 30 s),
    /// so the log says which part did not finish.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Supervisor {
        self.shutdown_timeout = Some(timeout);
        self
    }

    /// Adds a part: `run` is called with a [`Stop`] and returns its run,
    /// which must end with `Ok` once the stop completes (after its work in
    /// flight) and with `Err` when it can go on no longer. It is called
    /// again for each restart, so it builds what a restart needs anew: for a
    /// consumer, connect the source inside, and pass the stop to
    /// [`Runner::run_until`](crate::consumer::Runner::run_until),
    /// [`Runner::run_spawned_until`](crate::consumer::Runner::run_spawned_until)
    /// or `Runner::run_in_tx_until`. Any loop of the service that fits this
    /// shape can be a part too.
    ///
    /// ```
    /// use idem_runtime::consumer::{BrokerError, Runner, Source, testing::Memory};
    /// use idem_runtime::supervisor::Supervisor;
    ///
    /// # struct Quiet;
    /// # #[async_trait::async_trait]
    /// # impl Source for Quiet {
    /// #     type Delivery = Memory;
    /// #     async fn next(&mut self) -> Result<Memory, BrokerError> { std::future::pending().await }
    /// # }
    /// # async fn connect() -> Result<Quiet, BrokerError> { Ok(Quiet) }
    /// # #[derive(serde::Deserialize)] struct OrderPaid { order_id: String }
    /// # async fn settle(e: OrderPaid) -> Result<(), idem_runtime::Error> { Ok(()) }
    /// let runner = Runner::new();
    /// let supervisor = Supervisor::new().consumer("settlement", move |stop| {
    ///     let runner = runner.clone();
    ///     async move { runner.run_spawned_until(connect().await?, settle, stop).await }
    /// });
    /// # let _ = supervisor;
    /// ```
    ///
    /// # Panics
    ///
    /// If a part of that name was added already: health is reported by name.
    pub fn consumer<F, Fut, E>(self, name: impl Into<String>, run: F) -> Supervisor
    where
        F: FnMut(Stop) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<PartError>,
    {
        self.part(name.into(), part::boxed(run))
    }

    /// Adds the recovery worker: [`Worker::run_until`], its turns in flight
    /// finished at the shutdown. The worker retries a failing store itself,
    /// so it fails only by a panic.
    ///
    /// ```
    /// use idem_runtime::recovery::{Recovery, Worker};
    /// use idem_runtime::store::memory::MemoryStore;
    /// use idem_runtime::supervisor::Supervisor;
    ///
    /// let worker = Worker::builder(MemoryStore::new(), Recovery::new()).build();
    /// let supervisor = Supervisor::new().recovery("recovery", worker);
    /// # let _ = supervisor;
    /// ```
    ///
    /// # Panics
    ///
    /// If a part of that name was added already.
    pub fn recovery(self, name: impl Into<String>, worker: Worker) -> Supervisor {
        self.consumer(name, move |stop| {
            let worker = worker.clone();
            async move {
                worker.run_until(stop).await;
                Ok::<(), PartError>(())
            }
        })
    }

    /// Adds an outbox relay: [`Relay::run_until`](crate::outbox::Relay::run_until),
    /// its round in flight finished at the shutdown (nothing is left
    /// claimed). The relay retries a failing database or broker itself, so
    /// it fails only by a panic. Pass an `Arc<Relay>` to keep reading its
    /// `stats()`.
    ///
    /// ```
    /// # async fn relay(pool: sqlx::SqlitePool) {
    /// use idem_runtime::outbox::{Relay, sink::MemorySink};
    /// use idem_runtime::supervisor::Supervisor;
    ///
    /// let (sink, _published) = MemorySink::channel(64);
    /// let supervisor = Supervisor::new().relay("outbox", Relay::builder(pool, sink).build());
    /// # let _ = supervisor;
    /// # }
    /// ```
    ///
    /// # Panics
    ///
    /// If a part of that name was added already.
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[cfg_attr(
        docsrs,
        doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
    )]
    pub fn relay<DB: crate::outbox::OutboxDatabase>(
        self,
        name: impl Into<String>,
        relay: impl Into<std::sync::Arc<crate::outbox::Relay<DB>>>,
    ) -> Supervisor {
        let relay = relay.into();
        self.consumer(name, move |stop| {
            let relay = relay.clone();
            async move {
                relay.run_until(stop).await;
                Ok::<(), PartError>(())
            }
        })
    }

    fn part(mut self, name: String, start: Start) -> Supervisor {
        let taken = self.parts.iter().any(|(n, _)| *n == name);
        assert!(!taken, "the supervisor has a part named {name:?} already");
        self.health
            .send_modify(|parts| parts.push(PartStatus::new(name.clone())));
        self.parts.push((name, start));
        self
    }

    /// Each part's health, live, for a health route or a readiness probe.
    pub fn health(&self) -> Health {
        Health::new(self.health.subscribe())
    }

    /// Starts every part, each on a task of its own, and runs them until
    /// `shutdown` completes (`tokio::signal::ctrl_c()`, a `SIGTERM`); then
    /// hands each its [`Stop`], waits for each to finish its work in flight
    /// and returns. It returns earlier when every part has finished on its
    /// own, and, with [`stop_all_on_failure`](Supervisor::stop_all_on_failure),
    /// once the others have stopped after a part failed.
    ///
    /// `Err` names a part that failed and was not started again: under
    /// `stop_all_on_failure`, one that failed while stopping, or one not
    /// stopped within the [`shutdown_timeout`](Supervisor::shutdown_timeout)
    /// (the first of them; [`Health`] has every part's). Dropping the
    /// returned future aborts every part, as a crash would.
    ///
    /// See the [module documentation](self) for an example.
    pub async fn run_until(self, shutdown: impl Future) -> Result<(), PartFailed> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut running = JoinSet::new();
        for (index, (name, start)) in self.parts.into_iter().enumerate() {
            let report = Report {
                health: self.health.clone(),
                index,
                name,
            };
            running.spawn(part::supervise(
                start,
                Stop::new(stop_rx.clone()),
                self.policy,
                report,
            ));
        }
        let mut shutdown = std::pin::pin!(shutdown);
        let mut failed = None;
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                joined = running.join_next() => match joined {
                    None => return Ok(()),
                    Some(ended) => {
                        if let Some(f) = ended.unwrap_or_else(|e| supervisor_bug(&e)) {
                            failed = Some(f);
                            break;
                        }
                    }
                },
            }
        }
        tracing::info!("supervisor: stopping every part");
        let _ = stop_tx.send(true);
        let drained = async {
            while let Some(ended) = running.join_next().await {
                if let Some(f) = ended.unwrap_or_else(|e| supervisor_bug(&e)) {
                    failed.get_or_insert(f);
                }
            }
        };
        let timed_out = match self.shutdown_timeout {
            Some(timeout) => tokio::time::timeout(timeout, drained).await.is_err(),
            None => {
                drained.await;
                false
            }
        };
        if timed_out {
            running.abort_all();
            // Drained before the report: an aborted task polled elsewhere
            // could still write its state over it.
            while running.join_next().await.is_some() {}
            let timeout = self.shutdown_timeout.unwrap_or_default();
            let error = format!("did not stop within the shutdown timeout ({timeout:?}); aborted");
            self.health.send_modify(|parts| {
                for part in parts.iter_mut().filter(|p| !is_over(p.state)) {
                    tracing::error!(part = %part.name, "supervisor: {error}");
                    metrics::gauge!("idem_supervisor_part_up", "part" => part.name.clone())
                        .set(0.0);
                    part.state = PartState::Failed;
                    part.last_error = Some(error.clone());
                    failed.get_or_insert_with(|| PartFailed {
                        part: part.name.clone(),
                        error: error.clone(),
                    });
                }
            });
        }
        failed.map_or(Ok(()), Err)
    }
}

fn is_over(state: PartState) -> bool {
    matches!(
        state,
        PartState::Stopped | PartState::Finished | PartState::Failed
    )
}

/// `supervise` catches its part's panics on the part's own task; its own
/// task ending abnormally is a bug of this module.
fn supervisor_bug(e: &tokio::task::JoinError) -> Option<PartFailed> {
    panic!("a supervisor task ended abnormally: {e}")
}
