//! Each delivery in a database transaction of its own: the runner begins it,
//! hands it to the handler (whose `#[idempotent(consumer, tx = tx, …)]`
//! call records on it), commits on `Ok` and rolls back on `Err`, so the
//! business writes and idem's record commit together or not at all, with no
//! begin/commit written by the user.

use std::fmt;

use futures_util::future::BoxFuture;
use sqlx::{Database, Pool, Transaction};

use super::{Action, BrokerError, Delivery, FromDelivery, Runner, Source};
use crate::store::tx::TxConnection;

/// Why a delivery run by [`Runner::run_in_tx`] failed: the handler's own
/// error, or the transaction around it. Only its `Debug` is used: it is the
/// reason a retried or parked message carries.
pub enum TxError<E> {
    /// No transaction could be begun: the handler did not run.
    Begin(sqlx::Error),
    /// The handler returned `Err`: its transaction was rolled back.
    Handler(E),
    /// The handler returned `Ok` but the commit failed, or its answer was
    /// lost with the connection. Nothing it wrote lasted, idem's record
    /// included, unless the COMMIT reached the server before the connection
    /// went: then all of it did, and the redelivery replays the record. The
    /// message is not acked either way.
    Commit(sqlx::Error),
    /// The handler returned `Ok` but the database had already ended the
    /// transaction (a statement failed and the handler went on): its commit
    /// would have reported success and kept nothing, so it was rolled back.
    Aborted(&'static str),
    /// Whether the transaction could still commit could not be asked.
    Check(crate::StoreError),
}

impl<E: fmt::Debug> fmt::Debug for TxError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TxError::Begin(e) => write!(f, "could not begin a transaction: {e}"),
            TxError::Handler(e) => write!(f, "{e:?} (the transaction was rolled back)"),
            TxError::Commit(e) => write!(f, "the transaction failed to commit: {e}"),
            TxError::Aborted(why) => write!(f, "not committed: {why}"),
            TxError::Check(e) => write!(f, "could not check the transaction before COMMIT: {e}"),
        }
    }
}

impl Runner {
    /// [`Runner::run`], each delivery in a transaction of its own on `pool`.
    ///
    /// The handler gets the transaction and the message and returns its
    /// future boxed (`|tx, e| Box::pin(settle(tx, e))`): a future that
    /// borrows the transaction, and stays `Send` so the runner can be spawned
    /// (an `async` closure taking `&mut Transaction` cannot promise that on
    /// stable Rust). The future may borrow only the transaction: move into
    /// it what else it needs (`let name = name.clone(); Box::pin(async move {
    /// … })`). Its annotated call takes the transaction with `tx = …`.
    /// `Ok` commits, and the message is
    /// acked only after the commit succeeded; `Err` (or a panic) rolls back,
    /// and the delivery counts as a failure, redelivered after a backoff and
    /// parked at `max_deliveries`; a commit that fails counts the same, and so
    /// does a transaction the database ended under the handler (a failed
    /// statement it swallowed: PostgreSQL's COMMIT would roll it back and
    /// report success; see [`TxConnection::commit_refused`]). A
    /// duplicate replays the committed record. `final_err` is not available
    /// with `tx`: return a final outcome as `Ok`, and it commits.
    ///
    /// ```no_run
    /// use idem_runtime::consumer::{Runner, redis_streams::RedisStreamsSource};
    /// use idem_runtime::idempotent;
    /// use sqlx::{Postgres, Transaction};
    ///
    /// #[derive(serde::Deserialize)]
    /// struct OrderPaid { order_id: String, amount_cents: i64 }
    ///
    /// #[derive(Debug, thiserror::Error)]
    /// enum SettleError {
    ///     #[error(transparent)] Idem(#[from] idem_runtime::Error),
    ///     #[error(transparent)] Db(#[from] sqlx::Error),
    /// }
    ///
    /// #[idempotent(consumer, event = "SETTLE", key = "e.order_id", tx = tx)]
    /// async fn settle(tx: &mut Transaction<'_, Postgres>, e: OrderPaid) -> Result<(), SettleError> {
    ///     sqlx::query("INSERT INTO settlements (order_id, amount_cents) VALUES ($1, $2)")
    ///         .bind(&e.order_id).bind(e.amount_cents).execute(&mut **tx).await?;
    ///     Ok(())
    /// }
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// # let pool = sqlx::PgPool::connect("postgres://127.0.0.1/test").await?;
    /// # let client = redis::Client::open("redis://127.0.0.1")?;
    /// # let source = RedisStreamsSource::builder("orders.paid", "settlement", "worker-1")
    /// #     .connect(&client)
    /// #     .await?;
    /// // the handler's future is boxed: it borrows the transaction and stays `Send`
    /// let err = Runner::new().run_in_tx(source, &pool, |tx, e| Box::pin(settle(tx, e))).await;
    /// # let _ = err; Ok(()) }
    /// ```
    pub async fn run_in_tx<S, DB, M, T, E, H>(
        &self,
        source: S,
        pool: &Pool<DB>,
        handler: H,
    ) -> BrokerError
    where
        S: Source,
        DB: Database,
        DB::Connection: TxConnection,
        M: FromDelivery,
        H: for<'t> Fn(&'t mut Transaction<'static, DB>, M) -> BoxFuture<'t, Result<T, E>>,
        E: fmt::Debug,
    {
        let handler = &handler;
        self.run(source, |message: M| in_tx(pool, handler, message))
            .await
    }

