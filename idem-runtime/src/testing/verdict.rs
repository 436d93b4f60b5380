//! What the explorer makes of what a caller got: the clean value, the clean
//! final error, an error idem documents there, or something wrong.

use std::fmt::{self, Debug};

use super::faults::FaultStore;
use crate::observe::CallOutcome;
use crate::protocol::report::Noted;

/// What a caller got, and what idem said its call did.
pub(super) struct Got<T, E> {
    pub(super) out: Result<T, E>,
    pub(super) noted: Option<Noted>,
}

/// How a schedule went wrong.
pub(super) struct Wrong(pub(super) String);

/// Checks what a caller got: `Ok(true)` for the clean value, `Ok(false)` for
/// an error idem documents here, `Err` otherwise. A stale owner may also get
/// the error its own body saw once its lease was gone.
pub(super) fn judge<T: PartialEq + Debug, E: Debug>(
    caller: u32,
    got: Got<T, E>,
    value: &Clean<T>,
    store: &FaultStore,
    stale: bool,
) -> Result<bool, Wrong> {
    match (got.out, value) {
        (Ok(v), Clean::Value(clean)) if &v == clean => {
            store.note(format!("call {caller} returns the clean run's value"));
            Ok(true)
        }
        (Ok(v), _) => Err(Wrong(format!(
            "call {caller} returned Ok({v:?}); the clean run returned {value:?}"
        ))),
        (Err(e), Clean::FinalError(clean)) if &format!("{e:?}") == clean => {
            store.note(format!("call {caller} returns the clean run's final error"));
            Ok(true)
        }
        (Err(e), _) if documented(got.noted) || stale => {
            store.note(format!("call {caller} returns {e:?} ({})", said(got.noted)));
            Ok(false)
        }
        (Err(e), _) => Err(Wrong(format!(
            "call {caller} returned {e:?} ({}), not an error idem documents for a duplicate",
            said(got.noted)
        ))),
    }
}

/// A retry may fail with any error (the fault may leave it work to wait
/// for); only a wrong value is wrong at once.
pub(super) fn judge_retry<T: PartialEq + Debug, E: Debug>(
    caller: u32,
    got: Got<T, E>,
    value: &Clean<T>,
    store: &FaultStore,
) -> Result<bool, Wrong> {
    match (got.out, value) {
        (Err(e), Clean::FinalError(clean)) if &format!("{e:?}") != clean => {
            store.note(format!("call {caller} returns {e:?} ({})", said(got.noted)));
            Ok(false)
        }
        (Err(e), Clean::Value(_)) => {
            store.note(format!("call {caller} returns {e:?} ({})", said(got.noted)));
            Ok(false)
        }
        (out, _) => judge(
            caller,
            Got {
                out,
                noted: got.noted,
            },
            value,
            store,
            false,
        ),
    }
}

/// What the clean run ended with.
pub(super) enum Clean<T> {
    Value(T),
    /// A final error idem recorded, as `{:?}` shows it.
    FinalError(String),
}

impl<T: Debug> Debug for Clean<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Clean::Value(v) => write!(f, "Ok({v:?})"),
            Clean::FinalError(e) => write!(f, "Err({e})"),
        }
    }
}

fn documented(noted: Option<Noted>) -> bool {
    matches!(
        noted,
        Some(Noted::Call {
            outcome: CallOutcome::InProgress | CallOutcome::KeyReuse | CallOutcome::LeaseLost,
            ..
        }) | Some(Noted::Fenced { .. })
    )
}

pub(super) fn said(noted: Option<Noted>) -> String {
    match noted {
        Some(Noted::Call { outcome, .. }) => format!("idem: {outcome:?}"),
        Some(Noted::Fenced { .. }) => "idem: fenced off by a newer owner".to_owned(),
        Some(Noted::RolledBack) => "idem: the transaction rolled back".to_owned(),
        None => "no idempotent call reported".to_owned(),
    }
}

/// The lines of `now` that differ from `clean`.
pub(super) fn diff(clean: &str, now: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (clean.lines().collect(), now.lines().collect());
    if a.len() != b.len() {
        return format!("clean run:\n{clean}\nthis run:\n{now}");
    }
    a.iter()
        .zip(&b)
        .filter(|(x, y)| x != y)
        .map(|(x, y)| format!("  clean run: {}\n  this run:  {}", x.trim(), y.trim()))
        .collect::<Vec<_>>()
        .join("\n")
}
