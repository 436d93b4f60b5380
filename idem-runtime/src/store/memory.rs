//! The in-process store: a sharded map with expiry. One process only.
//!
//! ```
//! use std::time::Duration;
//! use idem_runtime::ManualClock;
//! use idem_runtime::store::memory::MemoryStore;
//!
//! let clock = ManualClock::new(0);
//! let store = MemoryStore::builder().clock(clock.clone()).build(); // leases and ttls on a clock the test moves
//! clock.advance(Duration::from_secs(31)); // a 30 s lease has run out
//! # let _ = store;
//! ```

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::{
    Abandoned, Claim, ClaimRequest, Completion, DEFAULT_MAX_RESULT_BYTES, RecordInfo, RecordState,
    RecoveryArgs, RecoveryInfo, RecoveryTurn, Store, StoredOutcome, StoredResult, Token, Turn,
};
use crate::clock::{Clock, SystemClock, duration_millis};
use crate::error::StoreError;
use crate::key::{DigestHasher, Fingerprint, Key};

// A power of two, so the shard is a mask of the (uniformly random) key hash.
const SHARDS: usize = 64;

#[derive(Debug, Clone)]
enum State {
    Processing {
        token: Token,
        lease_until: i64,
    },
    Done {
        outcome: StoredOutcome,
        payload: Arc<[u8]>,
        // Who completed it: a completion re-sent under the same token is the
        // success it was, not a lost claim.
        token: Token,
    },
    // Released records keep their fence so it never goes backwards.
    Released,
}

#[derive(Debug, Clone)]
struct Record {
    state: State,
    fence: u64,
    expires_at: i64,
    fingerprint: Option<Fingerprint>,
    /// What a recoverable claim stored beside it (only while PROCESSING).
    /// Boxed: most records have none, and every record of a shard moves
    /// when its table grows, so the common record is kept small.
    recovery: Option<Box<Recovery>>,
}

#[derive(Debug, Clone)]
struct Recovery {
    scope: Arc<str>,
    args: Arc<[u8]>,
    attempts: u32,
    next_at: i64,
    parked: Option<String>,
}

#[derive(Debug)]
struct Inner {
    shards: Vec<Mutex<HashMap<Key, Record, DigestHasher>>>,
    clock: Arc<dyn Clock>,
    max_result_bytes: usize,
}

/// An in-memory store: fast, exact within one process, gone on restart.
///
/// Use it for tests and single-process tools; a service with more than one
/// replica needs a shared store.
///
/// ```
/// use idem_runtime::store::memory::MemoryStore;
/// use idem_runtime::ManualClock;
/// use idem_runtime::store::Store;
///
/// let store = MemoryStore::builder()
///     .clock(ManualClock::default())
///     .max_result_bytes(64 * 1024)
///     .build();
/// assert_eq!(store.max_result_bytes(), 64 * 1024);
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// Configures a [`MemoryStore`].
#[derive(Debug)]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    max_result_bytes: usize,
}

impl MemoryStoreBuilder {
    /// The clock for leases and expiry (default: the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The largest result kept (default 1 MiB).
    pub fn max_result_bytes(mut self, limit: usize) -> Self {
        self.max_result_bytes = limit;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..SHARDS)
                    .map(|_| Mutex::new(HashMap::with_hasher(DigestHasher::default())))
                    .collect(),
                clock: self.clock,
                max_result_bytes: self.max_result_bytes,
            }),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// A store on the system clock with the default result cap.
    pub fn new() -> Self {
        MemoryStore::builder().build()
    }

    /// Configures a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            clock: Arc::new(SystemClock),
            max_result_bytes: DEFAULT_MAX_RESULT_BYTES,
        }
    }
}

