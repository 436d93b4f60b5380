//! Running the exploration: the clean run and the fault points it yields,
//! the schedules made from them, and each schedule driven on fresh state
//! (cut off, duplicate, stale owner, recovered), retried until the call
//! succeeds, then judged against the clean run.

use std::fmt::Debug;
use std::pin::Pin;
use std::time::{Duration, Instant};

use super::faults::{FaultStore, as_caller};
use super::schedule::{Schedule, describe};
use super::verdict::{Clean, Got, Wrong, diff, judge, judge_retry, said};
use super::{ACCEPT_ENV, Explorer, Failure, Report, START_MILLIS, history};
use crate::clock::ManualClock;
use crate::protocol::report::{Noted, observed};
use crate::store::StoreRef;

impl<S, T, E, P> Explorer<S, T, E, P>
where
    S: Clone + Send + Sync + 'static,
    T: PartialEq + Debug + Send + 'static,
    E: Debug + Send + 'static,
    P: PartialEq + Debug + Send + 'static,
{
    /// Moves the clock past any lease claimed so far.
    async fn outlast_leases(&self, clock: &ManualClock, store: &FaultStore) -> Duration {
        clock.advance(store.lease());
        match self.real_lease {
            Some(wait) => {
                tokio::time::sleep(wait).await;
                wait
            }
            None => store.lease(),
        }
    }

    /// [`Explorer::run`].
    pub(super) async fn explore(self) -> Report {
        let started = Instant::now();
        let clean = self.clean().await;
        let mut report = Report {
            explored: 0,
            skipped: 0,
            by_kind: Vec::new(),
            failure: None,
            clean_ops: Vec::new(),
            history: None,
            finished_by_worker: 0,
            elapsed: Duration::ZERO,
        };
        let (value, snapshot, ops) = match clean {
            Ok(clean) => clean,
            Err(problem) => {
                report.failure = Some(Failure {
                    schedule: "the clean run".to_owned(),
                    events: Vec::new(),
                    problem,
                });
                report.elapsed = started.elapsed();
                return report;
            }
        };
        report.clean_ops = ops.clone();
        if let Some(path) = &self.history {
            let accept = self
                .accept
                .unwrap_or_else(|| std::env::var_os(ACCEPT_ENV).is_some_and(|v| v != "0"));
            let scope = ops
                .iter()
                .find_map(|op| op.strip_prefix("claim call `"))
                .and_then(|rest| rest.split('`').next())
                .unwrap_or("the call");
            match history::check(path, scope, &history::of(&ops), accept) {
                Ok(note) => report.history = Some(note),
                Err(problem) => {
                    report.failure = Some(Failure {
                        schedule: "the step history".to_owned(),
                        events: Vec::new(),
                        problem,
                    });
                    report.elapsed = started.elapsed();
                    return report;
                }
            }
        }
        for schedule in self.schedules(&ops) {
            let (events, outcome) = self.one(schedule, &value, &snapshot).await;
            match outcome {
                Ok(true) => {
                    report.explored += 1;
                    report.count(schedule.kind());
                }
                Ok(false) => report.skipped += 1,
                Err(Wrong(problem)) => {
                    report.explored += 1;
                    report.count(schedule.kind());
                    report.failure = Some(Failure {
                        schedule: describe(schedule, &ops),
                        events,
                        problem,
                    });
                    break;
                }
            }
        }
        report.finished_by_worker = self
            .finished_by_worker
            .load(std::sync::atomic::Ordering::Relaxed);
        report.elapsed = started.elapsed();
        report
    }

    /// The clean run: its value, its snapshot and the first call's store
    /// operations.
    async fn clean(&self) -> Result<(Clean<T>, P, Vec<String>), String> {
        let clock = ManualClock::new(START_MILLIS);
        let store = FaultStore::new((self.store)(clock).await, None);
        let state = (self.fresh)(StoreRef::new(store.clone())).await;
        let got = self.call_as(1, &state).await;
        let value = match got.out {
            Ok(value) => Clean::Value(value),
            // A final error idem recorded (`final_err`): the outcome every
            // schedule must reach, its compensations done once.
            Err(e)
                if matches!(
                    got.noted,
                    Some(Noted::Call {
                        recorded_err: true,
                        ..
                    })
                ) =>
            {
                Clean::FinalError(format!("{e:?}"))
            }
            Err(e) => {
                return Err(format!(
                    "the clean run failed: {e:?} ({}); explore a call that succeeds, or ends with a final error (`final_err`)",
                    said(got.noted)
                ));
            }
        };
        let ops = store
            .trace()
            .into_iter()
            .filter(|op| op.caller == 1)
            .filter_map(|op| op.op)
            .collect();
        Ok((value, (self.snapshot)(state).await, ops))
    }

    fn schedules(&self, ops: &[String]) -> Vec<Schedule> {
        let wanted = |op: usize| match &self.step {
            Some(step) => ops[op].contains(&format!("step `{step}`")),
            None => true,
        };
        let mut all = Vec::new();
        for op in (0..ops.len()).filter(|&op| wanted(op)) {
            if self.faults.cut_offs {
                all.push(Schedule::CutOff { op, after: false });
                all.push(Schedule::CutOff { op, after: true });
                if self.recovery.is_some() {
                    all.push(Schedule::Recovered { op, after: false });
                    all.push(Schedule::Recovered { op, after: true });
                }
            }
            if self.faults.duplicates {
                all.push(Schedule::Duplicate { op });
            }
            if self.faults.stale_owners {
                all.push(Schedule::StaleOwner { op });
            }
        }
        if self.faults.duplicates && self.step.is_none() {
            all.push(Schedule::DuplicateAfterResult);
        }
        all
    }

    async fn call_as(&self, caller: u32, state: &S) -> Got<T, E> {
        let (out, noted, _) = as_caller(caller, observed((self.call)(state.clone()))).await;
        Got { out, noted }
    }

    /// Runs one schedule on fresh state: the trace, and `Ok(false)` when the
    /// first call never reached the schedule's point.
    async fn one(
        &self,
        schedule: Schedule,
        value: &Clean<T>,
        snapshot: &P,
    ) -> (Vec<String>, Result<bool, Wrong>) {
        let clock = ManualClock::new(START_MILLIS);
        let store = FaultStore::new((self.store)(clock.clone()).await, schedule.hold());
        let state = (self.fresh)(StoreRef::new(store.clone())).await;
        let outcome = self.drive(schedule, &store, &clock, &state, value).await;
        let outcome = match outcome {
            Ok(true) => {
                let now = (self.snapshot)(state).await;
                if &now == snapshot {
                    Ok(true)
                } else {
                    Err(Wrong(format!(
                        "the state differs from the clean run's:\n{}",
                        diff(&format!("{snapshot:#?}"), &format!("{now:#?}"))
                    )))
                }
            }
            other => other,
        };
        let events = store
            .trace()
            .into_iter()
            .map(|op| match op.caller {
                0 => op.text,
                n => format!("call {n}: {}", op.text),
            })
            .collect();
        (events, outcome)
    }

    async fn drive(
        &self,
        schedule: Schedule,
        store: &FaultStore,
        clock: &ManualClock,
        state: &S,
        value: &Clean<T>,
    ) -> Result<bool, Wrong> {
        let mut next_caller = 2;
        let mut succeeded = false;
        match schedule {
            Schedule::DuplicateAfterResult => {
                store.note("call 1 starts".to_owned());
                let first = self.call_as(1, state).await;
                succeeded |= judge(1, first, value, store, false)?;
                store.note("call 2 (a duplicate) starts after call 1 returned".to_owned());
                let second = self.call_as(2, state).await;
                if !judge(2, second, value, store, false)? {
                    return Err(Wrong(
                        "a duplicate after the stored result did not get it".to_owned(),
                    ));
                }
                next_caller = 3;
            }
            Schedule::CutOff { .. } | Schedule::Recovered { .. } => {
                store.note("call 1 starts".to_owned());
                let mut first: Pin<Box<_>> = Box::pin(self.call_as(1, state));
                tokio::select! {
                    _ = &mut first => {
                        // It never reached the point: nothing was explored.
                        return Ok(false);
                    }
                    () = store.reached() => {}
                }
                drop(first);
                store.note("call 1 is cut off: its future is dropped".to_owned());
                if let (Schedule::Recovered { .. }, Some(registry)) = (schedule, &self.recovery) {
                    let moved = self.outlast_leases(clock, store).await;
                    store.note(format!(
                        "the clock moves {moved:?} (the lease runs out); a recovery worker's pass"
                    ));
                    let worker = crate::recovery::Worker::builder(
                        StoreRef::new(store.clone()),
                        registry(state.clone()),
                    )
                    .build();
                    match worker.run_once().await {
                        Ok(pass) => {
                            store.note(format!(
                                "the worker found {}, recovered {}, gave up {}, failed {}, parked {}",
                                pass.found, pass.recovered, pass.gave_up, pass.failed, pass.parked
                            ));
                            self.finished_by_worker.fetch_add(
                                pass.recovered + pass.gave_up,
                                std::sync::atomic::Ordering::Relaxed,
                            );
                        }
                        Err(e) => {
                            return Err(Wrong(format!("the recovery worker's pass failed: {e}")));
                        }
                    }
                    store.note("call 2 (the caller, back) starts".to_owned());
                    let back = self.call_as(2, state).await;
                    succeeded |= judge_retry(2, back, value, store)?;
                    next_caller = 3;
                }
            }
            Schedule::Duplicate { .. } | Schedule::StaleOwner { .. } => {
                store.note("call 1 starts".to_owned());
                let mut first: Pin<Box<_>> = Box::pin(self.call_as(1, state));
                tokio::select! {
                    _ = &mut first => return Ok(false),
                    () = store.reached() => {}
                }
                let stale = matches!(schedule, Schedule::StaleOwner { .. });
                if stale {
                    let moved = self.outlast_leases(clock, store).await;
                    store.note(format!(
                        "call 1 stalls there; the clock moves {moved:?}: its lease runs out"
                    ));
                }
                store.note("call 2 (a duplicate) starts".to_owned());
                let mut second: Pin<Box<_>> = Box::pin(self.call_as(2, state));
                // A duplicate that waits for the first call (`wait = …`)
                // cannot finish while it is held: let the first go on.
                let second_first = tokio::select! {
                    got = &mut second => Some(got),
                    () = tokio::time::sleep(Duration::from_millis(200)) => None,
                };
                let second_done = second_first.is_some();
                if let Some(got) = second_first {
                    succeeded |= judge(2, got, value, store, false)?;
                }
                store.note("call 1 goes on".to_owned());
                store.release();
                let got = bounded(first).await.map_err(|()| {
                    Wrong("call 1 did not finish within 10 s after it went on".to_owned())
                })?;
                succeeded |= judge(1, got, value, store, stale)?;
                if !second_done {
                    let got = bounded(second)
                        .await
                        .map_err(|()| Wrong("call 2 did not finish within 10 s".to_owned()))?;
                    succeeded |= judge(2, got, value, store, false)?;
                }
                next_caller = 3;
            }
        }
        // Retried until it succeeds, the lease run out before each retry.
        let mut tries = 0;
        while !succeeded {
            if tries == self.retries {
                return Err(Wrong(format!(
                    "the call did not succeed in {} retries",
                    self.retries
                )));
            }
            tries += 1;
            let moved = self.outlast_leases(clock, store).await;
            store.note(format!(
                "the clock moves {moved:?} (any lease runs out); call {next_caller} (a retry) starts"
            ));
            let got = self.call_as(next_caller, state).await;
            succeeded = judge_retry(next_caller, got, value, store)?;
            next_caller += 1;
        }
        Ok(true)
    }
}

async fn bounded<F: Future>(fut: Pin<Box<F>>) -> Result<F::Output, ()> {
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .map_err(|_| ())
}
