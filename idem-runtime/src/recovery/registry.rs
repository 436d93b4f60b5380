//! Which function resumes which scope: the registry a [`Worker`](super::Worker)
//! consults, filled at start-up with one line per function.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::CodecError;

/// How a recovered call ended, as far as the worker needs to know from the
/// function itself (the rest it learns from the call's own report).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// `Ok`: the flow finished (ran, or replayed what another owner stored).
    Ok,
    /// `Err`: a final error stored, a retryable one, or idem's own.
    Err,
}

/// A recovered call, decoded and ready to run.
#[doc(hidden)]
pub type Prepared = Pin<Box<dyn Future<Output = Ended> + Send + 'static>>;

type Prepare = dyn Fn(&[u8]) -> Result<Prepared, CodecError> + Send + Sync;

/// A function made resumable by `#[idempotent(…, recover)]`, ready to
/// register: what [`recoverable!`](crate::recoverable) returns.
///
/// It decodes the stored arguments into the function's parameters and calls
/// the function exactly as a caller would (for a method, on the service value
/// given at registration), so its own claim takes the abandoned record over.
#[derive(Clone)]
pub struct Recoverable {
    scope: &'static str,
    prepare: Arc<Prepare>,
}

impl Recoverable {
    /// What the expansion of `recover` builds; use [`recoverable!`](crate::recoverable).
    #[doc(hidden)]
    pub fn new(
        scope: &'static str,
        prepare: impl Fn(&[u8]) -> Result<Prepared, CodecError> + Send + Sync + 'static,
    ) -> Recoverable {
        Recoverable {
            scope,
            prepare: Arc::new(prepare),
        }
    }

    /// The scope it resumes.
    pub fn scope(&self) -> &'static str {
        self.scope
    }

    /// The call for the stored arguments' JSON, or why they do not decode
    /// into the function's parameters.
    pub(crate) fn prepare(&self, json: &[u8]) -> Result<Prepared, CodecError> {
        (self.prepare)(json)
    }
}

impl fmt::Debug for Recoverable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recoverable")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// The functions a [`Worker`](super::Worker) may run, by scope.
///
/// Register every `recover` function whose records live in the worker's
/// store, once, at start-up. A claim abandoned in a scope with no function
/// here is reported (a log line, the `idem_recovery_unregistered` gauge,
/// [`WorkerStats::unregistered`](super::WorkerStats)), never run and never
/// skipped silently; another service's worker on the same store may own it.
///
/// ```
/// use idem_runtime::recovery::Recovery;
/// use idem_runtime::{idempotent, recoverable};
///
/// # #[derive(Debug)] struct AppError;
/// # impl From<idem_runtime::Error> for AppError { fn from(_: idem_runtime::Error) -> Self { AppError } }
/// #[idempotent(scope = "orders.create", key = "order_no", recover)]
/// async fn create_order(order_no: String, qty: u32) -> Result<u64, AppError> {
///     Ok(u64::from(qty))
/// }
///
/// let recovery = Recovery::new().register(recoverable!(create_order));
/// assert_eq!(recovery.scopes().collect::<Vec<_>>(), ["orders.create"]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Recovery {
    by_scope: BTreeMap<&'static str, Recoverable>,
}

impl Recovery {
    /// An empty registry.
    pub fn new() -> Recovery {
        Recovery::default()
    }

    /// Adds a function.
    ///
    /// # Panics
    ///
    /// When another function was registered for the same scope: two
    /// functions sharing a scope share their keys, and the worker could not
    /// tell which one a record belongs to.
    pub fn register(mut self, function: Recoverable) -> Recovery {
        let scope = function.scope;
        if self.by_scope.insert(scope, function).is_some() {
            panic!(
                "idem recovery: two functions registered for scope `{scope}`; each scope needs exactly one"
            );
        }
        self
    }

    /// The scopes registered.
    pub fn scopes(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.by_scope.keys().copied()
    }

    pub(crate) fn get(&self, scope: &str) -> Option<&Recoverable> {
        self.by_scope.get(scope)
    }
}
