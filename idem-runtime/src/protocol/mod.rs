//! The two-phase protocol, independent of any backend:
//! claim → run the body (heartbeating the lease) → complete, or release on `Err`;
//! duplicates replay, wait, or get `InProgress` / `KeyReuse`.
//!
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

pub(crate) mod args;
mod claim;
mod compensate;
mod heartbeat;
mod hint;
#[cfg(feature = "testing")]
pub(crate) mod labels;
mod record;
pub(crate) mod recovering;
pub(crate) mod report;
mod span;

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::error::Error;
use crate::flow::{self, Flow, FlowContext};
use crate::key::{Fingerprint, Key};
use crate::observe::{self, CallOutcome};
use crate::store::tx::{AsTxConnection, TxConnection};
use crate::store::{ClaimRequest, Completion, RecoveryArgs, Store, StoreRef, StoredOutcome, Token};
use args::CallArgs;

pub use crate::spec::{Kind, Spec};

use claim::{Acquired, Verdict, acquire, claim_failed, in_progress, judge, replay};
use heartbeat::heartbeat;
use record::{OnStore, finish};

pub use report::track_replays;

/// A result type that can be stored and replayed.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cached as the result of an idempotent call: it is not `Serialize + DeserializeOwned`",
    label = "the result is stored and replayed to duplicates",
    note = "the `T` of `Result<T, E>` must implement `Serialize` and `DeserializeOwned` (derive `serde::Serialize` and `serde::Deserialize`)"
)]
pub trait Cacheable: Serialize + DeserializeOwned {}
impl<T: Serialize + DeserializeOwned> Cacheable for T {}

/// How a result is written to a record and read back: its stored form.
///
/// Every `Serialize + DeserializeOwned` type is stored as its JSON (marker
/// [`ViaSerde`]). Types that are not serde types themselves but wrap one get
/// their own impl under another marker, so the impls never overlap: with the
/// `axum` feature, `Json<T>` and `(StatusCode, Json<T>)` (see
/// `idem_runtime::http`). The marker is inferred: callers never name it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cached as the result of an idempotent call: it is not `Serialize + DeserializeOwned`",
    label = "the result is stored and replayed to duplicates",
    note = "the `T` of `Result<T, E>` must implement `Serialize` and `DeserializeOwned` (derive `serde::Serialize` and `serde::Deserialize`)"
)]
pub trait StoredForm<M>: Sized {
    /// The bytes stored in the record.
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error>;
    /// The value rebuilt from a record, for a duplicate.
    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error>;
    /// Exactly [`to_stored`](Self::to_stored)'s bytes, borrowed when the
    /// value already holds them (the HTTP layer encodes the response before
    /// the protocol stores it), so a completion does not copy them once
    /// more. The protocol calls it wherever it does not keep the bytes.
    #[doc(hidden)]
    fn stored_bytes(&self) -> Result<std::borrow::Cow<'_, [u8]>, serde_json::Error> {
        self.to_stored().map(std::borrow::Cow::Owned)
    }
}

/// The [`StoredForm`] marker of serde types: their JSON.
#[derive(Debug)]
pub enum ViaSerde {}

impl<T: Serialize + DeserializeOwned> StoredForm<ViaSerde> for T {
    fn to_stored(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    fn from_stored(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// An error type `final_err` can store: a final error is replayed to duplicates.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored as a final error: it is not `Serialize + DeserializeOwned`",
    label = "with `final_err`, an error it calls final is stored and replayed to duplicates",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}` (skip what cannot be stored with `#[serde(skip)]`), or drop `final_err` so every `Err` releases the key for a retry"
)]
pub trait StorableError: Serialize + DeserializeOwned {}
impl<E: Serialize + DeserializeOwned> StorableError for E {}

/// An error type the protocol can report through.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot carry idempotency errors: it does not implement `From<idem_runtime::Error>`",
    label = "in-progress, key reuse and store failures reach the caller as this type",
    note = "implement `From<idem_runtime::Error>` for `{Self}` (for example a `#[from] idem_runtime::Error` variant with thiserror)"
)]
pub trait FromIdemError: From<Error> {}
impl<E: From<Error>> FromIdemError for E {}

/// How errors of the body are treated.
pub(crate) trait ErrorPolicy<E> {
    /// `Some(encoded)` stores the error as a final outcome; `None` releases the claim.
    fn keep(&self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>>;
    /// Decodes a stored final error.
    fn restore(&self, payload: &[u8]) -> Result<E, serde_json::Error>;
}

pub(crate) struct ReleaseAll;

impl<E> ErrorPolicy<E> for ReleaseAll {
    fn keep(&self, _: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        None
    }

