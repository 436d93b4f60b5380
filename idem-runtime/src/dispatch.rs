//! How expansions check the user's types and call the protocol, so that each
//! type problem is reported once, on the user's own token.
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
//! nothing to the error already reported. [`ErrProbe`] does the same for the
//! `Err` that `final_err` stores.
//!
//! The protocol call goes through the same autoref dispatch: [`Checked`] and
//! [`CheckedFinal`] apply when their bounds hold, and otherwise resolution falls
//! back to [`Unchecked`], which has no bounds and so adds no second, third and
//! fourth report of the same problem at the attribute. It is only ever selected
//! in a crate that does not compile: the assertions the expansion always emits
//! fail exactly when `Checked` does not apply. Its bodies therefore never run.

// Hidden API reached only through `__private`: the module doc above is its doc.
#![allow(missing_docs)]

use std::future::Future;
use std::marker::PhantomData;

use serde::Serialize;

use crate::key::{Fingerprint, Key};
use crate::protocol::{self, Cacheable, FromIdemError, IdemResult, Spec, StorableError};
use crate::store::StoreRef;
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

/// Probes the `Err` of the return type `R`.
pub struct ErrProbe<R>(PhantomData<fn() -> R>);

impl<R> OkProbe<R> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        OkProbe(PhantomData)
    }
}

impl<R> ErrProbe<R> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        ErrProbe(PhantomData)
    }
}

/// Chosen when the probed type `T` is `Serialize`: checks the rest.
pub trait SerializeHolds<T> {
    #[inline]
    fn assert_cacheable(&self)
    where
        T: Cacheable,
    {
    }

    #[inline]
    fn assert_storable_error(&self)
    where
        T: StorableError,
    {
    }
}

impl<R: IdemResult> SerializeHolds<R::Ok> for OkProbe<R> where R::Ok: Serialize {}
impl<R: IdemResult> SerializeHolds<R::Err> for ErrProbe<R> where R::Err: Serialize {}

/// Chosen when the probed type is not even `Serialize` (already reported), or
/// `R` is no `Result` at all (reported by `assert_result`).
pub trait SerializeMissing {
    #[inline]
    fn assert_cacheable(&self) {}

    #[inline]
    fn assert_storable_error(&self) {}
}

impl<R> SerializeMissing for &OkProbe<R> {}
impl<R> SerializeMissing for &ErrProbe<R> {}

/// The protocol, for result types it can cache.
pub trait Checked<T, E> {
    fn execute<'a, F>(
        &self,
        spec: &'a Spec,
        store: Option<StoreRef>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a;

    fn run_step<'a, F>(
        &self,
        name: &'static str,
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
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        C: AsTxConnection + ?Sized + 'a,
        F: AsyncFnOnce(&mut C) -> Result<T, E> + 'a,
        T: 'a,
        E: 'a;
}

impl<T: Cacheable, E: FromIdemError> Checked<T, E> for Dispatch<Result<T, E>> {
    fn execute<'a, F>(
        &self,
        spec: &'a Spec,
        store: Option<StoreRef>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
    {
        protocol::execute(spec, store, key, fingerprint, body)
    }

    fn run_step<'a, F>(
        &self,
        name: &'static str,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
    {
        protocol::run_step(name, body)
    }

    fn execute_in_tx<'a, C, F>(
        &self,
        spec: &'a Spec,
        conn: &'a mut C,
        key: Key,
        fingerprint: Option<Fingerprint>,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        C: AsTxConnection + ?Sized + 'a,
        F: AsyncFnOnce(&mut C) -> Result<T, E> + 'a,
        T: 'a,
        E: 'a,
    {
        protocol::execute_in_tx(spec, conn, key, fingerprint, body)
    }
}

/// The protocol with `final_err`, for error types it can also store. A trait of
/// its own, so that its extra bound on `E` selects the fallback instead of
/// failing at the attribute.
pub trait CheckedFinal<T, E> {
    #[allow(clippy::too_many_arguments)]
    fn execute_keeping_final<'a, F>(
        &self,
        spec: &'a Spec,
        store: Option<StoreRef>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        is_final: fn(&E) -> bool,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a;
}

impl<T: Cacheable, E: FromIdemError + StorableError> CheckedFinal<T, E> for Dispatch<Result<T, E>> {
    fn execute_keeping_final<'a, F>(
        &self,
        spec: &'a Spec,
        store: Option<StoreRef>,
        key: Key,
        fingerprint: Option<Fingerprint>,
        is_final: fn(&E) -> bool,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
    {
        protocol::execute_keeping_final(spec, store, key, fingerprint, is_final, body)
    }
}

const NEVER: &str = "idem: the unchecked dispatch is only chosen in a crate that fails to compile";

/// The fallback of a crate that already has a type error; never runs. Generic
/// over any return type, so even a `Result` alias that is no `Result` gets no
/// second error here.
pub trait Unchecked {
    fn execute<'a, F>(
        &self,
        _: &'a Spec,
        _: Option<StoreRef>,
        _: Key,
        _: Option<Fingerprint>,
        _: F,
    ) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        async { panic!("{NEVER}") }
    }

    #[allow(clippy::too_many_arguments)]
    fn execute_keeping_final<'a, F, E>(
        &self,
        _: &'a Spec,
        _: Option<StoreRef>,
        _: Key,
        _: Option<Fingerprint>,
        _: fn(&E) -> bool,
        _: F,
    ) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        async { panic!("{NEVER}") }
    }

    fn run_step<'a, F>(&self, _: &'static str, _: F) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        async { panic!("{NEVER}") }
    }

    fn execute_in_tx<'a, C, R, F>(
        &self,
        _: &'a Spec,
        _: &'a mut C,
        _: Key,
        _: Option<Fingerprint>,
        _: F,
    ) -> impl Future<Output = R> + 'a
    where
        C: ?Sized + 'a,
        F: AsyncFnOnce(&mut C) -> R + 'a,
        R: 'a,
    {
        async { panic!("{NEVER}") }
    }
}

impl<R> Unchecked for &Dispatch<R> {}
