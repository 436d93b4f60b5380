//! Recovery on the SQL stores: the rows of `idem_recovery` as every dialect
//! reads them, and the turn's decision, written once.
//!
//! A row holds what a recoverable claim stored (scope, sealed arguments) and
//! the worker's bookkeeping, keyed like its record and tagged with the token
//! of the claim that stored it. It counts only while the record is PROCESSING
//! under that token: every dialect's statement joins the two on key and
//! token, so a completed, released or taken-over record's row is ignored
//! without anyone having to delete it first (the purge does, later).

use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::key::Key;
use crate::store::{Abandoned, RecoveryInfo, Turn};

use super::record::corrupt;

/// An abandoned claim from a row selecting `key, fence, args, attempts,
/// lease_until` (the numbers as 64-bit integers).
pub(crate) fn abandoned<R>(r: &R) -> Result<Abandoned, sqlx::Error>
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    for<'a> i64: Decode<'a, R::Database> + Type<R::Database>,
    for<'a> Vec<u8>: Decode<'a, R::Database> + Type<R::Database>,
{
    let key: Vec<u8> = r.try_get("key")?;
    let key =
        <[u8; 32]>::try_from(key.as_slice()).map_err(|_| corrupt("a key that is not 32 bytes"))?;
    Ok(Abandoned {
        key: Key::from_bytes(key),
        fence: u64::try_from(r.try_get::<i64, _>("fence")?).unwrap_or(0),
        args: r.try_get("args")?,
        attempts: count(r.try_get("attempts")?),
        lease_until_millis: r.try_get("lease_until")?,
    })
}

/// The recovery state from a row selecting `scope, attempts, next_at, parked,
/// args_bytes`.
pub(crate) fn info<R>(r: &R) -> Result<RecoveryInfo, sqlx::Error>
where
    R: Row,
    for<'a> &'a str: ColumnIndex<R>,
    for<'a> i64: Decode<'a, R::Database> + Type<R::Database>,
    for<'a> Vec<u8>: Decode<'a, R::Database> + Type<R::Database>,
{
    let parked: Option<Vec<u8>> = r.try_get("parked")?;
    Ok(RecoveryInfo {
        scope: text(r.try_get("scope")?),
        attempts: count(r.try_get("attempts")?),
        next_attempt_millis: r.try_get("next_at")?,
        parked: parked.map(text),
        args_bytes: usize::try_from(r.try_get::<i64, _>("args_bytes")?).unwrap_or(0),
    })
}

/// What a turn's update did: nothing (`None`: the claim is not abandoned at
/// that fence, or waits out its backoff), or the row after it.
pub(crate) fn turn(after: Option<(i64, bool)>) -> Turn {
    match after {
        None => Turn::Gone,
        Some((attempts, true)) => Turn::Parked {
            attempts: count(attempts),
        },
        Some((attempts, false)) => Turn::Run {
            attempt: count(attempts),
        },
    }
}

/// The attempt limit a turn's update compares with: 0 parks at once.
pub(crate) fn limit(turn: &crate::store::RecoveryTurn<'_>) -> i64 {
    if turn.park_now {
        0
    } else {
        i64::from(turn.max_attempts)
    }
}

pub(crate) fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn count(v: i64) -> u32 {
    u32::try_from(v).unwrap_or(0)
}
