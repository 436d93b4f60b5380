//! The record as every SQL dialect stores it, and the judgements made on it.
//!
//! A dialect reads the row with its own SQL and clock, decodes it here, and
//! from then on nothing depends on the database: whether the record is live,
//! what a claimant that did not take it is told, what an operator sees.

use std::time::Duration;

use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::clock::duration_millis;
use crate::key::Fingerprint;
use crate::store::{
    Claim, Completion, RecordInfo, RecordState, StoredOutcome, StoredResult, Token,
};

/// The `state` column: free to claim (the row and its fence kept).
pub(crate) const RELEASED: i64 = 0;
/// The `state` column: claimed, and the body running.
pub(crate) const PROCESSING: i64 = 1;
/// The `state` column: finished; duplicates replay it.
pub(crate) const DONE: i64 = 2;

/// The state a claim writes: DONE when it carries its completion
/// (`claim_done`), PROCESSING otherwise.
pub(crate) fn claimed_state(done: Option<Completion<'_>>) -> i64 {
    if done.is_some() { DONE } else { PROCESSING }
}

/// The latest state a release takes from its owner: DONE as well inside the
/// caller's transaction, where `claim_done` may have written it.
pub(crate) fn released_up_to(done_too: bool) -> i64 {
    if done_too { DONE } else { PROCESSING }
}

/// The longest lease or ttl a statement writes, in milliseconds (about 35,000
/// years, and the Redis store's bound too). Durations are clamped to it so a
/// "forever" ttl stays forever on every dialect, and adding any server's "now"
/// to it can neither overflow a BIGINT (which strict SQL modes reject) nor
/// wrap.
pub(crate) const MAX_MILLIS: i64 = 1 << 50;

/// A lease or ttl as the milliseconds a statement adds to its clock.
pub(crate) fn millis(d: Duration) -> i64 {
    duration_millis(d).min(MAX_MILLIS)
}

/// How much earlier than its ttl from completion a completed record may
/// expire (milliseconds): a hundredth of the ttl, at most a minute. A
/// completion that comes this soon after its claim keeps the expiry the claim
/// wrote, so PostgreSQL can rewrite the row in place (no indexed column
/// changes, see its COMPLETE); a 7-day record then expires at most a minute
/// early, a one-second one at most 10 ms early.
pub(crate) fn completion_slack(ttl: Duration) -> i64 {
    (millis(ttl) / 100).min(60_000)
}

/// A record as read back, with the clock of the reading (the server's, or the
/// store's for SQLite) so every judgement on it agrees with the database.
#[derive(Debug)]
pub(crate) struct Record {
    state: i64,
    token: Vec<u8>,
    fence: i64,
    lease_until: i64,
    expires_at: i64,
    fingerprint: Option<Fingerprint>,
    result: Option<(StoredOutcome, Vec<u8>)>,
    now: i64,
}

impl Record {
    /// Decodes a row read when the clock stood at `now`. Every dialect's read
    /// selects `state, token, fence, lease_until, expires_at, fingerprint,
    /// outcome, result` under these names, `state` and `outcome` as 64-bit
    /// integers whatever their storage.
    ///
    /// A state or outcome this version does not know, or a fingerprint of the
    /// wrong size, is an error: an unknown record fails closed rather than
    /// being taken over or replayed as something it is not.
    pub(crate) fn decode<R>(r: &R, now: i64) -> Result<Record, sqlx::Error>
    where
        R: Row,
        for<'a> &'a str: ColumnIndex<R>,
        for<'a> i64: Decode<'a, R::Database> + Type<R::Database>,
        for<'a> bool: Decode<'a, R::Database> + Type<R::Database>,
        for<'a> Vec<u8>: Decode<'a, R::Database> + Type<R::Database>,
    {
        let state: i64 = r.try_get("state")?;
        if !matches!(state, RELEASED | PROCESSING | DONE) {
            return Err(corrupt("unknown record state"));
        }
        let fingerprint: Option<Vec<u8>> = r.try_get("fingerprint")?;
        let fingerprint = fingerprint
            .map(|b| <[u8; 32]>::try_from(b.as_slice()).map(Fingerprint::from_bytes))
            .transpose()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
        let outcome: Option<i64> = r.try_get("outcome")?;
        let payload: Option<Vec<u8>> = r.try_get("result")?;
        let result = match outcome {
            None => None,
            Some(code) => Some((
                StoredOutcome::from_code(code).ok_or_else(|| corrupt("unknown outcome code"))?,
                payload.unwrap_or_default(),
            )),
        };
        Ok(Record {
            state,
            token: r.try_get("token")?,
            fence: r.try_get("fence")?,
            lease_until: r.try_get("lease_until")?,
            expires_at: r.try_get("expires_at")?,
            fingerprint,
            result,
            now,
        })
    }

    /// Neither released nor expired.
    fn live(&self) -> bool {
        self.state != RELEASED && self.expires_at > self.now
    }

