//! Recovery on Redis: the arguments of a recoverable claim, and how a worker
//! finds the claims whose lease ran out.
//!
//! ```text
//! <prefix>{<32 hex>}:recovery        HASH  token scope args attempts next_at [parked]
//! <prefix>{recovery}:due:<scope>     ZSET  <64 hex of the key> -> when to look (ms, the client's clock)
//! <prefix>{recovery}:scopes          SET   the scopes ever indexed
//! ```
//!
//! The hash sits in its record's slot, so `reclaim.lua` writes it with the
//! claim, atomically, and every script that judges it reads the record in
//! the same step (`peek.lua`, `take.lua`, `recovery_info.lua`). It counts
//! only while the record is PROCESSING under the token that wrote it, and it
//! expires with the claim's life (so a body heartbeating past its ttl
//! outlives its arguments).
//!
//! Redis cannot ask "which PROCESSING records have run out of lease" without
//! a walk of every key, so a recoverable claim also indexes its key in its
//! scope's sorted set, before claiming (an index entry without a record is
//! harmless; a record without one would never be found). The index is one
//! key in one slot (`{recovery}`), apart from the records: a claim costs two
//! commands where a plain one costs one, and on a cluster every recoverable
//! claim writes to the one node that owns that slot. The score is when to
//! look next, for a new claim the end of its lease (so a pass that runs
//! between the index write and the claim does not find the entry due, see
//! it without a record and drop it): a worker's listing reads the due entries of its scope, peeks at
//! each record, and tidies as it goes: a finished record's entry (and hash)
//! go, a live one is looked at again when its lease would end, one in its
//! backoff when the backoff ends, a parked one leaves the index until
//! `retry_recovery` puts it back. So each recoverable call costs the worker
//! about one `EVALSHA` after its lease, and the index holds the calls in
//! flight plus those finished since the last pass.

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Script, Value};

use super::reply::{Malformed, bytes, int};
use super::{Inner, millis};
use crate::clock::{Clock, SystemClock};
use crate::error::StoreError;
use crate::key::Key;
use crate::store::{
    Abandoned, Claim, ClaimRequest, RecoveryArgs, RecoveryInfo, RecoveryTurn, Turn,
};

static PEEK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("peek.lua")));
static TAKE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("take.lua")));
static INFO: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("recovery_info.lua")));
static UNINDEX: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("unindex.lua")));

/// Where a recoverable record stands, from `peek.lua`.
enum Peeked {
    Gone,
    Live(Duration),
    Abandoned {
        fence: u64,
        args: Vec<u8>,
        attempts: u32,
        due_in_ms: i64,
        parked: bool,
        ended_ms_ago: i64,
    },
}

fn now_ms() -> i64 {
    SystemClock.now_millis()
}

/// An index score: `lease_ms` from now, on this client's clock.
fn due_after(lease_ms: u64) -> i64 {
    now_ms().saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX))
}

impl Inner {
    pub(super) fn recovery_hash(&self, key: &Key) -> String {
        let mut name = self.redis_key(key);
        name.push_str(":recovery");
        name
    }

    fn due_index(&self, scope: &str) -> String {
        format!("{}{{recovery}}:due:{scope}", self.key_prefix)
    }

    fn scopes_set(&self) -> String {
        format!("{}{{recovery}}:scopes", self.key_prefix)
    }

