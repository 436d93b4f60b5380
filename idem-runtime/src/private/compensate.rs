//! What `#[step(…, compensate = "…")]` expands to: the receiver and result
//! checks on the user's tokens, and the protocol call behind the same autoref
//! dispatch as the other steps (see `diagnostics.rs`).

use std::fmt::Debug;
use std::future::Future;

use crate::protocol::{Cacheable, FromIdemError};

/// The receiver of a step method with a compensation: the compensation runs
/// after the flow's body, when the step's borrow of `self` has ended, so it
/// gets a clone.
#[diagnostic::on_unimplemented(
    message = "a step method with `compensate` needs `{Self}: Clone + Send + Sync + 'static`",
    label = "the compensation runs after the flow's body has returned, on a clone of `self`",
    note = "derive `Clone` for `{Self}` (a service holding pools and `Arc`s clones cheaply), or put the step and its compensation on a free fn"
)]
pub trait CompensableReceiver: Clone + Send + Sync + 'static {}
impl<S: Clone + Send + Sync + 'static> CompensableReceiver for S {}

#[inline]
pub fn compensation_receiver<S: CompensableReceiver>(this: &S) -> S {
    this.clone()
}

/// A compensation's result: stored and replayed like a step's.
#[diagnostic::on_unimplemented(
    message = "a compensation must return `Result<T, E>` with a storable `T` and an `E: From<idem_runtime::Error> + Debug`; it returns `{Self}`",
    label = "the compensation's result is recorded so a retry never compensates twice",
    note = "return e.g. `Result<(), AppError>` where `AppError: From<idem_runtime::Error> + Debug`"
)]
pub trait CompensationResult {}
impl<U: Cacheable + Send + 'static, E2: FromIdemError + Debug + Send + 'static> CompensationResult
    for Result<U, E2>
{
}

#[inline]
pub fn compensation_result<R: CompensationResult>(r: R) -> R {
    r
}

/// The step's output `T` as the compensation's argument `P`, which must be
/// `T` itself: a compensation is called with the output, by value. `M` is
/// `Exact` for the one impl that applies; the second impl, which never
/// does, keeps rustc from settling `P` from `T` alone before the
/// compensation's parameter type is known, so a mismatch is this trait's
/// error (in words that say what to write) rather than "mismatched types".
#[diagnostic::on_unimplemented(
    message = "the compensation takes `{P}`, but it is called with the step's output, a `{Self}`",
    label = "`compensate` names the function that undoes the step: it gets the step's output by value",
    note = "declare the compensation's parameter as `{Self}`: `async fn undo(output: {Self}) -> Result<_, _>` (on a method, `async fn undo(&self, output: {Self})`)"
)]
pub trait CompensationInput<P, M> {
    fn into_input(self) -> P;
}

/// The marker of the [`CompensationInput`] that applies.
pub enum Exact {}

/// The marker of the [`CompensationInput`] that never applies.
pub enum NeverAnInput {}

/// What no compensation takes.
pub struct NotAnInput<T>(std::marker::PhantomData<T>);

#[diagnostic::do_not_recommend]
impl<T> CompensationInput<T, Exact> for T {
    #[inline]
    fn into_input(self) -> T {
        self
    }
}

#[diagnostic::do_not_recommend]
impl<T> CompensationInput<NotAnInput<T>, NeverAnInput> for T {
    #[inline]
    fn into_input(self) -> NotAnInput<T> {
        NotAnInput(std::marker::PhantomData)
    }
}

/// The compensation's argument: `P` is the compensation's parameter type,
/// so a mismatch is reported as [`CompensationInput`]'s.
#[inline]
pub fn compensation_arg<T: CompensationInput<P, M>, P, M>(output: T) -> P {
    output.into_input()
}

/// The protocol call of a compensated step, for result types it can cache
/// (the autoref dispatch of `diagnostics`).
pub trait WhenTypesHoldCompensated<T, E> {
    #[allow(clippy::too_many_arguments)]
    fn run_step_compensated<'a, F, C, CF, U, E2>(
        &self,
        step: crate::protocol::StepCall,
        compensation: &'static str,
        compensate: C,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: Send + 'static,
        E: 'a,
        C: FnOnce(T) -> CF + Send + 'static,
        CF: Future<Output = Result<U, E2>> + Send + 'static,
        U: Cacheable + Send + 'static,
        E2: FromIdemError + Debug + Send + 'static;
}

impl<T: Cacheable, E: FromIdemError> WhenTypesHoldCompensated<T, E>
    for super::diagnostics::Dispatch<Result<T, E>>
{
    fn run_step_compensated<'a, F, C, CF, U, E2>(
        &self,
        step: crate::protocol::StepCall,
        compensation: &'static str,
        compensate: C,
        body: F,
    ) -> impl Future<Output = Result<T, E>> + 'a
    where
        F: Future<Output = Result<T, E>> + 'a,
        T: Send + 'static,
        E: 'a,
        C: FnOnce(T) -> CF + Send + 'static,
        CF: Future<Output = Result<U, E2>> + Send + 'static,
        U: Cacheable + Send + 'static,
        E2: FromIdemError + Debug + Send + 'static,
    {
        crate::protocol::run_step_compensated(step, compensation, compensate, body)
    }
}

struct NeverInstantiated<T: ?Sized>(std::marker::PhantomData<T>);

impl<T: ?Sized> NeverInstantiated<T> {
    const ERROR: () = panic!(
        "idem: the compensated step fell back to `AfterTypeErrorCompensated` in a crate with no type error; please report this as a bug in idem"
    );
}

/// The fallback after a type error was reported (see `diagnostics`).
pub trait AfterTypeErrorCompensated {
    fn run_step_compensated<'a, F, C>(
        &self,
        _: crate::protocol::StepCall,
        _: &'static str,
        _: C,
        _: F,
    ) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        #[allow(clippy::let_unit_value)]
        let () = NeverInstantiated::<F>::ERROR;
        async { unreachable!("AfterTypeErrorCompensated is never instantiated") }
    }
}

impl<R> AfterTypeErrorCompensated for &super::diagnostics::Dispatch<R> {}
