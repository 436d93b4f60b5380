//! The store contract: one atomic claim, fenced completion and release.
//!
//! A backend implements [`Store`]; the protocol in [`crate::protocol`] does the
//! rest (encoding, replay, waiting, heartbeats, metrics). Every backend must pass
//! the conformance suite in `tests/src/conformance.rs`.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::error::StoreError;
use crate::key::{Fingerprint, Key};

/// `impl Store` by forwarding every method to another store: for a handle
/// type whose state is an `Arc` of a store (`forward_store!(MemoryStore =>
/// inner)`, with `AsStore`), and for `Arc<S>` itself. [`Store::share`]
/// hands out the `Arc` that is already there instead of wrapping a clone in
/// a new one, so a call on the handle allocates nothing to make its steps'
/// [`StoreRef`].
macro_rules! forward_store {
    ($handle:ty => $field:ident) => {
        forward_store!(
            @impl [] $handle, this => &*this.$field,
            share: $crate::store::StoreRef::from_arc(::std::sync::Arc::clone(&this.$field))
        );

        impl $crate::store::AsStore for $handle {
            type Store = $handle;

            fn as_store(&self) -> $handle {
                self.clone()
            }
        }
    };
    (@impl [$($g:tt)*] $ty:ty, $this:ident => $target:expr, share: $share:expr) => {
        impl<$($g)*> $crate::store::Store for $ty {
            fn backend(&self) -> &'static str {
                let $this = self;
                $crate::store::Store::backend($target)
            }

            fn max_result_bytes(&self) -> usize {
                let $this = self;
                $crate::store::Store::max_result_bytes($target)
            }

            fn share(&self) -> $crate::store::StoreRef {
                let $this = self;
                $share
            }

            fn claim(
                &self,
                req: $crate::store::ClaimRequest<'_>,
            ) -> impl ::std::future::Future<Output = Result<$crate::store::Claim, $crate::StoreError>>
            + Send {
                let $this = self;
                $crate::store::Store::claim($target, req)
            }

            fn complete(
                &self,
                key: &$crate::Key,
                token: $crate::store::Token,
                completion: $crate::store::Completion<'_>,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::complete($target, key, token, completion)
            }

            fn release(
                &self,
                key: &$crate::Key,
                token: $crate::store::Token,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::release($target, key, token)
            }

            fn renew(
                &self,
                key: &$crate::Key,
                token: $crate::store::Token,
                lease: ::std::time::Duration,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::renew($target, key, token, lease)
            }

            fn inspect(
                &self,
                key: &$crate::Key,
            ) -> impl ::std::future::Future<
                Output = Result<Option<$crate::store::RecordInfo>, $crate::StoreError>,
            > + Send {
                let $this = self;
                $crate::store::Store::inspect($target, key)
            }

            fn evict(
                &self,
                key: &$crate::Key,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::evict($target, key)
            }

            fn purge_expired(
                &self,
                limit: usize,
            ) -> impl ::std::future::Future<Output = Result<u64, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::purge_expired($target, limit)
            }

            fn stats(
                &self,
            ) -> impl ::std::future::Future<
                Output = Result<$crate::store::RecordStats, $crate::StoreError>,
            > + Send {
                let $this = self;
                $crate::store::Store::stats($target)
            }

            fn claim_recoverable(
                &self,
                req: $crate::store::ClaimRequest<'_>,
                recovery: $crate::store::RecoveryArgs<'_>,
            ) -> impl ::std::future::Future<Output = Result<$crate::store::Claim, $crate::StoreError>>
            + Send {
                let $this = self;
                $crate::store::Store::claim_recoverable($target, req, recovery)
            }

            fn recovery_scopes(
                &self,
            ) -> impl ::std::future::Future<Output = Result<Vec<String>, $crate::StoreError>> + Send
            {
                let $this = self;
                $crate::store::Store::recovery_scopes($target)
            }

            fn abandoned(
                &self,
                scope: &str,
                limit: usize,
            ) -> impl ::std::future::Future<
                Output = Result<Vec<$crate::store::Abandoned>, $crate::StoreError>,
            > + Send {
                let $this = self;
                $crate::store::Store::abandoned($target, scope, limit)
            }

            fn take_recovery(
                &self,
                key: &$crate::Key,
                turn: $crate::store::RecoveryTurn<'_>,
            ) -> impl ::std::future::Future<Output = Result<$crate::store::Turn, $crate::StoreError>>
            + Send {
                let $this = self;
                $crate::store::Store::take_recovery($target, key, turn)
            }

            fn recovery_info(
                &self,
                key: &$crate::Key,
            ) -> impl ::std::future::Future<
                Output = Result<Option<$crate::store::RecoveryInfo>, $crate::StoreError>,
            > + Send {
                let $this = self;
                $crate::store::Store::recovery_info($target, key)
            }

            fn retry_recovery(
                &self,
                key: &$crate::Key,
            ) -> impl ::std::future::Future<Output = Result<bool, $crate::StoreError>> + Send {
                let $this = self;
                $crate::store::Store::retry_recovery($target, key)
            }
        }

    };
}

