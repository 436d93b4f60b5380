//! The two-phase protocol, independent of any backend:
//! claim → run the body (heartbeating the lease) → complete, or release on `Err`;
//! duplicates replay, wait, or get `InProgress` / `KeyReuse`.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use crate::error::{CodecError, Error};
use crate::flow::{self, FlowContext};
use crate::key::{Fingerprint, Key};
use crate::observe;
use crate::store::tx::{AsTxConnection, TxConnection};
use crate::store::{Claim, ClaimRequest, Completion, Outcome, StoreRef, StoredResult, Token};

/// What kind of call a [`Spec`] describes: it picks metric names and defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A request handler or any other call.
    Call,
    /// A message consumer: `InProgress` means "redeliver later".
    Consumer,
    /// A step inside a flow.
    Step,
}

/// The fixed settings of one idempotent call site.
///
/// The attribute builds it as a constant; code that does not use the macros
/// builds it by hand and calls [`execute`].
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::protocol::{Kind, Spec};
///
/// const SPEC: Spec = Spec::new("orders::create", Kind::Call)
///     .ttl(Duration::from_secs(24 * 3600))
///     .lease(Duration::from_secs(30));
/// assert_eq!(SPEC.wait, None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// The namespace of the keys (default: module path and function name).
    pub scope: &'static str,
    /// What kind of call this is.
    pub kind: Kind,
    /// How long a record lives: at least the longest retry or redelivery window.
    pub ttl: Duration,
    /// How long a PROCESSING claim holds without a heartbeat.
    pub lease: Duration,
    /// How long a duplicate waits for the first call before `InProgress`.
    pub wait: Option<Duration>,
}

impl Spec {
    /// A spec with the defaults for `kind`: ttl 24 h (7 d for consumers),
    /// lease 30 s, no waiting.
    pub const fn new(scope: &'static str, kind: Kind) -> Spec {
        let ttl = match kind {
            Kind::Consumer => Duration::from_secs(7 * 24 * 3600),
            Kind::Call | Kind::Step => Duration::from_secs(24 * 3600),
        };
        Spec {
            scope,
            kind,
            ttl,
            lease: Duration::from_secs(30),
            wait: None,
        }
    }

    /// Sets the record lifetime.
    pub const fn ttl(mut self, ttl: Duration) -> Spec {
        self.ttl = ttl;
        self
    }

    /// Sets the lease.
    pub const fn lease(mut self, lease: Duration) -> Spec {
        self.lease = lease;
        self
    }

    /// Makes duplicates wait up to `wait` for the first call's result.
    pub const fn wait(mut self, wait: Duration) -> Spec {
        self.wait = Some(wait);
        self
    }
}

/// A result type that can be stored and replayed.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cached as the result of an idempotent call: it is not `Serialize + DeserializeOwned`",
    label = "the result is stored and replayed to duplicates",
    note = "the `T` of `Result<T, E>` must implement `Serialize` and `DeserializeOwned` (derive `serde::Serialize` and `serde::Deserialize`)"
)]
pub trait Cacheable: Serialize + DeserializeOwned {}
impl<T: Serialize + DeserializeOwned> Cacheable for T {}

/// The `Serialize` half of [`Cacheable`]. Expansions check it first and alone,
/// then the rest only when it holds (see the `dispatch` module), so a type that
/// has neither serde trait gets one error rather than one per trait.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be cached as the result of an idempotent call: it is not `Serialize + DeserializeOwned`",
    label = "the result is stored and replayed to duplicates",
    note = "the `T` of `Result<T, E>` must implement `Serialize` and `DeserializeOwned` (derive `serde::Serialize` and `serde::Deserialize`)"
)]
pub trait CacheableSerialize: Serialize {}
impl<T: Serialize + ?Sized> CacheableSerialize for T {}

/// An error type `final_err` can store: a final error is replayed to duplicates.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored as a final error: it is not `Serialize + DeserializeOwned`",
    label = "with `final_err`, an error it calls final is stored and replayed to duplicates",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}` (skip what cannot be stored with `#[serde(skip)]`), or drop `final_err` so every `Err` releases the key for a retry"
)]
pub trait StorableError: Serialize + DeserializeOwned {}
impl<E: Serialize + DeserializeOwned> StorableError for E {}

/// The `Serialize` half of [`StorableError`], checked first and alone like
/// [`CacheableSerialize`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored as a final error: it is not `Serialize + DeserializeOwned`",
    label = "with `final_err`, an error it calls final is stored and replayed to duplicates",
    note = "derive `serde::Serialize` and `serde::Deserialize` for `{Self}` (skip what cannot be stored with `#[serde(skip)]`), or drop `final_err` so every `Err` releases the key for a retry"
)]
pub trait StorableErrorSerialize: Serialize {}
impl<E: Serialize + ?Sized> StorableErrorSerialize for E {}

