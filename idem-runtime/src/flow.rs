//! The context of the idempotent call in progress: what steps and downstream
//! calls inside the body see.

use std::cell::{Cell, OnceCell};
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::Error;
use crate::key::{Fingerprint, Key};
use crate::spec::{Kind, Spec};
use crate::store::{Store as _, StoreRef, Token};

tokio::task_local! {
    static FLOW: Flow;
}

/// The call running on this task, as its body sees it: held by value in the
/// call's task-local scope. What every call has is here; the rest (step
/// numbering, compensations, the give-up record: [`FlowContext`]) is shared
/// behind an `Arc` made the first time a step or a compensation asks for
/// it, so a call whose body runs no step allocates none of it.
pub(crate) struct Flow {
    key: Key,
    store: Option<StoreRef>,
    ttl: Duration,
    lease: Duration,
    fence: Option<u64>,
    owner: Option<Token>,
    fingerprint: Option<Fingerprint>,
    /// The context of the flow this call runs inside (a nested call, or a
    /// step's body), so a lost lease up the chain stops new steps here too.
    parent: Option<Arc<FlowContext>>,
    /// The heartbeat found another owner (see [`Flow::mark_lease_lost`]):
    /// kept here whether or not the context exists yet, and copied into
    /// the context when it is made later.
    lease_lost: Cell<bool>,
    context: OnceCell<Arc<FlowContext>>,
}

impl Flow {
    pub(crate) fn new(
        key: Key,
        fingerprint: Option<Fingerprint>,
        store: Option<StoreRef>,
        ttl: Duration,
        lease: Duration,
        fence: Option<u64>,
        owner: Option<Token>,
    ) -> Flow {
        Flow {
            key,
            store,
            ttl,
            lease,
            fence,
            owner,
            fingerprint,
            parent: current(),
            lease_lost: Cell::new(false),
            context: OnceCell::new(),
        }
    }

    /// The shared part, made on first use.
    fn context(&self) -> &Arc<FlowContext> {
        self.context.get_or_init(|| {
            Arc::new(FlowContext {
                key: self.key,
                store: self.store.clone(),
                ttl: self.ttl,
                lease: self.lease,
                owner: self.owner,
                fingerprint: self.fingerprint,
                step_root: std::sync::OnceLock::new(),
                lease_lost: AtomicBool::new(self.lease_lost.get()),
                parent: self.parent.clone(),
                occurrences: Mutex::new(HashMap::new()),
                compensations: Mutex::new(Vec::new()),
                replayed: AtomicBool::new(false),
                may_give_up: AtomicBool::new(false),
                gave_up: Mutex::new(None),
            })
        })
    }

    /// The heartbeat found another owner on the record: no new step starts,
    /// whoever holds the context.
    fn mark_lease_lost(&self) {
        self.lease_lost.set(true);
        if let Some(context) = self.context.get() {
            context.mark_lease_lost();
        }
    }

    /// Whether this call, or a flow it runs inside, lost its lease (the
    /// context's own flag too: an owner proving itself can find it lost).
    fn lease_lost(&self) -> bool {
        self.lease_lost.get()
            || self.context.get().is_some_and(|c| c.lease_lost())
            || self.parent.as_ref().is_some_and(|p| p.lease_lost())
    }
}

