//! The two-phase protocol, independent of any backend:
//! claim → run the body (heartbeating the lease) → complete, or release on `Err`;
//! duplicates replay, wait, or get `InProgress` / `KeyReuse`.
//!
//! - this file: [`execute`] and [`execute_keeping_final`], a call on a
//!   store (claim, run under a heartbeat, record the outcome);
//! - `stored_form.rs`: what a result and an error must be to be stored
//!   ([`StoredForm`], [`Cacheable`], …), and whether an `Err` is final and
//!   what of it is stored ([`FinalVerdict`]);
//! - `in_tx.rs`: [`execute_in_tx`], a call on the caller's transaction;
//! - `step.rs`: [`run_step`] and [`StepCall`], the steps of a flow;
//! - `claim.rs`: one claim, what it means for the caller, waiting, and
//!   replaying a stored result;
//! - `heartbeat.rs`: renewing the lease while the body runs;
//! - `record.rs`: writing the outcome (complete or release), on a store or on
//!   the caller's transaction;
//! - `hint.rs`: when a duplicate should retry (`Error::InProgress`), from the
//!   durations this process observed;
//! - `report.rs`: each call outcome, once, to the task that runs the call
//!   (was it a replay; what the consumer runner must tell the broker) and to
//!   the metrics.
//! - `compensate.rs`: giving up a flow and undoing its finished steps.
//! - `args.rs`: a recoverable call's arguments as stored with its claim
//!   (sealed, capped); `recovering.rs`: what a recovery worker tells the call
//!   it runs. The worker itself is `crate::recovery`, which calls into here.
//!
//! The attribute expands to a call of [`execute`]; [`track_replays`] tells a
//! replay from a first execution:
//!
//! ```
//! use idem_runtime::protocol::track_replays;
//! use idem_runtime::store::memory::MemoryStore;
//!
//! #[idem_runtime::idempotent(key = "n", scope = "doc.protocol")]
//! async fn double(n: u64) -> Result<u64, idem_runtime::Error> { Ok(n * 2) }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! idem_runtime::install(MemoryStore::new());
//! let (first, replayed) = track_replays(double(21)).await;
//! assert_eq!((first.unwrap(), replayed), (42, false));
//! let (again, replayed) = track_replays(double(21)).await;
//! assert_eq!((again.unwrap(), replayed), (42, true));
//! # });
//! ```

pub(crate) mod args;
mod claim;
mod compensate;
mod heartbeat;
mod hint;
mod in_tx;
#[cfg(feature = "testing")]
pub(crate) mod labels;
mod record;
pub(crate) mod recovering;
pub(crate) mod report;
mod span;
mod step;
mod stored_form;

use std::future::Future;

use crate::error::Error;
use crate::flow::{self, Flow};
use crate::key::{Fingerprint, Key};
use crate::store::{RecoveryArgs, Store, StoreRef, Token};
use args::CallArgs;

pub use crate::spec::{Kind, Spec};

use claim::{Acquired, acquire, replay};
use heartbeat::heartbeat;
use record::{OnStore, finish};

pub use in_tx::execute_in_tx;
pub use report::track_replays;
pub use step::{StepCall, run_step, run_step_compensated};
pub(crate) use stored_form::FinalErrFn;
pub use stored_form::{
    Cacheable, FinalVerdict, FromIdemError, StorableError, StoredForm, ViaSerde,
};
pub(crate) use stored_form::{ErrorPolicy, KeepFinal, ReleaseAll};

