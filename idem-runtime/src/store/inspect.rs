//! A record as an operator sees it (`idem inspect`, `idem stats`).

use super::StoredResult;

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