    fn restore(&self, _: &[u8]) -> Result<E, serde_json::Error> {
        // Only reachable if this call site once marked errors final and no longer
        // does: the stored error cannot be rebuilt without a codec for `E`.
        Err(serde::de::Error::custom(
            "a final error was stored, but this call site no longer keeps final errors",
        ))
    }
}

pub(crate) struct KeepFinal<E>(fn(&E) -> bool);

impl<E: Serialize + DeserializeOwned> ErrorPolicy<E> for KeepFinal<E> {
    fn keep(&self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>> {
        (self.0)(err).then(|| serde_json::to_vec(err))
    }

    fn restore(&self, payload: &[u8]) -> Result<E, serde_json::Error> {
        serde_json::from_slice(payload)
    }
}

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

/// Like [`execute`], but an `Err` for which `is_final` returns `true` is stored
/// and replayed like a success (a declined card, a validation failure) instead
/// of releasing the claim.
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
pub fn execute_keeping_final<T, M, E, F>(
    spec: &Spec,
    store: Option<StoreRef>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    is_final: fn(&E) -> bool,
    body: F,
) -> impl Future<Output = Result<T, E>>
where
    T: StoredForm<M>,
    E: FromIdemError + Serialize + DeserializeOwned,
    F: Future<Output = Result<T, E>>,
{
    execute_keeping_final_on::<StoreRef, T, M, E, F>(
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
pub(crate) fn execute_keeping_final_on<S, T, M, E, F>(
    spec: &Spec,
    store: Option<S>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    is_final: fn(&E) -> bool,
    args: Option<CallArgs>,
    body: F,
) -> impl Future<Output = Result<T, E>>
where
    S: Store + Clone,
    T: StoredForm<M>,
    E: FromIdemError + Serialize + DeserializeOwned,
    F: Future<Output = Result<T, E>>,
{
    // A call that can give up compensates its finished steps first (see `compensate`).
    let body = compensate::settle(body, is_final);
    run::<S, T, M, E, _, KeepFinal<E>>(
        spec,
        store,
        key,
        fingerprint,
        body,
        KeepFinal(is_final),
        args,
    )
}

/// Runs `body` at most once per `key`, recording the claim and the result on
/// the caller's transaction, so they commit or roll back with its business
/// writes. `body` gets the transaction back to do those writes.
///
/// A duplicate running concurrently blocks on the record's unique key until
/// this transaction ends, then replays its committed result (or runs, if it
/// rolled back). If the result cannot be recorded, the call fails with
/// [`Error::Store`] so the caller rolls back rather than commit effects with no
/// record. Steps inside the body run directly: the transaction already makes
/// the call all-or-nothing.
///
/// Use it under READ COMMITTED (the default of PostgreSQL; MySQL's default
/// REPEATABLE READ also works because the claim is a locking write). Under
/// SERIALIZABLE a blocked duplicate gets a serialization failure to retry.
///
/// `known` is the result when it is known before the body runs (the
/// expansion passes `Some(())` for a `Result<(), E>`, `None` otherwise). On
/// a connection that can ([`TxConnection::claims_done`]) the claim then
/// writes the record DONE at once and no completion follows: a statement
/// fewer per first call. The record is on the caller's transaction, so it
/// commits only with the body's writes and a rollback removes it with them;
/// an `Err` from the body releases it, and if that release fails the call
/// fails with [`Error::Store`] so the caller rolls back. A body whose `Ok`
/// differs from `known` fails the same way. What it cannot cover: a caller
/// that commits after its call panicked or was dropped mid-body commits the
/// record as done (without `known`, as a claim a retry takes over once its
/// lease runs out), with whatever the body had written. Dropping an sqlx
/// `Transaction` rolls it back; commit only after the call returned.
///
/// Under READ UNCOMMITTED, a duplicate could read such a record before the
/// transaction that wrote it ends and replay it.
pub async fn execute_in_tx<C, T, M, E, F>(
    spec: &Spec,
    conn: &mut C,
    key: Key,
    fingerprint: Option<Fingerprint>,
    known: Option<T>,
    body: F,
) -> Result<T, E>
where
    C: AsTxConnection + ?Sized,
    T: StoredForm<M>,
    E: FromIdemError,
    F: AsyncFnOnce(&mut C) -> Result<T, E>,
{
    let span = span::tx_span(spec.scope, &key);
    async move {
        // Outside a transaction the claim would commit at once as PROCESSING
        // with nothing renewing its lease while the body runs (the body holds
        // the connection), so a slow body would be taken over while alive.
        if !conn.tx_connection().in_transaction() {
            report::call(spec, CallOutcome::NotInTransaction);
            return Err(Error::NotInTransaction {
                scope: spec.scope.to_owned(),
            }
            .into());
        }
        let token = Token::random();
        let req = ClaimRequest {
            key: &key,
            token,
            fingerprint,
            lease: spec.lease,
            ttl: spec.ttl,
        };
        let done = known
            .filter(|_| conn.tx_connection().claims_done())
            .and_then(|value| value.to_stored().ok())
            .filter(|payload| {
                payload.len() <= TxConnection::max_result_bytes(conn.tx_connection())
            });
        let started = std::time::Instant::now();
        let claim = match &done {
            Some(payload) => {
                let completion = Completion {
                    outcome: StoredOutcome::Success,
                    payload,
                    ttl: spec.ttl,
                };
                conn.tx_connection().claim_done(req, completion).await
            }
            None => conn.tx_connection().claim(req).await,
        };
        let answered = std::time::Instant::now();
        observe::claim_latency(spec, answered - started);
        let claim = claim
            .inspect_err(|e| claim_failed(spec, e))
            .map_err(Error::from)?;
        let fence = match judge(spec, claim, fingerprint)? {
            Verdict::Decided(Acquired::Replay(stored)) => return replay(spec, stored, &ReleaseAll),
            // A committed PROCESSING record from a call outside any transaction.
            Verdict::Busy(lease_remaining) => {
                return Err(in_progress(spec, &key, lease_remaining).into());
            }
            Verdict::Decided(Acquired::Owner { fence }) => fence,
        };
        let flow = Flow::new(
            key,
            fingerprint,
            None,
            spec.ttl,
            spec.lease,
            Some(fence),
            None,
        );
        let running = hint::Running::start(spec, key, answered);
        let out = flow::scope(flow, body(&mut *conn)).await;
        running.finish();
        if let Some(written) = done {
            return finish_done(spec, conn.tx_connection(), &key, token, out, &written).await;
        }
        finish(
            spec,
            conn.tx_connection(),
            &key,
            token,
            out,
            &ReleaseAll,
            false,
        )
        .await
    }
    .instrument(span)
    .await
}

/// The end of a call whose claim wrote the record DONE with `written`: an
/// `Ok` that is what was written leaves it; an `Err` releases it. A record
/// that cannot be made to say what happened fails the call, so the caller
/// rolls back instead of committing a success that was not.
async fn finish_done<C, T, M, E>(
    spec: &Spec,
    conn: &mut C,
    key: &Key,
    token: Token,
    out: Result<T, E>,
    written: &[u8],
) -> Result<T, E>
where
    C: TxConnection + ?Sized,
    T: StoredForm<M>,
    E: FromIdemError,
{
    let problem = match &out {
        Ok(value) if value.stored_bytes().is_ok_and(|bytes| *bytes == *written) => {
            report::call(spec, CallOutcome::Executed);
            return out;
        }
        Ok(_) => "the body's result is not the one known before it ran, which the claim recorded",
        Err(_) => match conn.release(key, token).await {
            Ok(true) => {
                report::call(spec, CallOutcome::Failed);
                return out;
            }
            Ok(false) => "the record this call wrote done was gone when its body failed",
            Err(e) => {
                report::call(spec, CallOutcome::StoreError);
                tracing::error!(error = %e, "could not release the record after an error; failing the call so it rolls back");
                return Err(E::from(Error::Store(e)));
            }
        },
    };
    report::call(spec, CallOutcome::StoreError);
    tracing::error!("{problem}; failing the call so it rolls back");
    Err(E::from(Error::Store(crate::StoreError::new(
        conn.backend(),
        crate::store::tx::IN_TX,
        problem,
    ))))
}

/// Which call of a step [`run_step`] runs: the step's name and, for a step
/// declared with `#[step("name", key = "…")]`, the key built from the call's
/// arguments (its *item*).
///
/// Calls are numbered per name and item by how many of them already finished
/// in this run. A step without an item is numbered among all the calls of its
/// name, so a loop whose body goes on past a failed call hands that call's
/// number to the next item; keyed calls of different items never share a
/// number, so each keeps its record however the others went.
///
/// ```
/// use idem_runtime::Key;
/// use idem_runtime::protocol::StepCall;
///
/// let plain: StepCall = "deduct_stock".into();
/// let item = Key::builder("charge_item").part(&42_u64).finish();
/// let keyed = StepCall::new("charge_item").item(item);
/// assert_eq!(keyed.name(), "charge_item");
/// assert_eq!(plain.item_key(), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCall {
    name: &'static str,
    item: Option<Key>,
}

impl StepCall {
    /// A call of the step `name`, numbered among all the calls of that name.
    pub const fn new(name: &'static str) -> StepCall {
        StepCall { name, item: None }
    }

    /// The call is for `item` (what `#[step(key = …)]` builds): it is
    /// numbered among the calls of this name for the same item only.
    pub const fn item(self, item: Key) -> StepCall {
        StepCall {
            name: self.name,
            item: Some(item),
        }
    }

    /// The step's name.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The item's key, for a keyed call.
    pub const fn item_key(&self) -> Option<Key> {
        self.item
    }
}

impl From<&'static str> for StepCall {
    fn from(name: &'static str) -> StepCall {
        StepCall::new(name)
    }
}

/// Runs a step of the current flow: replays its saved output if an earlier
/// attempt of the flow finished it, runs it otherwise. Outside a flow the body
/// simply runs.
///
/// Steps are told apart by name, item (see [`StepCall`]) and by how many calls
/// of that name and item already finished in this run of the flow: a step
/// called in a loop records each call, and a failed attempt that the body
/// retries reuses its number, so a retry of the whole flow finds the attempt
/// that succeeded. When the flow
/// declares a fingerprint, step records are bound to it: another payload never
/// sees them.
///
/// A flow whose lease was taken over starts no new step: the call fails with
/// [`Error::LeaseLost`].
pub async fn run_step<T, M, E, F>(step: impl Into<StepCall>, body: F) -> Result<T, E>
where
    T: StoredForm<M>,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
{
    match step_in_flow::<T, M, E, F>(step.into(), body).await {
        StepRun::Finished(value, ..) => Ok(value),
        StepRun::Ended(out) => out,
        StepRun::Outside(body) => body.await,
    }
}

/// [`run_step`] for a step with a compensation: once the step finished (ran,
/// or replayed its saved output), `compensate` is registered with its output,
/// and runs, recorded, if the flow gives up (a call with `final_err` ends with
/// a final error). See the README's "Compensation".
pub async fn run_step_compensated<T, E, F, C, CF, U, E2>(
    step: impl Into<StepCall>,
    compensation: &'static str,
    compensate: C,
    body: F,
) -> Result<T, E>
where
    T: Cacheable + Send + 'static,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
    C: FnOnce(T) -> CF + Send + 'static,
    CF: Future<Output = Result<U, E2>> + Send + 'static,
    U: Cacheable + Send + 'static,
    E2: FromIdemError + std::fmt::Debug + Send + 'static,
{
    let step = step.into();
    match step_in_flow::<T, ViaSerde, E, F>(step, body).await {
        StepRun::Finished(value, flow, key) => {
            compensate::register(&flow, step.name, compensation, key, &value, compensate);
            Ok(value)
        }
        StepRun::Ended(out) => out,
        StepRun::Outside(body) => body.await,
    }
}

/// How a step went.
enum StepRun<T, E, F> {
    /// It reached a stored outcome (ran, or replayed): its value, the flow,
    /// and the step's record key, which its compensation hangs off.
    Finished(T, std::sync::Arc<FlowContext>, Key),
    /// It ended without one: an error, released for the flow's retry.
    Ended(Result<T, E>),
    /// Outside a store-backed flow: the body, to run as it is.
    Outside(F),
}

/// A step's run inside a store-backed flow.
async fn step_in_flow<T, M, E, F>(step: StepCall, body: F) -> StepRun<T, E, F>
where
    T: StoredForm<M>,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
{
    let name = step.name;
    let Some((flow, store)) = flow::current_with_store() else {
        // Outside a flow there is nothing to resume; inside a transaction the
        // whole call commits or rolls back as one, so steps need no records.
        tracing::trace!(step = name, "step outside a store-backed flow; running it");
        return StepRun::Outside(body);
    };
    let spec = flow.step_spec(name);
    if flow.lease_lost() {
        report::call(&spec, CallOutcome::LeaseLost);
        tracing::warn!(
            step = name,
            "the flow's lease was taken over; not starting the step"
        );
        return StepRun::Ended(Err(Error::LeaseLost {
            scope: name.to_owned(),
        }
        .into()));
    }
    let (occurrence, key) = flow.next_occurrence(name, step.item);
    let executed = std::sync::atomic::AtomicBool::new(false);
    // Runs only when the step has no finished record, i.e. would run forward.
    let guarded = async {
        executed.store(true, std::sync::atomic::Ordering::Relaxed);
        if flow.known_give_up().flatten().is_some()
            || (flow.must_look_for_give_up()
                && compensate::read_give_up(&flow, &store).await?.is_some())
        {
            tracing::info!(
                step = name,
                "the flow gave up in an earlier run; not running the step"
            );
            return Err(Error::GaveUp {
                scope: name.to_owned(),
            }
            .into());
        }
        body.await
    };
    let out = run::<StoreRef, T, M, E, _, ReleaseAll>(
        &spec,
        Some(store.clone()),
        key,
        None,
        guarded,
        ReleaseAll,
        None,
    )
    .await;
    // Only a finished step spends its number; an `Err` (released, in progress,
    // a store failure) hands it back to the next call of this step.
    match out {
        Ok(value) => {
            occurrence.finish();
            if !executed.load(std::sync::atomic::Ordering::Relaxed) {
                flow.mark_replayed();
            }
            StepRun::Finished(value, flow, key)
        }
        Err(e) => StepRun::Ended(Err(e)),
    }
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
