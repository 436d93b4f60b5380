//! The faults the explorer tries and the schedules they make: where the
//! first call is held, and what happens then.

use super::faults::Hold;

/// Which faults the explorer tries (all of them unless narrowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Faults {
    pub(super) cut_offs: bool,
    pub(super) duplicates: bool,
    pub(super) stale_owners: bool,
}

impl Faults {
    /// Every kind.
    pub const ALL: Faults = Faults {
        cut_offs: true,
        duplicates: true,
        stale_owners: true,
    };
    /// Callers cut off before and after each store operation, then retried.
    pub const CUT_OFFS: Faults = Faults {
        cut_offs: true,
        duplicates: false,
        stale_owners: false,
    };
    /// A duplicate at each store operation, and one after the result.
    pub const DUPLICATES: Faults = Faults {
        cut_offs: false,
        duplicates: true,
        stale_owners: false,
    };
    /// A caller stalled past its lease at each store operation, then going on.
    pub const STALE_OWNERS: Faults = Faults {
        cut_offs: false,
        duplicates: false,
        stale_owners: true,
    };

    /// Both sets.
    pub const fn and(self, other: Faults) -> Faults {
        Faults {
            cut_offs: self.cut_offs || other.cut_offs,
            duplicates: self.duplicates || other.duplicates,
            stale_owners: self.stale_owners || other.stale_owners,
        }
    }
}

/// One schedule: where the first call is held and what happens then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Schedule {
    CutOff {
        op: usize,
        after: bool,
    },
    /// Cut off there, then a recovery worker's pass finishes the call.
    Recovered {
        op: usize,
        after: bool,
    },
    Duplicate {
        op: usize,
    },
    DuplicateAfterResult,
    StaleOwner {
        op: usize,
    },
}

impl Schedule {
    pub(super) fn kind(self) -> &'static str {
        match self {
            Schedule::CutOff { after: false, .. } => "cut off before a store operation",
            Schedule::CutOff { after: true, .. } => "cut off after a store operation",
            Schedule::Recovered { .. } => "cut off, then finished by the recovery worker",
            Schedule::Duplicate { .. } => "duplicate while the first call runs",
            Schedule::DuplicateAfterResult => "duplicate after the result is stored",
            Schedule::StaleOwner { .. } => "stale owner going on after a takeover",
        }
    }

    pub(super) fn hold(self) -> Option<Hold> {
        let (op, after) = match self {
            Schedule::CutOff { op, after } | Schedule::Recovered { op, after } => (op, after),
            Schedule::Duplicate { op } | Schedule::StaleOwner { op } => (op, false),
            Schedule::DuplicateAfterResult => return None,
        };
        Some(Hold {
            caller: 1,
            op,
            after,
        })
    }
}

/// The schedule, in a sentence, naming the operation it holds at.
pub(super) fn describe(schedule: Schedule, ops: &[String]) -> String {
    let at = |op: usize| ops.get(op).map_or("?", String::as_str);
    match schedule {
        Schedule::CutOff { op, after } => format!(
            "call 1 cut off {} its store operation #{} ({})",
            if after { "after" } else { "before" },
            op + 1,
            at(op)
        ),
        Schedule::Recovered { op, after } => format!(
            "call 1 cut off {} its store operation #{} ({}), then a recovery worker's pass",
            if after { "after" } else { "before" },
            op + 1,
            at(op)
        ),
        Schedule::Duplicate { op } => format!(
            "a duplicate while call 1 is held before its store operation #{} ({})",
            op + 1,
            at(op)
        ),
        Schedule::DuplicateAfterResult => "a duplicate after call 1 returned".to_owned(),
        Schedule::StaleOwner { op } => format!(
            "call 1 stalls past its lease before its store operation #{} ({}), another takes over, then call 1 goes on",
            op + 1,
            at(op)
        ),
    }
}
