//! Metrics: what an operator needs to see that deduplication works.
//!
//! `idem_calls_total{scope, kind, outcome}` counts every call by what happened
//! (see [`CallOutcome`] for the values). A `replayed` rate stuck at zero while
//! clients retry means the keys change on every retry. Steps count under
//! `kind="step"` with the step name as scope. `idem_takeovers_total` counts
//! claims taken from an owner whose lease ran out, `idem_fenced_total`
//! completions refused because a newer owner had taken over, and
//! `idem_claim_seconds` times the claim.

use std::time::Duration;

use crate::spec::{Kind, Spec};

/// The `outcome` label of `idem_calls_total`: what happened to one call.
///
/// ```
/// use idem_runtime::CallOutcome;
///
/// assert_eq!(CallOutcome::Replayed.as_str(), "replayed");
/// assert!(CallOutcome::ALL.contains(&CallOutcome::KeyReuse));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallOutcome {
    /// The body ran and its result was recorded.
    Executed,
    /// A stored result (or stored final error) was replayed; the body did not run.
    Replayed,
    /// Another caller holds a live claim.
    InProgress,
    /// The key was used with another payload fingerprint.
    KeyReuse,
    /// The body returned a retryable `Err`; the claim was released.
    Failed,
    /// The store failed: the claim (the body did not run) or the recording.
    StoreError,
    /// A stored result did not decode into the current type.
    CodecError,
    /// The result could not be stored (too large, or it did not encode); a
    /// marker was stored instead.
    Unstored,
    /// A duplicate found such a marker and got an error instead of a second run.
    ReplayedUnstored,
    /// A step did not start because its flow's lease was taken over.
    LeaseLost,
    /// `tx = …` named a connection outside a transaction; nothing ran.
    NotInTransaction,
}

impl CallOutcome {
    /// Every outcome, in the order the README lists them.
    pub const ALL: [CallOutcome; 11] = [
        CallOutcome::Executed,
        CallOutcome::Replayed,
        CallOutcome::InProgress,
        CallOutcome::KeyReuse,
        CallOutcome::Failed,
        CallOutcome::StoreError,
        CallOutcome::CodecError,
        CallOutcome::Unstored,
        CallOutcome::ReplayedUnstored,
        CallOutcome::LeaseLost,
        CallOutcome::NotInTransaction,
    ];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Executed => "executed",
            CallOutcome::Replayed => "replayed",
            CallOutcome::InProgress => "in_progress",
            CallOutcome::KeyReuse => "key_reuse",
            CallOutcome::Failed => "failed",
            CallOutcome::StoreError => "store_error",
            CallOutcome::CodecError => "codec_error",
            CallOutcome::Unstored => "unstored",
            CallOutcome::ReplayedUnstored => "replayed_unstored",
            CallOutcome::LeaseLost => "lease_lost",
            CallOutcome::NotInTransaction => "not_in_transaction",
        }
    }
}

fn kind(spec: &Spec) -> &'static str {
    match spec.kind {
        Kind::Call => "call",
        Kind::Consumer => "consumer",
        Kind::Step => "step",
    }
}

pub(crate) fn call(spec: &Spec, outcome: CallOutcome) {
    metrics::counter!("idem_calls_total", "scope" => spec.scope, "kind" => kind(spec), "outcome" => outcome.as_str())
        .increment(1);
}

pub(crate) fn takeover(spec: &Spec) {
    metrics::counter!("idem_takeovers_total", "scope" => spec.scope, "kind" => kind(spec))
        .increment(1);
}

pub(crate) fn fenced(spec: &Spec) {
    metrics::counter!("idem_fenced_total", "scope" => spec.scope, "kind" => kind(spec))
        .increment(1);
}

pub(crate) fn claim_latency(spec: &Spec, took: Duration) {
    metrics::histogram!("idem_claim_seconds", "scope" => spec.scope, "kind" => kind(spec))
        .record(took.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::CallOutcome;

    /// The README's list of outcome labels is this enum, in this order.
    #[test]
    fn the_readme_lists_every_outcome_and_no_other() {
        let readme = include_str!("../../README.md");
        let start = readme
            .find("`idem_calls_total{outcome}`")
            .expect("the README's Observability section names idem_calls_total{outcome}");
        let item = &readme[start..];
        let item = &item[..item.find("\n- ").expect("the list goes on")];
        // The code spans of the item that are label values: the metric's name
        // and the enum's path are not, and `outcome` names the label.
        let listed: Vec<&str> = item
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|w| *w != "outcome" && w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .collect();
        let ours: Vec<&str> = CallOutcome::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(listed, ours, "README lists {listed:?}");
    }
}
