//! What the idempotent calls on a task did, reported once per outcome: into
//! a task-local record that whoever runs the task reads back, then to the
//! metrics (`observe`).
//!
//! Two readers ask nearly the same question:
//! - an HTTP layer (and any caller) asks whether the result was *replayed*
//!   rather than produced now ([`track_replays`]): only a top-level call
//!   counts, not a step, and not a call nested inside another idempotent
//!   call's body, whose replay says nothing about the outer call;
//! - the consumer runner asks what the handler's outermost call did, to pick
//!   the broker action (`observed`): the outermost call finishes last, so the
//!   value left behind is the handler's own outcome; steps never speak for it.

use std::cell::Cell;
use std::future::Future;

use crate::flow;
use crate::observe::{self, CallOutcome};

use super::{Kind, Spec};

/// What the last non-step call on the task said, for the consumer runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Noted {
    /// `recorded_err`: the call ended with the `Err` its record holds (a
    /// stored or replayed final error); otherwise an `Err` the handler returns
    /// is not in any record.
    Call {
        outcome: CallOutcome,
        recorded_err: bool,
    },
    /// The body ran, but a newer owner had taken the key over: its record
    /// stands. `final_err`: the body ended with an error it kept as final.
    Fenced { final_err: bool },
    /// The caller's transaction carrying the record did not commit.
    RolledBack,
}

/// Whose call it was: the labels of the consumer runner's metrics, taken
/// from the handler's own attribute so they cannot disagree with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Labels {
    pub(crate) scope: &'static str,
    pub(crate) event: Option<&'static str>,
}

#[derive(Default)]
struct Seen {
    replayed: Cell<bool>,
    last: Cell<Option<Noted>>,
    labels: Cell<Option<Labels>>,
}

tokio::task_local! {
    static SEEN: Seen;
}

/// Runs `fut` and says whether an idempotent call in it replayed a stored
/// outcome instead of running its body.
///
/// Only top-level calls count: a step replayed inside a flow, or an idempotent
/// call replayed inside another one's body, does not make the outer result a
/// replay.
///
/// ```
/// use idem_runtime::protocol::{execute, track_replays, Kind, Spec};
/// use idem_runtime::{Error, Key};
/// use idem_runtime::store::StoreRef;
/// use idem_runtime::store::memory::MemoryStore;
///
/// const SPEC: Spec = Spec::new("doc::replays", Kind::Call);
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = StoreRef::new(MemoryStore::new());
/// let key = Key::builder(SPEC.scope).part("order-7").finish();
/// let call = || execute::<u32, _, Error, _>(&SPEC, Some(store.clone()), key, None, async { Ok(1) });
/// let (_, replayed) = track_replays(call()).await;
/// assert!(!replayed);
/// let (_, replayed) = track_replays(call()).await;
/// assert!(replayed);
/// # });
/// ```
pub async fn track_replays<F: Future>(fut: F) -> (F::Output, bool) {
    SEEN.scope(Seen::default(), async {
        let out = fut.await;
        (out, SEEN.with(|s| s.replayed.get()))
    })
    .await
}

/// Runs `fut` and returns what its outermost idempotent call said last, and
/// that call's labels.
pub(crate) async fn observed<F: Future>(fut: F) -> (F::Output, Option<Noted>, Option<Labels>) {
    SEEN.scope(Seen::default(), async {
        let out = fut.await;
        let (noted, labels) = SEEN.with(|s| (s.last.get(), s.labels.get()));
        (out, noted, labels)
    })
    .await
}

fn note(spec: &Spec, noted: Noted) {
    if spec.kind != Kind::Step {
        // Outside `observed` and `track_replays` nobody asked.
        let _ = SEEN.try_with(|s| {
            s.last.set(Some(noted));
            s.labels.set(Some(Labels {
                scope: spec.scope,
                event: spec.event,
            }));
        });
    }
}

/// A call outcome whose `Err`, if any, is not in a record.
pub(super) fn call(spec: &Spec, outcome: CallOutcome) {
    note(
        spec,
        Noted::Call {
            outcome,
            recorded_err: false,
        },
    );
    observe::call(spec, outcome);
}

/// A call that ends with the error its record holds: a final error stored or
/// replayed, or the error a replayed marker of an unstored result stands for.
pub(super) fn call_ending_in_recorded_err(spec: &Spec, outcome: CallOutcome) {
    note(
        spec,
        Noted::Call {
            outcome,
            recorded_err: true,
        },
    );
    observe::call(spec, outcome);
}

/// A completion fenced off by a newer owner. `final_err`: the body ended with
/// an error it would have stored as final.
pub(super) fn fenced(spec: &Spec, final_err: bool) {
    note(spec, Noted::Fenced { final_err });
    observe::fenced(spec);
}

/// A stored outcome was replayed instead of running the body.
pub(super) fn replayed(spec: &Spec) {
    if spec.kind == Kind::Step || flow::in_flow() {
        return;
    }
    let _ = SEEN.try_with(|s| s.replayed.set(true));
}

/// What the call recorded in the caller's transaction did not last: the
/// transaction failed to commit.
pub(crate) fn rolled_back() {
    let _ = SEEN.try_with(|s| s.last.set(Some(Noted::RolledBack)));
}