    /// Whether the record stops `token`'s claim: live and DONE (a replay), or
    /// PROCESSING under another owner's live lease (Busy). Otherwise it may be
    /// taken: expired, released, a lease run out, or the claimant's own.
    pub(crate) fn holds_off(&self, token: Token) -> bool {
        self.live()
            && (self.state == DONE
                || (self.state == PROCESSING
                    && self.lease_until > self.now
                    && self.token != token.as_bytes()))
    }

    /// What the record tells a claimant that has not taken it: a replay
    /// (DONE), or Busy (another owner's live lease). `None`: the record may be
    /// taken (absent for all purposes, expired, released, a lease run out, or
    /// the claimant's own), so the claim goes on to the dialect's upsert.
    pub(crate) fn judge(self, token: Token) -> Result<Option<Claim>, sqlx::Error> {
        if !self.holds_off(token) {
            return Ok(None);
        }
        if self.state == DONE {
            return self
                .stored()
                .map(|stored| Some(Claim::Done(stored)))
                .ok_or_else(|| corrupt("a DONE record without an outcome"));
        }
        Ok(Some(Claim::Busy {
            lease_remaining: remaining(self.lease_until, self.now),
            fingerprint: self.fingerprint,
        }))
    }

    /// The record as an operator sees it, if it is live.
    pub(crate) fn info(self) -> Result<Option<RecordInfo>, sqlx::Error> {
        if !self.live() {
            return Ok(None);
        }
        let (state, lease_until_millis) = match self.state {
            PROCESSING => (RecordState::Processing, self.lease_until),
            _ => (RecordState::Done, 0),
        };
        let (fence, expires_at_millis) = (fence(self.fence), self.expires_at);
        let result = self.stored();
        if state == RecordState::Done && result.is_none() {
            return Err(corrupt("a DONE record without an outcome"));
        }
        Ok(Some(RecordInfo {
            state,
            fence,
            lease_until_millis,
            expires_at_millis,
            result,
        }))
    }

    fn stored(self) -> Option<StoredResult> {
        let fingerprint = self.fingerprint;
        self.result.map(|(outcome, payload)| StoredResult {
            fingerprint,
            outcome,
            payload,
        })
    }
}

/// A claim the upsert won.
#[derive(Debug)]
pub(crate) struct Won {
    /// The fence it was given.
    pub fence: i64,
    /// Whether it took over a live record whose lease had run out.
    pub takeover: bool,
    /// The lease it wrote.
    pub lease_until: i64,
    /// The clock once the upsert had the row.
    pub now: i64,
}

impl Won {
    /// A claim whose dialect reads no clock back: its times on a clock that
    /// starts with the lease, the lease having lost `lost_millis` before the
    /// statement had the row (0 when the statement counts the lease from then
    /// itself). [`Won::began_long_ago`] judges it like any other.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) fn after(fence: i64, takeover: bool, lease: Duration, lost_millis: i64) -> Won {
        Won {
            fence,
            takeover,
            lease_until: millis(lease),
            now: lost_millis,
        }
    }

    /// Whether the lease lost more than a tenth of itself before the upsert
    /// had the row: the statement waited on a lock (or the write lock) with
    /// its clock read before, and the lease must start again. A smaller loss
    /// is the statement's own run time.
    pub(crate) fn began_long_ago(&self, lease: Duration) -> bool {
        let started = self.lease_until.saturating_sub(millis(lease));
        self.now.saturating_sub(started).saturating_mul(10) > millis(lease)
    }

    pub(crate) fn claim(self) -> Claim {
        Claim::Acquired {
            fence: fence(self.fence),
            takeover: self.takeover,
        }
    }
}

/// What a dialect's upsert did.
#[derive(Debug)]
pub(crate) enum Upserted {
    /// The caller owns the record now.
    Won(Won),
    /// Someone else holds it; the dialect has read it back already (`Some`),
    /// or the claim loop reads it (`None`).
    Lost(Option<Record>),
}

pub(crate) fn corrupt(what: &'static str) -> sqlx::Error {
    sqlx::Error::Decode(what.into())
}

fn remaining(until: i64, now: i64) -> Duration {
    Duration::from_millis(u64::try_from(until.saturating_sub(now)).unwrap_or(0))
}

fn fence(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absurd_durations_are_clamped_far_from_overflow() {
        assert_eq!(millis(Duration::MAX), MAX_MILLIS);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        // Any plausible clock plus the clamp stays far below BIGINT's end.
        const { assert!(i64::MAX - MAX_MILLIS > 4_000_000_000_000_000) };
    }

    #[test]
    fn a_lease_that_waited_starts_again() {
        let lease = Duration::from_secs(10);
        let won = |lease_until, now| Won {
            fence: 1,
            takeover: false,
            lease_until,
            now,
        };
        assert!(!won(10_000, 500).began_long_ago(lease));
        assert!(won(10_000, 1_500).began_long_ago(lease));
        assert!(!won(MAX_MILLIS, 0).began_long_ago(Duration::MAX));
    }
}
