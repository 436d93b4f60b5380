//! What an operator does with the outbox (`idem outbox stats | list | retry |
//! purge`), callable from code as well.

use std::time::Duration;

use super::dialect::{Backlog, ListedMessage, MessageState, OutboxDatabase};
use crate::error::StoreError;

fn store_error<DB: OutboxDatabase>(e: sqlx::Error) -> StoreError {
    StoreError::new(DB::BACKEND, "outbox", e)
}

/// The unsent messages by topic (and the sent ones not purged yet, when
/// `with_sent`, which scans them).
///
/// ```no_run
/// # async fn go(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
/// for b in idem_runtime::outbox::backlog(&pool, false).await? {
///     println!("{}: {} pending, oldest {} ms", b.topic, b.pending, b.oldest_pending_ms);
/// }
/// # Ok(()) }
/// ```
pub async fn backlog<DB: OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    with_sent: bool,
) -> Result<Vec<Backlog>, StoreError> {
    DB::backlog(pool, with_sent)
        .await
        .map_err(store_error::<DB>)
}

/// Up to `limit` messages in `state`, oldest first.
///
/// ```no_run
/// use idem_runtime::outbox::MessageState;
/// # async fn go(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
/// for m in idem_runtime::outbox::list(&pool, MessageState::Parked, 20).await? {
///     println!("{} {}: {:?}", m.id, m.topic, m.last_error);
/// }
/// # Ok(()) }
/// ```
pub async fn list<DB: OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    state: MessageState,
    limit: usize,
) -> Result<Vec<ListedMessage>, StoreError> {
    DB::list(pool, state, limit.min(i64::MAX as usize) as i64)
        .await
        .map_err(store_error::<DB>)
}

/// Makes a parked (or backing-off) message due now, its attempts reset.
/// `false` when no unsent message has that id.
///
/// ```no_run
/// # async fn go(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
/// assert!(idem_runtime::outbox::retry(&pool, "order-7-created").await?);
/// # Ok(()) }
/// ```
pub async fn retry<DB: OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    id: &str,
) -> Result<bool, StoreError> {
    DB::retry(pool, id).await.map_err(store_error::<DB>)
}

/// Deletes up to `limit` messages sent longer than `older_than` ago; returns
/// how many.
///
/// ```no_run
/// # async fn go(pool: sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
/// let n = idem_runtime::outbox::purge(&pool, std::time::Duration::from_secs(86_400), 10_000).await?;
/// # Ok(()) }
/// ```
pub async fn purge<DB: OutboxDatabase>(
    pool: &sqlx::Pool<DB>,
    older_than: Duration,
    limit: usize,
) -> Result<u64, StoreError> {
    DB::purge(
        pool,
        older_than.as_millis().min(i64::MAX as u128) as i64,
        limit.min(i64::MAX as usize) as i64,
    )
    .await
    .map_err(store_error::<DB>)
}
