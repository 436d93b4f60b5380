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
//! The recorder is the calling thread's default subscriber only: tests in the
//! same binary run on other threads, and their statements are not seen. So
//! the code under count must run on this thread, i.e. in a `current_thread`
//! runtime (plain `#[tokio::test]`) and not in a spawned task of a
//! multi-threaded one.

use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::DefaultGuard;
use tracing::{Event, Metadata, Subscriber};

const TARGET: &str = "sqlx::query";

/// The statements sent on this thread while it is alive.
pub struct Statements {
    seen: Arc<Mutex<Vec<String>>>,
    _guard: DefaultGuard,
}

impl Statements {
    /// Starts recording on the calling thread.
    pub fn record() -> Statements {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let guard = tracing::subscriber::set_default(Recorder(seen.clone()));
        Statements {
            seen,
            _guard: guard,
        }
    }

    /// The statements sent since the last call (or since recording began),
    /// each as its SQL text.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

struct Recorder(Arc<Mutex<Vec<String>>>);

impl Subscriber for Recorder {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target() == TARGET
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        // Never called for a span it does not enable, and it enables none.
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        if event.metadata().target() != TARGET {
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
        self.0.lock().unwrap().push(text.trim().to_owned());
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
