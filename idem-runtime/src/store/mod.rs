//! The store contract: one atomic claim, fenced completion and release.
//!
//! A backend implements [`Store`]; the protocol in [`crate::protocol`] does the
//! rest (encoding, replay, waiting, heartbeats, metrics). Every backend must pass
//! the conformance suite in `tests/src/conformance.rs`.
//!
//! ```
//! use idem_runtime::Key;
//! use idem_runtime::store::memory::MemoryStore;
//! use idem_runtime::store::{RecordState, Store, StoreRef};
//!
//! #[idem_runtime::idempotent(key = "n", scope = "doc.store", store = store.clone())]
//! async fn square(store: &StoreRef, n: u64) -> Result<u64, idem_runtime::Error> { Ok(n * n) }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let store = StoreRef::new(MemoryStore::new()); // or an `Arc` of any store
//! square(&store, 7).await.unwrap();
//! let key = Key::builder("doc.store").part(&7u64).finish();
//! let record = store.inspect(&key).await.unwrap().expect("a record");
//! assert_eq!(record.state, RecordState::Done);
//! # });
//! ```

use std::future::Future;
use std::time::Duration;

use crate::error::StoreError;
use crate::key::Key;

#[macro_use]
mod forward;

pub mod memory;

/// The attribute [`tx::TxConnection`] implementations are written with,
/// re-exported so a connection type outside this crate needs no dependency
/// of its own for it: `#[idem_runtime::store::async_trait] impl
/// TxConnection for MyConn { … }`. ([`Store`] needs none: its methods are
/// plain `async fn`s.)
pub use async_trait::async_trait;
mod claim;
mod erased;
mod inspect;
mod recovery;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub mod sql;
mod store_ref;
mod sweeper;
mod token;
pub mod tx;

pub use claim::{Claim, ClaimRequest, Completion, StoredOutcome, StoredResult};
pub use inspect::{RecordInfo, RecordState, RecordStats};
pub use recovery::{Abandoned, RecoveryArgs, RecoveryInfo, RecoveryTurn, Turn};
pub use store_ref::{AsStore, StoreRef};
pub use sweeper::spawn_sweeper;
pub use token::Token;

/// Results larger than this are not stored unless a store says otherwise.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 1024 * 1024;

