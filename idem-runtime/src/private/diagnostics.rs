//! Compile-time diagnostics: how expansions check the user's types and call
//! the protocol, so that each type problem is reported once, on the user's own
//! token. Everything here is hidden API, reached only through `__private`.
//!
//! An expansion first asserts, on the user's `T` and `E` tokens, that the
//! result can be cached and the error can carry ours (and, with `final_err`,
//! be stored); a failed assertion is the one error the user sees.
//!
//! `Serialize + DeserializeOwned` is two traits, and a bound on both reports a
//! type that derives neither twice. So the assertion checks `Serialize` alone,
//! and a probe checks the whole bound only where `Serialize` holds: on
//! `&OkProbe<R>`, method resolution picks [`SerializeHolds`] when the `Ok` of
//! `R` is `Serialize` (its method's bound then reports a missing
//! `Deserialize`), and otherwise falls back to [`SerializeMissing`], which adds
//! nothing to the error already reported. `final_err.rs` does the same for
//! what `final_err` stores.
//!
//! The protocol call goes through the same autoref dispatch: [`WhenTypesHold`]
//! (and with `final_err`, `WhenTypesHoldKeepingFinal`) applies when its bounds hold, and
//! otherwise resolution falls back to [`AfterTypeError`], which has no bounds
//! and so adds no second, third and fourth report of the same problem at the
//! attribute. It is only ever selected in a crate that does not compile: the
//! assertions the expansion always emits fail exactly when `WhenTypesHold`
//! does not apply. Should it ever be selected in a crate that type-checks, its
//! methods fail the build when they are instantiated (a post-monomorphization
//! error), so it can never become a silent runtime path.

// Hidden API reached only through `__private`: the module doc above is its doc.
#![allow(missing_docs)]

use std::future::Future;
use std::marker::PhantomData;

use serde::Serialize;

use crate::key::{Fingerprint, Key};
use crate::protocol::args::CallArgs;
use crate::protocol::{self, FromIdemError, Spec, StoredForm, ViaSerde};
use crate::store::Store;
use crate::store::tx::AsTxConnection;

/// Carries the annotated function's return type.
pub struct Dispatch<R>(PhantomData<fn() -> R>);

impl<R> Dispatch<R> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        Dispatch(PhantomData)
    }
}

/// Probes the `Ok` of the return type `R`.
pub struct OkProbe<R>(PhantomData<fn() -> R>);

impl<R> OkProbe<R> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        OkProbe(PhantomData)
    }
}

/// Chosen when the probed type `T` is `Serialize` (or, for `M` other than
/// [`ViaSerde`], wraps a `Serialize` type in a form that has a
/// [`StoredForm`]): checks the rest.
pub trait SerializeHolds<T, M> {
    #[inline]
    fn assert_cacheable(&self)
    where
        T: StoredForm<M>,
    {
    }
}

impl<R: IdemResult, M> SerializeHolds<R::Ok, M> for OkProbe<R> where R::Ok: CacheableSerialize<M> {}

/// Chosen when the probed type is not even `Serialize` (already reported), or
/// `R` is no `Result` at all (reported by `assert_result`).
pub trait SerializeMissing {
    #[inline]
    fn assert_cacheable(&self) {}
}

impl<R> SerializeMissing for &OkProbe<R> {}

/// The protocol, for result types it can cache (in the stored form `M`).
pub trait WhenTypesHold<T, E, M> {
    fn execute<'a, S, F>(
        &self,
        spec: &'a Spec,
        store: Option<S>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        S: Store + Clone,
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a;

    fn execute_recoverable<'a, S, F>(
        &self,
        spec: &'a Spec,
        store: Option<S>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        args: CallArgs,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        S: Store + Clone,
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a;

    fn run_step<'a, F>(
        &self,
        step: protocol::StepCall,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a;

