//! What a store keeps beside a claim so that a worker can finish the call if
//! its caller never comes back (`#[idempotent(…, recover)]`, see
//! [`crate::recovery`]): the types the [`Store`](super::Store) methods for
//! recovery take and return.
//!
//! The arguments are opaque bytes to a store (the runtime seals and checks
//! them); a store keeps them, with the scope and a little bookkeeping (how
//! many recoveries were attempted, when the next may start, whether an
//! operator must look), exactly as long as the claim is PROCESSING. A
//! completion or a release forgets them.

use std::time::Duration;

use crate::error::StoreError;
use crate::key::Key;

/// The arguments a recoverable claim stores beside its record
/// ([`Store::claim_recoverable`](super::Store::claim_recoverable)).
#[derive(Debug, Clone, Copy)]
pub struct RecoveryArgs<'a> {
    /// The scope of the call: which registered function resumes it.
    pub scope: &'a str,
    /// The sealed arguments (opaque to the store).
    pub args: &'a [u8],
}

/// A PROCESSING claim whose lease ran out, with arguments stored beside it:
/// its caller crashed, was killed or gave up waiting, and no one took it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    /// The record's key.
    pub key: Key,
    /// The fence of the owner that abandoned it.
    pub fence: u64,
    /// The sealed arguments.
    pub args: Vec<u8>,
    /// How many recoveries were already attempted.
    pub attempts: u32,
    /// When its lease ran out, milliseconds since the Unix epoch (the store's clock).
    pub lease_until_millis: i64,
}

/// A worker's request to take its turn at an abandoned claim
/// ([`Store::take_recovery`](super::Store::take_recovery)).
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::{Key, ManualClock};
/// use idem_runtime::store::memory::MemoryStore;
/// use idem_runtime::store::{Claim, ClaimRequest, RecoveryArgs, RecoveryTurn, Store, Token, Turn};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let clock = ManualClock::new(0);
/// let store = MemoryStore::builder().clock(clock.clone()).build();
/// let key = Key::builder("orders.create").part("c-1").finish();
/// let req = ClaimRequest {
///     key: &key,
///     token: Token::random(),
///     fingerprint: None,
///     lease: Duration::from_secs(30),
///     ttl: Duration::from_secs(3600),
/// };
/// let args = RecoveryArgs { scope: "orders.create", args: b"sealed" };
/// let Claim::Acquired { fence, .. } = store.claim_recoverable(req, args).await? else { unreachable!() };
/// clock.advance(Duration::from_secs(31)); // the owner died: its lease ran out
/// let abandoned = store.abandoned("orders.create", 10).await?;
/// assert_eq!(abandoned[0].key, key);
/// let turn = RecoveryTurn {
///     fence,
///     retry_in: Duration::from_secs(10),
///     max_attempts: 5,
///     note: "gave up after 5 recoveries",
///     park_now: false,
/// };
/// assert_eq!(store.take_recovery(&key, turn).await?, Turn::Run { attempt: 1 });
/// assert_eq!(store.take_recovery(&key, turn).await?, Turn::Gone); // one turn at a time
/// # Ok::<(), idem_runtime::StoreError>(())
/// # }).unwrap();
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RecoveryTurn<'a> {
    /// The fence the worker saw: the turn is refused once another owner took
    /// the claim (its fence grew) or finished it.
    pub fence: u64,
    /// How long after this turn the next one may start, should this one not
    /// finish the call.
    pub retry_in: Duration,
    /// A turn beyond this many attempts parks the claim instead.
    pub max_attempts: u32,
    /// Why the claim is parked, when it is (an operator reads it).
    pub note: &'a str,
    /// Park at once, whatever the count (the arguments cannot be used).
    pub park_now: bool,
}

/// What [`Store::take_recovery`](super::Store::take_recovery) decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// The worker runs the call now; this is attempt number `attempt` (from 1).
    Run {
        /// The attempt's number.
        attempt: u32,
    },
    /// The claim is parked for an operator (`idem recover` lets the worker
    /// try again); nothing runs.
    Parked {
        /// The attempts made before it was parked.
        attempts: u32,
    },
    /// The claim is no longer abandoned at that fence (taken over, finished,
    /// parked, or waiting out its backoff): another worker or the caller has
    /// it; nothing runs.
    Gone,
}

/// The recovery state of a PROCESSING record with stored arguments, for
/// operators (`idem inspect`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryInfo {
    /// The scope of the call.
    pub scope: String,
    /// How many recoveries were attempted.
    pub attempts: u32,
    /// When the next may start, milliseconds since the Unix epoch (0: as soon
    /// as the lease runs out).
    pub next_attempt_millis: i64,
    /// Why the worker stopped, when it parked the claim.
    pub parked: Option<String>,
    /// The size of the stored arguments, in bytes.
    pub args_bytes: usize,
}

/// The error of a store that keeps no recovery state.
pub(crate) fn unsupported(backend: &'static str, what: &str) -> StoreError {
    StoreError::new(
        backend,
        what.to_owned(),
        "this store keeps no arguments for recovery: `recover` calls run, but no worker can finish them",
    )
}
