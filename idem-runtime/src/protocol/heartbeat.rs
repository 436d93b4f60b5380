//! Renewing the lease while the body runs, so a live owner is never taken over.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::flow;
use crate::key::Key;
use crate::store::{Store, Token};

/// Polls the body and, beside it, renews the lease every third of it, so a long
/// body is never taken over while it is alive. The renewal starts (and arms
/// its timer) only once the body has waited.
pub(super) fn heartbeat<'a, S: Store, F: Future + 'a>(
    store: &'a S,
    key: &'a Key,
    token: Token,
    lease: Duration,
    body: F,
) -> impl Future<Output = F::Output> + 'a {
    let period = (lease / 3).max(Duration::from_millis(10));
    let renew = async move {
        loop {
            tokio::time::sleep(period).await;
            match store.renew(key, token, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    // Polled inside the call's flow scope: the flag is this call's.
                    flow::mark_lease_lost();
                    tracing::warn!(
                        "lease lost: another caller took over this key; no new step starts and its completion will win"
                    );
                    break;
                }
                // A transient failure: the next beat may get through before the lease ends.
                Err(e) => tracing::warn!(error = %e, "lease renewal failed"),
            }
        }
        std::future::pending::<()>().await;
    };
    Beside { body, renew }
}

pin_project_lite::pin_project! {
    /// The body first, then the renewal, which never ends. A struct rather
    /// than `select!` in an `async` block, which would hold the body twice
    /// (the block's capture and the macro's own tuple).
    struct Beside<F, R> {
        #[pin]
        body: F,
        #[pin]
        renew: R,
    }
}

impl<F: Future, R: Future<Output = ()>> Future for Beside<F, R> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.body.poll(cx) {
            return Poll::Ready(out);
        }
        match this.renew.poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => unreachable!("the heartbeat never finishes"),
        }
    }
}
