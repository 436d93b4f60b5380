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

/// The `idem` span of a call, or none when no subscriber takes debug spans.
///
/// `debug_span!` checks the level too, but where no subscriber was ever set
/// and some crate turned on `tracing`'s `log` feature (sqlx does), the span
/// it makes disabled still hands its fields and every enter and exit to
/// `log`'s machinery: 370 instructions a call on the memory store (6 % of
/// the call outside the key's hash), for lines nobody reads.
/// `level_enabled!` is one load.
pub(super) fn call_span(scope: &'static str, key: &Key) -> tracing::Span {
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        tracing::debug_span!("idem", scope, key = %key.short(), fence = tracing::field::Empty)
    } else {
        tracing::Span::none()
    }
}

/// The `idem` span of a call inside the caller's transaction, made as
/// [`call_span`] is.
pub(super) fn tx_span(scope: &'static str, key: &Key) -> tracing::Span {
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        tracing::debug_span!("idem", scope, key = %key.short(), tx = true)
    } else {
        tracing::Span::none()
    }
}

/// Records the fence of a call on its span, if it has one.
pub(super) fn record_fence(fence: u64) {
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        tracing::Span::current().record("fence", fence);
    }
}

impl<F: Future> Future for InSpan<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let mut this = self.project();
        let (scope, key) = (*this.scope, &*this.key);
        let span = this.span.get_or_insert_with(|| call_span(scope, key));
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
        fences: Mutex<Vec<u64>>,
        metas: Mutex<std::collections::HashMap<u64, &'static Metadata<'static>>>,
        /// The most verbose level the subscriber takes (`None`: all).
        max: Option<tracing::level_filters::LevelFilter>,
    }

    struct Fence<'a>(&'a Mutex<Vec<u64>>);

    impl tracing::field::Visit for Fence<'_> {
        fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
            if field.name() == "fence" {
                self.0.lock().unwrap().push(value);
            }
        }
        fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
    }

    #[derive(Clone)]
    struct Shared(Arc<Depth>);

    impl Subscriber for Shared {
        fn enabled(&self, meta: &Metadata<'_>) -> bool {
            self.0.max.is_none_or(|max| *meta.level() <= max)
        }
        fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
            self.0.max
        }
        fn new_span(&self, span: &Attributes<'_>) -> Id {
            if span.metadata().name() == "idem" {
                let parent = self.0.entered.lock().unwrap().last().copied();
                self.0.idem_parents.lock().unwrap().push(parent);
            }
            let id = self.0.next.fetch_add(1, Ordering::Relaxed) + 1;
            self.0.metas.lock().unwrap().insert(id, span.metadata());
            Id::from_u64(id)
        }
        // What `Span::current` asks (the fence is recorded on it).
        fn current_span(&self) -> tracing_core::span::Current {
            match self.0.entered.lock().unwrap().last() {
                Some(&id) => {
                    let meta = self.0.metas.lock().unwrap()[&id];
                    tracing_core::span::Current::new(Id::from_u64(id), meta)
                }
                None => tracing_core::span::Current::none(),
            }
        }
        fn record(&self, _: &Id, values: &Record<'_>) {
            values.record(&mut Fence(&self.0.fences));
        }
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

    /// A call's span carries the fence its claim got, where a subscriber
    /// takes debug spans, and a subscriber at info sees no `idem` span.
    /// (What the level check saves, `log`'s work for a disabled span where
    /// no subscriber was ever set, is not visible to a subscriber; the
    /// benchmarks show it.)
    #[test]
    fn the_span_records_the_fence_and_is_not_made_below_debug() {
        use crate::protocol::{Kind, Spec, execute};
        use crate::store::StoreRef;
        use crate::store::memory::MemoryStore;

        const SPEC: Spec = Spec::new("span.test.fence", Kind::Call);
        let store = StoreRef::new(MemoryStore::new());
        let run = |depth: &Arc<Depth>, part: &str| {
            let key = Key::builder(SPEC.scope).part(part).finish();
            let call = execute(&SPEC, Some(store.clone()), key, None, async {
                Ok::<u32, crate::Error>(7)
            });
            tracing::subscriber::with_default(Shared(depth.clone()), || {
                futures_util::FutureExt::now_or_never(call)
                    .unwrap()
                    .unwrap()
            })
        };
        let debug = Arc::new(Depth::default());
        assert_eq!(run(&debug, "a"), 7);
        assert_eq!(debug.idem_parents.lock().unwrap().len(), 1);
        assert_eq!(*debug.fences.lock().unwrap(), [1]);

        let info = Arc::new(Depth {
            max: Some(tracing::level_filters::LevelFilter::INFO),
            ..Depth::default()
        });
        assert_eq!(run(&info, "b"), 7);
        assert!(info.idem_parents.lock().unwrap().is_empty());
        assert!(info.fences.lock().unwrap().is_empty());
    }
}
