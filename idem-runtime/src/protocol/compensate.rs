//! Compensation: when a flow gives up, the steps it finished are undone in
//! reverse order, each undo recorded so it runs once.
//!
//! A flow gives up when its call ends with an error its `final_err` marks
//! final. Before anything is undone, a give-up record (the final error) is
//! written under the flow's step root: from then on the flow only goes back.
//! A retry that meets the record at a step that would run (a crash or a failed
//! compensation left the call unfinished) does not run it: the step fails with
//! [`Error::GaveUp`], and the call finishes the compensations and returns the
//! recorded final error, even if the step would succeed this time.
//!
//! Each compensation is a recorded step keyed by its step's record key, so a
//! retry replays the ones that finished and resumes at the one that did not.
//! The finished steps are found the way a retry finds them anyway: the body
//! runs again, and every step that replays registers its compensation with
//! its saved output.

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;

use crate::error::{CodecError, Error};
use crate::flow::{self, FlowContext, Pending};
use crate::key::Key;
use crate::store::{Completion, Store as _, StoreRef, StoredOutcome, Token};

use super::claim::{Acquired, acquire};
use super::{Cacheable, ErrorPolicy, FromIdemError, ReleaseAll, Spec, run};

const GIVE_UP_SCOPE: &str = "idem.give_up";

/// Reads the flow's give-up record once per run: the final error an earlier
/// run gave up with, if one did.
pub(super) async fn read_give_up(
    flow: &FlowContext,
    store: &StoreRef,
) -> Result<Option<Vec<u8>>, Error> {
    if let Some(known) = flow.known_give_up() {
        return Ok(known);
    }
    let spec = flow.step_spec(GIVE_UP_SCOPE);
    let key = flow.give_up_key();
    #[cfg(feature = "testing")]
    super::labels::note(key, crate::spec::Kind::Step, GIVE_UP_SCOPE);
    let token = Token::random();
    let found = match acquire(&spec, store, &key, token, None, None).await?.0 {
        Acquired::Replay(stored) => Some(stored.payload),
        Acquired::Owner { .. } => {
            // Only looking: an absent record stays absent.
            if let Err(e) = store.release(&key, token).await {
                tracing::warn!(error = %e, "could not release the give-up probe; it ends with its lease");
            }
            None
        }
    };
    flow.set_give_up(found.clone());
    Ok(found)
}

/// Writes the give-up record with `payload`, unless an earlier run wrote one:
/// the record that stands is returned.
async fn write_give_up(
    flow: &FlowContext,
    store: &StoreRef,
    payload: Vec<u8>,
) -> Result<Vec<u8>, Error> {
    let spec = flow.step_spec(GIVE_UP_SCOPE);
    let key = flow.give_up_key();
    #[cfg(feature = "testing")]
    super::labels::note(key, crate::spec::Kind::Step, GIVE_UP_SCOPE);
    let token = Token::random();
    let stands = match acquire(&spec, store, &key, token, None, None).await?.0 {
        Acquired::Replay(stored) => stored.payload,
        Acquired::Owner { .. } => {
            let completion = Completion {
                outcome: StoredOutcome::FinalError,
                payload: &payload,
                ttl: flow.ttl,
            };
            if !store.complete(&key, token, completion).await? {
                return Err(Error::LeaseLost {
                    scope: GIVE_UP_SCOPE.to_owned(),
                });
            }
            payload
        }
    };
    flow.set_give_up(Some(stands.clone()));
    Ok(stands)
}

/// A step that finished in this run registers its compensation with its output.
pub(super) fn register<T, C, CF, U, E2>(
    flow: &FlowContext,
    step: &'static str,
    compensation: &'static str,
    step_key: Key,
    output: &T,
    compensate: C,
) where
    T: Cacheable + Send + 'static,
    C: FnOnce(T) -> CF + Send + 'static,
    CF: Future<Output = Result<U, E2>> + Send + 'static,
    U: Cacheable + Send + 'static,
    E2: FromIdemError + Debug + Send + 'static,
{
    // The compensation gets the output as a replay would see it: its encoding.
    let encoded = serde_json::to_vec(output);
    let run = move |spec: Spec, store: StoreRef, key: Key| -> flow::CompensationFuture {
        Box::pin(async move {
            let encoded = encoded.map_err(|e| {
                format!(
                    "the step's output does not encode ({})",
                    CodecError::encoding(&e)
                )
            })?;
            let output: T = serde_json::from_slice(&encoded).map_err(|e| {
                format!(
                    "the step's output does not decode ({})",
                    CodecError::from(e)
                )
            })?;
            let out: Result<U, E2> = run(
                &spec,
                Some(store),
                key,
                None,
                compensate(output),
                ReleaseAll,
                None,
            )
            .await;
            out.map(drop).map_err(|e| format!("{e:?}"))
        })
    };
    flow.push_compensation(Pending {
        step,
        compensation,
        step_key,
        run: Box::new(run),
    });
}

