//! The worker's metrics, labelled by scope: what it finished, what failed and
//! will be tried again, what it parked, and how long abandoned claims wait.

use std::time::Duration;

/// The recovered call ended its flow: `ok` (its result stored, or replayed)
/// or `final_error` (a final error stored, the finished steps compensated).
pub(super) fn recovered(scope: &str, outcome: &'static str) {
    metrics::counter!("idem_recovery_recovered_total", "scope" => scope.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// A recovery that did not finish the flow; the claim comes back after its
/// backoff.
pub(super) fn failed(scope: &str) {
    metrics::counter!("idem_recovery_failed_total", "scope" => scope.to_owned()).increment(1);
}

/// A claim parked for an operator.
pub(super) fn parked(scope: &str) {
    metrics::counter!("idem_recovery_parked_total", "scope" => scope.to_owned()).increment(1);
}

/// How long the oldest abandoned claim of `scope` found in a pass has waited
/// since its lease ran out (0 when none was found).
pub(super) fn oldest_abandoned(scope: &str, age: Duration) {
    metrics::gauge!("idem_recovery_oldest_abandoned_seconds", "scope" => scope.to_owned())
        .set(age.as_secs_f64());
}

/// Abandoned claims of `scope` with arguments stored and no function
/// registered for it in this worker (0 once none are left).
pub(super) fn unregistered(scope: &str, count: usize) {
    metrics::gauge!("idem_recovery_unregistered", "scope" => scope.to_owned()).set(count as f64);
}
