//! Writing a finished call's outcome: complete with the result (or a marker
//! saying why it could not be stored), or release the claim on a retryable
//! `Err`; on a store, or on the caller's transaction.

use std::borrow::Cow;

use serde::Serialize;

use crate::error::{CodecError, Error};
use crate::key::Key;
use crate::observe::CallOutcome;
use crate::store::tx::TxConnection;
use crate::store::{Completion, Store, StoredOutcome, Token};

use super::{ErrorPolicy, FromIdemError, Spec, StoredForm, report};

/// Why a finished body's result is not in the record.
#[derive(Debug, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Unstored {
    TooLarge {
        size: usize,
        limit: usize,
    },
    // serde's message is not stored: it may quote the value.
    EncodeFailed {
        #[serde(alias = "message")]
        category: String,
    },
}

/// Where a finished call's outcome is written: a store, or the caller's
/// transaction.
pub(super) trait Recorder {
    fn max_result_bytes(&self) -> usize;
    /// Inside a transaction a record that could not be written must fail the
    /// call, so the caller rolls the business writes back with it; on a store
    /// the effects are already committed and the caller gets its result.
    fn must_record(&self) -> bool;
    async fn complete(
        &mut self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, crate::StoreError>;
    async fn release(&mut self, key: &Key, token: Token) -> Result<bool, crate::StoreError>;
}

/// A store, as what a finished call's outcome is written to.
pub(super) struct OnStore<'a, S>(pub(super) &'a S);

impl<S: Store> Recorder for OnStore<'_, S> {
    fn max_result_bytes(&self) -> usize {
        self.0.max_result_bytes()
    }

    fn must_record(&self) -> bool {
        false
    }

    async fn complete(
        &mut self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, crate::StoreError> {
        self.0.complete(key, token, completion).await
    }

    async fn release(&mut self, key: &Key, token: Token) -> Result<bool, crate::StoreError> {
        self.0.release(key, token).await
    }
}

impl<C: TxConnection + ?Sized> Recorder for C {
    fn max_result_bytes(&self) -> usize {
        TxConnection::max_result_bytes(self)
    }

    fn must_record(&self) -> bool {
        true
    }

    async fn complete(
        &mut self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, crate::StoreError> {
        TxConnection::complete(self, key, token, completion).await
    }

    async fn release(&mut self, key: &Key, token: Token) -> Result<bool, crate::StoreError> {
        TxConnection::release(self, key, token).await
    }
}

/// `keep_claim`: on a retryable `Err`, leave the claim to run out with its
/// lease instead of releasing it (a recovered call, which a worker retries).
pub(super) async fn finish<T, M, E, P, R>(
    spec: &Spec,
    store: &mut R,
    key: &Key,
    token: Token,
    out: Result<T, E>,
    policy: &P,
    keep_claim: bool,
) -> Result<T, E>
where
    T: StoredForm<M>,
    E: FromIdemError,
    P: ErrorPolicy<E>,
    R: Recorder + ?Sized,
{
    let (outcome, payload) = match &out {
        Ok(value) => match value.stored_bytes() {
            Ok(bytes) => (StoredOutcome::Success, bytes),
            Err(e) => unencodable(&e),
        },
        Err(err) => match policy.keep(err) {
            Some(Ok(bytes)) => (StoredOutcome::FinalError, Cow::Owned(bytes)),
            Some(Err(e)) => unencodable(&e),
            None => {
                report::call(spec, CallOutcome::Failed);
                if keep_claim {
                    tracing::info!(
                        "the recovered call failed; its claim stays until the lease runs out, for the worker's next turn"
                    );
                    return out;
                }
                if let Err(e) = store.release(key, token).await {
                    // The claim then ends with its lease and a retry takes over.
                    tracing::warn!(error = %e, "could not release the claim after an error");
                }
                return out;
            }
        },
    };
    let limit = store.max_result_bytes();
    let (outcome, payload) = if payload.len() > limit {
        tracing::error!(
            size = payload.len(),
            limit,
            "result over the store's cap; duplicates will get ResultTooLarge"
        );
        unstored(Unstored::TooLarge {
            size: payload.len(),
            limit,
        })
    } else {
        (outcome, payload)
    };
    if outcome == StoredOutcome::Unstored {
        report::call(spec, CallOutcome::Unstored);
    }
    let completion = Completion {
        outcome,
        payload: &payload,
        ttl: spec.ttl,
    };
    match store.complete(key, token, completion).await {
        // Only an error `final_err` kept gets this far: the record holds it.
        Ok(true) if out.is_err() => {
            report::call_ending_in_recorded_err(spec, CallOutcome::Executed)
        }
        Ok(true) => report::call(spec, CallOutcome::Executed),
        Ok(false) => {
            // The body ran and its effects happened: hand its result to the caller,
            // but the record belongs to whoever took over.
            report::fenced(spec, out.is_err());
            tracing::warn!("completed after losing the claim; the newer owner's record stands");
        }
        Err(e) if store.must_record() => {
            report::call(spec, CallOutcome::StoreError);
            tracing::error!(error = %e, "could not record the result in the transaction; failing the call so it rolls back");
            return Err(E::from(Error::Store(e)));
        }
        Err(e) => {
            report::call(spec, CallOutcome::StoreError);
            tracing::error!(error = %e, "could not store the result; a duplicate will take over after the lease");
        }
    }
    out
}

fn unencodable(e: &serde_json::Error) -> (StoredOutcome, Cow<'static, [u8]>) {
    let source = CodecError::encoding(e);
    tracing::error!(error = %source, "the result does not encode; duplicates will get a codec error");
    unstored(Unstored::EncodeFailed {
        category: format!("{:?}", source.category()),
    })
}

fn unstored(why: Unstored) -> (StoredOutcome, Cow<'static, [u8]>) {
    let payload = serde_json::to_vec(&why).expect("Unstored always encodes");
    (StoredOutcome::Unstored, Cow::Owned(payload))
}