/// An error type the protocol can report through.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot carry idempotency errors: it does not implement `From<idem_runtime::Error>`",
    label = "in-progress, key reuse and store failures reach the caller as this type",
    note = "implement `From<idem_runtime::Error>` for `{Self}` (for example a `#[from] idem_runtime::Error` variant with thiserror)"
)]
pub trait FromIdemError: From<Error> {}
impl<E: From<Error>> FromIdemError for E {}

/// A return type the attributes accept: a `Result<T, E>`, also when written
/// through an alias such as `io::Result<T>`. Expansions check its `Ok` against
/// [`Cacheable`] and its `Err` against [`FromIdemError`], each alone: a bound
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

/// How errors of the body are treated.
trait ErrorPolicy<E> {
    /// `Some(encoded)` stores the error as a final outcome; `None` releases the claim.
    fn keep(&self, err: &E) -> Option<Result<Vec<u8>, serde_json::Error>>;
    /// Decodes a stored final error.
    fn restore(&self, payload: &[u8]) -> Result<E, serde_json::Error>;
}

struct ReleaseAll;

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

struct KeepFinal<E>(fn(&E) -> bool);

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
///
/// ```
/// use idem_runtime::protocol::{execute, Kind, Spec};
/// use idem_runtime::{Error, Key, StoreRef};
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
pub async fn execute<T, E, F>(
    spec: &Spec,
    store: Option<StoreRef>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    body: F,
) -> Result<T, E>
where
    T: Cacheable,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
{
    run(spec, store, key, fingerprint, body, &ReleaseAll).await
}

