//! When a duplicate should try again: `Error::InProgress::retry_after`.
//!
//! The remaining lease is no answer: it is when the first call would be
//! declared dead, not when it is likely done (a 300 ms call would tell its
//! duplicate to come back in 29 s). The store does not say how old a claim
//! is, and asking it would change every store, so the hint comes from what
//! this process saw: how long calls of the scope took (a moving average), and,
//! when the first call runs in this process, how long it has been running.
//! Both are bounded: by a floor, so a duplicate does not spin, and by the
//! remaining lease, after which the claim is decided either way.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::key::{DigestHasher, Key};
use crate::observe::WordHasher;

use super::Spec;

/// The guess for a scope no call of which finished in this process yet.
const FIRST_GUESS: Duration = Duration::from_secs(1);
/// The least hint: a duplicate is not told to come back at once.
const FLOOR: Duration = Duration::from_millis(50);

/// Moving averages of how long calls took, per scope, in nanoseconds (0: no
/// call of the scope finished yet). Scopes are `&'static str`, a fixed set
/// per program, so the map is bounded, and each slot lives as long as the
/// program: a thread finds it once through this lock, then through
/// `SLOTS`.
static OBSERVED: Mutex<HashMap<&'static str, &'static AtomicU64, ScopeHasher>> =
    Mutex::new(HashMap::with_hasher(ScopeHasher(0)));

thread_local! {
    /// This thread's way to a scope's slot, by the scope string's address
    /// and length: no lock and no hash of its bytes when a call finishes.
    static SLOTS: RefCell<HashMap<(usize, usize), &'static AtomicU64, BuildHasherDefault<WordHasher>>> =
        RefCell::new(HashMap::default());
}

/// The moving average of `scope`'s calls.
fn observed(scope: &'static str) -> &'static AtomicU64 {
    let shared = || {
        *lock(&OBSERVED)
            .entry(scope)
            .or_insert_with(|| Box::leak(Box::new(AtomicU64::new(0))))
    };
    // A call finishing while its thread's locals are torn down goes the long way.
    SLOTS
        .try_with(|slots| {
            *slots
                .borrow_mut()
                .entry((scope.as_ptr() as usize, scope.len()))
                .or_insert_with(shared)
        })
        .unwrap_or_else(|_| shared())
}

/// The calls running in this process and when they started: at most one
/// entry per call in flight, removed when it ends (or is dropped).
static RUNNING: [Mutex<HashMap<Key, Instant, DigestHasher>>; SHARDS] =
    [const { Mutex::new(HashMap::with_hasher(DigestHasher::new())) }; SHARDS];

/// Every call enters and leaves `RUNNING`: shards keep concurrent calls off
/// one lock, picked by the key's first byte (keys are SHA-256 digests, so
/// uniform).
const SHARDS: usize = 16;

fn running(key: &Key) -> std::sync::MutexGuard<'_, HashMap<Key, Instant, DigestHasher>> {
    lock(&RUNNING[usize::from(key.as_bytes()[0]) % SHARDS])
}

/// Scopes are short strings: FNV-1a over their bytes, not SipHash, for the
/// lookup a thread makes the first time it meets a scope.
#[derive(Clone, Copy, Default)]
struct ScopeHasher(u64);

impl std::hash::BuildHasher for ScopeHasher {
    type Hasher = ScopeHasher;
    fn build_hasher(&self) -> ScopeHasher {
        ScopeHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for ScopeHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// The moving average of the calls of `spec`'s scope: found once per call
/// site when the attribute made one, else on every call.
fn typical_of(spec: &Spec) -> &'static AtomicU64 {
    match spec.site {
        Some(site) => site.typical.get_or_init(|| observed(spec.scope)),
        None => observed(spec.scope),
    }
}

/// A body running in this process, for duplicates arriving meanwhile.
pub(super) struct Running {
    typical: &'static AtomicU64,
    key: Key,
    started: Instant,
}

impl Running {
    /// The body starts now; `started` is a reading of the clock just taken
    /// (the claim's answer), saving another.
    pub(super) fn start(spec: &Spec, key: Key, started: Instant) -> Running {
        running(&key).insert(key, started);
        Running {
            typical: typical_of(spec),
            key,
            started,
        }
    }

    /// The body ended (with any outcome): its duration informs later hints.
    pub(super) fn finish(self) {
        let took = u64::try_from(self.started.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        let slot = self.typical;
        // New samples weigh a quarter: a slow outlier moves the hint, but
        // does not rule it. Two calls finishing at once may lose one sample
        // to the other: a hint, not a count.
        let avg = match slot.load(Ordering::Relaxed) {
            0 => took,
            avg => (avg / 4).saturating_mul(3).saturating_add(took / 4).max(1),
        };
        slot.store(avg, Ordering::Relaxed);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        running(&self.key).remove(&self.key);
    }
}

/// When the first call with `key` is likely done.
pub(super) fn retry_after(spec: &Spec, key: &Key, lease_remaining: Duration) -> Duration {
    let typical = match typical_of(spec).load(Ordering::Relaxed) {
        0 => FIRST_GUESS,
        nanos => Duration::from_nanos(nanos),
    };
    let left = match running(key).get(key).copied() {
        // Running here: what is left of a typical call; one that already ran
        // longer than usual is likely close to done.
        Some(started) => typical
            .checked_sub(started.elapsed())
            .unwrap_or(typical / 4),
        // Running elsewhere, age unknown: a typical call's duration is the
        // most it likely has left.
        None => typical,
    };
    left.max(FLOOR).min(lease_remaining.max(FLOOR))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The maps hold plain data, valid after any panic.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
