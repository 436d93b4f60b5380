//! What the explorer reports: how many schedules ran, per kind, and the
//! first that went wrong, as what happened in order.

use std::fmt;
use std::time::Duration;

/// What the explorer found: read it with `{}` or [`Report::assert_passed`].
#[derive(Debug)]
pub struct Report {
    pub(super) explored: usize,
    pub(super) skipped: usize,
    pub(super) by_kind: Vec<(&'static str, usize)>,
    pub(super) failure: Option<Failure>,
    pub(super) clean_ops: Vec<String>,
    /// What the step history check said, when asked for.
    pub(super) history: Option<String>,
    pub(super) finished_by_worker: usize,
    pub(super) elapsed: Duration,
}

/// The first schedule that went wrong.
#[derive(Debug)]
pub struct Failure {
    pub(super) schedule: String,
    pub(super) events: Vec<String>,
    pub(super) problem: String,
}

impl Report {
    pub(super) fn count(&mut self, kind: &'static str) {
        match self.by_kind.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => self.by_kind.push((kind, 1)),
        }
    }

    /// How many schedules ran (the failing one included).
    pub fn explored(&self) -> usize {
        self.explored
    }

    /// How many schedules ran per fault kind, in the order first tried.
    pub fn by_kind(&self) -> &[(&'static str, usize)] {
        &self.by_kind
    }

    /// How many cut-off calls the recovery worker finished (with
    /// [`Explorer::recover_with`](super::Explorer::recover_with)).
    pub fn finished_by_the_worker(&self) -> usize {
        self.finished_by_worker
    }

    /// Whether every schedule passed.
    pub fn passed(&self) -> bool {
        self.failure.is_none()
    }

    /// The first failing schedule, if any.
    pub fn failure(&self) -> Option<&Failure> {
        self.failure.as_ref()
    }

    /// Panics with the report unless every schedule passed.
    pub fn assert_passed(&self) {
        assert!(self.passed(), "{self}");
    }
}

impl Failure {
    /// The schedule, in a sentence.
    pub fn schedule(&self) -> &str {
        &self.schedule
    }

    /// What went wrong (a wrong value, an undocumented error, the
    /// snapshot's difference).
    pub fn problem(&self) -> &str {
        &self.problem
    }

    /// What happened, in order: the callers' store operations and what they
    /// returned, the explorer's moves.
    pub fn events(&self) -> &[String] {
        &self.events
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.failure {
            None => write!(
                f,
                "idem explorer: {} schedules passed in {:.2?} ({} fault points",
                self.explored,
                self.elapsed,
                self.clean_ops.len()
            )?,
            Some(failure) => {
                writeln!(f, "idem explorer: FAILED at {}", failure.schedule)?;
                if !failure.events.is_empty() {
                    writeln!(f, "what happened:")?;
                }
                for (i, e) in failure.events.iter().enumerate() {
                    writeln!(f, "  {:>2}. {e}", i + 1)?;
                }
                writeln!(f, "problem: {}", failure.problem)?;
                write!(
                    f,
                    "({} schedules explored in {:.2?} before it; {} fault points",
                    self.explored.saturating_sub(1),
                    self.elapsed,
                    self.clean_ops.len()
                )?;
            }
        }
        for (kind, n) in &self.by_kind {
            write!(f, "; {kind}: {n}")?;
        }
        if self.finished_by_worker > 0 {
            write!(
                f,
                "; calls the recovery worker finished: {}",
                self.finished_by_worker
            )?;
        }
        if self.skipped > 0 {
            write!(f, "; {} skipped, the point not reached", self.skipped)?;
        }
        write!(f, ")")?;
        if let Some(note) = &self.history {
            write!(f, "; {note}")?;
        }
        Ok(())
    }
}