    fn execute_in_tx<'a, C, F>(
        &self,
        spec: &'a Spec,
        conn: &'a mut C,
        key: Key,
        fingerprint: Option<Fingerprint>,
        known: Option<T>,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        C: AsTxConnection + ?Sized + 'a,
        F: AsyncFnOnce(&mut C) -> Result<T, E> + 'a,
        T: 'a,
        E: 'a;
}

impl<T: StoredForm<M>, E: FromIdemError, M: 'static> WhenTypesHold<T, E, M>
    for Dispatch<Result<T, E>>
{
    fn execute<'a, S, F>(
        &self,
        spec: &'a Spec,
        store: Option<S>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        S: Store + Clone,
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
    {
        protocol::execute_on::<S, T, M, E, F>(spec, store, key, fingerprint, None, body)
    }

    fn execute_recoverable<'a, S, F>(
        &self,
        spec: &'a Spec,
        store: Option<S>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        args: CallArgs,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        S: Store + Clone,
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
    {
        protocol::execute_on::<S, T, M, E, F>(spec, store, key, fingerprint, Some(args), body)
    }

    fn run_step<'a, F>(
        &self,
        step: protocol::StepCall,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
    {
        protocol::run_step::<T, M, E, F>(step, body)
    }

    fn execute_in_tx<'a, C, F>(
        &self,
        spec: &'a Spec,
        conn: &'a mut C,
        key: Key,
        fingerprint: Option<Fingerprint>,
        known: Option<T>,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        C: AsTxConnection + ?Sized + 'a,
        F: AsyncFnOnce(&mut C) -> Result<T, E> + 'a,
        T: 'a,
        E: 'a,
    {
        protocol::execute_in_tx::<C, T, M, E, F>(spec, conn, key, fingerprint, known, body)
    }
}

/// Fails the build of any crate that instantiates a method of
/// [`AfterTypeError`]: one that type-checks yet picked the fallback.
struct NeverInstantiated<T: ?Sized>(PhantomData<T>);

impl<T: ?Sized> NeverInstantiated<T> {
    const ERROR: () = panic!(
        "idem: the protocol call fell back to `AfterTypeError` in a crate with no type error; please report this as a bug in idem"
    );
}

/// The fallback chosen only after a type error was reported; it never runs.
/// Generic over any return type, so even a `Result` alias that is no `Result`
/// gets no second error here.
pub trait AfterTypeError {
    fn execute<'a, S, F>(
        &self,
        _: &'a Spec,
        _: Option<S>,
        _: Key,
        _: Option<Fingerprint>,
        _: F,
    ) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        #[allow(clippy::let_unit_value)]
        let () = NeverInstantiated::<F>::ERROR;
        async { unreachable!("AfterTypeError is never instantiated") }
    }

    #[allow(clippy::too_many_arguments)]
    fn execute_keeping_final<'a, S, F, P>(
        &self,
        _: &'a Spec,
        _: Option<S>,
        _: Key,
        _: Option<Fingerprint>,
        _: P,
        _: F,
    ) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        #[allow(clippy::let_unit_value)]
        let () = NeverInstantiated::<F>::ERROR;
        async { unreachable!("AfterTypeError is never instantiated") }
    }

    fn execute_recoverable<'a, S, F>(
        &self,
        _: &'a Spec,
        _: Option<S>,
        _: Key,
        _: Option<Fingerprint>,
        _: CallArgs,
        _: F,
    ) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        #[allow(clippy::let_unit_value)]
        let () = NeverInstantiated::<F>::ERROR;
        async { unreachable!("AfterTypeError is never instantiated") }
    }

    #[allow(clippy::too_many_arguments)]
    fn execute_keeping_final_recoverable<'a, S, F, P>(
        &self,
        _: &'a Spec,
        _: Option<S>,
        _: Key,
        _: Option<Fingerprint>,
        _: P,
        _: CallArgs,
        _: F,
    ) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        #[allow(clippy::let_unit_value)]
        let () = NeverInstantiated::<F>::ERROR;
        async { unreachable!("AfterTypeError is never instantiated") }
    }

    fn run_step<'a, F>(&self, _: protocol::StepCall, _: F) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        #[allow(clippy::let_unit_value)]
        let () = NeverInstantiated::<F>::ERROR;
        async { unreachable!("AfterTypeError is never instantiated") }
    }

    fn execute_in_tx<'a, C, R, F>(
        &self,
        _: &'a Spec,
        _: &'a mut C,
        _: Key,
        _: Option<Fingerprint>,
        // The expansion passes `Some(())` or `None`, both typed here.
        _: Option<()>,
        _: F,
    ) -> impl Future<Output = R> + 'a
    where
        C: ?Sized + 'a,
        F: AsyncFnOnce(&mut C) -> R + 'a,
        R: 'a,
    {
        #[allow(clippy::let_unit_value)]
        let () = NeverInstantiated::<F>::ERROR;
        async { unreachable!("AfterTypeError is never instantiated") }
    }
}

