//! The store the explorer hands the user's service: every operation goes to
//! the real store underneath, and the one the schedule names is held there,
//! before it reaches the store or after, for as long as the explorer wants
//! (forever, for a caller it cuts off).

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};

use crate::error::StoreError;
use crate::key::Key;
use crate::protocol::labels;
use crate::store::{
    Abandoned, Claim, ClaimRequest, Completion, RecordInfo, RecordStats, RecoveryArgs,
    RecoveryInfo, RecoveryTurn, Store, StoreRef, Token, Turn,
};

tokio::task_local! {
    /// Which of the explorer's callers the running task is (0: none of them).
    static CALLER: u32;
}

/// Runs `fut` as caller `n`: its store operations are counted and traced
/// under that number.
pub(super) fn as_caller<F: Future>(n: u32, fut: F) -> impl Future<Output = F::Output> {
    CALLER.scope(n, fut)
}

/// Where a schedule holds a caller: at its `op`-th store operation (from 0),
/// before the operation reaches the store or after it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hold {
    pub(super) caller: u32,
    pub(super) op: usize,
    pub(super) after: bool,
}

/// One line of the trace: a store operation and what it returned, or a
/// note.
#[derive(Debug, Clone)]
pub(super) struct Op {
    pub(super) caller: u32,
    pub(super) text: String,
    /// The operation alone, without its result (`None` for a note and for
    /// an operation that is no fault point).
    pub(super) op: Option<String>,
}

#[derive(Default)]
struct State {
    ops: HashMap<u32, usize>,
    trace: Vec<Op>,
    hold: Option<Hold>,
    /// The caller standing at its hold: a stalled process stalls whole, so
    /// its heartbeat's renewals wait too.
    held: Option<u32>,
}

struct Inner {
    store: StoreRef,
    state: Mutex<State>,
    /// The held caller reached its hold.
    reached: Notify,
    /// A permit lets the held caller go on.
    release: Semaphore,
    /// The held caller went on: its other operations may too.
    resumed: Notify,
    /// The longest lease a claim asked for, in ms: how far the clock moves
    /// for a lease to run out.
    lease_ms: AtomicU64,
}

/// A [`Store`] that passes everything to the store it wraps, traces it, and
/// holds the operation a schedule names.
#[derive(Clone)]
pub(super) struct FaultStore(Arc<Inner>);

impl FaultStore {
    pub(super) fn new(store: StoreRef, hold: Option<Hold>) -> FaultStore {
        FaultStore(Arc::new(Inner {
            store,
            state: Mutex::new(State {
                hold,
                ..State::default()
            }),
            reached: Notify::new(),
            release: Semaphore::new(0),
            resumed: Notify::new(),
            lease_ms: AtomicU64::new(0),
        }))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the held caller stands at its hold.
    pub(super) async fn reached(&self) {
        self.0.reached.notified().await;
    }

    /// Lets the held caller go on.
    pub(super) fn release(&self) {
        self.state().held = None;
        self.0.resumed.notify_waiters();
        self.0.release.add_permits(1);
    }

    /// The store operations so far, in order.
    pub(super) fn trace(&self) -> Vec<Op> {
        self.state().trace.clone()
    }

    /// A little longer than the longest lease claimed so far.
    pub(super) fn lease(&self) -> Duration {
        Duration::from_millis(self.0.lease_ms.load(Ordering::Relaxed)) + Duration::from_secs(1)
    }

    pub(super) fn note(&self, text: String) {
        self.note_for(0, text);
    }

    /// Runs one operation of the current caller, traced, held where the
    /// schedule says.
    async fn op<T, F>(&self, what: &str, key: Option<&Key>, run: F) -> T
    where
        F: Future<Output = T>,
        T: Outcome,
    {
        self.op_counted(true, what, key, run).await
    }

    /// `counted` false: a renewal, which a heartbeat sends on a timer, so it
    /// is no fault point (the points must be the same in every run).
    async fn op_counted<T, F>(&self, counted: bool, what: &str, key: Option<&Key>, run: F) -> T
    where
        F: Future<Output = T>,
        T: Outcome,
    {
        let caller = CALLER.try_with(|c| *c).unwrap_or(0);
        let name = match key {
            Some(key) => format!("{what} {}", labels::describe(key)),
            None => what.to_owned(),
        };
        let resumed = self.0.resumed.notified();
        tokio::pin!(resumed);
        let (hold, stalled) = {
            let mut state = self.state();
            let stalled = caller != 0 && state.held == Some(caller);
            if stalled {
                // Registered under the lock: a release cannot slip in
                // between the look and the wait.
                resumed.as_mut().enable();
            }
            let hold = if counted {
                let n = state.ops.entry(caller).or_default();
                let index = *n;
                *n += 1;
                state
                    .hold
                    .filter(|h| caller != 0 && h.caller == caller && h.op == index)
            } else {
                None
            };
            if hold.is_some() {
                state.held = Some(caller);
            }
            (hold, stalled)
        };
        if stalled {
            // Another operation of the held caller (its heartbeat): it waits
            // for the caller to go on, and is not traced.
            resumed.await;
            return run.await;
        }
        if hold.is_some_and(|h| !h.after) {
            self.note_for(caller, format!("held before: {name}"));
            self.wait_at_hold().await;
        }
        let out = run.await;
        self.state().trace.push(Op {
            caller,
            text: format!("{name} → {}", out.summary()),
            op: counted.then(|| name.clone()),
        });
        if hold.is_some_and(|h| h.after) {
            self.note_for(caller, format!("held after: {name}"));
            self.wait_at_hold().await;
        }
        out
    }

    fn note_for(&self, caller: u32, text: String) {
        self.state().trace.push(Op {
            caller,
            text,
            op: None,
        });
    }

    async fn wait_at_hold(&self) {
        self.0.reached.notify_one();
        // Never closed: a caller cut off waits here until its future is
        // dropped.
        if let Ok(permit) = self.0.release.acquire().await {
            permit.forget();
        }
    }
}

/// How an operation's result reads in the trace.
trait Outcome {
    fn summary(&self) -> String;
}

impl Outcome for Result<Claim, StoreError> {
    fn summary(&self) -> String {
        match self {
            Ok(Claim::Acquired { fence, takeover }) => {
                format!(
                    "acquired (fence {fence}{})",
                    if *takeover { ", taken over" } else { "" }
                )
            }
            Ok(Claim::Busy { .. }) => "busy (another caller holds it)".to_owned(),
            Ok(Claim::Done(_)) => "done (a stored outcome to replay)".to_owned(),
            Err(e) => format!("error: {e}"),
        }
    }
}

impl Outcome for Result<bool, StoreError> {
    fn summary(&self) -> String {
        match self {
            Ok(true) => "ok".to_owned(),
            Ok(false) => "refused (no longer this caller's)".to_owned(),
            Err(e) => format!("error: {e}"),
        }
    }
}

impl Outcome for Result<Option<RecordInfo>, StoreError> {
    fn summary(&self) -> String {
        match self {
            Ok(Some(info)) => format!("{:?}", info.state),
            Ok(None) => "none".to_owned(),
            Err(e) => format!("error: {e}"),
        }
    }
}

impl<T> Outcome for Result<Vec<T>, StoreError> {
    fn summary(&self) -> String {
        match self {
            Ok(v) => format!("{} found", v.len()),
            Err(e) => format!("error: {e}"),
        }
    }
}

impl Outcome for Result<Turn, StoreError> {
    fn summary(&self) -> String {
        match self {
            Ok(turn) => format!("{turn:?}"),
            Err(e) => format!("error: {e}"),
        }
    }
}

impl Outcome for Result<Option<RecoveryInfo>, StoreError> {
    fn summary(&self) -> String {
        match self {
            Ok(Some(_)) => "recovery state".to_owned(),
            Ok(None) => "none".to_owned(),
            Err(e) => format!("error: {e}"),
        }
    }
}

impl Store for FaultStore {
    fn backend(&self) -> &'static str {
        self.0.store.backend()
    }

