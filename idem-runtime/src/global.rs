//! The process-wide default store, installed once at start-up.

use std::sync::RwLock;

use crate::store::{AsStore, StoreRef};

static DEFAULT: RwLock<Option<StoreRef>> = RwLock::new(None);

/// Installs the store that annotated calls without `store = …` use.
///
/// Call it once at start-up, before serving. Installing again replaces the
/// store for calls that start afterwards (tests use this).
///
/// ```
/// use idem_runtime::store::memory::MemoryStore;
///
/// idem_runtime::install(MemoryStore::new());
/// ```
pub fn install(store: impl AsStore) {
    let store = store.as_store();
    *DEFAULT.write().unwrap_or_else(|p| p.into_inner()) = Some(store);
}

pub(crate) fn default_store() -> Option<StoreRef> {
    DEFAULT.read().unwrap_or_else(|p| p.into_inner()).clone()
}