/// The shared part of a running call's [`Flow`]: what its steps and
/// compensations keep across awaits.
pub(crate) struct FlowContext {
    pub(crate) key: Key,
    // `None` inside a caller's transaction: steps then run without records.
    pub(crate) store: Option<StoreRef>,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    /// The token this call's claim holds the record under (`None` inside a
    /// caller's transaction, where nothing can take the record over).
    owner: Option<Token>,
    /// The payload fingerprint the call claimed with, which step keys are
    /// bound to (see [`FlowContext::step_root`]).
    fingerprint: Option<Fingerprint>,
    /// Derived on the first step: most calls have none, and the derivation
    /// is a hash.
    step_root: std::sync::OnceLock<Key>,
    lease_lost: AtomicBool,
    // The flow this call runs inside (a step's body runs inside its flow): a
    // lost lease up the chain stops new steps down here too.
    parent: Option<Arc<FlowContext>>,
    occurrences: Mutex<HashMap<(&'static str, Option<Key>), Occurrences>>,
    /// The compensations of the steps with `compensate` that finished (ran or
    /// replayed) in this run, in the order they finished.
    compensations: Mutex<Vec<Pending>>,
    /// A step of this run replayed a record: this run is a retry, and an
    /// earlier run may have given up.
    replayed: AtomicBool,
    /// The call treats some errors as final (`final_err`), so it can give up.
    may_give_up: AtomicBool,
    /// What is known of the give-up record: `None` not read yet, `Some(None)`
    /// absent, `Some(Some(final error))` an earlier run gave up.
    gave_up: Mutex<Option<Option<Vec<u8>>>>,
}

/// A finished step's compensation, waiting for the flow to give up.
pub(crate) struct Pending {
    pub(crate) step: &'static str,
    pub(crate) compensation: &'static str,
    /// The key of the step's record; the compensation's own record hangs off it.
    pub(crate) step_key: Key,
    /// Runs the compensation as a recorded step under the given settings, store
    /// and key; `Err` carries the compensation's error, for the message.
    pub(crate) run: Box<dyn FnOnce(Spec, StoreRef, Key) -> CompensationFuture + Send>,
}

pub(crate) type CompensationFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// How the calls of one step (its name and, with `#[step(key = …)]`, the key
/// built from the call's arguments) are numbered within one run of a flow.
///
/// A number is spent only when a call reaches a stored outcome: a failed
/// attempt hands its number back, so a body that retries a flaky step records
/// the attempt that succeeded under the number a retry of the whole flow will
/// look up. Numbers in flight are skipped, so concurrent calls never share a
/// record. A handed-back number goes to the next call with the same name and
/// item key: without a `key`, that may be the next item of a loop, which is
/// why a loop that goes on past a failed call keys its step.
#[derive(Default)]
struct Occurrences {
    finished: BTreeSet<u64>,
    in_flight: BTreeSet<u64>,
}

impl Occurrences {
    fn take(&mut self) -> u64 {
        let n = (0..)
            .find(|n| !self.finished.contains(n) && !self.in_flight.contains(n))
            .expect("a free occurrence number");
        self.in_flight.insert(n);
        n
    }
}

/// One numbered call of a step; hands its number back unless it finished.
pub(crate) struct Occurrence {
    flow: Arc<FlowContext>,
    name: &'static str,
    item: Option<Key>,
    pub(crate) number: u64,
    finished: bool,
}

impl Occurrence {
    /// The step reached a stored outcome: its number is spent for this run.
    pub(crate) fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Occurrence {
    fn drop(&mut self) {
        let mut map = self.flow.lock_occurrences();
        let slots = map.entry((self.name, self.item)).or_default();
        slots.in_flight.remove(&self.number);
        if self.finished {
            slots.finished.insert(self.number);
        }
    }
}

impl FlowContext {
    /// What step keys hang off: the flow key, bound to the payload fingerprint
    /// when there is one, so a retry with another payload (after a release or a
    /// takeover) never replays the steps of the first.
    fn step_root(&self) -> &Key {
        self.step_root.get_or_init(|| match self.fingerprint {
            Some(fp) => self
                .key
                .derive(&format!("fingerprint:{}", hex::encode(fp.as_bytes()))),
            None => self.key,
        })
    }

