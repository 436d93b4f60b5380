//! One turn at one abandoned claim: open and decode its stored arguments,
//! take the turn in the store (counted, spaced by the backoff, parked after
//! `max_attempts`), run the registered function as the call's caller would,
//! and judge from what the call reported how the turn went.

use std::time::Duration;

use super::registry::{Ended, Recoverable};
use super::stats::Outcome;
use super::worker::Worker;
use crate::abort::AbortOnDrop;
use crate::observe::CallOutcome;
use crate::protocol::args;
use crate::protocol::recovering::{self as context, Expectation, Met};
use crate::protocol::report::{self, Noted};
use crate::store::{Abandoned, RecoveryTurn, Store as _, Turn};

impl Worker {
    fn backoff_for(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.s
            .first_backoff
            .saturating_mul(1u32 << doublings)
            .min(self.s.max_backoff)
    }

    /// One abandoned claim: check and decode its arguments, take the turn,
    /// run the function.
    pub(super) async fn turn(&self, function: &Recoverable, abandoned: &Abandoned) -> Outcome {
        let span = tracing::info_span!("idem_recovery", scope = function.scope(), key = %abandoned.key.short(), fence = abandoned.fence);
        tracing::Instrument::instrument(self.turn_in_span(function, abandoned), span).await
    }

    async fn turn_in_span(&self, function: &Recoverable, abandoned: &Abandoned) -> Outcome {
        let scope = function.scope();
        let key = abandoned.key;
        let prepared = args::open(&key, scope, &abandoned.args)
            .map_err(|why| why.0)
            .and_then(|json| {
                function.prepare(json).map_err(|e| {
                    format!(
                        "the stored arguments do not decode into the function's parameters ({e}): its signature changed since the call was made"
                    )
                })
            });
        let call = match prepared {
            Ok(call) => call,
            Err(why) => return self.park_now(abandoned, scope, &why).await,
        };
        let note = format!(
            "gave up after {} recoveries that did not finish the flow",
            self.s.max_attempts
        );
        let turn = RecoveryTurn {
            fence: abandoned.fence,
            retry_in: self.backoff_for(abandoned.attempts.saturating_add(1)),
            max_attempts: self.s.max_attempts,
            note: &note,
            park_now: false,
        };
        let attempt = match self.store.take_recovery(&key, turn).await {
            Ok(Turn::Run { attempt }) => attempt,
            Ok(Turn::Parked { attempts }) => {
                tracing::warn!(
                    attempts,
                    "parked for an operator: {note}; `idem recover` retries it"
                );
                return Outcome::Parked;
            }
            Ok(Turn::Gone) => return Outcome::Gone,
            Err(e) => {
                tracing::warn!(error = %e, "could not take a turn at the claim");
                return Outcome::Failed;
            }
        };
        let expectation = Expectation::new(key);
        // Spawned, so a panicking function is a failed recovery, not a dead worker.
        let run = tokio::spawn(tracing::Instrument::in_current_span(report::observed(
            context::expect(expectation.clone(), call),
        )));
        // A dropped turn (the worker's future dropped) aborts the call with it,
        // as dropping any idempotent call's future stops it: a spawned task
        // whose handle is dropped would otherwise run on, unwatched.
        let _abort = AbortOnDrop::new(&run);
        let (ended, noted, _) = match run.await {
            Ok(done) => done,
            Err(e) => {
                tracing::error!(attempt, error = %e, "the recovered call panicked; its claim comes back after its lease and backoff");
                return Outcome::Failed;
            }
        };
        match (expectation.met(), ended, noted) {
            (Met::Mismatched, ..) => {
                self.park_now(
                    abandoned,
                    scope,
                    "the stored arguments derive another key than the record's: the key's segments, the scope or the key secret changed since the call was made",
                )
                .await
            }
            (Met::Never, ..) => {
                tracing::warn!(attempt, "the recovered call ended before it claimed its key (is a store installed?)");
                Outcome::Failed
            }
            (Met::Matched, Ended::Ok, _) => {
                tracing::info!(attempt, "recovered the flow");
                Outcome::Recovered
            }
            (
                Met::Matched,
                Ended::Err,
                Some(Noted::Call {
                    outcome: CallOutcome::Executed | CallOutcome::Replayed,
                    recorded_err: true,
                }),
            ) => {
                tracing::info!(attempt, "the recovered flow ended with its final error; finished steps compensated");
                Outcome::GaveUp
            }
            (
                Met::Matched,
                Ended::Err,
                Some(Noted::Call {
                    outcome: CallOutcome::InProgress,
                    ..
                })
                | Some(Noted::Fenced { .. }),
            ) => {
                tracing::info!(attempt, "another owner holds the claim now");
                Outcome::Busy
            }
            (Met::Matched, Ended::Err, noted) => {
                let why = match noted {
                    Some(Noted::Call { outcome, .. }) => outcome.as_str(),
                    _ => "error",
                };
                tracing::warn!(attempt, outcome = why, "the recovery did not finish the flow; it comes back after its lease and backoff");
                Outcome::Failed
            }
        }
    }

    async fn park_now(&self, abandoned: &Abandoned, scope: &str, why: &str) -> Outcome {
        let turn = RecoveryTurn {
            fence: abandoned.fence,
            retry_in: Duration::ZERO,
            max_attempts: self.s.max_attempts,
            note: why,
            park_now: true,
        };
        match self.store.take_recovery(&abandoned.key, turn).await {
            Ok(Turn::Parked { .. }) => {
                tracing::error!(scope, key = %abandoned.key.short(), "parked for an operator: {why}");
                Outcome::Parked
            }
            Ok(Turn::Gone) => Outcome::Gone,
            Ok(Turn::Run { .. }) => Outcome::Failed,
            Err(e) => {
                tracing::warn!(error = %e, "could not park the claim");
                Outcome::Failed
            }
        }
    }
}