/// Runs `body` at most once per `key` (within the record's ttl), replaying its
/// result to duplicates. `Err` releases the claim, so a retry runs again.
///
/// `store` of `None` means the process-wide default ([`crate::install`]).
/// The result is anything with a [`StoredForm`]: serde types and, with the
/// `axum` feature, the response types axum handlers return (`Json<T>`,
/// `(StatusCode, Json<T>)`); the marker `M` is inferred.
///
/// ```
/// use idem_runtime::protocol::{execute, Kind, Spec};
/// use idem_runtime::{Error, Key};
/// use idem_runtime::store::StoreRef;
/// use idem_runtime::store::memory::MemoryStore;
///
/// const SPEC: Spec = Spec::new("doc::charge", Kind::Call);
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = StoreRef::new(MemoryStore::new());
/// let key = Key::builder(SPEC.scope).part("order-7").finish();
/// let first: Result<u32, Error> = execute(&SPEC, Some(store.clone()), key, None, async { Ok(1) }).await;
/// let again: Result<u32, Error> = execute(&SPEC, Some(store), key, None, async { Ok(2) }).await;
/// assert_eq!(first.unwrap(), 1);
/// assert_eq!(again.unwrap(), 1); // replayed, the body did not run
/// # });
/// ```
// The `execute*` functions are plain functions returning `run`'s future, not
// `async fn`s: an `async fn` keeps its arguments, the body's future among
// them, for as long as it lives, so each layer would hold another copy of it.
pub fn execute<T, M, E, F>(
    spec: &Spec,
    store: Option<StoreRef>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    body: F,
) -> impl Future<Output = Result<T, E>>
where
    T: StoredForm<M>,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
{
    execute_on::<StoreRef, T, M, E, F>(spec, store, key, fingerprint, None, body)
}

/// [`execute`] on a store of a known type (what the attribute calls with
/// `store = …`): the store's futures are polled in place, not boxed.
/// `None` means the installed default, which only a [`StoreRef`] can be.
/// With `args` (a call with `recover`), the arguments are stored with the
/// claim, so a [`Worker`](crate::recovery::Worker) can finish the call if
/// its caller never comes back (see [`crate::recovery`]).
pub(crate) fn execute_on<S, T, M, E, F>(
    spec: &Spec,
    store: Option<S>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    args: Option<CallArgs>,
    body: F,
) -> impl Future<Output = Result<T, E>>
where
    S: Store + Clone,
    T: StoredForm<M>,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
{
    run::<S, T, M, E, F, ReleaseAll>(spec, store, key, fingerprint, body, ReleaseAll, args)
}

/// Like [`execute`], but an `Err` that `is_final` calls final is stored and
/// replayed like a success (a declined card, a validation failure) instead
/// of releasing the claim.
///
/// `is_final` answers a [`FinalVerdict`]: `bool` stores the error itself (`E`
/// must then be `Serialize + DeserializeOwned`); `Option<S>` stores `S`, and a
/// duplicate gets `E::from(s)`.
///
/// ```
/// use idem_runtime::protocol::{execute_keeping_final, Kind, Spec};
/// use idem_runtime::{Error, Key};
/// use idem_runtime::store::StoreRef;
/// use idem_runtime::store::memory::MemoryStore;
///
/// #[derive(Debug, serde::Serialize, serde::Deserialize)]
/// enum PayError { Declined, #[serde(skip)] Idem(String) }
/// impl From<Error> for PayError { fn from(e: Error) -> Self { PayError::Idem(e.to_string()) } }
///
/// const SPEC: Spec = Spec::new("doc::pay", Kind::Call);
/// let is_final = |e: &PayError| matches!(e, PayError::Declined);
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = StoreRef::new(MemoryStore::new());
/// let key = Key::builder(SPEC.scope).part("card-1").finish();
/// let first: Result<u32, PayError> =
///     execute_keeping_final(&SPEC, Some(store.clone()), key, None, is_final, async { Err(PayError::Declined) }).await;
/// let again: Result<u32, PayError> =
///     execute_keeping_final(&SPEC, Some(store), key, None, is_final, async { Ok(1) }).await;
/// assert!(matches!(again, Err(PayError::Declined))); // replayed, not charged again
/// # });
/// ```
pub fn execute_keeping_final<T, M, E, F, P, O>(
    spec: &Spec,
    store: Option<StoreRef>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    is_final: P,
    body: F,
) -> impl Future<Output = Result<T, E>>
where
    T: StoredForm<M>,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
    P: Fn(&E) -> O + Clone,
    O: FinalVerdict<E>,
{
    execute_keeping_final_on::<StoreRef, T, M, E, F, P>(
        spec,
        store,
        key,
        fingerprint,
        is_final,
        None,
        body,
    )
}

