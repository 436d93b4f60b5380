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
        /// When the first call's result is likely ready: from how long calls
        /// of this scope took in this process and, when the first call runs
        /// here, how long it has run; never past the claim's remaining lease
        /// (then the claim is decided either way). Not the remaining lease
        /// itself, which would send a duplicate of a 300 ms call away for 29 s.
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
        /// What went wrong, without the data it went wrong on.
        #[source]
        source: CodecError,
    },

    /// The call's lease was taken over by another caller while its body was
    /// still running (it stalled past the lease), so it starts no new step: the
    /// caller that took over runs the flow, and this one's completion would be
    /// fenced off anyway.
    #[error(
        "`{scope}`: this call lost its lease to another caller while it ran, so it goes no further (no new step, no give-up, no compensation); the newer owner finishes the flow"
    )]
    LeaseLost {
        /// The scope of the step, give-up or compensation that did not start.
        scope: String,
    },

    /// An earlier run of this flow gave up with a final error and started
    /// compensating its finished steps, so no step runs forward any more: the
    /// flow only finishes its compensations and returns that final error.
    #[error(
        "`{scope}`: the flow gave up with a final error and is compensating its finished steps, so this step does not run"
    )]
    GaveUp {
        /// The step that did not run.
        scope: String,
    },

    /// A compensation failed. The flow's claim is released, so a retry of the
    /// call resumes the compensations: the finished ones replay, this one runs
    /// again.
    #[error(
        "`{scope}`: compensation `{scope}` of step `{step}` failed ({message}); the call was released so a retry resumes the compensations"
    )]
    CompensationFailed {
        /// The compensation that failed.
        scope: String,
        /// The step it compensates.
        step: String,
        /// The compensation's error, as its `Debug` output.
        message: String,
    },

    /// `tx = …` named a connection that is not inside a transaction. In
    /// autocommit the claim would commit at once with nothing renewing its
    /// lease while the body runs, so a slow body could be taken over while
    /// alive and run twice.
    #[error(
        "`{scope}`: `tx = …` needs a connection inside a transaction: pass the `sqlx::Transaction` from `begin()` (or use `store = …`, which renews its lease)"
    )]
    NotInTransaction {
        /// The scope of the call.
        scope: String,
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

    /// A recovery worker ran a call with its stored arguments, and the call
    /// derived another key from them than the abandoned record's: the key's
    /// segments, the scope or the key secret changed since the call was made.
    /// Nothing was claimed and the body did not run; the worker parks the
    /// record for an operator.
    #[error(
        "`{scope}`: the stored arguments of a recovered call derive another key than its record's (the key's segments, the scope or the key secret changed), so it did not run"
    )]
    RecoveryMismatch {
        /// The scope of the call.
        scope: String,
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

/// Why stored bytes did not decode (or a result did not encode), reduced to
/// serde's category and position.
///
/// serde's own messages quote the offending value (`invalid type: string
/// "jane.doe@example.com"`); stored results hold customers' data, and errors
/// end up in logs, so the value is dropped.
///
/// ```
/// use idem_runtime::CodecError;
///
/// let e = serde_json::from_str::<u64>(r#""jane.doe@example.com""#).unwrap_err();
/// let safe = CodecError::from(e);
/// assert!(!safe.to_string().contains("jane"));
/// assert_eq!(safe.to_string(), "a value of another type or shape at line 1, column 22");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecError {
    category: serde_json::error::Category,
    line: usize,
    column: usize,
    encoding: bool,
}

impl CodecError {
    /// A result that did not encode: no position, only the category.
    pub(crate) fn encoding(e: &serde_json::Error) -> Self {
        CodecError {
            category: e.classify(),
            line: 0,
            column: 0,
            encoding: true,
        }
    }

    /// The first call's result did not encode (its record says so).
    pub(crate) fn unencodable() -> Self {
        CodecError {
            category: serde_json::error::Category::Data,
            line: 0,
            column: 0,
            encoding: true,
        }
    }

    /// Syntax, data (another type or shape), or end of input.
    pub fn category(&self) -> serde_json::error::Category {
        self.category
    }

    /// The line of the stored JSON where decoding stopped (1-based; 0 when
    /// encoding failed).
    pub fn line(&self) -> usize {
        self.line
    }

    /// The column where decoding stopped (1-based; 0 when encoding failed).
    pub fn column(&self) -> usize {
        self.column
    }

    /// Whether this was a result that could not be encoded (rather than stored
    /// bytes that could not be decoded).
    pub fn is_encoding(&self) -> bool {
        self.encoding
    }
}

impl From<serde_json::Error> for CodecError {
    fn from(e: serde_json::Error) -> Self {
        CodecError {
            category: e.classify(),
            line: e.line(),
            column: e.column(),
            encoding: false,
        }
    }
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use serde_json::error::Category;
        if self.encoding {
            return f.write_str(match self.category {
                Category::Io => "the result could not be written as JSON (an I/O failure)",
                _ => "the result could not be encoded as JSON (its Serialize impl failed)",
            });
        }
        let what = match self.category {
            Category::Io => "an I/O failure",
            Category::Syntax => "bytes that are not valid JSON",
            Category::Data => "a value of another type or shape",
            Category::Eof => "JSON that ends early",
        };
        write!(f, "{what} at line {}, column {}", self.line, self.column)
    }
}

impl std::error::Error for CodecError {}

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
