//! One claim and what it means for the caller: run the body, replay a stored
//! result, wait for the owner, or fail with `InProgress` / `KeyReuse`.

use std::time::Duration;

use crate::error::{CodecError, Error};
use crate::key::{Fingerprint, Key};
use crate::observe::{self, CallOutcome};
use crate::store::{Claim, ClaimRequest, RecoveryArgs, Store, StoredOutcome, StoredResult, Token};

use super::record::Unstored;
use super::{ErrorPolicy, FromIdemError, Spec, StoredForm, hint, report};

pub(super) enum Acquired {
    Owner { fence: u64 },
    Replay(StoredResult),
}

/// What one claim means for the caller.
pub(super) enum Verdict {
    Decided(Acquired),
    Busy(Duration),
}

pub(super) fn judge(
    spec: &Spec,
    claim: Claim,
    fingerprint: Option<Fingerprint>,
) -> Result<Verdict, Error> {
    let key_reuse = || {
        report::call(spec, CallOutcome::KeyReuse);
        Error::KeyReuse {
            scope: spec.scope.to_owned(),
        }
    };
    match claim {
        Claim::Acquired { fence, takeover } => {
            if takeover {
                observe::takeover(spec);
                tracing::warn!(fence, "previous owner's lease ran out; taking over");
            }
            Ok(Verdict::Decided(Acquired::Owner { fence }))
        }
        Claim::Done(stored) if mismatch(fingerprint, stored.fingerprint) => Err(key_reuse()),
        Claim::Done(stored) => Ok(Verdict::Decided(Acquired::Replay(stored))),
        Claim::Busy {
            fingerprint: theirs,
            ..
        } if mismatch(fingerprint, theirs) => Err(key_reuse()),
        Claim::Busy {
            lease_remaining, ..
        } => Ok(Verdict::Busy(lease_remaining)),
    }
}

/// `InProgress`, with a hint of when the first call's result is likely ready
/// rather than when its lease would run out (see `hint.rs`).
pub(super) fn in_progress(spec: &Spec, key: &Key, lease_remaining: Duration) -> Error {
    report::call(spec, CallOutcome::InProgress);
    Error::InProgress {
        scope: spec.scope.to_owned(),
        retry_after: hint::retry_after(spec, key, lease_remaining),
    }
}

pub(super) fn claim_failed(spec: &Spec, e: &crate::StoreError) {
    report::call(spec, CallOutcome::StoreError);
    tracing::warn!(error = %e, "claim failed; the body does not run");
}

/// Claims the key (waiting up to the spec's `wait` while it is busy), and
/// says when the store answered. With `recovery`, the call's arguments are
/// stored with the claim.
pub(super) async fn acquire<S: Store>(
    spec: &Spec,
    store: &S,
    key: &Key,
    token: Token,
    fingerprint: Option<Fingerprint>,
    recovery: Option<RecoveryArgs<'_>>,
) -> Result<(Acquired, std::time::Instant), Error> {
    let req = ClaimRequest {
        key,
        token,
        fingerprint,
        lease: spec.lease,
        ttl: spec.ttl,
    };
    let deadline = spec.wait.map(|w| tokio::time::Instant::now() + w);
    let mut backoff = Duration::from_millis(5);
    loop {
        let started = std::time::Instant::now();
        let claim = match recovery {
            Some(recovery) => store.claim_recoverable(req, recovery).await,
            None => store.claim(req).await,
        };
        // One reading for the latency and for when the body starts.
        let answered = std::time::Instant::now();
        observe::claim_latency(spec, answered - started);
        let claim = claim.inspect_err(|e| claim_failed(spec, e))?;
        let lease_remaining = match judge(spec, claim, fingerprint)? {
            Verdict::Decided(acquired) => return Ok((acquired, answered)),
            Verdict::Busy(lease_remaining) => lease_remaining,
        };
        let now = tokio::time::Instant::now();
        match deadline {
            Some(deadline) if now < deadline => {
                let nap = backoff
                    .min(deadline - now)
                    .min(lease_remaining.max(backoff));
                tokio::time::sleep(nap).await;
                backoff = (backoff * 2).min(Duration::from_millis(250));
            }
            _ => return Err(in_progress(spec, key, lease_remaining)),
        }
    }
}

fn mismatch(ours: Option<Fingerprint>, theirs: Option<Fingerprint>) -> bool {
    // A record written before the call site declared a fingerprint (or after it
    // stopped) has nothing to compare against; only two known fingerprints can differ.
    matches!((ours, theirs), (Some(a), Some(b)) if a != b)
}

pub(super) fn replay<T, M, E, P>(spec: &Spec, stored: StoredResult, policy: &P) -> Result<T, E>
where
    T: StoredForm<M>,
    E: FromIdemError,
    P: ErrorPolicy<E>,
{
    let codec_error = |e: serde_json::Error| {
        let source = CodecError::from(e);
        report::call(spec, CallOutcome::CodecError);
        tracing::error!(error = %source, "stored result does not decode");
        E::from(Error::Codec {
            scope: spec.scope.to_owned(),
            source,
        })
    };
    report::replayed(spec);
    match stored.outcome {
        StoredOutcome::Success => {
            let value = T::from_stored(&stored.payload).map_err(codec_error)?;
            report::call(spec, CallOutcome::Replayed);
            Ok(value)
        }
        StoredOutcome::FinalError => {
            let err = policy.restore(&stored.payload).map_err(codec_error)?;
            report::call_ending_in_recorded_err(spec, CallOutcome::Replayed);
            Err(err)
        }
        StoredOutcome::Unstored => {
            let why: Unstored = serde_json::from_slice(&stored.payload).map_err(codec_error)?;
            report::call_ending_in_recorded_err(spec, CallOutcome::ReplayedUnstored);
            Err(E::from(match why {
                Unstored::TooLarge { size, limit } => Error::ResultTooLarge {
                    scope: spec.scope.to_owned(),
                    size,
                    limit,
                },
                Unstored::EncodeFailed { .. } => Error::Codec {
                    scope: spec.scope.to_owned(),
                    source: CodecError::unencodable(),
                },
            }))
        }
    }
}