/// [`execute_keeping_final`] on a store of a known type, with `recover`'s
/// arguments if any (see [`execute_on`]).
pub(crate) fn execute_keeping_final_on<S, T, M, E, F, P>(
    spec: &Spec,
    store: Option<S>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    is_final: P,
    args: Option<CallArgs>,
    body: F,
) -> impl Future<Output = Result<T, E>>
where
    S: Store + Clone,
    T: StoredForm<M>,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
    P: FinalErrFn<E>,
{
    // A call that can give up compensates its finished steps first (see `compensate`).
    let body = compensate::settle(body, KeepFinal(is_final.clone()));
    run::<S, T, M, E, _, KeepFinal<P>>(
        spec,
        store,
        key,
        fingerprint,
        body,
        KeepFinal(is_final),
        args,
    )
}

/// One plain function around one `async` block, which alone holds the body's
/// future (see `execute`); the span is made when the call is first polled,
/// under whatever span is current then, as an `async fn`'s would be.
fn run<S, T, M, E, F, P>(
    spec: &Spec,
    store: Option<S>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    body: F,
    policy: P,
    args: Option<CallArgs>,
) -> impl Future<Output = Result<T, E>>
where
    S: Store + Clone,
    T: StoredForm<M>,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
    P: ErrorPolicy<E>,
{
    #[cfg(feature = "testing")]
    labels::note(key, spec.kind, spec.scope);
    let call = async move {
        let policy = &policy;
        let Some(store) = store.or_else(default_store) else {
            return Err(Error::NoStore.into());
        };
        // The first call a recovery runs must claim the abandoned record's key.
        let recovering = match spec.kind {
            Kind::Step => None,
            _ => recovering::check(&key),
        };
        if recovering == Some(false) {
            tracing::error!(scope = spec.scope, key = %key.short(), "a recovered call derived another key from its stored arguments; not claiming it");
            return Err(Error::RecoveryMismatch {
                scope: spec.scope.to_owned(),
            }
            .into());
        }
        let token = Token::random();
        let sealed = args.map(|a| args::seal(&key, spec.scope, &a, store.max_result_bytes()));
        let recovery = sealed.as_deref().map(|args| RecoveryArgs {
            scope: spec.scope,
            args,
        });
        match acquire(spec, &store, &key, token, fingerprint, recovery).await? {
            (Acquired::Replay(stored), _) => replay(spec, stored, policy),
            (Acquired::Owner { fence }, answered) => {
                span::record_fence(fence);
                let flow = Flow::new(
                    key,
                    fingerprint,
                    Some(store.share()),
                    spec.ttl,
                    spec.lease,
                    Some(fence),
                    Some(token),
                );
                let beat = heartbeat(&store, &key, token, spec.lease, body);
                let running = hint::Running::start(spec, key, answered);
                let out = flow::scope(flow, beat).await;
                running.finish();
                // A recovered call has no caller left to retry it: its claim
                // stays until the lease runs out, and comes back to the worker.
                let keep_claim = recovering == Some(true);
                let on = &mut OnStore(&store);
                finish(spec, on, &key, token, out, policy, keep_claim).await
            }
        }
    };
    span::InSpan::new(spec.scope, key, call)
}

/// The installed default store, for a call given none. Only a [`StoreRef`]
/// can be the default: a call whose store has another type always has one.
fn default_store<S: 'static>() -> Option<S> {
    debug_assert!(
        std::any::TypeId::of::<S>() == std::any::TypeId::of::<StoreRef>(),
        "a call without a store must be typed `None::<StoreRef>`"
    );
    let mut default = crate::install::default_store();
    (&mut default as &mut dyn std::any::Any)
        .downcast_mut::<Option<S>>()?
        .take()
}
