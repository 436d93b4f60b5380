//! How expansions call the protocol without repeating type errors.
//!
//! An expansion first asserts, on the user's own `T` and `E` tokens, that the
//! result can be cached and the error can carry ours; a failed assertion is the
//! one error the user sees. The call itself then goes through autoref dispatch:
//! [`Checked`] applies when the bounds hold, and otherwise method resolution
//! falls back to [`Unchecked`], which has no bounds and so adds no second,
//! third and fourth report of the same problem at the attribute.
//!
//! `Unchecked` is only ever selected in a crate that does not compile: the
//! assertions the expansion always emits fail exactly when `Checked` does not
//! apply. Its bodies are therefore never run.

// Hidden API reached only through `__private`: the module doc above is its doc.
#![allow(missing_docs)]

use std::future::Future;
use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::key::{Fingerprint, Key};
use crate::protocol::{self, Cacheable, FromIdemError, Spec};
use crate::store::StoreRef;

/// Carries the annotated function's return type.
pub struct Dispatch<R>(PhantomData<fn() -> R>);

impl<R> Dispatch<R> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        Dispatch(PhantomData)
    }
}

macro_rules! protocol_trait {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        pub trait $name<T, E> {
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
                E: Serialize + DeserializeOwned,
                T: 'a,
                E: 'a;

            fn run_step<'a, F>(&self, name: &'static str, body: F) -> impl Future<Output = Result<T, E>> + 'a
            where
                F: Future<Output = Result<T, E>> + 'a,
                T: 'a,
                E: 'a;
        }
    };
}

protocol_trait!(
    /// The protocol, for result types it can cache.
    Checked
);
protocol_trait!(
    /// The fallback of a crate that already has a type error; never runs.
    Unchecked
);

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
        E: Serialize + DeserializeOwned,
        T: 'a,
        E: 'a,
    {
        protocol::execute_keeping_final(spec, store, key, fingerprint, is_final, body)
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
}

const NEVER: &str = "idem: the unchecked dispatch is only chosen in a crate that fails to compile";

impl<T, E> Unchecked<T, E> for &Dispatch<Result<T, E>> {
    fn execute<'a, F>(
        &self,
        _: &'a Spec,
        _: Option<StoreRef>,
        _: Key,
        _: Option<Fingerprint>,
        _: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
    {
        async { panic!("{NEVER}") }
    }

    fn execute_keeping_final<'a, F>(
        &self,
        _: &'a Spec,
        _: Option<StoreRef>,
        _: Key,
        _: Option<Fingerprint>,
        _: fn(&E) -> bool,
        _: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        E: Serialize + DeserializeOwned,
        T: 'a,
        E: 'a,
    {
        async { panic!("{NEVER}") }
    }

    fn run_step<'a, F>(&self, _: &'static str, _: F) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: 'a,
        E: 'a,
    {
        async { panic!("{NEVER}") }
    }
}