pub mod memory;

/// The attribute [`tx::TxConnection`] implementations are written with,
/// re-exported so a connection type outside this crate needs no dependency
/// of its own for it: `#[idem_runtime::store::async_trait] impl
/// TxConnection for MyConn { … }`. ([`Store`] needs none: its methods are
/// plain `async fn`s.)
pub use async_trait::async_trait;
mod erased;
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
pub mod tx;

pub use recovery::{Abandoned, RecoveryArgs, RecoveryInfo, RecoveryTurn, Turn};
pub use store_ref::{AsStore, StoreRef};
pub use sweeper::spawn_sweeper;

/// Results larger than this are not stored unless a store says otherwise.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 1024 * 1024;

/// The random identity of one claim attempt: its owner.
///
/// Completion and release carry it, and act only while it still owns the record,
/// so a stale owner finishing late can neither overwrite nor delete the record
/// of the caller that took over.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token([u8; 16]);

thread_local! {
    /// Where this thread's tokens come from: a small, fast generator
    /// (xoshiro, 256 bits of state on 64-bit targets) seeded once from the
    /// operating system's entropy through `rand`'s `ThreadRng`. A token must
    /// be unique, never secret (it fences owners against each other and
    /// authenticates nothing), and 128-bit draws from generators seeded
    /// apart do not collide; a cryptographic generator per claim cost more
    /// than the memory store's whole claim. Like `ThreadRng`, it is not
    /// reseeded in a child process: a process that forks after making
    /// tokens must not claim from the thread that made them in both (a
    /// tokio runtime does not survive a fork anyway).
    static TOKENS: std::cell::RefCell<rand::rngs::SmallRng> =
        std::cell::RefCell::new(rand::SeedableRng::from_rng(&mut rand::rng()));
}

impl Token {
    /// A fresh random token, unique to this claim attempt.
    ///
    /// ```
    /// use idem_runtime::store::Token;
    /// assert_ne!(Token::random(), Token::random());
    /// ```
    pub fn random() -> Self {
        TOKENS
            .try_with(|rng| {
                // Two words, not sixteen bytes: `random::<[u8; 16]>` draws
                // a word per byte.
                let mut rng = rng.borrow_mut();
                let (a, b) = (
                    rand::RngCore::next_u64(&mut *rng),
                    rand::RngCore::next_u64(&mut *rng),
                );
                let mut bytes = [0; 16];
                bytes[..8].copy_from_slice(&a.to_le_bytes());
                bytes[8..].copy_from_slice(&b.to_le_bytes());
                Token(bytes)
            })
            // A claim made while the thread's locals are torn down, when
            // `ThreadRng`'s may be gone too: straight from the OS.
            .unwrap_or_else(|_| {
                let mut rng: rand::rngs::SmallRng = rand::SeedableRng::from_os_rng();
                Token(rand::Rng::random(&mut rng))
            })
    }

