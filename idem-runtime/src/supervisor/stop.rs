//! [`Stop`]: the shutdown each part is handed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;
use tokio::sync::watch;

/// A future that completes when the [`Supervisor`](super::Supervisor) shuts
/// down: what a part passes to its `run_until` (the relay's, the worker's,
/// the runner's) so it finishes its work in flight and returns.
///
/// Clones complete together. A supervisor dropped without a shutdown (its
/// `run_until` future dropped) completes them too.
///
/// ```
/// use idem_runtime::supervisor::Supervisor;
///
/// let supervisor = Supervisor::new().consumer("ticker", |stop| async move {
///     assert!(!stop.is_stopped());
///     stop.await; // the shutdown came
///     Ok::<(), std::io::Error>(())
/// });
/// # let _ = supervisor;
/// ```
pub struct Stop {
    rx: watch::Receiver<bool>,
    // A `Mutex` only so `Stop` is `Sync` (a part may hold `&Stop` across an
    // await and stay `Send`); it is never locked: `poll` has `&mut`.
    wait: Option<Mutex<BoxFuture<'static, ()>>>,
}

impl Stop {
    pub(super) fn new(rx: watch::Receiver<bool>) -> Stop {
        Stop { rx, wait: None }
    }

    /// Whether the shutdown has come.
    pub fn is_stopped(&self) -> bool {
        *self.rx.borrow() || self.rx.has_changed().is_err()
    }
}

impl Clone for Stop {
    fn clone(&self) -> Stop {
        Stop::new(self.rx.clone())
    }
}

impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop")
            .field("stopped", &self.is_stopped())
            .finish()
    }
}

impl Future for Stop {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        let rx = &this.rx;
        let wait = this.wait.get_or_insert_with(|| {
            let mut rx = rx.clone();
            // `Err`: the supervisor is gone, and nothing is left to wait for.
            Mutex::new(Box::pin(async move {
                let _ = rx.wait_for(|stopped| *stopped).await;
            }))
        });
        wait.get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .poll(cx)
    }
}
