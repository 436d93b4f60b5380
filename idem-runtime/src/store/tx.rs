//! Claims inside the caller's database transaction.
//!
//! With `#[idempotent(tx = tx, …)]` the record is written on the caller's own
//! transaction, so it commits or rolls back together with the business writes:
//! a rolled-back order leaves no "done" record behind, and a committed one can
//! never lack it. A concurrent duplicate blocks on the record's unique index
//! until the first transaction ends, then replays what it committed (or claims
//! the key itself if it rolled back). The claim is an upsert, never a caught
//! unique violation, so a duplicate never aborts the caller's transaction.
//!
//! ```
//! # #[cfg(feature = "postgres")] mod doc {
//! use idem_runtime::idempotent;
//! use sqlx::Postgres;
//! # #[derive(serde::Serialize, serde::Deserialize)]
//! # pub struct Order { id: i64 }
//! # pub struct CreateOrder { order_no: String }
//! # #[derive(Debug)]
//! # pub enum AppError { Idem(idem_runtime::Error), Db(sqlx::Error) }
//! # impl From<idem_runtime::Error> for AppError { fn from(e: idem_runtime::Error) -> Self { AppError::Idem(e) } }
//! # impl From<sqlx::Error> for AppError { fn from(e: sqlx::Error) -> Self { AppError::Db(e) } }
//! # async fn insert_order(conn: &mut sqlx::PgConnection, req: &CreateOrder) -> Result<Order, sqlx::Error> {
//! #     let id = sqlx::query_scalar("INSERT INTO orders (order_no) VALUES ($1) RETURNING id")
//! #         .bind(&req.order_no)
//! #         .fetch_one(conn)
//! #         .await?;
//! #     Ok(Order { id })
//! # }
//!
//! #[idempotent(key = "req.order_no", tx = tx)]
//! async fn create_order(tx: &mut sqlx::Transaction<'_, Postgres>, req: CreateOrder) -> Result<Order, AppError> {
//!     let order = insert_order(&mut **tx, &req).await?;   // your writes, on your transaction
//!     Ok(order)
//! }
//! // caller: let mut tx = pool.begin().await?; create_order(&mut tx, req).await?; tx.commit().await?;
//! # }
//! ```

use async_trait::async_trait;

use crate::error::StoreError;
use crate::key::Key;
use crate::store::{Claim, ClaimRequest, Completion, Token};

/// Where errors on the caller's own connection say they happened: a
/// connection has no address to show.
pub(crate) const IN_TX: &str = "the caller's transaction";

/// A database connection the claim protocol can run on inside a transaction.
///
/// Implemented for the sqlx connections of the SQL stores. Time is the
/// database server's; records go to the same `idem_records` table the store
/// of that dialect uses (run the store's migrations once at start-up).
#[async_trait]
pub trait TxConnection: Send {
    /// The backend's name, for errors and metrics.
    fn backend(&self) -> &'static str;

    /// The largest result payload kept.
    fn max_result_bytes(&self) -> usize {
        crate::store::DEFAULT_MAX_RESULT_BYTES
    }

    /// Whether the connection is inside a transaction. The protocol refuses a
    /// connection in autocommit: nothing would renew its claim's lease while
    /// the body runs (the body holds the connection), so a slow body could be
    /// taken over while alive.
    fn in_transaction(&self) -> bool;

    /// Why the transaction would not commit although the driver's commit
    /// would report success, or `None` when it would commit: PostgreSQL
    /// answers COMMIT of an aborted transaction with ROLLBACK and no error,
    /// MariaDB and MySQL run the statements after a lost deadlock in
    /// autocommit. [`Runner::run_in_tx`](crate::consumer::Runner::run_in_tx)
    /// asks before it commits; call it before your own commit when a handler
    /// may have swallowed a failed statement. The default (for a connection
    /// whose commit fails on its own) is `None`.
    ///
    /// ```no_run
    /// # #[cfg(feature = "postgres")] async fn go(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_runtime::store::tx::TxConnection;
    /// let mut tx = pool.begin().await?;
    /// let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await; // an error swallowed
    /// assert!(tx.commit_refused().await?.is_some());
    /// # Ok(()) }
    /// ```
    async fn commit_refused(&mut self) -> Result<Option<&'static str>, StoreError> {
        Ok(None)
    }

    /// [`crate::store::Store::claim`], on this connection.
    async fn claim(&mut self, req: ClaimRequest<'_>) -> Result<Claim, StoreError>;

    /// Whether [`TxConnection::claim_done`] writes the record DONE in the
    /// claim itself, and [`TxConnection::release`] releases a record
    /// written so. The protocol uses `claim_done` only then; the default is
    /// `false` (claim, body, completion). The SQL stores' connections say
    /// `true`.
    fn claims_done(&self) -> bool {
        false
    }

    /// A claim whose record is written DONE with `completion` at once, for a
    /// body whose result is known before it runs (a `()` result). The record
    /// commits with the body's writes or rolls back with them, so no
    /// completion statement follows; if the body fails after all,
    /// [`TxConnection::release`] releases it. A live record is judged as by
    /// [`TxConnection::claim`]. Called only when
    /// [`TxConnection::claims_done`] says so.
    ///
    /// The default claims, then completes (two statements).
    async fn claim_done(
        &mut self,
        req: ClaimRequest<'_>,
        completion: Completion<'_>,
    ) -> Result<Claim, StoreError> {
        let claim = self.claim(req).await?;
        if let Claim::Acquired { .. } = claim
            && !self.complete(req.key, req.token, completion).await?
        {
            return Err(StoreError::new(
                self.backend(),
                IN_TX,
                "a record claimed in this transaction was gone at its completion",
            ));
        }
        Ok(claim)
    }

    /// [`crate::store::Store::complete`], on this connection.
    async fn complete(
        &mut self,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> Result<bool, StoreError>;

    /// [`crate::store::Store::release`], on this connection; it also releases
    /// a record `token` wrote DONE through [`TxConnection::claim_done`].
    async fn release(&mut self, key: &Key, token: Token) -> Result<bool, StoreError>;
}

/// What `tx = …` may name: a `&mut sqlx::Transaction` or a `&mut` connection.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a transaction idem can claim in",
    label = "`tx = …` must name a `&mut sqlx::Transaction<'_, DB>` or `&mut DB::Connection` parameter",
    note = "claims inside a transaction are supported on PostgreSQL, MySQL/MariaDB and SQLite connections (features `postgres`, `mysql`, `sqlite`)"
)]
pub trait AsTxConnection: Send {
    /// The connection the claim runs on.
    type Connection: TxConnection + ?Sized;

    /// The connection under the transaction.
    fn tx_connection(&mut self) -> &mut Self::Connection;
}

/// `tx = conn` with a bare `&mut` connection: the claim runs in the
/// transaction the connection is in (one begun through sqlx); a connection in
/// autocommit is refused with [`crate::Error::NotInTransaction`].
impl<C: TxConnection> AsTxConnection for C {
    type Connection = C;

    fn tx_connection(&mut self) -> &mut C {
        self
    }
}

/// `tx = tx` with a `&mut sqlx::Transaction`, the usual case, on any dialect
/// whose connection claims in transactions (PostgreSQL, MySQL, SQLite).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
impl<DB> AsTxConnection for sqlx::Transaction<'_, DB>
where
    DB: sqlx::Database,
    DB::Connection: TxConnection,
{
    type Connection = DB::Connection;

    fn tx_connection(&mut self) -> &mut DB::Connection {
        self
    }
}