    fn lock_occurrences(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<(&'static str, Option<Key>), Occurrences>> {
        self.occurrences.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The settings every record under this flow is written with: its steps,
    /// its give-up record and its compensations.
    pub(crate) fn step_spec(&self, scope: &'static str) -> Spec {
        // A takeover can find a step still claimed by the crashed previous
        // owner for the few milliseconds its lease outlives the flow's: the
        // claim waits that out.
        Spec {
            scope,
            kind: Kind::Step,
            ttl: self.ttl,
            lease: self.lease,
            wait: Some(self.lease),
            event: None,
            site: None,
        }
    }

    /// Numbers the next call of `step` (of its `item`, for a keyed step) and
    /// returns its record's key.
    pub(crate) fn next_occurrence(
        self: &Arc<Self>,
        step: &'static str,
        item: Option<Key>,
    ) -> (Occurrence, Key) {
        let number = self
            .lock_occurrences()
            .entry((step, item))
            .or_default()
            .take();
        let key = match &item {
            None => self.step_root().derive_indexed(step, number),
            Some(item) => self.step_root().derive_item(step, item, number),
        };
        let occurrence = Occurrence {
            flow: Arc::clone(self),
            name: step,
            item,
            number,
            finished: false,
        };
        (occurrence, key)
    }

    /// Records a finished step's compensation.
    pub(crate) fn push_compensation(&self, pending: Pending) {
        lock(&self.compensations).push(pending);
    }

    /// The compensations registered so far, in the order their steps finished.
    pub(crate) fn take_compensations(&self) -> Vec<Pending> {
        std::mem::take(&mut *lock(&self.compensations))
    }

    pub(crate) fn has_compensations(&self) -> bool {
        !lock(&self.compensations).is_empty()
    }

    pub(crate) fn mark_replayed(&self) {
        self.replayed.store(true, Ordering::Relaxed);
    }

    pub(crate) fn replayed(&self) -> bool {
        self.replayed.load(Ordering::Relaxed)
    }

    pub(crate) fn set_may_give_up(&self) {
        self.may_give_up.store(true, Ordering::Relaxed);
    }

    /// Whether a step about to run must first look for an earlier run's give-up
    /// record. Only a retry (a step replayed) of a call that can give up and
    /// has something to compensate can meet one; a first run pays nothing.
    pub(crate) fn must_look_for_give_up(&self) -> bool {
        self.may_give_up.load(Ordering::Relaxed)
            && self.replayed()
            && self.has_compensations()
            && lock(&self.gave_up).is_none()
    }

    /// What is known of the give-up record (see the field).
    pub(crate) fn known_give_up(&self) -> Option<Option<Vec<u8>>> {
        lock(&self.gave_up).clone()
    }

    pub(crate) fn set_give_up(&self, record: Option<Vec<u8>>) {
        *lock(&self.gave_up) = Some(record);
    }

    /// The key of the record saying this flow gave up, bound like the steps'.
    pub(crate) fn give_up_key(&self) -> Key {
        self.step_root().derive("idem:gave-up")
    }

    /// The heartbeat found another owner on the record.
    pub(crate) fn mark_lease_lost(&self) {
        self.lease_lost.store(true, Ordering::Relaxed);
    }

    /// Proves against the store that this call still owns its record, before
    /// an act only the owner may take (giving the flow up, undoing a step):
    /// a renewal under the claim's token, which fails once another caller
    /// took the key over, even if it finished since, or before this call's
    /// heartbeat noticed. Renewing also keeps the lease for the act that
    /// follows. The local flag alone cannot tell a stalled owner it is stale.
    pub(crate) async fn prove_ownership(&self, act: &str) -> Result<(), Error> {
        if let (Some(store), Some(token)) = (&self.store, self.owner) {
            let owned = store.renew(&self.key, token, self.lease).await?;
            if !owned {
                self.mark_lease_lost();
            }
        }
        if self.lease_lost() {
            tracing::warn!(act, "this call no longer owns its key; not going on");
            return Err(Error::LeaseLost {
                scope: act.to_owned(),
            });
        }
        Ok(())
    }

    /// Whether this call, or a flow it runs inside, lost its lease.
    pub(crate) fn lease_lost(&self) -> bool {
        self.lease_lost.load(Ordering::Relaxed)
            || self.parent.as_ref().is_some_and(|p| p.lease_lost())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn scope<F: Future>(flow: Flow, fut: F) -> impl Future<Output = F::Output> {
    FLOW.scope(flow, fut)
}

/// The shared context of the call running on this task (made now if no one
/// asked for it before).
pub(crate) fn current() -> Option<Arc<FlowContext>> {
    FLOW.try_with(|f| Arc::clone(f.context())).ok()
}

/// [`current`], for a call whose records have a store (not one inside a
/// caller's transaction, whose steps need no records): the context and the
/// store. Makes no context otherwise.
pub(crate) fn current_with_store() -> Option<(Arc<FlowContext>, StoreRef)> {
    FLOW.try_with(|f| {
        let store = f.store.clone()?;
        Some((Arc::clone(f.context()), store))
    })
    .ok()
    .flatten()
}

/// Whether an idempotent call runs on this task; makes no context.
pub(crate) fn in_flow() -> bool {
    FLOW.try_with(|_| ()).is_ok()
}

/// The heartbeat of the call running on this task found another owner.
pub(crate) fn mark_lease_lost() {
    let _ = FLOW.try_with(Flow::mark_lease_lost);
}

/// The key of the idempotent call (or step) running on this task, if any.
///
/// Pass it, or a key derived from it per downstream call, as the
/// `Idempotency-Key` of a payment or SMS provider, so a retry that reaches the
/// provider again is deduplicated there too. It is the same on every retry of
/// the same business intent.
///
/// Task-local: a task spawned from the body does not see it; capture it first.
///
/// ```
/// use std::sync::LazyLock;
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// use idem_runtime::store::memory::MemoryStore;
///
/// #[derive(Debug)]
/// struct AppError(idem_runtime::Error);
/// impl From<idem_runtime::Error> for AppError {
///     fn from(e: idem_runtime::Error) -> Self { AppError(e) }
/// }
///
/// // One store for every call: a store built per call would remember nothing.
/// static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
/// static CHARGES: AtomicUsize = AtomicUsize::new(0);
///
/// #[idem_runtime::idempotent(key = "order_id", store = &*STORE)]
/// async fn charge(order_id: u64) -> Result<String, AppError> {
///     let key = idem_runtime::current_key().expect("inside an idempotent call");
///     CHARGES.fetch_add(1, Ordering::SeqCst);
///     Ok(key.derive("psp:charge").to_hex()) // the provider's Idempotency-Key
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let first = charge(7).await.unwrap();
/// assert_eq!(first.len(), 64);
/// assert_eq!(charge(7).await.unwrap(), first); // a retry: replayed, not charged again
/// assert_eq!(CHARGES.load(Ordering::SeqCst), 1);
/// assert!(idem_runtime::current_key().is_none());
/// # });
/// ```
pub fn current_key() -> Option<Key> {
    FLOW.try_with(|f| f.key).ok()
}

/// The fence of the idempotent call (or step) running on this task: a number
/// that grows with every acquisition of its key.
///
/// Pass it downstream with a write (a version column, a fencing token) so the
/// system that receives it can refuse a write from an owner that was taken
/// over. `None` outside an idempotent call.
///
/// ```
/// use std::sync::LazyLock;
/// use std::sync::atomic::{AtomicUsize, Ordering};
///
/// use idem_runtime::store::memory::MemoryStore;
///
/// #[derive(Debug)]
/// struct AppError(idem_runtime::Error);
/// impl From<idem_runtime::Error> for AppError {
///     fn from(e: idem_runtime::Error) -> Self { AppError(e) }
/// }
///
/// static STORE: LazyLock<MemoryStore> = LazyLock::new(MemoryStore::new);
/// static SHIPMENTS: AtomicUsize = AtomicUsize::new(0);
///
/// #[idem_runtime::idempotent(key = "order_id", store = &*STORE)]
/// async fn ship(order_id: u64) -> Result<u64, AppError> {
///     SHIPMENTS.fetch_add(1, Ordering::SeqCst);
///     Ok(idem_runtime::current_fence().expect("inside an idempotent call"))
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let fence = ship(7).await.unwrap();
/// assert!(fence >= 1);
/// assert_eq!(ship(7).await.unwrap(), fence); // replayed
/// assert_eq!(SHIPMENTS.load(Ordering::SeqCst), 1);
/// assert!(idem_runtime::current_fence().is_none());
/// # });
/// ```
pub fn current_fence() -> Option<u64> {
    FLOW.try_with(|f| f.fence).ok().flatten()
}

/// Whether the idempotent call running on this task has lost its lease: its
/// heartbeat found the record owned by a caller that took it over.
///
/// A stale owner cannot start new steps (they fail with
/// [`Error::LeaseLost`](crate::Error::LeaseLost)) and its completion is fenced
/// off, but work that is not a step (a direct write, a loop) is the body's to
/// stop: check this before an effect that a step does not guard. `false`
/// outside an idempotent call.
///
/// ```
/// assert!(!idem_runtime::lease_lost());
/// ```
pub fn lease_lost() -> bool {
    FLOW.try_with(|f| f.lease_lost()).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    fn flow(key: &str) -> Flow {
        let key = Key::builder("flow-tests").part(key).finish();
        let (ttl, lease) = (Duration::from_secs(60), Duration::from_secs(5));
        Flow::new(key, None, None, ttl, lease, Some(1), None)
    }

    /// The shared context is made only when asked for, and is one for the
    /// call however often it is asked for.
    #[test]
    fn the_context_is_made_on_first_use_only() {
        scope(flow("a"), async {
            assert!(in_flow());
            assert!(FLOW.with(|f| f.context.get().is_none()));
            let first = current().expect("inside a flow");
            assert!(Arc::ptr_eq(&first, &current().unwrap()));
        })
        .now_or_never()
        .unwrap();
        assert!(!in_flow() && current().is_none());
    }

    /// A lease lost before the context existed, after it was made, or found
    /// by the context itself: the call, its context and the calls nested in
    /// it all see it.
    #[test]
    fn a_lost_lease_is_seen_wherever_it_was_marked() {
        scope(flow("before"), async {
            mark_lease_lost();
            assert!(lease_lost());
            assert!(
                current().unwrap().lease_lost(),
                "a context made after the mark"
            );
        })
        .now_or_never()
        .unwrap();
        scope(flow("after"), async {
            let context = current().unwrap();
            assert!(!lease_lost() && !context.lease_lost());
            mark_lease_lost();
            assert!(context.lease_lost(), "a context made before the mark");
        })
        .now_or_never()
        .unwrap();
        scope(flow("context"), async {
            current().unwrap().mark_lease_lost();
            assert!(lease_lost(), "the context's own flag");
        })
        .now_or_never()
        .unwrap();
        scope(flow("parent"), async {
            let nested = flow("child");
            mark_lease_lost();
            scope(nested, async {
                assert!(lease_lost(), "a call nested in one that lost its lease");
                assert!(current().unwrap().lease_lost());
            })
            .await;
        })
        .now_or_never()
        .unwrap();
        assert!(!lease_lost());
    }
}
