//! What `#[idempotent(…, final_err = f)]` expands to: the checks of `f` and
//! of what it stores, each on the user's tokens, and the protocol call behind
//! the autoref dispatch of `diagnostics.rs`.
//!
//! `f` is a `fn(&E) -> bool` (the error itself is stored, so `E` must be
//! serde) or a `fn(&E) -> Option<S>` (the stored form `S` must be serde, and
//! `E: From<S>` rebuilds the error for a duplicate). Which one it is decides
//! which checks apply, so they go through [`FinalProbe`]: its methods of
//! [`StoresTheError`] apply only to a `bool` function, those of
//! [`StoresAForm`] only to an `Option<S>` one, and [`NoFinalCheck`] answers
//! every other call with nothing. Each check is split in two like the
//! result's (`Serialize` first, the rest only where it holds), so a type that
//! derives neither serde trait gets one error.
//!
//! The protocol call goes through [`DispatchFinal`], which carries `f`'s type
//! next to the return type: the checked [`WhenTypesHoldKeepingFinal`] applies
//! when every bound above holds, the bound-free [`AfterTypeError`] otherwise,
//! which only happens after one of these checks has failed.

// Hidden API reached only through `__private`: the module doc above is its doc.
#![allow(missing_docs)]

use std::future::Future;
use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::diagnostics::{AfterTypeError, Dispatch};
use crate::key::{Fingerprint, Key};
use crate::protocol::args::CallArgs;
use crate::protocol::{self, FinalErrFn, FromIdemError, Spec, StorableError, StoredForm};
use crate::store::Store;

/// What a `final_err` function may return.
#[diagnostic::on_unimplemented(
    message = "a `final_err` function returns `bool` or `Option<S>`, not `{Self}`",
    label = "`final_err` decides which errors are final and what of them is stored",
    note = "`fn(&E) -> bool`: the final errors are stored themselves (`E: Serialize + DeserializeOwned`)",
    note = "`fn(&E) -> Option<S>`: a final error is stored as `S` (`Serialize + DeserializeOwned`) and replayed as `E::from(s)`"
)]
pub trait FinalErrOutput {}
impl FinalErrOutput for bool {}
impl<S> FinalErrOutput for Option<S> {}

/// Checks the shape of `final_err`'s function on its tokens; the function
/// itself, unchanged.
#[inline]
pub fn final_err<E, O: FinalErrOutput, F: Fn(&E) -> O + Clone>(f: F) -> F {
    f
}

/// The `Serialize` half of [`StorableError`], checked first and alone.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored as a final error: it is not `Serialize + DeserializeOwned`",
    label = "with `final_err`, an error it calls final is stored and replayed to duplicates",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}` (skip what cannot be stored with `#[serde(skip)]`), or drop `final_err` so every `Err` releases the key for a retry",
    note = "an error type that wraps errors which are not serde (sqlx, reqwest, idem's own) stores the part of its final errors worth replaying instead: a `final_err` function returning `Option<S>`, where `S` is a serde type and `{Self}: From<S>`"
)]
pub trait StorableErrorSerialize: Serialize {}
// Not recommended: the error names this trait and its notes, not `Serialize`
// and the two hundred types that implement it.
#[diagnostic::do_not_recommend]
impl<E: Serialize + ?Sized> StorableErrorSerialize for E {}

/// The `Serialize` half of a stored form's check.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the stored form of a final error: it is not `Serialize + DeserializeOwned`",
    label = "`final_err` returns `Some({Self})` for a final error, and that value is stored and replayed to duplicates",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}`"
)]
pub trait StoredErrorFormSerialize: Serialize {}
#[diagnostic::do_not_recommend]
impl<S: Serialize> StoredErrorFormSerialize for S {}

/// A stored form of final errors: serde, both ways.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be the stored form of a final error: it is not `Serialize + DeserializeOwned`",
    label = "`final_err` returns `Some({Self})` for a final error, and that value is stored and replayed to duplicates",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}`"
)]
pub trait StoredErrorForm: Serialize + DeserializeOwned {}
impl<S: Serialize + DeserializeOwned> StoredErrorForm for S {}

/// The error type, rebuilt from its stored form for a duplicate.
#[diagnostic::on_unimplemented(
    message = "a final error stored as `{S}` cannot be replayed as `{Self}`: `{Self}` does not implement `From<{S}>`",
    label = "a duplicate gets the final error back as `{Self}::from(stored)`",
    note = "implement `From<{S}>` for `{Self}` (with thiserror, `#[from]` on the variant that holds it)"
)]
pub trait FromStoredError<S>: From<S> {}
impl<E: From<S>, S> FromStoredError<S> for E {}

/// Probes `final_err`'s function `F` on errors `E`.
pub struct FinalProbe<E, F>(PhantomData<fn() -> (E, F)>);

