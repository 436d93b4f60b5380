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
    /// hold another copy of it. A call that finishes or is dropped (a
    /// cancelled request) is dropped inside the span too, so what its drop
    /// logs keeps the scope and key.
    pub(super) struct InSpan<F> {
        scope: &'static str,
        key: Key,
        span: Option<tracing::Span>,
        #[pin]
        call: Option<F>,
    }

    impl<F> PinnedDrop for InSpan<F> {
        fn drop(this: Pin<&mut Self>) {
            let mut this = this.project();
            if let Some(span) = this.span.as_ref() {
                let _entered = span.enter();
                this.call.set(None);
            }
        }
    }
}

impl<F> InSpan<F> {
    pub(super) fn new(scope: &'static str, key: Key, call: F) -> Self {
        InSpan {
            scope,
            key,
            span: None,
            call: Some(call),
        }
    }
}

impl<F: Future> Future for InSpan<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let mut this = self.project();
        let (scope, key) = (*this.scope, &*this.key);
        let span = this.span.get_or_insert_with(|| {
            tracing::debug_span!("idem", scope, key = %key.short(), fence = tracing::field::Empty)
        });
        let _entered = span.enter();
        let out = this
            .call
            .as_mut()
            .as_pin_mut()
            .expect("an idempotent call polled after it finished")
            .poll(cx);
        if out.is_ready() {
            this.call.set(None);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use tracing::span::{Attributes, Id, Record};
    use tracing::{Event, Metadata, Subscriber};

    use super::*;

    /// The spans entered right now (one thread), and what was entered when
    /// each `idem` span was made.
    #[derive(Default)]
    struct Depth {
        entered: Mutex<Vec<u64>>,
        idem_parents: Mutex<Vec<Option<u64>>>,
        next: AtomicU64,
    }

    #[derive(Clone)]
    struct Shared(Arc<Depth>);

    impl Subscriber for Shared {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, span: &Attributes<'_>) -> Id {
            if span.metadata().name() == "idem" {
                let parent = self.0.entered.lock().unwrap().last().copied();
                self.0.idem_parents.lock().unwrap().push(parent);
            }
            Id::from_u64(self.0.next.fetch_add(1, Ordering::Relaxed) + 1)
        }
        fn record(&self, _: &Id, _: &Record<'_>) {}
        fn record_follows_from(&self, _: &Id, _: &Id) {}
        fn event(&self, _: &Event<'_>) {}
        fn enter(&self, id: &Id) {
            self.0.entered.lock().unwrap().push(id.into_u64());
        }
        fn exit(&self, _: &Id) {
            self.0.entered.lock().unwrap().pop();
        }
    }

    /// Says how many spans were entered when it was dropped.
    struct Guard(Arc<Depth>, Arc<AtomicUsize>);

    impl Drop for Guard {
        fn drop(&mut self) {
            let depth = self.0.entered.lock().unwrap().len();
            self.1.store(depth, Ordering::Relaxed);
        }
    }

    /// A call cancelled after it started (a client that went away) is
    /// dropped inside its span, as `Instrumented` drops what it wraps.
    #[test]
    fn a_cancelled_call_is_dropped_inside_its_span() {
        let depth = Arc::new(Depth::default());
        let seen = Arc::new(AtomicUsize::new(usize::MAX));
        tracing::subscriber::with_default(Shared(depth.clone()), || {
            let guard = Guard(depth.clone(), seen.clone());
            let key = Key::builder("span.test").part("k").finish();
            let mut call = Box::pin(InSpan::new("span.test", key, async move {
                let _guard = guard;
                std::future::pending::<()>().await
            }));
            let mut cx = Context::from_waker(std::task::Waker::noop());
            assert!(call.as_mut().poll(&mut cx).is_pending());
            assert!(
                depth.entered.lock().unwrap().is_empty(),
                "left the span after the poll"
            );
            drop(call);
        });
        assert_eq!(
            seen.load(Ordering::Relaxed),
            1,
            "the body was dropped inside the span"
        );
    }

    /// A call built outside any span and first polled inside one gets its
    /// `idem` span under that one, as an `async fn`'s span would: not under
    /// whatever was current when the future was made.
    #[test]
    fn the_span_is_made_under_the_span_of_the_first_poll() {
        let depth = Arc::new(Depth::default());
        tracing::subscriber::with_default(Shared(depth.clone()), || {
            let key = Key::builder("span.test").part("k").finish();
            let mut call = Box::pin(InSpan::new("span.test", key, async { 1 }));
            assert!(
                depth.idem_parents.lock().unwrap().is_empty(),
                "no span before the poll"
            );
            let outer = tracing::info_span!("outer");
            let outer_id = outer.id().unwrap().into_u64();
            let _in_outer = outer.enter();
            let mut cx = Context::from_waker(std::task::Waker::noop());
            assert_eq!(call.as_mut().poll(&mut cx), Poll::Ready(1));
            assert_eq!(*depth.idem_parents.lock().unwrap(), [Some(outer_id)]);
        });
    }
}