/// Like [`execute`], but an `Err` for which `is_final` returns `true` is stored
/// and replayed like a success (a declined card, a validation failure) instead
/// of releasing the claim.
///
/// ```
/// use idem_runtime::protocol::{execute_keeping_final, Kind, Spec};
/// use idem_runtime::{Error, Key, StoreRef};
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
pub async fn execute_keeping_final<T, E, F>(
    spec: &Spec,
    store: Option<StoreRef>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    is_final: fn(&E) -> bool,
    body: F,
) -> Result<T, E>
where
    T: Cacheable,
    E: FromIdemError + Serialize + DeserializeOwned,
    F: Future<Output = Result<T, E>>,
{
    run(spec, store, key, fingerprint, body, &KeepFinal(is_final)).await
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
pub async fn execute_in_tx<C, T, E, F>(
    spec: &Spec,
    conn: &mut C,
    key: Key,
    fingerprint: Option<Fingerprint>,
    body: F,
) -> Result<T, E>
where
    C: AsTxConnection + ?Sized,
    T: Cacheable,
    E: FromIdemError,
    F: AsyncFnOnce(&mut C) -> Result<T, E>,
{
    let span = tracing::debug_span!("idem", scope = spec.scope, key = %key.short(), tx = true);
    async move {
        // Outside a transaction the claim would commit at once as PROCESSING
        // with nothing renewing its lease while the body runs (the body holds
        // the connection), so a slow body would be taken over while alive.
        if !conn.tx_connection().in_transaction() {
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
        let started = std::time::Instant::now();
        let claim = conn.tx_connection().claim(req).await;
        observe::claim_latency(spec, started.elapsed());
        let claim = claim
            .inspect_err(|e| claim_failed(spec, e))
            .map_err(Error::from)?;
        let fence = match judge(spec, claim, fingerprint)? {
            Verdict::Decided(Acquired::Replay(stored)) => return replay(spec, stored, &ReleaseAll),
            // A committed PROCESSING record from a call outside any transaction.
            Verdict::Busy(lease_remaining) => return Err(in_progress(spec, lease_remaining).into()),
            Verdict::Decided(Acquired::Owner { fence }) => fence,
        };
        let ctx = FlowContext::new(key, fingerprint, None, spec.ttl, spec.lease, Some(fence));
        let out = flow::scope(ctx, body(&mut *conn)).await;
        finish(spec, conn.tx_connection(), &key, token, out, &ReleaseAll).await
    }
    .instrument(span)
    .await
}

/// Runs a step of the current flow: replays its saved output if an earlier
/// attempt of the flow finished it, runs it otherwise. Outside a flow the body
/// simply runs.
///
/// Steps are told apart by `name` and by how many calls of that name already
/// finished in this run of the flow: a step called in a loop records each
/// call, and a failed attempt that the body retries reuses its number, so a
/// retry of the whole flow finds the attempt that succeeded. When the flow
/// declares a fingerprint, step records are bound to it: another payload never
/// sees them.
///
/// A flow whose lease was taken over starts no new step: the call fails with
/// [`Error::LeaseLost`].
pub async fn run_step<T, E, F>(name: &'static str, body: F) -> Result<T, E>
where
    T: Cacheable,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
{
    let Some((flow, store)) = flow::current().and_then(|f| f.store.clone().map(|s| (f, s))) else {
        // Outside a flow there is nothing to resume; inside a transaction the
        // whole call commits or rolls back as one, so steps need no records.
        tracing::trace!(step = name, "step outside a store-backed flow; running it");
        return body.await;
    };
    if flow.lease_lost() {
        tracing::warn!(
            step = name,
            "the flow's lease was taken over; not starting the step"
        );
        return Err(Error::LeaseLost {
            scope: name.to_owned(),
        }
        .into());
    }
    let (occurrence, key) = flow.next_occurrence(name);
    // A takeover can find the step still claimed by the crashed previous owner for
    // the few milliseconds its step lease outlives the flow lease: wait that out.
    let spec = Spec {
        scope: name,
        kind: Kind::Step,
        ttl: flow.ttl,
        lease: flow.lease,
        wait: Some(flow.lease),
    };
    let out = run(&spec, Some(store), key, None, body, &ReleaseAll).await;
    // Only a finished step spends its number; an `Err` (released, in progress,
    // a store failure) hands it back to the next call of this step.
    if out.is_ok() {
        occurrence.finish();
    }
    out
}

async fn run<T, E, F, P>(
    spec: &Spec,
    store: Option<StoreRef>,
    key: Key,
    fingerprint: Option<Fingerprint>,
    body: F,
    policy: &P,
) -> Result<T, E>
where
    T: Cacheable,
    E: FromIdemError,
    F: Future<Output = Result<T, E>>,
    P: ErrorPolicy<E>,
{
    let Some(store) = store.or_else(crate::global::default_store) else {
        return Err(Error::NoStore.into());
    };
    let span = tracing::debug_span!("idem", scope = spec.scope, key = %key.short(), fence = tracing::field::Empty);
    async move {
        let token = Token::random();
        match acquire(spec, &store, &key, token, fingerprint).await? {
            Acquired::Replay(stored) => replay(spec, stored, policy),
            Acquired::Owner { fence } => {
                tracing::Span::current().record("fence", fence);
                let ctx = FlowContext::new(
                    key,
                    fingerprint,
                    Some(store.clone()),
                    spec.ttl,
                    spec.lease,
                    Some(fence),
                );
                let beat = heartbeat(&store, &key, token, spec.lease, &ctx, body);
                let out = flow::scope(ctx.clone(), beat).await;
                let mut store = store;
                finish(spec, &mut store, &key, token, out, policy).await
            }
        }
    }
    .instrument(span)
    .await
}

enum Acquired {
    Owner { fence: u64 },
    Replay(StoredResult),
}

/// What one claim means for the caller.
enum Verdict {
    Decided(Acquired),
    Busy(Duration),
}

fn judge(spec: &Spec, claim: Claim, fingerprint: Option<Fingerprint>) -> Result<Verdict, Error> {
    let key_reuse = || {
        observe::call(spec, "key_reuse");
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

fn in_progress(spec: &Spec, retry_after: Duration) -> Error {
    observe::call(spec, "in_progress");
    Error::InProgress {
        scope: spec.scope.to_owned(),
        retry_after,
    }
}

fn claim_failed(spec: &Spec, e: &crate::StoreError) {
    observe::call(spec, "store_error");
    tracing::warn!(error = %e, "claim failed; the body does not run");
}

async fn acquire(
    spec: &Spec,
    store: &StoreRef,
    key: &Key,
    token: Token,
    fingerprint: Option<Fingerprint>,
) -> Result<Acquired, Error> {
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
        let claim = store.claim(req).await;
        observe::claim_latency(spec, started.elapsed());
        let claim = claim.inspect_err(|e| claim_failed(spec, e))?;
        let lease_remaining = match judge(spec, claim, fingerprint)? {
            Verdict::Decided(acquired) => return Ok(acquired),
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
            _ => return Err(in_progress(spec, lease_remaining)),
        }
    }
}

fn mismatch(ours: Option<Fingerprint>, theirs: Option<Fingerprint>) -> bool {
    // A record written before the call site declared a fingerprint (or after it
    // stopped) has nothing to compare against; only two known fingerprints can differ.
    matches!((ours, theirs), (Some(a), Some(b)) if a != b)
}

fn replay<T, E, P>(spec: &Spec, stored: StoredResult, policy: &P) -> Result<T, E>
where
    T: Cacheable,
    E: FromIdemError,
    P: ErrorPolicy<E>,
{
    let codec_error = |e: serde_json::Error| {
        let source = CodecError::from(e);
        observe::call(spec, "codec_error");
        tracing::error!(error = %source, "stored result does not decode");
        E::from(Error::Codec {
            scope: spec.scope.to_owned(),
            source,
        })
    };
    match stored.outcome {
        Outcome::Success => {
            let value = serde_json::from_slice(&stored.payload).map_err(codec_error)?;
            observe::call(spec, "replayed");
            Ok(value)
        }
        Outcome::FinalError => {
            let err = policy.restore(&stored.payload).map_err(codec_error)?;
            observe::call(spec, "replayed");
            Err(err)
        }
        Outcome::Unstored => {
            let why: Unstored = serde_json::from_slice(&stored.payload).map_err(codec_error)?;
            observe::call(spec, "replayed_unstored");
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

/// Why a finished body's result is not in the record.
#[derive(Debug, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum Unstored {
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

/// Polls the body and, beside it, renews the lease every third of it, so a long
/// body is never taken over while it is alive.
async fn heartbeat<F: Future>(
    store: &StoreRef,
    key: &Key,
    token: Token,
    lease: Duration,
    ctx: &FlowContext,
    body: F,
) -> F::Output {
    let period = (lease / 3).max(Duration::from_millis(10));
    let renew = async {
        loop {
            tokio::time::sleep(period).await;
            match store.renew(key, token, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    ctx.mark_lease_lost();
                    tracing::warn!(
                        "lease lost: another caller took over this key; no new step starts and its completion will win"
                    );
                    break;
                }
                // A transient failure: the next beat may get through before the lease ends.
                Err(e) => tracing::warn!(error = %e, "lease renewal failed"),
            }
        }
        std::future::pending::<()>().await;
    };
    tokio::select! {
        biased;
        out = body => out,
        () = renew => unreachable!("the heartbeat never finishes"),
    }
}

/// Where a finished call's outcome is written: a store, or the caller's
/// transaction.
trait Recorder {
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

impl Recorder for StoreRef {
    fn max_result_bytes(&self) -> usize {
        (**self).max_result_bytes()
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
        (**self).complete(key, token, completion).await
    }

    async fn release(&mut self, key: &Key, token: Token) -> Result<bool, crate::StoreError> {
        (**self).release(key, token).await
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

async fn finish<T, E, P, R>(
    spec: &Spec,
    store: &mut R,
    key: &Key,
    token: Token,
    out: Result<T, E>,
    policy: &P,
) -> Result<T, E>
where
    T: Cacheable,
    E: FromIdemError,
    P: ErrorPolicy<E>,
    R: Recorder + ?Sized,
{
    let (outcome, payload) = match &out {
        Ok(value) => match serde_json::to_vec(value) {
            Ok(bytes) => (Outcome::Success, bytes),
            Err(e) => unencodable(&e),
        },
        Err(err) => match policy.keep(err) {
            Some(Ok(bytes)) => (Outcome::FinalError, bytes),
            Some(Err(e)) => unencodable(&e),
            None => {
                observe::call(spec, "failed");
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
    if outcome == Outcome::Unstored {
        observe::call(spec, "unstored");
    }
    let completion = Completion {
        outcome,
        payload: &payload,
        ttl: spec.ttl,
    };
    match store.complete(key, token, completion).await {
        Ok(true) => observe::call(spec, "executed"),
        Ok(false) => {
            // The body ran and its effects happened: hand its result to the caller,
            // but the record belongs to whoever took over.
            observe::fenced(spec);
            tracing::warn!("completed after losing the claim; the newer owner's record stands");
        }
        Err(e) if store.must_record() => {
            observe::call(spec, "store_error");
            tracing::error!(error = %e, "could not record the result in the transaction; failing the call so it rolls back");
            return Err(E::from(Error::Store(e)));
        }
        Err(e) => {
            observe::call(spec, "store_error");
            tracing::error!(error = %e, "could not store the result; a duplicate will take over after the lease");
        }
    }
    out
}

fn unencodable(e: &serde_json::Error) -> (Outcome, Vec<u8>) {
    let source = CodecError::encoding(e);
    tracing::error!(error = %source, "the result does not encode; duplicates will get a codec error");
    unstored(Unstored::EncodeFailed {
        category: format!("{:?}", source.category()),
    })
}

fn unstored(why: Unstored) -> (Outcome, Vec<u8>) {
    let payload = serde_json::to_vec(&why).expect("Unstored always encodes");
    (Outcome::Unstored, payload)
}
