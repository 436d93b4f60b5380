//! What a call's result and errors must be to be stored, and how they are:
//! [`StoredForm`] (a result's stored bytes, JSON for serde types under the
//! marker [`ViaSerde`]), the bounds whose diagnostics name what is missing
//! ([`Cacheable`], [`StorableError`], [`FromIdemError`]), and the policies
//! that decide whether an `Err` is stored as final or releases the claim.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::Error;

/// A result type that can be stored and replayed.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cached as the result of an idempotent call: it is not `Serialize + DeserializeOwned`",
    label = "the result is stored and replayed to duplicates",
    note = "the `T` of `Result<T, E>` must implement `Serialize` and `DeserializeOwned` (derive `serde::Serialize` and `serde::Deserialize`)"
)]
pub trait Cacheable: Serialize + DeserializeOwned {}
impl<T: Serialize + DeserializeOwned> Cacheable for T {}

/// How a result is written to a record and read back: its stored form.
///
/// Every `Serialize + DeserializeOwned` type is stored as its JSON (marker
/// [`ViaSerde`]). Types that are not serde types themselves but wrap one get
/// their own impl under another marker, so the impls never overlap: with the
/// `axum` feature, `Json<T>` and `(StatusCode, Json<T>)` (see
/// `idem_runtime::http`). The marker is inferred: callers never name it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cached as the result of an idempotent call: it is not `Serialize + DeserializeOwned`",
    label = "the result is stored and replayed to duplicates",
    note = "the `T` of `Result<T, E>` must implement `Serialize` and `DeserializeOwned` (derive `serde::Serialize` and `serde::Deserialize`)"
)]
pub trait StoredForm<M>: Sized {
    /// The bytes stored in the record.
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error>;
    /// The value rebuilt from a record, for a duplicate.
    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error>;
    /// Exactly [`to_stored`](Self::to_stored)'s bytes, borrowed when the
    /// value already holds them (the HTTP layer encodes the response before
    /// the protocol stores it), so a completion does not copy them once
    /// more. The protocol calls it wherever it does not keep the bytes.
    #[doc(hidden)]
    fn stored_bytes(&self) -> Result<std::borrow::Cow<'_, [u8]>, serde_json::Error> {
        self.to_stored().map(std::borrow::Cow::Owned)
    }
}

/// The [`StoredForm`] marker of serde types: their JSON.
#[derive(Debug)]
pub enum ViaSerde {}

impl<T: Serialize + DeserializeOwned> StoredForm<ViaSerde> for T {
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// An error type `final_err` can store: a final error is replayed to duplicates.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored as a final error: it is not `Serialize + DeserializeOwned`",
    label = "with `final_err`, an error it calls final is stored and replayed to duplicates",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}` (skip what cannot be stored with `#[serde(skip)]`), or drop `final_err` so every `Err` releases the key for a retry"
)]
pub trait StorableError: Serialize + DeserializeOwned {}
impl<E: Serialize + DeserializeOwned> StorableError for E {}

/// An error type the protocol can report through.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot carry idempotency errors: it does not implement `From<idem_runtime::Error>`",
    label = "in-progress, key reuse and store failures reach the caller as this type",
    note = "implement `From<idem_runtime::Error>` for `{Self}` (for example a `#[from] idem_runtime::Error` variant with thiserror)"
)]
pub trait FromIdemError: From<Error> {}
impl<E: From<Error>> FromIdemError for E {}

/// How errors of the body are treated.
pub(crate) trait ErrorPolicy<E> {
    /// `Some(encoded)` stores the error as a final outcome; `None` releases the claim.
    fn keep(&self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>>;
    /// Decodes a stored final error.
    fn restore(&self, payload: &[u8]) -> Result<E, serde_json::Error>;
}

pub(crate) struct ReleaseAll;

impl<E> ErrorPolicy<E> for ReleaseAll {
    fn keep(&self, _: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        None
    }

    fn restore(&self, _: &[u8]) -> Result<E, serde_json::Error> {
        // Only reachable if this call site once marked errors final and no longer
        // does: the stored error cannot be rebuilt without a codec for `E`.
        Err(serde::de::Error::custom(
            "a final error was stored, but this call site no longer keeps final errors",
        ))
    }
}

pub(crate) struct KeepFinal<E>(pub(super) fn(&E) -> bool);

impl<E: Serialize + DeserializeOwned> ErrorPolicy<E> for KeepFinal<E> {
    fn keep(&self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        (self.0)(err).then(|| serde_json::to_vec(err))
    }

    fn restore(&self, payload: &[u8]) -> Result<E, serde_json::Error> {
        serde_json::from_slice(payload)
    }
}
