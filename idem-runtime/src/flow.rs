//! The context of the idempotent call in progress: what steps and downstream
//! calls inside the body see.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::key::Key;
use crate::store::StoreRef;

tokio::task_local! {
    static FLOW: Arc<FlowContext>;
}

pub(crate) struct FlowContext {
    pub(crate) key: Key,
    // `None` inside a caller's transaction: steps then run without records.
    pub(crate) store: Option<StoreRef>,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    // How many times each step name has been called in this run of the flow.
    occurrences: Mutex<HashMap<&'static str, u64>>,
}

impl FlowContext {
    pub(crate) fn new(
        key: Key,
        store: Option<StoreRef>,
        ttl: Duration,
        lease: Duration,
    ) -> Arc<Self> {
        Arc::new(FlowContext {
            key,
            store,
            ttl,
            lease,
            occurrences: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn next_occurrence(&self, step: &'static str) -> u64 {
        let mut map = self.occurrences.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(step).or_insert(0);
        let current = *n;
        *n += 1;
        current
    }
}

pub(crate) fn scope<F: Future>(ctx: Arc<FlowContext>, fut: F) -> impl Future<Output = F::Output> {
    FLOW.scope(ctx, fut)
}

pub(crate) fn current() -> Option<Arc<FlowContext>> {
    FLOW.try_with(Arc::clone).ok()
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
/// #[derive(Debug)]
/// struct AppError(idem_runtime::Error);
/// impl From<idem_runtime::Error> for AppError {
///     fn from(e: idem_runtime::Error) -> Self { AppError(e) }
/// }
///
/// #[idem_runtime::idempotent(key = "order_id", store = idem_runtime::store::memory::MemoryStore::new())]
/// async fn charge(order_id: u64) -> Result<String, AppError> {
///     let key = idem_runtime::current_key().expect("inside an idempotent call");
///     Ok(key.derive("psp:charge").to_hex()) // the provider's Idempotency-Key
/// }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// assert_eq!(charge(7).await.unwrap().len(), 64);
/// assert!(idem_runtime::current_key().is_none());
/// # });
/// ```
pub fn current_key() -> Option<Key> {
    FLOW.try_with(|f| f.key).ok()
}