    fn max_result_bytes(&self) -> usize {
        self.0.store.max_result_bytes()
    }

    async fn claim(&self, req: ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.0
            .lease_ms
            .fetch_max(req.lease.as_millis() as u64, Ordering::Relaxed);
        let key = *req.key;
        self.op("claim", Some(&key), self.0.store.claim(req)).await
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError> {
        self.op(
            "record the outcome of",
            Some(key),
            self.0.store.complete(key, token, completion),
        )
        .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<bool, StoreError> {
        self.op("release", Some(key), self.0.store.release(key, token))
            .await
    }

    async fn renew(&self, key: &Key, token: Token, lease: Duration) -> Result<bool, StoreError> {
        self.op_counted(
            false,
            "renew",
            Some(key),
            self.0.store.renew(key, token, lease),
        )
        .await
    }

    async fn inspect(&self, key: &Key) -> Result<Option<RecordInfo>, StoreError> {
        self.op("read", Some(key), self.0.store.inspect(key)).await
    }

    async fn evict(&self, key: &Key) -> Result<bool, StoreError> {
        self.op("evict", Some(key), self.0.store.evict(key)).await
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        self.0.store.purge_expired(limit).await
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.0.store.stats().await
    }

    async fn claim_recoverable(
        &self,
        req: ClaimRequest<'_>,
        recovery: RecoveryArgs<'_>,
    ) -> Result<Claim, StoreError> {
        self.0
            .lease_ms
            .fetch_max(req.lease.as_millis() as u64, Ordering::Relaxed);
        let key = *req.key;
        self.op(
            "claim",
            Some(&key),
            self.0.store.claim_recoverable(req, recovery),
        )
        .await
    }

    async fn recovery_scopes(&self) -> Result<Vec<String>, StoreError> {
        self.0.store.recovery_scopes().await
    }

    async fn abandoned(&self, scope: &str, limit: usize) -> Result<Vec<Abandoned>, StoreError> {
        self.op(
            "look for abandoned calls of",
            None,
            self.0.store.abandoned(scope, limit),
        )
        .await
    }

    async fn take_recovery(&self, key: &Key, turn: RecoveryTurn<'_>) -> Result<Turn, StoreError> {
        self.op(
            "take a recovery turn at",
            Some(key),
            self.0.store.take_recovery(key, turn),
        )
        .await
    }

    async fn recovery_info(&self, key: &Key) -> Result<Option<RecoveryInfo>, StoreError> {
        self.0.store.recovery_info(key).await
    }

    async fn retry_recovery(&self, key: &Key) -> Result<bool, StoreError> {
        self.0.store.retry_recovery(key).await
    }
}
