//! Deleting expired records in the background.
//!
//! Claims already reclaim an expired record in place, so sweeping is about
//! space, not correctness: without it a table keeps every key ever used.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::store::{Store as _, StoreRef};

/// Spawns a task that deletes expired and released records every `every`,
/// `batch` at a time, so no single statement locks or deletes much.
///
/// Each round purges batch after batch until one comes back short (the
/// backlog is gone), then sleeps. A failed purge is logged with `tracing` and
/// retried the next round; the task never ends on its own. Abort the returned
/// handle to stop it. The first round runs at once.
///
/// The SQL stores find dead records through their `expires_at` index (a
/// release expires its record at once), so a batch never scans the table.
/// Several replicas may each run a sweeper: PostgreSQL and MySQL/MariaDB lock
/// each batch with SKIP LOCKED, so sweepers split the dead rows between them
/// and pass by any row a claim or another transaction holds, never waiting on
/// it. SQLite has one writer at a time: sweepers and claims take turns, one
/// bounded batch each.
///
/// Must be called inside a Tokio runtime. A zero `batch` is treated as 1 and a
/// zero `every` as 1 ms.
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::store::StoreRef;
/// use idem_runtime::store::memory::MemoryStore;
/// use idem_runtime::store::spawn_sweeper;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = StoreRef::new(MemoryStore::new());
/// let sweeper = spawn_sweeper(store, Duration::from_secs(60), 1000);
/// // … at shutdown:
/// sweeper.abort();
/// # });
/// ```
pub fn spawn_sweeper(store: StoreRef, every: Duration, batch: usize) -> JoinHandle<()> {
    let batch = batch.max(1);
    let every = every.max(Duration::from_millis(1));
    tokio::spawn(async move {
        loop {
            sweep(&store, batch).await;
            tokio::time::sleep(every).await;
        }
    })
}

/// One round: batches until a short one. Returns how many records went.
async fn sweep(store: &StoreRef, batch: usize) -> u64 {
    let mut purged = 0u64;
    loop {
        match store.purge_expired(batch).await {
            Ok(n) => {
                purged += n;
                if n < batch as u64 {
                    break;
                }
                // A large backlog on an in-process store is all CPU: let the
                // other tasks on this worker run between batches.
                tokio::task::yield_now().await;
            }
            Err(e) => {
                tracing::warn!(
                    backend = store.backend(),
                    error = %e,
                    "sweeping expired idempotency records failed; retrying next round"
                );
                break;
            }
        }
    }
    if purged > 0 {
        tracing::debug!(
            backend = store.backend(),
            purged,
            "swept expired idempotency records"
        );
    }
    purged
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::{Claim, ClaimRequest, Completion, RecordInfo, Store, StoredOutcome, Token};
    use crate::{Key, ManualClock, StoreError};

    /// A memory store that can fail its purges and remembers each batch's size.
    struct Watched {
        inner: MemoryStore,
        failing: AtomicBool,
        failures: AtomicUsize,
        batches: Mutex<Vec<u64>>,
    }

    impl Store for Watched {
        fn backend(&self) -> &'static str {
            "watched"
        }
        async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
            self.inner.claim(req).await
        }
        async fn complete(
            &self,
            key: &Key,
            token: Token,
            completion: Completion<'_>,
        ) -> Result<bool, StoreError> {
            self.inner.complete(key, token, completion).await
        }
        async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
            self.inner.release(key, token).await
        }
        async fn renew(
            &self,
            key: &Key,
            token: Token,
            lease: Duration,
        ) -> Result<bool, StoreError> {
            self.inner.renew(key, token, lease).await
        }
        async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
            self.inner.inspect(key).await
        }
        async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
            self.inner.evict(key).await
        }
        async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
            if self.failing.load(Ordering::SeqCst) {
                self.failures.fetch_add(1, Ordering::SeqCst);
                return Err(StoreError::new("watched", "test", "the database is down"));
            }
            let n = self.inner.purge_expired(limit).await?;
            self.batches.lock().unwrap().push(n);
            Ok(n)
        }
    }

    async fn done_record(store: &MemoryStore, name: &str, ttl: Duration) -> Key {
        let key = Key::builder("sweeper").part(name).finish();
        let token = Token::random();
        let req = ClaimRequest {
            key: &key,
            token,
            fingerprint: None,
            lease: Duration::from_secs(30),
            ttl,
        };
        assert!(matches!(
            store.claim(req).await.unwrap(),
            Claim::Acquired { .. }
        ));
        let completion = Completion {
            outcome: StoredOutcome::Success,
            payload: b"1",
            ttl,
        };
        assert!(store.complete(&key, token, completion).await.unwrap());
        key
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sweeps_in_batches_survives_errors_and_keeps_live_records() {
        let clock = ManualClock::default();
        let inner = MemoryStore::builder().clock(clock.clone()).build();
        for i in 0..5 {
            done_record(&inner, &format!("dead-{i}"), Duration::from_secs(60)).await;
        }
        let live = done_record(&inner, "live", Duration::from_secs(3600)).await;
        clock.advance(Duration::from_secs(120));
        let watched = std::sync::Arc::new(Watched {
            inner: inner.clone(),
            failing: AtomicBool::new(true),
            failures: AtomicUsize::new(0),
            batches: Mutex::new(Vec::new()),
        });
        let sweeper = spawn_sweeper(
            StoreRef::from_arc(watched.clone()),
            Duration::from_millis(20),
            2,
        );

        // The database is down: rounds fail, are logged, and keep coming.
        until("three failed rounds", || {
            watched.failures.load(Ordering::SeqCst) >= 3
        })
        .await;
        assert!(!sweeper.is_finished(), "an error ended the sweeper");

        // Back up: one round takes the 5 dead records 2 + 2 + 1, then stops.
        watched.failing.store(false, Ordering::SeqCst);
        until("the backlog swept", || {
            watched.batches.lock().unwrap().iter().sum::<u64>() == 5
        })
        .await;
        let batches = watched.batches.lock().unwrap().clone();
        assert_eq!(&batches[..3], &[2, 2, 1], "batches: {batches:?}");
        assert!(inner.inspect(&live).await.unwrap().is_some());

        // Records that expire later go in a later round.
        done_record(&inner, "later", Duration::from_secs(1)).await;
        clock.advance(Duration::from_secs(2));
        until("the later record swept", || {
            watched.batches.lock().unwrap().iter().sum::<u64>() == 6
        })
        .await;
        assert!(inner.inspect(&live).await.unwrap().is_some());
        sweeper.abort();
    }
}
