//! What a worker tells the call it runs, and learns back from it, through a
//! task-local: the call never sees the worker, only that it is recovering
//! the record under a given key.
//!
//! The first idempotent call (not a step) that starts on the task is the
//! registered function's own: it must derive the key of the abandoned record
//! from the stored arguments. If it derives another one (the key's segments,
//! the scope or the secret changed since the claim was made) it does not
//! claim at all: running it would start another intent, not finish this one.
//! A matching call keeps its claim on a retryable error instead of releasing
//! it: a released claim has no caller left to retry it, while one whose
//! lease runs out comes back to the worker after its backoff.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::key::Key;

const PENDING: u8 = 0;
const MATCHED: u8 = 1;
const MISMATCHED: u8 = 2;

/// The record a worker is recovering, and what the call made of it.
#[derive(Debug)]
pub(crate) struct Expectation {
    key: Key,
    state: AtomicU8,
}

/// What the recovered call did with the expectation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Met {
    /// No idempotent call started (it failed before it claimed, e.g. no store).
    Never,
    /// The call claimed the expected key.
    Matched,
    /// The call derived another key and did not claim.
    Mismatched,
}

impl Expectation {
    pub(crate) fn new(key: Key) -> Arc<Self> {
        Arc::new(Expectation {
            key,
            state: AtomicU8::new(PENDING),
        })
    }

    pub(crate) fn met(&self) -> Met {
        match self.state.load(Ordering::Acquire) {
            MATCHED => Met::Matched,
            MISMATCHED => Met::Mismatched,
            _ => Met::Never,
        }
    }
}

tokio::task_local! {
    static RECOVERING: Arc<Expectation>;
}

/// Runs `fut` as the recovery of the record under the expectation's key.
pub(crate) fn expect<F: Future>(
    expectation: Arc<Expectation>,
    fut: F,
) -> impl Future<Output = F::Output> {
    RECOVERING.scope(expectation, fut)
}

/// How an idempotent call (not a step) that is about to claim `key` stands
/// to a recovery: `None` outside one (or for every call after the first),
/// `Some(true)` when it is the recovered call, `Some(false)` when it derived
/// another key and must not claim.
pub(crate) fn check(key: &Key) -> Option<bool> {
    RECOVERING
        .try_with(|e| {
            let matched = e.key == *key;
            let state = if matched { MATCHED } else { MISMATCHED };
            e.state
                .compare_exchange(PENDING, state, Ordering::AcqRel, Ordering::Acquire)
                .ok()
                .map(|_| matched)
        })
        .ok()
        .flatten()
}