    /// A token read back from a store.
    ///
    /// ```
    /// use idem_runtime::store::Token;
    /// let t = Token::random();
    /// assert_eq!(Token::from_bytes(*t.as_bytes()), t);
    /// ```
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Token(bytes)
    }

    /// The token's 16 bytes, as a store writes them.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", hex::encode(self.0))
    }
}

/// How a finished call ended, as its record stores it (the call's own
/// outcome, as metrics count it, is [`crate::CallOutcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StoredOutcome {
    /// `Ok(T)`: the payload is the encoded `T`.
    Success = 1,
    /// `Err(E)` that the user marked final: the payload is the encoded `E`.
    FinalError = 2,
    /// The body finished but its result could not be stored (too large, or it
    /// failed to encode); the payload says why. Duplicates get an error, never a
    /// second execution.
    Unstored = 3,
}

impl StoredOutcome {
    /// The code stores persist.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The outcome for a persisted code.
    pub fn from_code(code: i64) -> Option<StoredOutcome> {
        match code {
            1 => Some(StoredOutcome::Success),
            2 => Some(StoredOutcome::FinalError),
            3 => Some(StoredOutcome::Unstored),
            _ => None,
        }
    }
}

/// One claim attempt.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The hashed key.
    pub key: &'a Key,
    /// The caller's owner token.
    pub token: Token,
    /// The payload fingerprint, if the call declares one.
    pub fingerprint: Option<Fingerprint>,
    /// How long the PROCESSING claim holds before another caller may take it over.
    pub lease: Duration,
    /// How long the record lives (as PROCESSING, and again from completion as DONE).
    pub ttl: Duration,
}

/// A finished record, as read back for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResult {
    /// The fingerprint the record was claimed with.
    pub fingerprint: Option<Fingerprint>,
    /// How the call ended.
    pub outcome: StoredOutcome,
    /// The encoded result (see [`StoredOutcome`]).
    pub payload: Vec<u8>,
}

/// What one atomic claim found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller now owns the record as PROCESSING and must run the body.
    Acquired {
        /// A number that grows with every acquisition of this key.
        fence: u64,
        /// The previous owner's lease had run out while it was still PROCESSING:
        /// it crashed or stalled, and this caller took over.
        takeover: bool,
    },
    /// Another owner holds a live PROCESSING claim.
    Busy {
        /// How long its lease still holds.
        lease_remaining: Duration,
        /// The fingerprint it claimed with.
        fingerprint: Option<Fingerprint>,
    },
    /// The record is DONE: replay it.
    Done(StoredResult),
}

/// What a completion stores.
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// How the call ended.
    pub outcome: StoredOutcome,
    /// The encoded result.
    pub payload: &'a [u8],
    /// How long the DONE record lives from now.
    pub ttl: Duration,
}

/// The state of a record, for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed and running (or its owner died and the lease will run out).
    Processing,
    /// Finished; duplicates replay it.
    Done,
}

/// A record as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordInfo {
    /// PROCESSING or DONE.
    pub state: RecordState,
    /// The fence of the current owner.
    pub fence: u64,
    /// Lease end, milliseconds since the Unix epoch (meaningful while PROCESSING).
    pub lease_until_millis: i64,
    /// When the record expires, milliseconds since the Unix epoch.
    pub expires_at_millis: i64,
    /// The stored result, once DONE.
    pub result: Option<StoredResult>,
}

/// How many records a store holds, by state: for operators (`idem stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordStats {
    /// PROCESSING under a live lease: a body is running.
    pub processing: u64,
    /// PROCESSING past its lease: the owner crashed or stalled, and the next
    /// call takes it over.
    pub stalled: u64,
    /// DONE: duplicates replay it.
    pub done: u64,
    /// Released or expired, not yet deleted: a claim reuses it, a purge
    /// deletes it.
    pub dead: u64,
    /// Live, in a state this version does not know: calls on it fail closed.
    pub unknown: u64,
}

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