    /// Indexes the key in its scope, then claims through `reclaim.lua`,
    /// which writes the arguments with the claim.
    ///
    /// The entry is due when the claim's lease would end, not now: a pass
    /// that read it between the two commands would find no record and drop
    /// it, and the claim written a moment later would never be found. A
    /// claim whose second command came back later than half its lease after
    /// the first (a stalled client, a slow network) may have met such a pass
    /// all the same, so it indexes itself once more, now that its record
    /// exists. This relies on the clients' clocks agreeing to within half a
    /// lease, as the index's scores come from the claimer's clock and are
    /// read against the worker's.
    pub(super) async fn claim_recoverable_record(
        &self,
        req: ClaimRequest<'_>,
        recovery: RecoveryArgs<'_>,
    ) -> Result<Claim, StoreError> {
        let index = self.due_index(recovery.scope);
        let member = req.key.to_hex();
        let (lease, ttl) = (millis(req.lease), millis(req.ttl));
        let started = std::time::Instant::now();
        let mut indexing = redis::pipe();
        indexing
            .sadd(self.scopes_set(), recovery.scope)
            .ignore()
            .zadd(&index, &member, due_after(lease))
            .ignore();
        // The earlier name, beside the index's write (earlier.rs).
        let mut conn = self.conn();
        let (indexed, earlier) = if self.earlier.may_remain() {
            let (indexed, earlier) = tokio::join!(
                indexing.query_async::<()>(&mut conn),
                self.read_earlier(req.key)
            );
            (indexed, earlier?.is_some())
        } else {
            (indexing.query_async::<()>(&mut conn).await, false)
        };
        indexed.map_err(|e| self.err_at(&index, e))?;
        let key = self.redis_key(req.key);
        let hash = self.recovery_hash(req.key);
        let head = super::record::processing_head(req.token, req.fingerprint);
        let mut claim = self
            .reclaim_with(&key, Some((&hash, recovery)), &head, lease, ttl)
            .await?;
        if let Claim::Acquired { fence, .. } = claim
            && earlier
            && self
                .adopt_over(
                    req.key,
                    &super::record::processing_at(&head, fence, ttl, lease),
                )
                .await?
        {
            claim = self
                .reclaim_with(&key, Some((&hash, recovery)), &head, lease, ttl)
                .await?;
        }
        if let Claim::Acquired { fence, .. } = claim {
            if started.elapsed() >= req.lease / 2 {
                let indexed: Result<i64, _> = redis::cmd("ZADD")
                    .arg(&index)
                    .arg(due_after(lease))
                    .arg(&member)
                    .query_async(&mut self.conn())
                    .await;
                if let Err(e) = indexed {
                    // A claim a worker may never find must not stand: free
                    // the key (best effort; the body has not run) and fail
                    // the call as the store's error.
                    let _ = self
                        .fenced(&super::SCRIPTS.release, req.key, &[req.token.as_bytes()])
                        .await;
                    return Err(self.err_at(&index, e));
                }
            }
            self.hold_record(req, super::record::processing_at(&head, fence, ttl, lease));
        }
        Ok(claim)
    }

