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

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use crate::key::Key;

use super::Spec;

/// The guess for a scope no call of which finished in this process yet.
const FIRST_GUESS: Duration = Duration::from_secs(1);
/// The least hint: a duplicate is not told to come back at once.
const FLOOR: Duration = Duration::from_millis(50);

/// Moving averages of how long calls took, per scope. Scopes are
/// `&'static str`, a fixed set per program, so the map is bounded.
static OBSERVED: LazyLock<Mutex<HashMap<&'static str, Duration>>> = LazyLock::new(Default::default);

/// The calls running in this process and when they started: at most one
/// entry per call in flight, removed when it ends (or is dropped).
static RUNNING: LazyLock<Mutex<HashMap<Key, Instant>>> = LazyLock::new(Default::default);

/// A body running in this process, for duplicates arriving meanwhile.
pub(super) struct Running {
    scope: &'static str,
    key: Key,
    started: Instant,
}

impl Running {
    pub(super) fn start(spec: &Spec, key: Key) -> Running {
        let started = Instant::now();
        lock(&RUNNING).insert(key, started);
        Running {
            scope: spec.scope,
            key,
            started,
        }
    }

    /// The body ended (with any outcome): its duration informs later hints.
    pub(super) fn finish(self) {
        let took = self.started.elapsed();
        let mut observed = lock(&OBSERVED);
        let avg = observed.entry(self.scope).or_insert(took);
        // New samples weigh a quarter: a slow outlier moves the hint, but
        // does not rule it.
        *avg = (*avg * 3 + took) / 4;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        lock(&RUNNING).remove(&self.key);
    }
}

/// When the first call with `key` is likely done.
pub(super) fn retry_after(spec: &Spec, key: &Key, lease_remaining: Duration) -> Duration {
    let typical = lock(&OBSERVED)
        .get(spec.scope)
        .copied()
        .unwrap_or(FIRST_GUESS);
    let left = match lock(&RUNNING).get(key) {
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
