//! Tying a spawned task's life to the future that awaits it.
//!
//! Dropping a `JoinHandle` detaches its task: the work goes on, unwatched.
//! Where idem spawns work on behalf of a future (a delivery under
//! `run_spawned`, a recovered call under a worker's turn, a supervisor's
//! part), dropping that future must stop the work, as dropping any
//! idempotent call's future stops it at its `.await`.

/// Aborts the task when dropped; a no-op once the task has ended.
pub(crate) struct AbortOnDrop(tokio::task::AbortHandle);

impl AbortOnDrop {
    /// Guards the task behind `handle`.
    pub(crate) fn new<T>(handle: &tokio::task::JoinHandle<T>) -> Self {
        AbortOnDrop(handle.abort_handle())
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
