//! What a call's result and errors must be to be stored, and how they are:
//! [`StoredForm`] (a result's stored bytes, JSON for serde types under the
//! marker [`ViaSerde`]), the bounds whose diagnostics name what is missing
//! ([`Cacheable`], [`StorableError`], [`FromIdemError`]), what a `final_err`
//! function answers ([`FinalVerdict`]: `bool`, or the stored form of the
//! final errors), and the policies that decide whether an `Err` is stored as
//! final or releases the claim.

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

/// What a `final_err` function answers for an error: whether it is final,
/// and what of it is stored.
///
/// - `bool`: `true` stores the error itself, so `E` must be
///   `Serialize + DeserializeOwned`, and a duplicate gets it back decoded.
/// - `Option<S>`: `Some(stored)` marks the error final and stores `stored`,
///   a serde type of the user's (`Declined { reason }`); a duplicate gets
///   `E::from(stored)` back. `E` itself need not be serde: an error type that
///   wraps `sqlx::Error` or `reqwest::Error` names the part of its final
///   errors worth replaying.
///
/// ```
/// use idem_runtime::idempotent;
///
/// /// The stored form of the final errors: what a duplicate is told.
/// #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
/// pub struct Declined { reason: String }
///
/// #[derive(Debug)]
/// pub enum PayError {
///     Declined(Declined),
///     Idem(idem_runtime::Error), // not serde: it is never final
/// }
/// impl From<idem_runtime::Error> for PayError {
///     fn from(e: idem_runtime::Error) -> Self { PayError::Idem(e) }
/// }
/// impl From<Declined> for PayError {
///     fn from(d: Declined) -> Self { PayError::Declined(d) }
/// }
/// impl PayError {
///     fn declined(&self) -> Option<Declined> {
///         match self { PayError::Declined(d) => Some(d.clone()), _ => None }
///     }
/// }
///
/// #[idempotent(key = "card", final_err = PayError::declined)]
/// async fn pay(card: String) -> Result<u64, PayError> {
///     Err(PayError::Declined(Declined { reason: format!("{card}: insufficient funds") }))
/// }
/// ```
pub trait FinalVerdict<E> {
    /// `Some(encoded)` when the error is final: the bytes the record keeps.
    fn stored(self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>>;
    /// The final error a duplicate gets back from the record's bytes.
    fn restore(payload: &[u8]) -> Result<E, serde_json::Error>;
}

impl<E: Serialize + DeserializeOwned> FinalVerdict<E> for bool {
    fn stored(self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        self.then(|| serde_json::to_vec(err))
    }

    fn restore(payload: &[u8]) -> Result<E, serde_json::Error> {
        serde_json::from_slice(payload)
    }
}

impl<S: Serialize + DeserializeOwned, E: From<S>> FinalVerdict<E> for Option<S> {
    fn stored(self, _: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        self.map(|stored| serde_json::to_vec(&stored))
    }

    fn restore(payload: &[u8]) -> Result<E, serde_json::Error> {
        serde_json::from_slice::<S>(payload).map(E::from)
    }
}

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

/// A `final_err` function: `Fn(&E) -> O` for a [`FinalVerdict`] `O`, named
/// without its `O`, so that the futures generic over it do not capture `O`.
pub trait FinalErrFn<E>: Clone {
    /// `Some(encoded)` when `err` is final.
    fn keep(&self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>>;
    /// The final error a duplicate gets back.
    fn restore(&self, payload: &[u8]) -> Result<E, serde_json::Error>;
}

impl<E, O, F> FinalErrFn<E> for F
where
    F: Fn(&E) -> O + Clone,
    O: FinalVerdict<E>,
{
    fn keep(&self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        self(err).stored(err)
    }

    fn restore(&self, payload: &[u8]) -> Result<E, serde_json::Error> {
        O::restore(payload)
    }
}

/// `final_err`'s function as the body's error policy.
#[derive(Clone, Copy)]
pub(crate) struct KeepFinal<F>(pub(super) F);

impl<E, F: FinalErrFn<E>> ErrorPolicy<E> for KeepFinal<F> {
    fn keep(&self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        self.0.keep(err)
    }

    fn restore(&self, payload: &[u8]) -> Result<E, serde_json::Error> {
        self.0.restore(payload)
    }
}
