//! One part under the supervisor: started, watched, started again after a
//! failure (or not, by the policy), its state published at each change.

use std::future::Future;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::health::{PartState, PartStatus};
use super::stop::Stop;
use crate::abort::AbortOnDrop;

/// What a part's run ended with, other than `Ok`.
pub(super) type PartError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Starts one run of a part; called again for each restart.
pub(super) type Start = Box<dyn FnMut(Stop) -> BoxFuture<'static, Result<(), PartError>> + Send>;

/// What the supervisor does when a part fails.
#[derive(Debug, Clone, Copy)]
pub(super) enum Policy {
    Restart { first: Duration, max: Duration },
    StopAll,
}

/// A part that failed and was not started again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the supervised part {part:?} failed: {error}")]
#[non_exhaustive]
pub struct PartFailed {
    /// The part's name.
    pub part: String,
    /// Its error, or the message of its panic.
    pub error: String,
}

/// The part's slot in the health report.
pub(super) struct Report {
    pub(super) health: watch::Sender<Vec<PartStatus>>,
    pub(super) index: usize,
    pub(super) name: String,
}

impl Report {
    pub(super) fn set(&self, state: PartState, error: Option<String>) {
        self.health.send_modify(|parts| {
            let part = &mut parts[self.index];
            part.state = state;
            if error.is_some() {
                part.last_error = error;
            }
        });
        metrics::gauge!("idem_supervisor_part_up", "part" => self.name.clone()).set(
            if state == PartState::Running {
                1.0
            } else {
                0.0
            },
        );
    }

    fn restarted(&self) {
        self.health
            .send_modify(|parts| parts[self.index].restarts += 1);
        metrics::counter!("idem_supervisor_restarts_total", "part" => self.name.clone())
            .increment(1);
    }
}

/// Runs the part until the shutdown (and its work in flight) is over, or
/// until it fails under `StopAll`; `Some` is a failure the supervisor's
/// `run_until` reports.
pub(super) async fn supervise(
    mut start: Start,
    stop: Stop,
    policy: Policy,
    report: Report,
) -> Option<PartFailed> {
    let mut delay = match policy {
        Policy::Restart { first, .. } => first,
        Policy::StopAll => Duration::ZERO,
    };
    loop {
        if stop.is_stopped() {
            report.set(PartState::Stopped, None);
            return None;
        }
        let started = Instant::now();
        let ended = run_once(&mut start, &stop, &report).await;
        let error = match ended {
            Ok(()) if stop.is_stopped() => {
                tracing::info!(part = %report.name, "supervisor: part stopped");
                report.set(PartState::Stopped, None);
                return None;
            }
            Ok(()) => {
                tracing::warn!(part = %report.name, "supervisor: part returned on its own; not started again");
                report.set(PartState::Finished, None);
                return None;
            }
            Err(error) => error,
        };
        let failed = |report: &Report, error: String| {
            tracing::error!(part = %report.name, %error, "supervisor: part failed; not started again");
            report.set(PartState::Failed, Some(error.clone()));
            Some(PartFailed {
                part: report.name.clone(),
                error,
            })
        };
        let (first, max) = match policy {
            _ if stop.is_stopped() => return failed(&report, error),
            Policy::StopAll => return failed(&report, error),
            Policy::Restart { first, max } => (first, max),
        };
        // A part that ran longer than the longest wait failed anew, not in a
        // loop: it starts over from the first delay.
        if started.elapsed() >= max {
            delay = first;
        }
        tracing::error!(part = %report.name, %error, retry_in = ?delay, "supervisor: part failed; starting it again");
        report.set(PartState::Restarting, Some(error));
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stop.clone() => {
                report.set(PartState::Stopped, None);
                return None;
            }
        }
        delay = delay.saturating_mul(2).min(max);
        report.restarted();
    }
}

/// One run of the part, on a task of its own so a panic is caught as its
/// failure; marked `Stopping` when the shutdown comes while it runs.
async fn run_once(start: &mut Start, stop: &Stop, report: &Report) -> Result<(), String> {
    let task = tokio::spawn(start(stop.clone()));
    let _abort = AbortOnDrop::new(&task);
    report.set(PartState::Running, None);
    tracing::info!(part = %report.name, "supervisor: part started");
    let mut task = std::pin::pin!(task);
    let mut stopping = std::pin::pin!(stop.clone());
    let mut marked = false;
    let joined = loop {
        tokio::select! {
            joined = &mut task => break joined,
            () = &mut stopping, if !marked => {
                marked = true;
                report.set(PartState::Stopping, None);
            }
        }
    };
    match joined {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(match e.try_into_panic() {
            Ok(panic) => format!("panicked: {}", panic_message(&*panic)),
            Err(e) => e.to_string(),
        }),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// A part's run as the supervisor stores it.
pub(super) fn boxed<F, Fut, E>(mut run: F) -> Start
where
    F: FnMut(Stop) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<PartError>,
{
    Box::new(move |stop| {
        let run = run(stop);
        Box::pin(async move { run.await.map_err(Into::into) })
    })
}
