//! Metrics: what an operator needs to see that deduplication works.
//!
//! `idem_calls_total{scope, kind, outcome}` counts every call by what happened:
//! `executed`, `replayed`, `in_progress`, `key_reuse`, `failed` (the body
//! returned a retryable `Err`), `store_error`, `codec_error`, `unstored`,
//! `replayed_unstored`. A `replayed` rate stuck at zero while clients retry
//! means the keys change on every retry. Steps count under `kind="step"` with
//! the step name as scope. `idem_takeovers_total` counts claims taken from an
//! owner whose lease ran out, `idem_fenced_total` completions refused because a
//! newer owner had taken over, and `idem_claim_seconds` times the claim.

use std::time::Duration;

use crate::protocol::{Kind, Spec};

fn kind(spec: &Spec) -> &'static str {
    match spec.kind {
        Kind::Call => "call",
        Kind::Consumer => "consumer",
        Kind::Step => "step",
    }
}

pub(crate) fn call(spec: &Spec, outcome: &'static str) {
    metrics::counter!("idem_calls_total", "scope" => spec.scope, "kind" => kind(spec), "outcome" => outcome)
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