/// A backend that keeps idempotency records.
///
/// Every method is one atomic operation on the backend. Time (for leases and
/// expiry) is the store's own clock, so a store on a server can use the
/// server's time and a test store a [`crate::ManualClock`].
///
/// The full contract, case by case, is the conformance suite
/// (`idem-tests/src/conformance.rs`); a new backend runs it unchanged.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::Key;
/// use idem_runtime::store::{Claim, ClaimRequest, Store, Token};
/// use idem_runtime::store::memory::MemoryStore;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let key = Key::builder("doc").part("k").finish();
/// let req = ClaimRequest {
///     key: &key,
///     token: Token::random(),
///     fingerprint: None,
///     lease: Duration::from_secs(30),
///     ttl: Duration::from_secs(3600),
/// };
/// assert!(matches!(store.claim(req).await?, Claim::Acquired { .. }));
/// # Ok::<(), idem_runtime::StoreError>(())
/// # }).unwrap();
/// ```
///
/// The methods are `async fn`s whose futures are `Send`: an implementation
/// writes `async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim,
/// StoreError>` and so on, with no attribute. A call on a store of a known
/// type (`store = …` naming a `MemoryStore`, a `RedisStore`, an `Arc` of
/// one) polls these futures in place; a [`StoreRef`] (the installed
/// default, or any store behind one) boxes each.
pub trait Store: Send + Sync + 'static {
    /// The backend's name, for errors, metrics and logs.
    fn backend(&self) -> &'static str;

    /// The largest result payload this store keeps.
    fn max_result_bytes(&self) -> usize {
        DEFAULT_MAX_RESULT_BYTES
    }

    /// This store as a [`StoreRef`], for the steps of a call running on it
    /// (a step's store is not known by type). The default wraps a clone;
    /// a store whose state is behind an `Arc` shares that instead.
    fn share(&self) -> StoreRef
    where
        Self: Clone,
    {
        StoreRef::new(self.clone())
    }

    /// Atomically: if the record is absent, expired, released, or PROCESSING
    /// past its lease (or PROCESSING under this same token, a retried claim),
    /// make it PROCESSING for `req.token`; otherwise report what holds it.
    fn claim(
        &self,
        req: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Marks the record DONE with the result, only if `token` still owns it.
    /// Returns whether it did. A completion re-sent under the token that
    /// already completed the record (after a dropped connection) returns
    /// `true` and changes nothing.
    fn complete(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Gives up the claim so a retry can run at once, only if `token` still
    /// owns it. Keeps the fence, so it never goes backwards. Returns whether it
    /// did.
    fn release(
        &self,
        key: &Key,
        token: Token,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Extends the lease of a PROCESSING record to `lease` from now, only if
    /// `token` still owns it, and keeps the record from expiring before the
    /// new lease ends (a body may run past its ttl). Returns whether it did.
    fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Reads a live record (not expired, not released).
    fn inspect(
        &self,
        key: &Key,
    ) -> impl Future<Output = Result<Option<RecordInfo>, StoreError>> + Send;

    /// Ends a live record whatever its state, so the next call runs the body:
    /// an operator's override. Returns whether there was a live record.
    ///
    /// Fences keep growing: a DONE record is released (keeping its fence); a
    /// PROCESSING one stays PROCESSING under no owner with its lease ended,
    /// so its owner, if still running, can no longer renew, complete or
    /// release, the next claim takes it over with a higher fence, and no
    /// purge deletes it before then. Deleting the record would start the
    /// next claim at fence 1 again, beside an owner that may still hold 1.
    fn evict(&self, key: &Key) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes up to `limit` expired or released records. Returns how many.
    fn purge_expired(&self, limit: usize) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Counts the records by state. An operator's query, not for a request
    /// path: SQL stores scan the table, Redis walks its key prefix with
    /// `SCAN`. Stores that cannot count say so with an error (the default).
    fn stats(&self) -> impl Future<Output = Result<RecordStats, StoreError>> + Send {
        async move {
            Err(StoreError::new(
                self.backend(),
                "stats",
                "this store does not count its records",
            ))
        }
    }

    // Recovery (`#[idempotent(…, recover)]`, `crate::recovery`). A store that
    // keeps nothing for it inherits these defaults: recoverable calls run as
    // plain ones, and a worker on it reports that it cannot work.

    /// [`Store::claim`] that also stores the call's scope and sealed
    /// arguments with the claim, in the same atomic operation, when it
    /// acquires the record. A takeover keeps the recovery count, the backoff
    /// and a parking (they belong to the abandoned call, which this owner
    /// continues); any other acquisition starts them afresh. A plain
    /// [`Store::claim`] that acquires the record drops what was stored, and
    /// so do completion and release.
    ///
    /// The default claims without storing anything.
    fn claim_recoverable(
        &self,
        req: ClaimRequest<'_>,
        recovery: RecoveryArgs<'_>,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        async move {
            let _ = recovery;
            self.claim(req).await
        }
    }

    /// The scopes of the PROCESSING records that have arguments stored,
    /// abandoned or not: a worker looks there for claims no function it has
    /// can resume. A store may name more (Redis names every scope it ever
    /// indexed), never fewer.
    fn recovery_scopes(&self) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send {
        async move { Err(recovery::unsupported(self.backend(), "recovery_scopes")) }
    }

    /// Up to `limit` records of `scope` that are PROCESSING past their lease
    /// with arguments stored, not parked and past their backoff, oldest lease
    /// first.
    fn abandoned(
        &self,
        scope: &str,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Abandoned>, StoreError>> + Send {
        async move {
            let _ = (scope, limit);
            Err(recovery::unsupported(self.backend(), "abandoned"))
        }
    }

    /// Atomically: if the record is still abandoned at `turn.fence`
    /// (PROCESSING, its lease run out, arguments stored, not parked, past its
    /// backoff; or, with `park_now`, whatever its backoff), count one more
    /// attempt and set the next one `turn.retry_in` from now; past
    /// `turn.max_attempts` (or with `park_now`) park it with `turn.note`
    /// instead. Two workers taking a turn at the same record: one gets it.
    fn take_recovery(
        &self,
        key: &Key,
        turn: RecoveryTurn<'_>,
    ) -> impl Future<Output = Result<Turn, StoreError>> + Send {
        async move {
            let _ = (key, turn);
            Err(recovery::unsupported(self.backend(), "take_recovery"))
        }
    }

    /// The recovery state of a live PROCESSING record with arguments stored.
    /// The default knows none.
    fn recovery_info(
        &self,
        key: &Key,
    ) -> impl Future<Output = Result<Option<RecoveryInfo>, StoreError>> + Send {
        async move {
            let _ = key;
            Ok(None)
        }
    }

    /// An operator's retry (`idem recover`): clears a parking, the count and
    /// the backoff of a PROCESSING record with arguments stored, so a worker
    /// takes it up once its lease has run out. Returns whether there was one.
    fn retry_recovery(&self, key: &Key) -> impl Future<Output = Result<bool, StoreError>> + Send {
        async move {
            let _ = key;
            Err(recovery::unsupported(self.backend(), "retry_recovery"))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::Token;

    /// Wrapping a `StoreRef` hands it back: a second box would make every
    /// call through it box twice.
    #[test]
    fn a_store_ref_wrapped_again_is_the_same_store_ref() {
        let once = super::StoreRef::new(super::memory::MemoryStore::new());
        let again = super::StoreRef::new(once.clone());
        assert!(std::sync::Arc::ptr_eq(&once.0, &again.0));
        let shared = std::sync::Arc::new(super::memory::MemoryStore::new());
        let from_arc = super::StoreRef::from_arc(shared.clone());
        // `from_arc` shares the `Arc` it is given (the data pointers agree).
        assert!(std::ptr::eq(
            std::sync::Arc::as_ptr(&from_arc.0) as *const u8,
            std::sync::Arc::as_ptr(&shared) as *const u8
        ));
    }

    /// Each thread seeds its own generator: threads seeded alike would hand
    /// out each other's tokens, and two owners would pass each other's fence.
    #[test]
    fn tokens_are_unique_across_threads() {
        let per_thread: Vec<Vec<Token>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| (0..5_000).map(|_| Token::random()).collect()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let all: HashSet<Token> = per_thread.iter().flatten().copied().collect();
        assert_eq!(all.len(), 8 * 5_000);
        // Not a constant stream either: the bytes vary within a token.
        assert!(
            all.iter()
                .all(|t| t.as_bytes().iter().any(|&b| b != t.as_bytes()[0]))
        );
    }
}
