//! What a call site keeps across its calls, so a call finds its metric keys
//! and its scope's moving average without a lookup: the attribute's hidden
//! `static` per annotated function, and one shared per scope for callers
//! built at run time (the HTTP layer).

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;

/// How many metric keys a call site keeps: one per call outcome and the
/// claim's latency (`observe.rs` checks the count).
pub(crate) const SITE_KEYS: usize = 12;

/// What one call site keeps across its calls: the metric keys they name and
/// the moving average of how long they take (for `InProgress` hints). The
/// attribute makes one per annotated function, as a `static` beside its
/// `Spec`, so a call finds them with no lookup; a `Spec` built by hand has
/// none, and a call finds the same things by its scope (a map per thread).
///
/// ```
/// use idem_runtime::__private::{CallSite, Kind, Spec};
///
/// static SITE: CallSite = CallSite::new();
/// static SPEC: Spec = Spec::new("doc::site", Kind::Call).site(&SITE);
/// ```
#[doc(hidden)]
pub struct CallSite {
    pub(crate) keys: [OnceLock<metrics::Key>; SITE_KEYS],
    /// The moving average of the scope's calls (shared by every site and
    /// `Spec` of the scope), found once.
    pub(crate) typical: OnceLock<&'static AtomicU64>,
}

impl CallSite {
    /// A site with nothing found yet: each slot fills at its first use.
    #[allow(clippy::new_without_default)]
    pub const fn new() -> CallSite {
        CallSite {
            keys: [const { OnceLock::new() }; SITE_KEYS],
            typical: OnceLock::new(),
        }
    }
}

impl fmt::Debug for CallSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CallSite")
    }
}

// One call site is equal only to itself: two `Spec`s are the same settings
// of the same site.
impl PartialEq for CallSite {
    fn eq(&self, other: &CallSite) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for CallSite {}

/// The call site shared by everything in this process that runs calls of
/// `scope` and `kind` (a `Kind`'s discriminant: `Spec::with_shared_site`
/// passes it, so this module needs nothing of `spec`'s) without an
/// attribute's own `static` (the HTTP layer): asked for once when such a
/// caller is built, never per call. What a site caches depends on the scope
/// and kind alone (the keys' labels, the scope's average), so callers of
/// one scope can share it. One is made per scope and kind and kept for the
/// life of the process, as the attribute's are and as the per-scope
/// averages already are.
#[cfg(feature = "http")]
pub(crate) fn shared_site(scope: &'static str, kind: u8) -> &'static CallSite {
    use std::collections::BTreeMap;
    use std::sync::{Mutex, PoisonError};

    static SITES: Mutex<BTreeMap<(&'static str, u8), &'static CallSite>> =
        Mutex::new(BTreeMap::new());
    // Only an allocation happens under the lock: the map is whole after any
    // panic.
    let mut sites = SITES.lock().unwrap_or_else(PoisonError::into_inner);
    sites
        .entry((scope, kind))
        .or_insert_with(|| Box::leak(Box::new(CallSite::new())))
}

#[cfg(all(test, feature = "http"))]
mod tests {
    use super::*;

    #[test]
    fn one_shared_site_per_scope_and_kind() {
        let a = shared_site("site::tests::a", 0);
        assert!(std::ptr::eq(a, shared_site("site::tests::a", 0)));
        // The same text from another allocation is the same scope.
        let again: &'static str = String::from("site::tests::a").leak();
        assert!(std::ptr::eq(a, shared_site(again, 0)));
        assert!(!std::ptr::eq(a, shared_site("site::tests::b", 0)));
        assert!(!std::ptr::eq(a, shared_site("site::tests::a", 2)));
    }
}
