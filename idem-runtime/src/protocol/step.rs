//! Steps of a flow ([`run_step`], [`run_step_compensated`]): which call of a
//! step this is ([`StepCall`]: its name, its item, its number in the run),
//! replaying a finished step's saved output, running it otherwise, and
//! registering its compensation.

use std::future::Future;

use super::{Cacheable, FromIdemError, ReleaseAll, StoredForm, ViaSerde, compensate, report, run};
use crate::error::Error;
use crate::flow::{self, FlowContext};
use crate::key::Key;
use crate::observe::CallOutcome;
use crate::store::StoreRef;

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
/// a final error). See the guide's [steps](crate::guide::steps) page.
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