/// Runs the registered compensations in reverse order of their steps.
async fn compensate_all(flow: &Arc<FlowContext>, store: &StoreRef) -> Result<(), Error> {
    for pending in flow.take_compensations().into_iter().rev() {
        flow.prove_ownership(pending.compensation).await?;
        let spec = flow.step_spec(pending.compensation);
        let key = pending.step_key.derive("idem:compensate");
        tracing::info!(
            step = pending.step,
            compensation = pending.compensation,
            "compensating a finished step"
        );
        (pending.run)(spec, store.clone(), key)
            .await
            .map_err(|message| {
                tracing::warn!(step = pending.step, compensation = pending.compensation, %message, "compensation failed; the call is released for a retry");
                Error::CompensationFailed {
                    scope: pending.compensation.to_owned(),
                    step: pending.step.to_owned(),
                    message,
                }
            })?;
    }
    Ok(())
}

/// The body of a call with `final_err`, which can give up: after the body,
/// decides whether the flow gave up (now, or in an earlier run) and if so
/// compensates before the final error is recorded. Runs inside the call's
/// flow scope and heartbeat, so the lease holds while it compensates. The
/// give-up record holds the final error in the form `policy` stores it.
pub(super) async fn settle<T, E, F, P>(body: F, policy: P) -> Result<T, E>
where
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
    P: ErrorPolicy<E>,
{
    let flow = flow::current();
    if let Some(flow) = &flow {
        flow.set_may_give_up();
    }
    let out = body.await;
    let Some((flow, store)) = flow.and_then(|f| f.store.clone().map(|s| (f, s))) else {
        return out;
    };
    let decided = match flow.known_give_up() {
        Some(Some(payload)) => Some(payload),
        // Nothing was finished that could be undone: the outcome stands as is.
        _ if !flow.has_compensations() => return out,
        _ => None,
    };
    let kept = match (&decided, &out) {
        (None, Err(e)) => policy.keep(e),
        _ => None,
    };
    let (payload, ours) = match (decided, kept) {
        (Some(payload), _) => (payload, None),
        (None, Some(kept)) => {
            let Ok(mine) = kept else {
                // The record layer reports an error that cannot be stored;
                // giving up on a decision that cannot be recorded is not safe.
                return out;
            };
            // A stale owner must not decide for a flow its successor may
            // have finished: every duplicate would replay that success with
            // its effects undone.
            if let Err(e) = flow.prove_ownership(GIVE_UP_SCOPE).await {
                return Err(E::from(e));
            }
            match write_give_up(&flow, &store, mine.clone()).await {
                Ok(stands) => {
                    let ours = stands == mine;
                    (stands, ours.then_some(()))
                }
                Err(e) => return Err(E::from(e)),
            }
        }
        // A retry whose steps all replayed never looked for the record; an
        // earlier run that gave up still decides.
        (None, None) if flow.replayed() => match read_give_up(&flow, &store).await {
            Ok(Some(payload)) => (payload, None),
            Ok(None) => return out,
            Err(e) => return Err(E::from(e)),
        },
        (None, None) => return out,
    };
    if let Err(e) = compensate_all(&flow, &store).await {
        return Err(E::from(e));
    }
    if ours.is_some() {
        return out;
    }
    match policy.restore(&payload) {
        Ok(e) => Err(e),
        Err(e) => Err(E::from(Error::Codec {
            scope: GIVE_UP_SCOPE.to_owned(),
            source: CodecError::from(e),
        })),
    }
}
