//! What a worker tells: its counts since it was built ([`WorkerStats`]),
//! what one pass did ([`Pass`]), and how one turn went.

use std::collections::BTreeMap;
use std::time::Duration;

/// Counts since the worker was built, and what its last pass found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerStats {
    /// Passes made.
    pub passes: u64,
    /// Flows the worker finished with their result (or found finished).
    pub recovered: u64,
    /// Flows that ended with a final error during recovery: the error is
    /// stored and the finished steps compensated.
    pub gave_up: u64,
    /// Recoveries that did not finish the flow (a retryable error, a panic,
    /// a store failure); each comes back after its backoff.
    pub failed: u64,
    /// Claims parked for an operator.
    pub parked: u64,
    /// Turns that found the claim held by someone else (the caller came
    /// back, or another worker got there first).
    pub busy: u64,
    /// From the last pass: abandoned claims per scope that no registered
    /// function resumes. They are left alone (another service's worker may
    /// own them) and reported, never skipped silently.
    pub unregistered: BTreeMap<String, u64>,
    /// From the last pass: how long the oldest abandoned claim found had
    /// waited since its lease ran out.
    pub oldest_abandoned: Option<Duration>,
    /// Why the last pass failed, when it did (a store that keeps no
    /// recovery state says so here).
    pub last_error: Option<String>,
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pass {
    /// Abandoned claims found in registered scopes.
    pub found: usize,
    /// Finished with their result.
    pub recovered: usize,
    /// Ended with a final error (compensated).
    pub gave_up: usize,
    /// Did not finish; back after their backoff.
    pub failed: usize,
    /// Parked.
    pub parked: usize,
    /// Held by someone else.
    pub busy: usize,
    /// Found but left for a later pass: this worker already runs a turn at
    /// the claim, or all its `concurrency` turns were in flight (only in
    /// [`Worker::run`](super::Worker::run), whose passes never wait for a
    /// turn to end).
    pub deferred: usize,
    /// Abandoned claims per scope with no function registered.
    pub unregistered: BTreeMap<String, u64>,
    /// The oldest abandoned claim's wait.
    pub oldest_abandoned: Option<Duration>,
}

impl Pass {
    pub(super) fn count(&mut self, outcome: &Outcome) {
        match outcome {
            Outcome::Recovered => self.recovered += 1,
            Outcome::GaveUp => self.gave_up += 1,
            Outcome::Failed => self.failed += 1,
            Outcome::Parked => self.parked += 1,
            Outcome::Busy => self.busy += 1,
            Outcome::Gone => {}
        }
    }
}

/// How one turn went.
#[derive(Clone, Copy)]
pub(super) enum Outcome {
    Recovered,
    GaveUp,
    Failed,
    Parked,
    Busy,
    /// Not abandoned any more by the time of the turn.
    Gone,
}
