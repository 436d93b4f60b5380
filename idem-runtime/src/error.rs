//! The one error type every annotated call can fail with, besides the user's own.

use std::fmt;
use std::time::Duration;

/// Why an idempotent call did not run its body or could not return its result.
///
/// Annotated functions return the user's own error type `E`; the expansion
/// converts through `E: From<idem_runtime::Error>`, so every variant reaches the
/// caller in the type it already handles.
///
/// ```
/// use idem_runtime::Error;
///
/// #[derive(Debug)]
/// enum AppError {
///     Idem(Error),
/// }
///
/// impl From<Error> for AppError {
///     fn from(e: Error) -> Self {
///         AppError::Idem(e)
///     }
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another call with the same key holds a live claim. Retry after
    /// `retry_after` (an HTTP layer answers 409 with `Retry-After`; a consumer
    /// redelivers later).
    #[error(
        "`{scope}`: a call with the same idempotency key is still in progress; retry in {retry_after:?}"
    )]
    InProgress {
        /// The scope of the call.
        scope: String,
        /// How long the current claim's lease still holds.
        retry_after: Duration,
    },

    /// The key was used before with a different payload fingerprint: this is a
    /// different request wearing an old key, and replaying the old result to it
    /// would be wrong.
    #[error(
        "`{scope}`: this idempotency key was already used with a different payload; a new request needs a new key"
    )]
    KeyReuse {
        /// The scope of the call.
        scope: String,
    },

    /// A stored result could not be decoded into the current result type (the
    /// type changed since it was stored), or a result could not be encoded.
    #[error(
        "`{scope}`: the stored result does not match the current result type ({source}); evict the record or keep the type backward compatible"
    )]
    Codec {
        /// The scope of the call.
        scope: String,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },

    /// The first call's result was larger than the store's cap, so it was not
    /// stored; duplicates get this error instead of a second execution.
    #[error(
        "`{scope}`: the result was {size} bytes, over the store's cap of {limit} bytes, so it was not stored; return something smaller (an id, a status) or raise the cap"
    )]
    ResultTooLarge {
        /// The scope of the call.
        scope: String,
        /// The encoded size of the result.
        size: usize,
        /// The store's cap.
        limit: usize,
    },

    /// The store failed or could not be reached. The body did not run.
    #[error(transparent)]
    Store(#[from] StoreError),

    /// No store was passed with `store = …` and none was installed with
    /// [`crate::install`].
    #[error(
        "no idempotency store: call `idem_runtime::install(store)` at start-up or pass `store = …` to the attribute"
    )]
    NoStore,
}

/// A failure inside a store: the backend, where it was, and what went wrong.
///
/// The location never contains a password: stores build it from the parts of
/// their connection options that are safe to log.
///
/// ```
/// use idem_runtime::StoreError;
///
/// let e = StoreError::new("sqlite", "orders.db", std::io::Error::other("disk full"));
/// assert_eq!(e.to_string(), "idempotency store sqlite (orders.db): disk full");
/// ```
#[derive(Debug)]
pub struct StoreError {
    backend: &'static str,
    location: String,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl StoreError {
    /// Wraps a backend error.
    pub fn new(
        backend: &'static str,
        location: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        StoreError {
            backend,
            location: location.into(),
            source: source.into(),
        }
    }

    /// The backend's name (`"memory"`, `"sqlite"`, …).
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// Where the backend lives (a file, a host and port), without credentials.
    pub fn location(&self) -> &str {
        &self.location
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "idempotency store {} ({}): {}",
            self.backend, self.location, self.source
        )
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}
