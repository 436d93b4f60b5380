//! Token-checked locks: concurrency control, never idempotency.
//!
//! A lock stops two calls that overlap in time from running the same critical
//! section at once. It does nothing for the call that comes back after the
//! first one finished (a retry, a redelivery): only the claim
//! (`#[idempotent]`) and a business unique constraint stop that one. Use a
//! lock *inside* an idempotent call when the work itself must not run
//! concurrently with other work (a nightly batch, a rebalancing job), never in
//! place of the claim.
//!
//! Every lock is held under a random [`Token`](crate::store::Token). Renewing and
//! releasing check it in one atomic step, so a holder whose lease ran out (a
//! long GC pause, a partition) can neither extend nor delete the lock a later
//! holder took meanwhile: the reference notes' "lock deleted by mistake".
//!
//! - `redis` (feature `redis`): `SET key token NX PX lease`; renew and
//!   release are compare-and-set Lua scripts.
//! - `postgres` (feature `postgres`): a session advisory lock on a
//!   connection the guard owns; the lease is the server's
//!   `idle_session_timeout` on that connection.
//!
//! A lease shorter than the work is a bug the lock cannot fix: renew every
//! third of the lease, and stop when a renewal answers `false`.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_runtime::lock::postgres::PgLocks;
//!
//! # async fn run() -> Result<(), idem_runtime::StoreError> {
//! let locks = PgLocks::connect("postgres://app@127.0.0.1:5432/orders").await?;
//! if let Some(lock) = locks.try_acquire("nightly-settlement", Duration::from_secs(30)).await? {
//!     // … the batch, inside an idempotent call; renew every third of the lease …
//!     lock.release().await?;
//! }
//! # Ok(()) }
//! ```

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;

use std::time::Duration;

/// How long to sleep between two attempts of a waiting acquire: full jitter
/// over a doubling window (5, 10, … ms, at most 320), so waiters do not meet
/// again in lockstep.
pub(crate) fn pause(attempt: u32) -> Duration {
    let window = 5u64 << attempt.min(6);
    Duration::from_millis(1 + rand::random::<u64>() % window)
}

#[cfg(test)]
mod tests {
    #[test]
    fn pauses_stay_short() {
        for attempt in 0..20 {
            let p = super::pause(attempt);
            assert!(p.as_millis() >= 1 && p.as_millis() <= 321, "{p:?}");
        }
    }
}
