//! What the contract's calls carry: a claim's request and what it found
//! ([`ClaimRequest`], [`Claim`]), a finished record read back for replay
//! ([`StoredResult`], [`StoredOutcome`]), and what a completion stores
//! ([`Completion`]).

use std::time::Duration;

use super::Token;
use crate::key::{Fingerprint, Key};

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
