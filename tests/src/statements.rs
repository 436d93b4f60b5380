//! Counts the SQL statements a piece of code sends, from sqlx's own
//! per-statement events.
//!
//! sqlx emits one tracing event (target `sqlx::query`) for every statement it
//! executes on a connection, BEGIN and COMMIT included, when the statement's
//! result is finished; preparing a statement is part of the same execution
//! and is not counted apart. Listening to those events counts exactly what
//! went to the server through sqlx, without a proxy or a server extension
//! (`pg_stat_statements` is not loaded on the test servers, and it counts
//! every session's statements at once).
//!
//! The recorder is installed once as the binary's global subscriber and keeps
//! only what the threads currently recording send: tests in the same binary
//! run on other threads, and their statements are not seen. So the code under
//! count must run on the recording thread, i.e. in a `current_thread` runtime
//! (plain `#[tokio::test]`) and not in a spawned task of a multi-threaded one.
//! (A thread-local default subscriber would not do: tracing caches whether a
//! call site is enabled at all when it is first hit, and a first hit on
//! another test's thread, which has no subscriber, would disable sqlx's event
//! for everyone.)

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Once;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

const TARGET: &str = "sqlx::query";

thread_local! {
    static SEEN: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
}

/// The statements sent on this thread while it is alive.
pub struct Statements {
    // Recording is the creating thread's.
    _not_send: PhantomData<*const ()>,
}

impl Statements {
    /// Starts recording on the calling thread.
    ///
    /// # Panics
    ///
    /// If another global subscriber is installed in this test binary.
    pub fn record() -> Statements {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            tracing::subscriber::set_global_default(Recorder)
                .expect("no other global tracing subscriber in a binary that counts statements");
        });
        SEEN.with(|seen| *seen.borrow_mut() = Some(Vec::new()));
        Statements {
            _not_send: PhantomData,
        }
    }

    /// The statements sent since the last call (or since recording began),
    /// each as its SQL text.
    pub fn take(&self) -> Vec<String> {
        SEEN.with(|seen| seen.borrow_mut().as_mut().map(std::mem::take))
            .unwrap_or_default()
    }
}

impl Drop for Statements {
    fn drop(&mut self) {
        SEEN.with(|seen| seen.borrow_mut().take());
    }
}

struct Recorder;

impl Subscriber for Recorder {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        // Asked again at every event: whether its thread records changes.
        if metadata.target() == TARGET {
            Interest::sometimes()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target() == TARGET && SEEN.with(|seen| seen.borrow().is_some())
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        // Never called for a span it does not enable, and it enables none.
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        if !self.enabled(event.metadata()) {
            return;
        }
        let mut sql = Sql::default();
        event.record(&mut sql);
        // sqlx leaves `db.statement` empty when the summary (its first four
        // words) is the whole statement.
        let text = if sql.statement.is_empty() {
            sql.summary
        } else {
            sql.statement
        };
        SEEN.with(|seen| {
            if let Some(seen) = seen.borrow_mut().as_mut() {
                seen.push(text.trim().to_owned());
            }
        });
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}
#[derive(Default)]
struct Sql {
    summary: String,
    statement: String,
}

impl Visit for Sql {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "summary" => self.summary = value.to_owned(),
            "db.statement" => self.statement = value.to_owned(),
            _ => {}
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}