impl<E, F> FinalProbe<E, F> {
    #[inline]
    pub fn of(_: &F) -> Self {
        FinalProbe(PhantomData)
    }
}

/// A `fn(&E) -> bool`: the error itself is stored. The `Serialize` half.
pub trait StoresTheError<E> {
    #[inline]
    fn assert_error_serializable(&self)
    where
        E: StorableErrorSerialize,
    {
    }
}

impl<E, F: Fn(&E) -> bool> StoresTheError<E> for FinalProbe<E, F> {}

/// The rest of a `fn(&E) -> bool`'s check, where `E: Serialize` holds.
pub trait StoresTheErrorRest<E> {
    #[inline]
    fn assert_error_storable(&self)
    where
        E: StorableError,
    {
    }
}

impl<E: Serialize, F: Fn(&E) -> bool> StoresTheErrorRest<E> for FinalProbe<E, F> {}

/// A `fn(&E) -> Option<S>`: `S` is stored and `E` rebuilt from it.
pub trait StoresAForm<E, S> {
    #[inline]
    fn assert_form_serializable(&self)
    where
        S: StoredErrorFormSerialize,
    {
    }

    #[inline]
    fn assert_form_replays(&self)
    where
        E: FromStoredError<S>,
    {
    }
}

impl<E, S, F: Fn(&E) -> Option<S>> StoresAForm<E, S> for FinalProbe<E, F> {}

/// The rest of a stored form's check, where `S: Serialize` holds.
pub trait StoresAFormRest<E, S> {
    #[inline]
    fn assert_form_storable(&self)
    where
        S: StoredErrorForm,
    {
    }
}

impl<E, S: Serialize, F: Fn(&E) -> Option<S>> StoresAFormRest<E, S> for FinalProbe<E, F> {}

/// Every check that does not apply to this function (or, after a type error
/// already reported, to any): nothing.
pub trait NoFinalCheck {
    #[inline]
    fn assert_error_serializable(&self) {}
    #[inline]
    fn assert_error_storable(&self) {}
    #[inline]
    fn assert_form_serializable(&self) {}
    #[inline]
    fn assert_form_replays(&self) {}
    #[inline]
    fn assert_form_storable(&self) {}
}

impl<E, F> NoFinalCheck for &FinalProbe<E, F> {}

/// [`Dispatch`] with `final_err`'s function type beside the return type, so
/// that the choice between the checked protocol and the fallback is made on
/// the receiver alone.
pub struct DispatchFinal<R, F>(PhantomData<fn() -> (R, F)>);

impl<R> Dispatch<R> {
    #[inline]
    pub fn keeping_final<F>(&self, _: &F) -> DispatchFinal<R, F> {
        DispatchFinal(PhantomData)
    }
}

/// The protocol with `final_err`, where the result can be cached and `F`'s
/// verdicts stored.
pub trait WhenTypesHoldKeepingFinal<T, E, M, F> {
    #[allow(clippy::too_many_arguments)]
    fn execute_keeping_final<'a, S, B>(
        &self,
        spec: &'a Spec,
        store: Option<S>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        is_final: F,
        body: B,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        S: Store + Clone,
        B: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
        F: 'a;

    #[allow(clippy::too_many_arguments)]
    fn execute_keeping_final_recoverable<'a, S, B>(
        &self,
        spec: &'a Spec,
        store: Option<S>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        is_final: F,
        args: CallArgs,
        body: B,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        S: Store + Clone,
        B: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
        F: 'a;
}

impl<T, E, M, F> WhenTypesHoldKeepingFinal<T, E, M, F> for DispatchFinal<Result<T, E>, F>
where
    T: StoredForm<M>,
    E: FromIdemError,
    M: 'static,
    F: FinalErrFn<E>,
{
    fn execute_keeping_final<'a, S, B>(
        &self,
        spec: &'a Spec,
        store: Option<S>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        is_final: F,
        body: B,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        S: Store + Clone,
        B: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
        F: 'a,
    {
        protocol::execute_keeping_final_on::<S, T, M, E, B, F>(
            spec,
            store,
            key,
            fingerprint,
            is_final,
            None,
            body,
        )
    }

    fn execute_keeping_final_recoverable<'a, S, B>(
        &self,
        spec: &'a Spec,
        store: Option<S>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        is_final: F,
        args: CallArgs,
        body: B,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        S: Store + Clone,
        B: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
        F: 'a,
    {
        protocol::execute_keeping_final_on::<S, T, M, E, B, F>(
            spec,
            store,
            key,
            fingerprint,
            is_final,
            Some(args),
            body,
        )
    }
}

impl<R, F> AfterTypeError for &DispatchFinal<R, F> {}
