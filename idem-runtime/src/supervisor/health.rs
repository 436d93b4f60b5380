//! What the supervisor reports: each part's state, for a health route, a
//! readiness probe or a test.

use serde::Serialize;
use tokio::sync::watch;

/// Where one part is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PartState {
    /// Added; the supervisor's `run_until` has not started it yet.
    Starting,
    /// Running.
    Running,
    /// Failed (see `last_error`), and waits its backoff to be started again.
    Restarting,
    /// The shutdown came: finishing what it has in flight.
    Stopping,
    /// Ended after the shutdown, its work in flight finished.
    Stopped,
    /// Returned on its own, with no error and no shutdown asked; not started
    /// again.
    Finished,
    /// Failed and not started again (see `last_error`): with
    /// [`stop_all_on_failure`](super::Supervisor::stop_all_on_failure), or
    /// failing while it stopped, or not stopped within the
    /// [`shutdown_timeout`](super::Supervisor::shutdown_timeout).
    Failed,
}

/// One part's health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PartStatus {
    /// The name it was added under.
    pub name: String,
    /// Where it is.
    pub state: PartState,
    /// How many times it was started again after a failure.
    pub restarts: u32,
    /// Its last failure, kept once it runs again so an operator sees what
    /// happened: a broker error, or the message of a panic.
    pub last_error: Option<String>,
}

impl PartStatus {
    pub(super) fn new(name: String) -> PartStatus {
        PartStatus {
            name,
            state: PartState::Starting,
            restarts: 0,
            last_error: None,
        }
    }
}

/// Every part's health, live: a handle from
/// [`Supervisor::health`](super::Supervisor::health), cheap to clone into a
/// route's state (the [guide](crate::guide) page on the supervisor has an
/// axum health route answering 503 while a part is not running).
///
/// ```
/// use idem_runtime::supervisor::{PartState, Supervisor};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let supervisor = Supervisor::new().consumer("settlement", |stop| async move {
///     stop.await;
///     Ok::<(), std::io::Error>(())
/// });
/// let mut health = supervisor.health();
/// assert_eq!(health.part("settlement").unwrap().state, PartState::Starting);
/// let run = tokio::spawn(supervisor.run_until(std::future::pending::<()>()));
/// health.wait_for(|parts| parts.iter().all(|p| p.state == PartState::Running)).await;
/// assert!(health.is_healthy());
/// # run.abort();
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct Health {
    rx: watch::Receiver<Vec<PartStatus>>,
}

impl Health {
    pub(super) fn new(rx: watch::Receiver<Vec<PartStatus>>) -> Health {
        Health { rx }
    }

    /// Each part's status, in the order they were added.
    pub fn parts(&self) -> Vec<PartStatus> {
        self.rx.borrow().clone()
    }

    /// The status of the part added under `name`.
    pub fn part(&self, name: &str) -> Option<PartStatus> {
        self.rx.borrow().iter().find(|p| p.name == name).cloned()
    }

    /// Whether every part is running (a supervisor of no parts is healthy).
    /// A part restarting after a failure, or ended, makes it `false`.
    pub fn is_healthy(&self) -> bool {
        self.rx
            .borrow()
            .iter()
            .all(|p| p.state == PartState::Running)
    }

    /// Waits until the parts' statuses satisfy `ready`, and returns them:
    /// for a readiness probe that waits for every part to run, or a test.
    /// If the supervisor is dropped first, returns the last statuses.
    pub async fn wait_for(
        &mut self,
        mut ready: impl FnMut(&[PartStatus]) -> bool,
    ) -> Vec<PartStatus> {
        let waited = self
            .rx
            .wait_for(|parts| ready(parts))
            .await
            .map(|parts| parts.clone());
        waited.unwrap_or_else(|_| self.parts())
    }
}