impl<R> AfterTypeError for &Dispatch<R> {}

/// The `Serialize` half of [`StoredForm`]. Expansions check it first and alone,
/// then the rest only when it holds (see [`SerializeHolds`]), so a type that
/// has neither serde trait gets one error rather than one per trait.
///
/// `M` is the stored form's marker, inferred: [`ViaSerde`] for serde types;
/// with the `axum` feature, `idem_runtime::http::ViaAxum` for `Json<T>`,
/// `(StatusCode, Json<T>)`, `(HeaderMap, Json<T>)` and
/// `(StatusCode, HeaderMap, Json<T>)` of a `Serialize` `T`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cached as the result of an idempotent call: it is not `Serialize + DeserializeOwned`",
    label = "the result is stored and replayed to duplicates",
    note = "the `T` of `Result<T, E>` must implement `Serialize` and `DeserializeOwned` (derive `serde::Serialize` and `serde::Deserialize`)",
    note = "an axum handler returns `Json<T>`, `(StatusCode, Json<T>)`, `(HeaderMap, Json<T>)` or `(StatusCode, HeaderMap, Json<T>)` of such a `T` instead (feature `axum`): a header is set through the `HeaderMap`; a bare `Response`, `Html`, an array of header pairs or `impl IntoResponse` cannot be replayed"
)]
pub trait CacheableSerialize<M> {}
impl<T: Serialize + ?Sized> CacheableSerialize<ViaSerde> for T {}

/// A return type the attributes accept: a `Result<T, E>`, also when written
/// through an alias such as `io::Result<T>`. Expansions check its `Ok` against
/// [`Cacheable`](crate::protocol::Cacheable) and its `Err` against [`FromIdemError`](crate::protocol::FromIdemError), each alone: a bound
/// on the whole `Result` would report a failing `E` as an unexplained
/// "`io::Error: From<idem_runtime::Error>` is not satisfied".
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a `Result<T, E>`",
    label = "an idempotent call must return `Result<T, E>`",
    note = "`Ok` is stored and replayed to duplicates; in-progress, key reuse and store failures reach the caller as `E`"
)]
pub trait IdemResult {
    /// The `T`.
    type Ok;
    /// The `E`.
    type Err;
}
impl<T, E> IdemResult for Result<T, E> {
    type Ok = T;
    type Err = E;
}

/// Pins the first half of the cached type's check to the user's `T`, so the
/// error lands there; `OkProbe` does the second half.
#[inline]
pub fn assert_serializable<T: CacheableSerialize<M> + ?Sized, M>() {}

/// Pins the error type's check to the user's `E`.
#[inline]
pub fn assert_error_type<E: FromIdemError>() {}

/// The same checks for a return type whose `T` and `E` are not written out
/// (an alias such as `io::Result<T>`), on the whole return type.
#[inline]
pub fn assert_result<R, M>()
where
    R: IdemResult,
    R::Ok: CacheableSerialize<M>,
    R::Err: FromIdemError,
{
}