    pub(super) async fn recovery_scope_names(&self) -> Result<Vec<String>, StoreError> {
        let set = self.scopes_set();
        redis::cmd("SMEMBERS")
            .arg(&set)
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&set, e))
    }

    /// Reads the scope's due entries, peeks at each record and tidies the
    /// index on the way (see the module's doc).
    pub(super) async fn abandoned_records(
        &self,
        scope: &str,
        limit: usize,
    ) -> Result<Vec<Abandoned>, StoreError> {
        let index = self.due_index(scope);
        let now = now_ms();
        let due: Vec<(String, f64)> = redis::cmd("ZRANGEBYSCORE")
            .arg(&index)
            .arg("-inf")
            .arg(now)
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(limit.max(1))
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&index, e))?;
        let mut found = Vec::new();
        for (member, seen) in due {
            let Ok(key) = Key::from_hex(&member) else {
                self.unindex(&index, &member, seen).await?;
                continue;
            };
            match self.peek(&key).await? {
                Peeked::Gone => self.unindex(&index, &member, seen).await?,
                Peeked::Live(left) => self.reschedule(&index, &member, now, left).await?,
                Peeked::Abandoned { parked: true, .. } => {
                    self.unindex(&index, &member, seen).await?;
                }
                Peeked::Abandoned { due_in_ms, .. } if due_in_ms > 0 => {
                    let left = Duration::from_millis(u64::try_from(due_in_ms).unwrap_or(0));
                    self.reschedule(&index, &member, now, left).await?;
                }
                Peeked::Abandoned {
                    fence,
                    args,
                    attempts,
                    ended_ms_ago,
                    ..
                } => found.push(Abandoned {
                    key,
                    fence,
                    args,
                    attempts,
                    lease_until_millis: now - ended_ms_ago,
                }),
            }
        }
        found.sort_by_key(|a| a.lease_until_millis);
        Ok(found)
    }

    async fn peek(&self, key: &Key) -> Result<Peeked, StoreError> {
        self.adopt_earlier(key).await?;
        let name = self.redis_key(key);
        let reply: Value = PEEK
            .key(&name)
            .key(self.recovery_hash(key))
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        let malformed = |e: Malformed| self.err(e);
        let Value::Array(items) = reply else {
            return Err(self.err("unexpected reply: peek.lua did not answer an array"));
        };
        let mut items = items.into_iter();
        let tag = bytes(items.next()).map_err(malformed)?;
        Ok(match &tag[..] {
            b"none" | b"gone" => Peeked::Gone,
            b"live" => Peeked::Live(Duration::from_millis(
                u64::try_from(int(items.next()).map_err(malformed)?).unwrap_or(0),
            )),
            b"abandoned" => Peeked::Abandoned {
                fence: u64::try_from(int(items.next()).map_err(malformed)?).unwrap_or(0),
                args: bytes(items.next()).map_err(malformed)?,
                attempts: u32::try_from(int(items.next()).map_err(malformed)?).unwrap_or(0),
                due_in_ms: int(items.next()).map_err(malformed)?,
                parked: int(items.next()).map_err(malformed)? == 1,
                ended_ms_ago: int(items.next()).map_err(malformed)?,
            },
            _ => return Err(self.err("unexpected reply: peek.lua answered an unknown tag")),
        })
    }

    async fn unindex(&self, index: &str, member: &str, seen: f64) -> Result<(), StoreError> {
        let _: i64 = UNINDEX
            .key(index)
            .arg(member)
            .arg(seen)
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(index, e))?;
        Ok(())
    }

    /// Looks at the entry again `after` from `now` (only if it is still
    /// indexed: `XX`).
    async fn reschedule(
        &self,
        index: &str,
        member: &str,
        now: i64,
        after: Duration,
    ) -> Result<(), StoreError> {
        let at = now.saturating_add(i64::try_from(after.as_millis()).unwrap_or(i64::MAX));
        let _: i64 = redis::cmd("ZADD")
            .arg(index)
            .arg("XX")
            .arg(at)
            .arg(member)
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(index, e))?;
        Ok(())
    }

    pub(super) async fn take_turn(
        &self,
        key: &Key,
        turn: RecoveryTurn<'_>,
    ) -> Result<Turn, StoreError> {
        self.adopt_earlier(key).await?;
        let name = self.redis_key(key);
        let limit = if turn.park_now { 0 } else { turn.max_attempts };
        let reply: Value = TAKE
            .key(&name)
            .key(self.recovery_hash(key))
            .arg(turn.fence)
            .arg(limit)
            .arg(turn.note)
            .arg(millis(turn.retry_in))
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        let malformed = |e: Malformed| self.err(e);
        let Value::Array(items) = reply else {
            return Err(self.err("unexpected reply: take.lua did not answer an array"));
        };
        let mut items = items.into_iter();
        let tag = bytes(items.next()).map_err(malformed)?;
        if &tag[..] == b"gone" {
            return Ok(Turn::Gone);
        }
        let attempts = u32::try_from(int(items.next()).map_err(malformed)?).unwrap_or(0);
        let scope = String::from_utf8_lossy(&bytes(items.next()).map_err(malformed)?).into_owned();
        let index = self.due_index(&scope);
        let member = key.to_hex();
        match &tag[..] {
            b"run" => {
                self.reschedule(&index, &member, now_ms(), turn.retry_in)
                    .await?;
                Ok(Turn::Run { attempt: attempts })
            }
            b"parked" => {
                let _: i64 = redis::cmd("ZREM")
                    .arg(&index)
                    .arg(&member)
                    .query_async(&mut self.conn())
                    .await
                    .map_err(|e| self.err_at(&index, e))?;
                Ok(Turn::Parked { attempts })
            }
            _ => Err(self.err("unexpected reply: take.lua answered an unknown tag")),
        }
    }

    async fn info_script(&self, key: &Key, op: &str) -> Result<Option<RecoveryInfo>, StoreError> {
        self.adopt_earlier(key).await?;
        let name = self.redis_key(key);
        let reply: Value = INFO
            .key(&name)
            .key(self.recovery_hash(key))
            .arg(op)
            .invoke_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&name, e))?;
        let malformed = |e: Malformed| self.err(e);
        let Value::Array(items) = reply else {
            return Ok(None);
        };
        let mut items = items.into_iter();
        let scope = String::from_utf8_lossy(&bytes(items.next()).map_err(malformed)?).into_owned();
        let attempts = u32::try_from(int(items.next()).map_err(malformed)?).unwrap_or(0);
        let next_attempt_millis = int(items.next()).map_err(malformed)?;
        let parked = int(items.next()).map_err(malformed)? == 1;
        let note = bytes(items.next()).map_err(malformed)?;
        let args_bytes = usize::try_from(int(items.next()).map_err(malformed)?).unwrap_or(0);
        Ok(Some(RecoveryInfo {
            scope,
            attempts,
            next_attempt_millis,
            parked: parked.then(|| String::from_utf8_lossy(&note).into_owned()),
            args_bytes,
        }))
    }

    pub(super) async fn recovery_state(
        &self,
        key: &Key,
    ) -> Result<Option<RecoveryInfo>, StoreError> {
        self.info_script(key, "read").await
    }

    /// Clears the count and the parking, and puts the key back in its
    /// scope's index, due now.
    pub(super) async fn retry_record(&self, key: &Key) -> Result<bool, StoreError> {
        let Some(info) = self.info_script(key, "retry").await? else {
            return Ok(false);
        };
        let index = self.due_index(&info.scope);
        let _: i64 = redis::cmd("ZADD")
            .arg(&index)
            .arg(0)
            .arg(key.to_hex())
            .query_async(&mut self.conn())
            .await
            .map_err(|e| self.err_at(&index, e))?;
        Ok(true)
    }
}