    /// [`Runner::run_in_tx`] until `stop` completes, as
    /// [`Runner::run_until`]: the deliveries in flight commit (or roll back)
    /// and are acked (or redelivered) before it returns `Ok`.
    ///
    /// ```no_run
    /// # use idem_runtime::consumer::{BrokerError, Runner, Source};
    /// # use sqlx::{Postgres, Transaction};
    /// # #[derive(serde::Deserialize)] struct OrderPaid { order_id: String }
    /// # async fn settle(tx: &mut Transaction<'_, Postgres>, e: OrderPaid) -> Result<(), sqlx::Error> { Ok(()) }
    /// // `shutdown`: `async { tokio::signal::ctrl_c().await.ok(); }`, or a supervisor's `Stop`
    /// async fn consume(source: impl Source, pool: sqlx::PgPool, shutdown: impl Future) -> Result<(), BrokerError> {
    ///     Runner::new()
    ///         .run_in_tx_until(source, &pool, |tx, e| Box::pin(settle(tx, e)), shutdown)
    ///         .await
    /// }
    /// ```
    pub async fn run_in_tx_until<S, DB, M, T, E, H>(
        &self,
        source: S,
        pool: &Pool<DB>,
        handler: H,
        stop: impl std::future::Future,
    ) -> Result<(), BrokerError>
    where
        S: Source,
        DB: Database,
        DB::Connection: TxConnection,
        M: FromDelivery,
        H: for<'t> Fn(&'t mut Transaction<'static, DB>, M) -> BoxFuture<'t, Result<T, E>>,
        E: fmt::Debug,
    {
        let handler = &handler;
        self.run_until(source, |message: M| in_tx(pool, handler, message), stop)
            .await
    }

    /// [`Runner::process`], in a transaction of its own on `pool`: see
    /// [`Runner::run_in_tx`].
    pub async fn process_in_tx<D, DB, M, T, E, H>(
        &self,
        delivery: D,
        pool: &Pool<DB>,
        handler: &H,
    ) -> Result<Action, BrokerError>
    where
        D: Delivery,
        DB: Database,
        DB::Connection: TxConnection,
        M: FromDelivery,
        H: for<'t> Fn(&'t mut Transaction<'static, DB>, M) -> BoxFuture<'t, Result<T, E>> + ?Sized,
        E: fmt::Debug,
    {
        self.process(delivery, &|message: M| in_tx(pool, handler, message))
            .await
    }
}

async fn in_tx<DB, M, T, E, H>(pool: &Pool<DB>, handler: &H, message: M) -> Result<T, TxError<E>>
where
    DB: Database,
    DB::Connection: TxConnection,
    H: for<'t> Fn(&'t mut Transaction<'static, DB>, M) -> BoxFuture<'t, Result<T, E>> + ?Sized,
{
    let mut tx = pool.begin().await.map_err(TxError::Begin)?;
    // An `Err` drops `tx`, which rolls it back: the claim the call made on it
    // goes with the business writes.
    let value = handler(&mut tx, message).await.map_err(TxError::Handler)?;
    // The driver's commit reports success for a transaction the server has
    // already ended (PostgreSQL: aborted by a failed statement the handler
    // swallowed), so ask first; dropping `tx` then rolls it back.
    let refused = match TxConnection::commit_refused(&mut *tx).await {
        Ok(None) => None,
        Ok(Some(why)) => Some(TxError::Aborted(why)),
        Err(e) => Some(TxError::Check(e)),
    };
    if let Some(e) = refused {
        super::mark_rolled_back();
        return Err(e);
    }
    if let Err(e) = tx.commit().await {
        super::mark_rolled_back();
        return Err(TxError::Commit(e));
    }
    Ok(value)
}
