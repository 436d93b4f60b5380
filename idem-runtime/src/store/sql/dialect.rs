//! What each SQL database supplies to the shared store: its statements, its
//! clock, its migration lock, and which of its errors are worth a retry. The
//! algorithms (the claim loop, completion, the judgement of a record, retries
//! on the pool) are written once in [`super::store`].
//!
//! Three traits, one per concern, so a dialect's directory has one file per
//! concern: [`Dialect`] (the record's life, `<dialect>/records.rs`),
//! [`RecoveryRows`] (the rows of `idem_recovery`, `<dialect>/recovery.rs`) and
//! [`Migrations`] (`<dialect>/migrations.rs`). `Dialect` requires the other
//! two, so the shared store names only `D: Dialect`.

use std::future::Future;

use sqlx::pool::PoolConnection;

use crate::clock::Clock;
use crate::key::Key;
use crate::store::{
    Abandoned, ClaimRequest, Completion, RecordStats, RecoveryArgs, RecoveryInfo, RecoveryTurn,
    Token, Turn,
};

use super::record::{Record, Upserted};

/// A database the SQL stores speak, implemented on sqlx's `Sqlite`,
/// `Postgres` and `MySql` (as sqlx's own `Migrate` is per database).
///
/// Every step runs on one connection: a pooled one for the store,
/// or the caller's inside its transaction (`TxConnection`). `clock` is the
/// store's clock; a dialect that reads the server's clock in its SQL ignores
/// it. No step retries: the pool path retries whole operations on
/// [`Dialect::is_retryable`] errors, and the transaction path must not (a lost
/// deadlock has rolled the caller's transaction back).
pub(crate) trait Dialect: sqlx::Database + RecoveryRows + Migrations {
    /// The backend's name, for errors, metrics and logs.
    const BACKEND: &'static str;

    /// Whether the claim loop reads the record before the upsert, answering a
    /// replay or Busy from that plain read. A dialect whose upsert locks even a
    /// row it refuses needs it, or replays of a hot key inside transactions
    /// queue behind each other; one whose upsert checks first on its own does
    /// not.
    const READ_FIRST: bool;

    /// The record under `key` (a plain read that takes no lock), with the
    /// clock of the reading.
    fn read(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        key: &Key,
    ) -> impl Future<Output = Result<Option<Record>, sqlx::Error>> + Send;

    /// The claim's one upsert: takes the record if it may be taken, with the
    /// lease and expiry counting from when the row was had.
    ///
    /// With `done` (inside a caller's transaction, for a result known before
    /// the body runs) the record it writes is already DONE with that
    /// completion, so no completion statement follows: the transaction
    /// commits it with the body's writes or rolls it back with them. A dialect
    /// that cannot write it in the same statement completes right after.
    ///
    /// With `fresh_first` (the first round of a claim on the caller's
    /// transaction, where nearly every call is a new key) a dialect may first
    /// try a plain insert that only a new key takes, cheaper for the server
    /// than the full upsert, at the price of a second statement for a key
    /// that has a row. On the pool, where a replay must stay one statement,
    /// it is false.
    fn upsert(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        req: ClaimRequest<'_>,
        done: Option<Completion<'_>>,
        fresh_first: bool,
    ) -> impl Future<Output = Result<Upserted, sqlx::Error>> + Send;

    /// Marks the record DONE if `token` still owns it (PROCESSING).
    fn complete(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        key: &Key,
        token: Token,
        completion: Completion<'_>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Whether the record is DONE under `token`: a re-sent completion.
    fn completed_by(
        conn: &mut Self::Connection,
        key: &Key,
        token: Token,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Releases (and expires) the record if `token` still owns it. With
    /// `done_too` (inside the caller's transaction) also a record `token`
    /// wrote DONE in the claim (`upsert` with `done`): its body failed after
    /// all, and the transaction may still commit.
    fn release(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        key: &Key,
        token: Token,
        done_too: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Extends the lease from when the row is had, keeping expiry past it.
    fn renew(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        key: &Key,
        token: Token,
        lease: std::time::Duration,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Ends a live record whatever its state, keeping its fence: a
    /// PROCESSING record is handed to `nobody` (a token no caller holds) with
    /// its lease ended, anything else is released (see `Store::evict`).
    fn evict(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        key: &Key,
        nobody: Token,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Deletes up to `limit` dead records in `expires_at` order, skipping rows
    /// other transactions hold where the database can.
    fn purge(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;

    /// Counts the records by state (one scan of the table).
    fn stats(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
    ) -> impl Future<Output = Result<RecordStats, sqlx::Error>> + Send;

    /// Whether the error is a lost lock conflict, so running the operation
    /// again may succeed.
    fn is_retryable(error: &sqlx::Error) -> bool;

    /// Why the transaction `conn` is in would not commit although sqlx's
    /// `commit()` would return `Ok`, or `None` when it would commit.
    /// PostgreSQL answers COMMIT of a transaction an earlier failed statement
    /// aborted with ROLLBACK and no error; MariaDB and MySQL end a transaction
    /// that lost a deadlock, run the statements after it in autocommit, and
    /// answer COMMIT with OK.
    fn commit_refused(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<Option<&'static str>, sqlx::Error>> + Send;
}

/// The rows of `idem_recovery` (see `super::recovery`), each read or written
/// joined to its record on key and token.
pub(crate) trait RecoveryRows: sqlx::Database {
    /// Stores a recoverable claim's scope and arguments under the token that
    /// just acquired the record; `takeover` keeps the row's count, backoff
    /// and parking, anything else starts them afresh. On the claim's own
    /// transaction.
    fn keep_args(
        conn: &mut Self::Connection,
        key: &Key,
        token: Token,
        recovery: RecoveryArgs<'_>,
        takeover: bool,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// The scopes of live PROCESSING records with arguments.
    fn recovery_scopes(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
    ) -> impl Future<Output = Result<Vec<Vec<u8>>, sqlx::Error>> + Send;

    /// `Store::abandoned`.
    fn abandoned(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        scope: &str,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<Abandoned>, sqlx::Error>> + Send;

    /// `Store::take_recovery`, on a transaction of its own.
    fn take_recovery(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        key: &Key,
        turn: RecoveryTurn<'_>,
    ) -> impl Future<Output = Result<Turn, sqlx::Error>> + Send;

    /// `Store::recovery_info`.
    fn recovery_info(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        key: &Key,
    ) -> impl Future<Output = Result<Option<RecoveryInfo>, sqlx::Error>> + Send;

    /// `Store::retry_recovery`.
    fn retry_recovery(
        conn: &mut Self::Connection,
        clock: &dyn Clock,
        key: &Key,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send;

    /// Deletes up to `limit` rows of `idem_recovery` that no longer count
    /// (their record is gone, finished, released or someone else's),
    /// skipping rows a claim holds where the database can.
    fn purge_recovery(
        conn: &mut Self::Connection,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send;
}

/// The dialect's schema: the embedded migrations of `super::schema_migrations`
/// and the lock that serialises applying them across processes.
pub(crate) trait Migrations: sqlx::Database {
    /// Applies the embedded migrations not yet recorded, under the dialect's
    /// lock against concurrent processes.
    fn migrate(
        conn: &mut PoolConnection<Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}
