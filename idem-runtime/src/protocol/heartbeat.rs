//! Renewing the lease while the body runs, so a live owner is never taken over.

use std::future::Future;
use std::time::Duration;

use crate::flow::FlowContext;
use crate::key::Key;
use crate::store::{StoreRef, Token};

/// Polls the body and, beside it, renews the lease every third of it, so a long
/// body is never taken over while it is alive.
pub(super) async fn heartbeat<F: Future>(
    store: &StoreRef,
    key: &Key,
    token: Token,
    lease: Duration,
    ctx: &FlowContext,
    body: F,
) -> F::Output {
    let period = (lease / 3).max(Duration::from_millis(10));
    let renew = async {
        loop {
            tokio::time::sleep(period).await;
            match store.renew(key, token, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    ctx.mark_lease_lost();
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
    tokio::select! {
        biased;
        out = body => out,
        () = renew => unreachable!("the heartbeat never finishes"),
    }
}
