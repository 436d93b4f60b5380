//! The runner's loop: deliveries taken while fewer than `concurrency` are in
//! flight, until the broker fails or a stop asks it to end, and the
//! `run_until` forms that take that stop.

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use futures_util::StreamExt;
use futures_util::stream::{self, FuturesUnordered};

use super::{Action, BrokerError, FromDelivery, Runner, Source};
use crate::abort::AbortOnDrop;

impl Runner {
    /// [`Runner::run`] until `stop` completes: then no new delivery is taken,
    /// the ones in flight run to their end (each acked, redelivered or parked
    /// as its outcome says), and `Ok` is returned. A broker error before that
    /// ends it as `run` does, with the error (after the deliveries in
    /// flight), and so does one while it finishes them.
    ///
    /// What the source had read and not handed out yet (a `next()` still
    /// waiting when the stop came) is dropped with it: the broker delivers
    /// it again, to this consumer's successor or another one, as after a
    /// crash. [`Supervisor::consumer`](crate::supervisor::Supervisor::consumer)
    /// passes its shutdown here.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_runtime::consumer::{BrokerError, Runner, Source, testing::Memory};
    ///
    /// /// One message, then a quiet queue.
    /// struct Queue(Option<Memory>);
    /// #[async_trait::async_trait]
    /// impl Source for Queue {
    ///     type Delivery = Memory;
    ///     async fn next(&mut self) -> Result<Memory, BrokerError> {
    ///         match self.0.take() {
    ///             Some(delivery) => Ok(delivery),
    ///             None => std::future::pending().await,
    ///         }
    ///     }
    /// }
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let delivery = Memory::new(br#"{"order_id":"o-1"}"#);
    /// let log = delivery.log();
    /// let handler = |_: serde_json::Value| async {
    ///     tokio::time::sleep(Duration::from_millis(50)).await; // running when the stop comes
    ///     Ok::<_, std::io::Error>(())
    /// };
    /// let stop = tokio::time::sleep(Duration::from_millis(10));
    /// Runner::new().run_until(Queue(Some(delivery)), handler, stop).await?;
    /// assert_eq!(*log.lock().unwrap(), ["ack"]); // finished, then returned
    /// # Ok::<(), BrokerError>(())
    /// # }).unwrap();
    /// ```
    pub async fn run_until<S, M, T, E, H, Fut>(
        &self,
        source: S,
        handler: H,
        stop: impl Future,
    ) -> Result<(), BrokerError>
    where
        S: Source,
        M: FromDelivery,
        H: Fn(M) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Debug,
    {
        let handler = &handler;
        self.drive(source, |delivery| self.process(delivery, handler), stop)
            .await
    }

    /// [`Runner::run_spawned`] until `stop` completes, as
    /// [`Runner::run_until`]: the deliveries in flight (each on its own task)
    /// run to their end before it returns.
    ///
    /// ```no_run
    /// use idem_runtime::consumer::{BrokerError, Runner, Source};
    ///
    /// # #[derive(serde::Deserialize)] struct OrderPaid { order_id: String }
    /// # async fn settle(e: OrderPaid) -> Result<(), std::io::Error> { Ok(()) }
    /// // `shutdown`: `async { tokio::signal::ctrl_c().await.ok(); }`, or a supervisor's `Stop`
    /// async fn consume<S>(source: S, shutdown: impl Future) -> Result<(), BrokerError>
    /// where
    ///     S: Source<Delivery: 'static>,
    /// {
    ///     Runner::new().concurrency(16).run_spawned_until(source, settle, shutdown).await
    /// }
    /// ```
    pub async fn run_spawned_until<S, M, T, E, H, Fut>(
        &self,
        source: S,
        handler: H,
        stop: impl Future,
    ) -> Result<(), BrokerError>
    where
        S: Source,
        S::Delivery: 'static,
        M: FromDelivery + Send + 'static,
        H: Fn(M) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
        T: Send + 'static,
        E: fmt::Debug + Send + 'static,
    {
        let handler = Arc::new(handler);
        let start = |delivery| {
            let (runner, handler) = (self.clone(), handler.clone());
            let task = tokio::spawn(async move { runner.process(delivery, &*handler).await });
            // Dropped with the loop (its future dropped, or a supervisor's
            // timeout), the delivery stops at its `.await` as under `run`:
            // a task whose handle is dropped would go on, unwatched.
            let abort = AbortOnDrop::new(&task);
            async move {
                let _abort = abort;
                match task.await {
                    Ok(done) => done,
                    Err(e) => match e.try_into_panic() {
                        Ok(panic) => std::panic::resume_unwind(panic),
                        // Only a runtime shutting down cancels the task.
                        Err(e) => Err(BrokerError::new("runner", e)),
                    },
                }
            }
        };
        self.drive(source, start, stop).await
    }

    /// The loop of `run` and `run_spawned`: takes deliveries while fewer than
    /// `concurrency` are in flight, each started by `start`. Once `stop`
    /// completes it takes no more, and returns `Ok` when those in flight have
    /// ended.
    pub(super) async fn drive<S, F, Fut>(
        &self,
        source: S,
        start: F,
        stop: impl Future,
    ) -> Result<(), BrokerError>
    where
        S: Source,
        F: Fn(S::Delivery) -> Fut,
        Fut: Future<Output = Result<Action, BrokerError>>,
    {
        let mut stop = pin!(stop);
        let mut stopping = false;
        // The source as a stream: a `next()` call that is still waiting when a
        // delivery in flight finishes must be resumed, not dropped (a dropped
        // XREADGROUP would leave what it read pending on this consumer, to
        // come back only after `claim_idle`, counted).
        let mut deliveries = pin!(stream::unfold(source, |mut source| async move {
            let next = source.next().await;
            Some((next, source))
        }));
        let mut in_flight = FuturesUnordered::new();
        let mut failed: Option<BrokerError> = None;
        loop {
            if in_flight.is_empty() {
                if let Some(e) = failed.take() {
                    return Err(e);
                }
                if stopping {
                    return Ok(());
                }
            }
            let taking = !stopping && failed.is_none() && in_flight.len() < self.concurrency;
            let step = std::future::poll_fn(|cx| {
                // Finished deliveries first: each frees a slot.
                if let Poll::Ready(Some(done)) = in_flight.poll_next_unpin(cx) {
                    return Poll::Ready(Step::Done(done));
                }
                // Before the next delivery: a source that always has one
                // ready must not hold a stop off.
                if !stopping && stop.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Step::Stop);
                }
                if taking {
                    if let Poll::Ready(Some(next)) = deliveries.poll_next_unpin(cx) {
                        return Poll::Ready(Step::Next(next));
                    }
                }
                Poll::Pending
            });
            match step.await {
                Step::Next(Ok(delivery)) => in_flight.push(start(delivery)),
                Step::Next(Err(e)) | Step::Done(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Step::Done(Ok(_)) => {}
                Step::Stop => stopping = true,
            }
        }
    }
}

/// What woke `drive`.
enum Step<D> {
    Next(Result<D, BrokerError>),
    Done(Result<Action, BrokerError>),
    Stop,
}
