//! What the expansion of `recover` calls: the checks on each argument's type,
//! encoding the arguments before the body takes them, and the hidden
//! registration item that decodes them and calls the function again.
//!
//! Each argument is checked like a result: `Serialize` alone first, on the
//! parameter's own type token, and the `Deserialize` half through a probe
//! only where `Serialize` holds (see `diagnostics.rs`), so a type with neither
//! gets one error, in our words, on that type.

// Hidden API reached only through `__private`: the module doc above is its doc.
#![allow(missing_docs)]

use std::marker::PhantomData;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::CodecError;
use crate::protocol::args::CallArgs;
use crate::recovery::Ended;

/// The `Serialize` half of [`RecoverableArg`], checked first and alone.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored for recovery: it is not `Serialize + DeserializeOwned`",
    label = "with `recover`, every argument is stored with the claim, so that a worker can run the call again",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}`, take a stored value instead (an id rather than a connection or a handle), or drop `recover`",
    note = "a service's handles (a pool, a client) belong in the service a `&self` method is registered with: `recoverable!(Service::method, service)`; an axum handler's extractors belong in a handler without `recover` that calls such a method (idem_runtime::guide::recovery)"
)]
pub trait RecoverableArgSerialize {}
// Not recommended: the error names this trait and its notes, not `Serialize`
// and the two hundred types that implement it.
#[diagnostic::do_not_recommend]
impl<T: Serialize + ?Sized> RecoverableArgSerialize for T {}

/// An argument a `recover` call can store and a worker can decode again.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored for recovery: it is not `Serialize + DeserializeOwned`",
    label = "with `recover`, every argument is stored with the claim, so that a worker can run the call again",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}`, take a stored value instead (an id rather than a connection or a handle), or drop `recover`"
)]
pub trait RecoverableArg: Serialize + DeserializeOwned {}
impl<T: Serialize + DeserializeOwned> RecoverableArg for T {}

/// Pins the first half of an argument's check to its type token.
#[inline]
pub fn assert_recoverable_arg<T: RecoverableArgSerialize + ?Sized>() {}

/// Probes the stored type `S` of one argument.
pub struct ArgProbe<S: ?Sized>(PhantomData<fn() -> PhantomData<S>>);

impl<S: ?Sized> ArgProbe<S> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        ArgProbe(PhantomData)
    }
}

/// The arguments of one call, written as a JSON array in parameter order.
pub struct ArgsWriter {
    json: Vec<u8>,
    failed: Option<serde_json::Error>,
}

impl ArgsWriter {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        ArgsWriter {
            json: vec![b'['],
            failed: None,
        }
    }

    fn push<V: Serialize + ?Sized>(&mut self, value: &V) {
        if self.failed.is_some() {
            return;
        }
        if self.json.len() > 1 {
            self.json.push(b',');
        }
        if let Err(e) = serde_json::to_writer(&mut self.json, value) {
            self.failed = Some(e);
        }
    }

    /// The call's arguments, for `execute_recoverable`.
    pub fn finish(mut self) -> CallArgs {
        match self.failed {
            Some(e) => CallArgs(Err(format!("{:?}", e.classify()))),
            None => {
                self.json.push(b']');
                CallArgs(Ok(self.json))
            }
        }
    }
}

/// Chosen when the stored type is `Serialize`: checks the rest and writes
/// the value.
pub trait ArgSerializeHolds<S: ?Sized> {
    #[inline]
    fn push<V: Serialize + ?Sized>(&self, writer: &mut ArgsWriter, value: &V)
    where
        S: RecoverableArg,
    {
        writer.push(value);
    }
}

impl<S: Serialize + ?Sized> ArgSerializeHolds<S> for ArgProbe<S> {}

/// Chosen only when the stored type is not `Serialize`, which
/// `assert_recoverable_arg` has already reported: the crate does not build.
pub trait ArgSerializeMissing {
    #[inline]
    fn push<V: ?Sized>(&self, _: &mut ArgsWriter, _: &V) {}
}

impl<S: ?Sized> ArgSerializeMissing for &ArgProbe<S> {}

/// Probes the tuple of the function's parameter types, for decoding.
pub struct DecodeProbe<A>(PhantomData<fn() -> A>);

impl<A> DecodeProbe<A> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        DecodeProbe(PhantomData)
    }
}

/// Decodes the stored arguments into the function's parameter types (a
/// tuple, in parameter order).
pub trait DecodeHolds<A> {
    #[inline]
    fn decode(&self, json: &[u8]) -> Result<A, CodecError>
    where
        A: DeserializeOwned,
    {
        serde_json::from_slice(json).map_err(CodecError::from)
    }
}

impl<A: DeserializeOwned> DecodeHolds<A> for DecodeProbe<A> {}

/// Chosen only when an argument's type cannot be decoded, which
/// `assert_recoverable_arg` or the probe has already reported on the type:
/// no second error at the attribute. Never instantiated in a crate that
/// builds (see `diagnostics.rs`).
pub trait DecodeMissing<A> {
    fn decode(&self, _: &[u8]) -> Result<A, CodecError> {
        #[allow(clippy::let_unit_value)]
        let () = NeverDecoded::<A>::ERROR;
        unreachable!("DecodeMissing is never instantiated")
    }
}

impl<A> DecodeMissing<A> for &DecodeProbe<A> {}

struct NeverDecoded<A>(PhantomData<A>);

impl<A> NeverDecoded<A> {
    const ERROR: () = panic!(
        "idem: decoding recovery arguments fell back to `DecodeMissing` in a crate with no type error; please report this as a bug in idem"
    );
}

/// The service a `&self` method with `recover` is registered with: the
/// service, or an `Arc` of it.
#[diagnostic::on_unimplemented(
    message = "a `&self` method of `{S}` is registered with the service it runs on, and `{Self}` is not one",
    label = "the worker calls the method on this value",
    note = "register it as `recoverable!({S}::method, service)`, with the `{S}` (or an `Arc<{S}>`) the worker calls the method on"
)]
pub trait RecoveryService<S> {
    fn into_service(self) -> Arc<S>;
}

#[diagnostic::do_not_recommend]
impl<S, T: Into<Arc<S>>> RecoveryService<S> for T {
    #[inline]
    fn into_service(self) -> Arc<S> {
        self.into()
    }
}

/// What the worker needs to know of the function's result.
#[inline]
pub fn recovery_end<T, E>(out: Result<T, E>) -> Ended {
    match out {
        Ok(_) => Ended::Ok,
        Err(_) => Ended::Err,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_a_json_array_that_decodes_as_a_tuple() {
        let mut w = ArgsWriter::new();
        ArgProbe::<String>::new().push(&mut w, "SKU-1");
        ArgProbe::<u32>::new().push(&mut w, &3u32);
        let CallArgs(Ok(json)) = w.finish() else {
            panic!("encodes")
        };
        assert_eq!(json, br#"["SKU-1",3]"#);
        let (sku, qty): (String, u32) = DecodeProbe::new().decode(&json).unwrap();
        assert_eq!((sku.as_str(), qty), ("SKU-1", 3));
    }
}