impl Inner {
    fn shard(&self, key: &Key) -> MutexGuard<'_, HashMap<Key, Record, DigestHasher>> {
        let idx = usize::from(key.as_bytes()[0]) & (SHARDS - 1);
        // A panic while holding the lock cannot leave a record half-written (every
        // mutation is a single assignment), so a poisoned shard is still consistent.
        self.shards[idx]
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn claim_with(
        &self,
        req: ClaimRequest<'_>,
        recovery: Option<RecoveryArgs<'_>>,
    ) -> Result<Claim, StoreError> {
        let now = self.now();
        let mut shard = self.shard(req.key);
        // One lookup for the read and the write: on a first call the record
        // is absent and the probe that finds so is where it goes.
        let entry = shard.entry(*req.key);
        let old = match &entry {
            Entry::Occupied(o) => Some(o.get()),
            Entry::Vacant(_) => None,
        };
        let (fence, takeover) = match old {
            None => (1, false),
            Some(rec) if !is_live(rec, now) => (rec.fence + 1, false),
            Some(rec) => match &rec.state {
                State::Done {
                    outcome, payload, ..
                } => {
                    return Ok(Claim::Done(StoredResult {
                        fingerprint: rec.fingerprint,
                        outcome: *outcome,
                        payload: payload.to_vec(),
                    }));
                }
                State::Processing { token, .. } if *token == req.token => (rec.fence, false),
                State::Processing { lease_until, .. } if *lease_until > now => {
                    return Ok(Claim::Busy {
                        lease_remaining: remaining(*lease_until, now),
                        fingerprint: rec.fingerprint,
                    });
                }
                State::Processing { .. } => (rec.fence + 1, true),
                State::Released => unreachable!("released records are not live"),
            },
        };
        // A takeover (or the same claim re-sent) continues the abandoned call:
        // its recovery count, backoff and parking go on with it.
        let kept = old
            .filter(|rec| is_live(rec, now) && matches!(rec.state, State::Processing { .. }))
            .and_then(|rec| rec.recovery.as_deref());
        let recovery = recovery.map(|r| {
            Box::new(Recovery {
                scope: r.scope.into(),
                args: r.args.into(),
                attempts: kept.map_or(0, |k| k.attempts),
                next_at: kept.map_or(0, |k| k.next_at),
                parked: kept.and_then(|k| k.parked.clone()),
            })
        });
        let record = Record {
            state: State::Processing {
                token: req.token,
                lease_until: now.saturating_add(duration_millis(req.lease)),
            },
            fence,
            expires_at: now.saturating_add(duration_millis(req.ttl)),
            fingerprint: req.fingerprint,
            recovery,
        };
        match entry {
            Entry::Occupied(mut o) => *o.get_mut() = record,
            Entry::Vacant(v) => {
                v.insert(record);
            }
        }
        Ok(Claim::Acquired { fence, takeover })
    }

    fn now(&self) -> i64 {
        self.clock.now_millis()
    }
}

fn remaining(until: i64, now: i64) -> Duration {
    Duration::from_millis(u64::try_from(until.saturating_sub(now)).unwrap_or(0))
}

fn is_live(rec: &Record, now: i64) -> bool {
    rec.expires_at > now && !matches!(rec.state, State::Released)
}

