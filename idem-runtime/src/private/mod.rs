//! The layer macro expansions call into, above the protocol: the autoref
//! dispatch that reports a type error on the user's tokens (`diagnostics.rs`),
//! `final_err`'s checks (`final_err.rs`), the compensated step's checks
//! (`compensate.rs`), and the thin functions
//! the generated code names. Reached only as `idem_runtime::__private`; not
//! a public API, it changes without notice.

mod compensate;
pub(crate) mod diagnostics;
mod final_err;
mod recover;

pub use crate::key::{FingerprintBuilder, Key, KeyBuilder};
pub use crate::protocol::{Cacheable, FromIdemError, StepCall, StorableError};
pub use crate::recovery::{Ended, Prepared, Recoverable};
pub use crate::site::CallSite;
pub use crate::spec::{Kind, Spec};
pub use crate::store::{AsStore, StoreRef};
pub use compensate::{
    AfterTypeErrorCompensated, CompensationInput, WhenTypesHoldCompensated, compensation_arg,
    compensation_receiver, compensation_result,
};
pub use core::option::Option::{None, Some};
pub use core::result::Result::{Err, Ok};
pub use core::time::Duration;
pub use diagnostics::{
    AfterTypeError, CacheableSerialize, Dispatch, IdemResult, OkProbe, SerializeHolds,
    SerializeMissing, WhenTypesHold, assert_error_type, assert_result, assert_serializable,
};
pub use final_err::{
    DispatchFinal, FinalErrOutput, FinalProbe, FromStoredError, NoFinalCheck,
    StorableErrorSerialize, StoredErrorForm, StoredErrorFormSerialize, StoresAForm,
    StoresAFormRest, StoresTheError, StoresTheErrorRest, WhenTypesHoldKeepingFinal, final_err,
};
pub use recover::{
    ArgProbe, ArgSerializeHolds, ArgSerializeMissing, ArgsWriter, DecodeHolds, DecodeMissing,
    DecodeProbe, RecoverableArg, RecoverableArgSerialize, RecoveryService, assert_recoverable_arg,
    recovery_end,
};
pub use std::boxed::Box;
pub use std::sync::Arc;

use crate::key::{Fingerprint, KeyPart};

#[inline]
pub fn key_builder(scope: &str) -> KeyBuilder {
    Key::builder(scope)
}

#[inline]
pub fn fingerprint_builder() -> FingerprintBuilder {
    Fingerprint::builder()
}

// A free function rather than a method call, so an unsupported segment type is
// reported as `KeyPart` unimplemented on the segment itself.
#[inline]
pub fn key_part<P: KeyPart + ?Sized>(builder: &mut KeyBuilder, part: &P) {
    builder.push(part);
}

#[inline]
pub fn fingerprint_part<P: KeyPart + ?Sized>(builder: &mut FingerprintBuilder, part: &P) {
    builder.push(part);
}

#[inline]
pub fn store_of<S: AsStore + ?Sized>(store: &S) -> S::Store {
    store.as_store()
}
