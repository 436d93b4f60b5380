//! The `idem` span of a call, made when the call is first polled.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::key::Key;

pin_project_lite::pin_project! {
    /// Polls `call` inside the call's span, as `Instrument::instrument`
    /// does, but makes the span at the first poll rather than when the
    /// future is built: under the span current then, as an `async fn`'s
    /// own would be, and without an `async` layer around `call` that would
    /// hold another copy of it.
    pub(super) struct InSpan<F> {
        scope: &'static str,
        key: Key,
        span: Option<tracing::Span>,
        #[pin]
        call: F,
    }
}

impl<F> InSpan<F> {
    pub(super) fn new(scope: &'static str, key: Key, call: F) -> Self {
        InSpan {
            scope,
            key,
            span: None,
            call,
        }
    }
}

impl<F: Future> Future for InSpan<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let (scope, key) = (*this.scope, &*this.key);
        let span = this.span.get_or_insert_with(|| {
            tracing::debug_span!("idem", scope, key = %key.short(), fence = tracing::field::Empty)
        });
        let _entered = span.enter();
        this.call.poll(cx)
    }
}
