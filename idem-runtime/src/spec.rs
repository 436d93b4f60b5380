//! The fixed settings of one idempotent call site: what the attributes build
//! as a constant and what code without the macros passes to
//! [`crate::protocol::execute`].

use std::time::Duration;

use crate::site::CallSite;

/// What kind of call a [`Spec`] describes: it picks metric names and defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A request handler or any other call.
    Call,
    /// A message consumer: `InProgress` means "redeliver later".
    Consumer,
    /// A step inside a flow.
    Step,
}

/// The fixed settings of one idempotent call site.
///
/// The attribute builds it as a constant; code that does not use the macros
/// builds it by hand and calls [`crate::protocol::execute`].
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::protocol::{Kind, Spec};
///
/// const SPEC: Spec = Spec::new("orders::create", Kind::Call)
///     .ttl(Duration::from_secs(24 * 3600))
///     .lease(Duration::from_secs(30));
/// assert_eq!(SPEC.wait, None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// Built with `Spec::new` and its setters, so a setting added later breaks no
// caller (the macro expansion included).
#[non_exhaustive]
pub struct Spec {
    /// The namespace of the keys (default: module path and function name).
    pub scope: &'static str,
    /// What kind of call this is.
    pub kind: Kind,
    /// How long a record lives: at least the longest retry or redelivery window.
    pub ttl: Duration,
    /// How long a PROCESSING claim holds without a heartbeat.
    pub lease: Duration,
    /// How long a duplicate waits for the first call before `InProgress`.
    pub wait: Option<Duration>,
    /// A consumer's event type (the attribute's `event`): the first part of
    /// its key, and with `scope` the labels of the consumer runner's metrics.
    pub event: Option<&'static str>,
    /// What the call site keeps across calls (the attribute's own `static`).
    pub(crate) site: Option<&'static CallSite>,
}

impl Spec {
    /// A spec with the defaults for `kind`: ttl 24 h (7 d for consumers),
    /// lease 30 s, no waiting.
    pub const fn new(scope: &'static str, kind: Kind) -> Spec {
        let ttl = match kind {
            Kind::Consumer => Duration::from_secs(7 * 24 * 3600),
            Kind::Call | Kind::Step => Duration::from_secs(24 * 3600),
        };
        Spec {
            scope,
            kind,
            ttl,
            lease: Duration::from_secs(30),
            wait: None,
            event: None,
            site: None,
        }
    }

    /// Sets the record lifetime.
    pub const fn ttl(mut self, ttl: Duration) -> Spec {
        self.ttl = ttl;
        self
    }

    /// Sets the lease.
    pub const fn lease(mut self, lease: Duration) -> Spec {
        self.lease = lease;
        self
    }

    /// Makes duplicates wait up to `wait` for the first call's result.
    pub const fn wait(mut self, wait: Duration) -> Spec {
        self.wait = Some(wait);
        self
    }

    /// Names the consumer's event type. It labels the runner's metrics; it
    /// does not enter the key (the attribute adds it to the key itself).
    pub const fn event(mut self, event: &'static str) -> Spec {
        self.event = Some(event);
        self
    }

    /// Keeps what the call site needs on every call in `site` (the
    /// attribute gives each annotated function a `static` one).
    #[doc(hidden)]
    pub const fn site(mut self, site: &'static CallSite) -> Spec {
        self.site = Some(site);
        self
    }

    /// Takes the call site every caller of this scope and kind built at run
    /// time shares (see `site::shared_site`): once, when the caller is
    /// built, so its calls look nothing up.
    #[cfg(feature = "http")]
    pub(crate) fn with_shared_site(mut self) -> Spec {
        self.site = Some(crate::site::shared_site(self.scope, self.kind as u8));
        self
    }
}
