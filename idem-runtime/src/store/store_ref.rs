//! [`StoreRef`], the handle to a store of any type, and [`AsStore`], what
//! `store = …` may name.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::erased::DynStore;
use super::{
    Abandoned, Claim, ClaimRequest, Completion, RecordInfo, RecordStats, RecoveryArgs,
    RecoveryInfo, RecoveryTurn, Store, Token, Turn,
};
use crate::error::StoreError;
use crate::key::Key;

/// A shared handle to some store, whatever its type: what the
/// process-wide default is, and what code that does not know its store's
/// type holds. It is a [`Store`] itself; each call through it boxes the
/// store's future.
///
/// ```
/// use idem_runtime::store::{Store, StoreRef};
/// use idem_runtime::store::memory::MemoryStore;
///
/// let store = StoreRef::new(MemoryStore::new());
/// assert_eq!(store.backend(), "memory");
/// ```
#[derive(Clone)]
pub struct StoreRef(pub(super) Arc<dyn DynStore>);

impl StoreRef {
    /// Wraps a store (a `StoreRef` is returned as it is, not boxed twice).
    pub fn new<S: Store>(store: S) -> Self {
        let mut store = Some(store);
        if let Some(shared) =
            (&mut store as &mut dyn std::any::Any).downcast_mut::<Option<StoreRef>>()
        {
            return shared.take().expect("just put there");
        }
        StoreRef(Arc::new(store.expect("not taken")))
    }

    /// Wraps a shared store, without another allocation.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idem_runtime::store::StoreRef;
    /// use idem_runtime::store::memory::MemoryStore;
    ///
    /// let shared = Arc::new(MemoryStore::new());
    /// let store = StoreRef::from_arc(shared.clone());
    /// # let _ = store;
    /// ```
    pub fn from_arc<S: Store>(store: Arc<S>) -> Self {
        StoreRef(store)
    }
}

impl fmt::Debug for StoreRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreRef({})", self.0.backend())
    }
}

impl Store for StoreRef {
    fn backend(&self) -> &'static str {
        self.0.backend()
    }

    fn max_result_bytes(&self) -> usize {
        self.0.max_result_bytes()
    }

    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.0.claim(req).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        self.0.complete(key, token, completion).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        self.0.release(key, token).await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        self.0.renew(key, token, lease).await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        self.0.inspect(key).await
    }

    async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
        self.0.evict(key).await
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.0.purge_expired(limit).await
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.0.stats().await
    }

    async fn claim_recoverable(
        &self,
        req: ClaimRequest<'_>,
        recovery: RecoveryArgs<'_>,
    ) -> Result<Claim, StoreError> {
        self.0.claim_recoverable(req, recovery).await
    }

    async fn recovery_scopes(&self) -> Result<Vec<String>, StoreError> {
        self.0.recovery_scopes().await
    }

    async fn abandoned(&self, scope: &str, limit: usize) -> Result<Vec<Abandoned>, StoreError> {
        self.0.abandoned(scope, limit).await
    }

    async fn take_recovery(&self, key: &Key, turn: RecoveryTurn<'_>) -> Result<Turn, StoreError> {
        self.0.take_recovery(key, turn).await
    }

    async fn recovery_info(&self, key: &Key) -> Result<Option<RecoveryInfo>, StoreError> {
        self.0.recovery_info(key).await
    }

    async fn retry_recovery(&self, key: &Key) -> Result<bool, StoreError> {
        self.0.retry_recovery(key).await
    }

    fn share(&self) -> StoreRef {
        self.clone()
    }
}

// A shared store is a store: `Arc<RedisStore>` goes wherever a store does,
// and its calls are not boxed.
forward_store!(@impl [S: Store] Arc<S>, this => &**this, share: StoreRef::from_arc(Arc::clone(this)));

/// Anything the `store = …` option may name: a store, an `Arc` of one, a
/// reference to one, or a [`StoreRef`].
///
/// ```
/// use idem_runtime::store::AsStore;
/// use idem_runtime::store::memory::MemoryStore;
///
/// let store = MemoryStore::new();
/// let handle: MemoryStore = (&store).as_store(); // a clone, no box
/// # let _ = handle;
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idempotency store",
    label = "`store = …` must name a store",
    note = "pass one of this crate's stores, an `Arc` of any store, or an `idem_runtime::store::StoreRef`"
)]
pub trait AsStore {
    /// What a call holds while it runs: the store itself, cloned (a
    /// handle: stores share their state behind an `Arc`).
    type Store: Store + Clone;

    /// The handle for one call.
    fn as_store(&self) -> Self::Store;

    /// The store as a [`StoreRef`], for what keeps a store of any type
    /// (the installed default, an HTTP layer, a recovery worker).
    fn store_ref(&self) -> StoreRef {
        self.as_store().share()
    }
}

impl AsStore for StoreRef {
    type Store = StoreRef;

    fn as_store(&self) -> StoreRef {
        self.clone()
    }
}

impl<S: Store> AsStore for Arc<S> {
    type Store = Arc<S>;

    fn as_store(&self) -> Arc<S> {
        self.clone()
    }
}

impl<T: AsStore + ?Sized> AsStore for &T {
    type Store = T::Store;

    fn as_store(&self) -> T::Store {
        (**self).as_store()
    }

    fn store_ref(&self) -> StoreRef {
        (**self).store_ref()
    }
}
