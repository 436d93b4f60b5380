//! A call on the caller's transaction ([`execute_in_tx`]): the claim and the
//! result are written on the caller's connection and commit or roll back
//! with its business writes; with a result known before the body, the claim
//! writes the record DONE at once.

use tracing::Instrument;

use super::claim::{Acquired, Verdict, claim_failed, in_progress, judge, replay};
use super::record::finish;
use super::{FromIdemError, ReleaseAll, Spec, StoredForm, hint, report, span};
use crate::error::Error;
use crate::flow::{self, Flow};
use crate::key::{Fingerprint, Key};
use crate::observe::{self, CallOutcome};
use crate::store::tx::{AsTxConnection, TxConnection};
use crate::store::{ClaimRequest, Completion, StoredOutcome, Token};

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
