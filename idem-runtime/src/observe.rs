//! Metrics: what an operator needs to see that deduplication works.
//!
//! `idem_calls_total{scope, kind, outcome}` counts every call by what happened
//! (see [`CallOutcome`] for the values). A `replayed` rate stuck at zero while
//! clients retry means the keys change on every retry. Steps count under
//! `kind="step"` with the step name as scope. `idem_takeovers_total` counts
//! claims taken from an owner whose lease ran out, `idem_fenced_total`
//! completions refused because a newer owner had taken over, and
//! `idem_claim_seconds` times the claim.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::time::Duration;

use metrics::{Key, Label, Level, Metadata};

use crate::site::SITE_KEYS;
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
    /// Every outcome, in the order the guide's operating page lists them.
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

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// Which metric of which call site: scopes are `&'static str`, compared by
/// address (two call sites sharing a scope string by value get two entries,
/// each with the right labels).
#[derive(PartialEq, Eq)]
struct Site {
    name: &'static str,
    scope: (usize, usize),
    kind: u8,
    outcome: Option<CallOutcome>,
}

impl std::hash::Hash for Site {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // One word: the addresses and small numbers already tell sites
        // apart; `WordHasher` spreads it.
        let outcome = self.outcome.map_or(0, |o| o as u64 + 1);
        h.write_u64(
            (self.scope.0 as u64)
                ^ ((self.scope.1 as u64) << 40)
                ^ (self.name.as_ptr() as u64).rotate_left(17)
                ^ (u64::from(self.kind) << 56)
                ^ (outcome << 60),
        );
    }
}

/// Fibonacci hashing of keys made of a word or two (a call site here, a
/// scope's address and length in the in-progress hint): SipHash would cost
/// more than the lookup saves.
#[derive(Default)]
pub(crate) struct WordHasher(u64);

impl std::hash::Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

thread_local! {
    /// The metric keys every call names, built once per thread: a `Key`
    /// with labels sorts and hashes them, which on the hot path cost about
    /// as much as the memory store's claim. Per thread, so no lock; freed
    /// with the thread.
    static KEYS: RefCell<HashMap<Site, Key, BuildHasherDefault<WordHasher>>> =
        RefCell::new(HashMap::default());
}

const CALLS_TOTAL: &str = "idem_calls_total";

/// The site's slot of each key it keeps: an outcome's `idem_calls_total`,
/// or `idem_claim_seconds` after them.
const CLAIM_SECONDS_SLOT: usize = CallOutcome::ALL.len();
const _: () = assert!(CLAIM_SECONDS_SLOT + 1 == SITE_KEYS);

/// The slot of an outcome's `idem_calls_total` key: a `match` with no
/// wildcard, so an outcome added later must be given its own.
const fn outcome_slot(outcome: CallOutcome) -> usize {
    match outcome {
        CallOutcome::Executed => 0,
        CallOutcome::Replayed => 1,
        CallOutcome::InProgress => 2,
        CallOutcome::KeyReuse => 3,
        CallOutcome::Failed => 4,
        CallOutcome::StoreError => 5,
        CallOutcome::CodecError => 6,
        CallOutcome::Unstored => 7,
        CallOutcome::ReplayedUnstored => 8,
        CallOutcome::LeaseLost => 9,
        CallOutcome::NotInTransaction => 10,
    }
}

// Every outcome has a slot of its own below the claim latency's.
const _: () = {
    let mut i = 0;
    while i < CallOutcome::ALL.len() {
        assert!(outcome_slot(CallOutcome::ALL[i]) < CLAIM_SECONDS_SLOT);
        let mut j = 0;
        while j < i {
            assert!(outcome_slot(CallOutcome::ALL[i]) != outcome_slot(CallOutcome::ALL[j]));
            j += 1;
        }
        i += 1;
    }
};

/// Runs `f` with the key of `name` at this call site: from the site's own
/// slots when the attribute gave it some, else from this thread's map.
fn with_key<R>(
    name: &'static str,
    spec: &Spec,
    outcome: Option<CallOutcome>,
    f: impl FnOnce(&Key) -> R,
) -> R {
    if let Some(site) = spec.site {
        // Two names only, told apart by the outcome: `call` passes one,
        // `claim_latency` none.
        debug_assert_eq!(outcome.is_some(), name == CALLS_TOTAL);
        let slot = outcome.map_or(CLAIM_SECONDS_SLOT, outcome_slot);
        return f(site.keys[slot].get_or_init(|| key_of(name, spec, outcome)));
    }
    let site = Site {
        name,
        scope: (spec.scope.as_ptr() as usize, spec.scope.len()),
        kind: spec.kind as u8,
        outcome,
    };
    KEYS.with(|keys| {
        let mut keys = keys.borrow_mut();
        let key = keys
            .entry(site)
            .or_insert_with(|| key_of(name, spec, outcome));
        f(key)
    })
}

fn key_of(name: &'static str, spec: &Spec, outcome: Option<CallOutcome>) -> Key {
    let mut labels = vec![
        Label::new("scope", spec.scope),
        Label::new("kind", kind(spec)),
    ];
    if let Some(o) = outcome {
        labels.push(Label::new("outcome", o.as_str()));
    }
    Key::from_parts(name, labels)
}

pub(crate) fn call(spec: &Spec, outcome: CallOutcome) {
    with_key(CALLS_TOTAL, spec, Some(outcome), |key| {
        metrics::with_recorder(|r| r.register_counter(key, &METADATA)).increment(1)
    });
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
    with_key("idem_claim_seconds", spec, None, |key| {
        metrics::with_recorder(|r| r.register_histogram(key, &METADATA)).record(took.as_secs_f64())
    });
}

#[cfg(test)]
mod tests {
    use super::CallOutcome;

    /// The guide's list of outcome labels is this enum, in this order.
    #[test]
    fn the_guide_lists_every_outcome_and_no_other() {
        let readme = include_str!("../guide/operating.md");
        let start = readme
            .find("`idem_calls_total{outcome}`")
            .expect("the guide's Observability section names idem_calls_total{outcome}");
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
        assert_eq!(listed, ours, "the guide lists {listed:?}");
    }
}
