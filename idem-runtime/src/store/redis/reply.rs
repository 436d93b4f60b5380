//! Reading the scripts' replies: the shapes RESP2 and RESP3 give them, and
//! the record `inspect.lua` answers with.

use std::fmt;

use redis::Value;

use crate::key::Fingerprint;
use crate::store::{RecordInfo, RecordState};

use super::record::{self, Record, Unreadable};

/// A reply that does not have the shape the scripts return.
#[derive(Debug)]
pub(super) struct Malformed(pub(super) &'static str);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unexpected reply: {}", self.0)
    }
}

impl std::error::Error for Malformed {}

pub(super) fn bytes(v: Option<Value>) -> Result<Vec<u8>, Malformed> {
    match v {
        Some(Value::BulkString(b)) => Ok(b),
        Some(Value::SimpleString(s)) => Ok(s.into_bytes()),
        _ => Err(Malformed("expected a string")),
    }
}

pub(super) fn int(v: Option<Value>) -> Result<i64, Malformed> {
    match v {
        Some(Value::Int(i)) => Ok(i),
        Some(Value::BulkString(b)) => std::str::from_utf8(&b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(Malformed("expected an integer")),
        _ => Err(Malformed("expected an integer")),
    }
}

/// A field or reply slot that may be absent: Lua's `false` is nil in RESP2
/// and a boolean in RESP3.
fn optional(v: Option<Value>) -> Option<Value> {
    match v {
        None | Some(Value::Nil) | Some(Value::Boolean(false)) => None,
        other => other,
    }
}

/// A stored fingerprint; empty (what claim.lua writes for none) or absent is none.
pub(super) fn fingerprint(v: Option<Value>) -> Result<Option<Fingerprint>, Malformed> {
    let Some(b) = optional(v).map(|v| bytes(Some(v))).transpose()? else {
        return Ok(None);
    };
    if b.is_empty() {
        return Ok(None);
    }
    <[u8; 32]>::try_from(b.as_slice())
        .map(|a| Some(Fingerprint::from_bytes(a)))
        .map_err(|_| Malformed("a fingerprint is not 32 bytes"))
}

/// A record as inspect.lua reads it: the value, its expiry, and (while
/// PROCESSING) the lease end, which is the expiry minus the value's margin.
pub(super) struct Inspected {
    pub(super) record: Record,
    pub(super) expires_at_millis: i64,
    pub(super) lease_until_millis: i64,
}

/// Decodes inspect.lua's reply; `None` for a key that is gone (absent, or
/// expired and deleted by Redis).
pub(super) fn read_inspected(reply: Value) -> Result<Option<Inspected>, RecordError> {
    let Value::Array(items) = reply else {
        return Err(RecordError::Malformed(Malformed(
            "inspect.lua did not answer an array",
        )));
    };
    let mut items = items.into_iter();
    let Some(value) = optional(items.next()) else {
        return Ok(None);
    };
    let value = bytes(Some(value))?;
    let expires_at_millis = int(items.next())?;
    let record = record::decode(&value)?;
    let lease_until_millis = match record {
        Record::Processing { .. } => {
            let (_, _, margin) = record::processing_tail(&value)?;
            expires_at_millis - i64::try_from(margin).unwrap_or(i64::MAX)
        }
        Record::Done { .. } | Record::Released => 0,
    };
    Ok(Some(Inspected {
        record,
        expires_at_millis,
        lease_until_millis,
    }))
}

/// A live record for `Store::inspect` (a released one is not live).
pub(super) fn decode_record(reply: Value) -> Result<Option<RecordInfo>, RecordError> {
    let Some(found) = read_inspected(reply)? else {
        return Ok(None);
    };
    let (state, fence, result) = match found.record {
        Record::Released => return Ok(None),
        Record::Processing { fence, .. } => (RecordState::Processing, fence, None),
        Record::Done { fence, result, .. } => (RecordState::Done, fence, Some(result)),
    };
    Ok(Some(RecordInfo {
        state,
        fence,
        lease_until_millis: found.lease_until_millis,
        expires_at_millis: found.expires_at_millis,
        result,
    }))
}

#[derive(Debug)]
pub(super) enum RecordError {
    Malformed(Malformed),
    Unreadable(Unreadable),
}

impl From<Malformed> for RecordError {
    fn from(e: Malformed) -> Self {
        RecordError::Malformed(e)
    }
}

impl From<Unreadable> for RecordError {
    fn from(e: Unreadable) -> Self {
        RecordError::Unreadable(e)
    }
}
