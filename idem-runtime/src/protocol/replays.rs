//! Telling a caller that a result was replayed rather than produced now: an
//! HTTP layer answers `Idempotent-Replayed: true`, a handler may log it.
//!
//! A task-local flag, set by the replay of a top-level call (not of a step,
//! and not of a call nested inside another idempotent call's body, whose
//! replay says nothing about the outer call).

use std::cell::Cell;
use std::future::Future;

use crate::flow;

use super::{Kind, Spec};

tokio::task_local! {
    static REPLAYED: Cell<bool>;
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
/// use idem_runtime::{Error, Key, StoreRef};
/// use idem_runtime::store::memory::MemoryStore;
///
/// const SPEC: Spec = Spec::new("doc::replays", Kind::Call);
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = StoreRef::new(MemoryStore::new());
/// let key = Key::builder(SPEC.scope).part("order-7").finish();
/// let call = || execute::<u32, Error, _>(&SPEC, Some(store.clone()), key, None, async { Ok(1) });
/// let (_, replayed) = track_replays(call()).await;
/// assert!(!replayed);
/// let (_, replayed) = track_replays(call()).await;
/// assert!(replayed);
/// # });
/// ```
pub async fn track_replays<F: Future>(fut: F) -> (F::Output, bool) {
    REPLAYED
        .scope(Cell::new(false), async {
            let out = fut.await;
            (out, REPLAYED.with(Cell::get))
        })
        .await
}

pub(super) fn mark(spec: &Spec) {
    if spec.kind == Kind::Step || flow::current().is_some() {
        return;
    }
    // Outside `track_replays` nobody asked.
    let _ = REPLAYED.try_with(|r| r.set(true));
}