impl Store for Inner {
    fn backend(&self) -> &'static str {
        "memory"
    }

    fn max_result_bytes(&self) -> usize {
        self.max_result_bytes
    }

    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.claim_with(req, None)
    }

    async fn claim_recoverable(
        &self,
        req: ClaimRequest<'_>,
        recovery: RecoveryArgs<'_>,
    ) -> Result<Claim, StoreError> {
        self.claim_with(req, Some(recovery))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        let now = self.now();
        let mut shard = self.shard(key);
        match shard.get_mut(key) {
            Some(rec) if owned_by(rec, token) => {
                rec.state = State::Done {
                    outcome: completion.outcome,
                    payload: completion.payload.into(),
                    token,
                };
                rec.recovery = None;
                rec.expires_at = now.saturating_add(duration_millis(completion.ttl));
                Ok(true)
            }
            Some(Record {
                state: State::Done { token: done_by, .. },
                expires_at,
                ..
            }) if *done_by == token && *expires_at > now => Ok(true),
            _ => Ok(false),
        }
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        let mut shard = self.shard(key);
        match shard.get_mut(key) {
            Some(rec) if owned_by(rec, token) => {
                rec.state = State::Released;
                rec.recovery = None;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        let now = self.now();
        let mut shard = self.shard(key);
        match shard.get_mut(key) {
            Some(rec) if owned_by(rec, token) && rec.expires_at > now => {
                let lease_until = now.saturating_add(duration_millis(lease));
                rec.state = State::Processing { token, lease_until };
                // A body may run past its ttl: while it heartbeats, its record
                // must not expire under it, or a newcomer would take it over.
                rec.expires_at = rec.expires_at.max(lease_until);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        let now = self.now();
        let shard = self.shard(key);
        Ok(shard.get(key).filter(|r| is_live(r, now)).map(|rec| {
            let (state, lease_until_millis, result) = match &rec.state {
                State::Processing { lease_until, .. } => {
                    (RecordState::Processing, *lease_until, None)
                }
                State::Done {
                    outcome, payload, ..
                } => (
                    RecordState::Done,
                    0,
                    Some(StoredResult {
                        fingerprint: rec.fingerprint,
                        outcome: *outcome,
                        payload: payload.to_vec(),
                    }),
                ),
                State::Released => unreachable!("released records are not live"),
            };
            RecordInfo {
                state,
                fence: rec.fence,
                lease_until_millis,
                expires_at_millis: rec.expires_at,
                result,
            }
        }))
    }

    async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
        let now = self.now();
        let mut shard = self.shard(key);
        let Some(rec) = shard.get_mut(key).filter(|r| is_live(r, now)) else {
            return Ok(false);
        };
        rec.state = match rec.state {
            // Disowned, its lease ended: the next claim takes it over with the
            // next fence, and the record stays (it is live) until then.
            State::Processing { .. } => State::Processing {
                token: Token::random(),
                lease_until: now,
            },
            State::Done { .. } | State::Released => State::Released,
        };
        Ok(true)
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let now = self.now();
        let mut purged = 0usize;
        for shard in &self.shards {
            if purged >= limit {
                break;
            }
            let mut map = shard.lock().unwrap_or_else(|p| p.into_inner());
            let dead: Vec<Key> = map
                .iter()
                .filter(|(_, r)| !is_live(r, now))
                .map(|(k, _)| *k)
                .take(limit - purged)
                .collect();
            for k in &dead {
                map.remove(k);
            }
            purged += dead.len();
        }
        Ok(purged as u64)
    }

    async fn recovery_scopes(&self) -> Result<Vec<String>, StoreError> {
        let now = self.now();
        let mut scopes = std::collections::BTreeSet::new();
        for shard in &self.shards {
            let map = shard.lock().unwrap_or_else(|p| p.into_inner());
            for rec in map.values().filter(|r| is_live(r, now)) {
                if let (State::Processing { .. }, Some(r)) = (&rec.state, &rec.recovery) {
                    scopes.insert(r.scope.to_string());
                }
            }
        }
        Ok(scopes.into_iter().collect())
    }

    async fn abandoned(&self, scope: &str, limit: usize) -> Result<Vec<Abandoned>, StoreError> {
        let now = self.now();
        let mut found = Vec::new();
        for shard in &self.shards {
            let map = shard.lock().unwrap_or_else(|p| p.into_inner());
            for (key, rec) in map.iter().filter(|(_, r)| is_live(r, now)) {
                let (State::Processing { lease_until, .. }, Some(r)) = (&rec.state, &rec.recovery)
                else {
                    continue;
                };
                if *lease_until <= now
                    && &*r.scope == scope
                    && r.parked.is_none()
                    && r.next_at <= now
                {
                    found.push(Abandoned {
                        key: *key,
                        fence: rec.fence,
                        args: r.args.to_vec(),
                        attempts: r.attempts,
                        lease_until_millis: *lease_until,
                    });
                }
            }
        }
        found.sort_by_key(|a| a.lease_until_millis);
        found.truncate(limit);
        Ok(found)
    }

    async fn take_recovery(&self, key: &Key, turn: RecoveryTurn<'_>) -> Result<Turn, StoreError> {
        let now = self.now();
        let mut shard = self.shard(key);
        let Some(rec) = shard
            .get_mut(key)
            .filter(|r| is_live(r, now) && r.fence == turn.fence)
        else {
            return Ok(Turn::Gone);
        };
        let (State::Processing { lease_until, .. }, Some(r)) = (&rec.state, &mut rec.recovery)
        else {
            return Ok(Turn::Gone);
        };
        if *lease_until > now || r.parked.is_some() || (r.next_at > now && !turn.park_now) {
            return Ok(Turn::Gone);
        }
        if turn.park_now || r.attempts >= turn.max_attempts {
            r.parked = Some(turn.note.to_owned());
            return Ok(Turn::Parked {
                attempts: r.attempts,
            });
        }
        r.attempts += 1;
        r.next_at = now.saturating_add(duration_millis(turn.retry_in));
        Ok(Turn::Run {
            attempt: r.attempts,
        })
    }

    async fn recovery_info(&self, key: &Key) -> Result<Option<RecoveryInfo>, StoreError> {
        let now = self.now();
        let shard = self.shard(key);
        Ok(shard
            .get(key)
            .filter(|r| is_live(r, now) && matches!(r.state, State::Processing { .. }))
            .and_then(|rec| rec.recovery.as_ref())
            .map(|r| RecoveryInfo {
                scope: r.scope.to_string(),
                attempts: r.attempts,
                next_attempt_millis: r.next_at,
                parked: r.parked.clone(),
                args_bytes: r.args.len(),
            }))
    }

    async fn retry_recovery(&self, key: &Key) -> Result<bool, StoreError> {
        let now = self.now();
        let mut shard = self.shard(key);
        let Some(r) = shard
            .get_mut(key)
            .filter(|r| is_live(r, now) && matches!(r.state, State::Processing { .. }))
            .and_then(|rec| rec.recovery.as_mut())
        else {
            return Ok(false);
        };
        r.attempts = 0;
        r.next_at = 0;
        r.parked = None;
        Ok(true)
    }
}

// Ownership is the token of a PROCESSING record; a DONE or released record has
// no owner left to act.
fn owned_by(rec: &Record, token: Token) -> bool {
    matches!(rec.state, State::Processing { token: t, .. } if t == token)
}

forward_store!(MemoryStore => inner);
