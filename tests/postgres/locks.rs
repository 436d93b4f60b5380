//! Row locks: leases and renewals that waited on a lock count from when they
//! got the row, and replays and Busy answers take none.

use idem_runtime::Key;
use idem_runtime::store::sql::PgStore;
use idem_tests::conformance::fresh_key;
use sqlx::postgres::PgPoolOptions;

use crate::{store, until};

/// A store with one connection, and that connection's backend pid: whatever
/// the store runs, `waits_on_a_lock(pid)` can watch.
async fn store_with_one_connection() -> Option<(PgStore, i32)> {
    let store = store().await?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(store.pool().connect_options().as_ref().clone())
        .await
        .unwrap();
    let one = PgStore::builder().pool(pool).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(one.pool())
        .await
        .unwrap();
    Some((one, pid))
}

async fn wait_on_a_lock(store: &PgStore, pid: i32) {
    until("the call to wait on a row lock", || async {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_one(store.pool())
                .await
                .unwrap();
        waiting.as_deref() == Some("Lock")
    })
    .await;
}

/// The shared case (`idem_tests::sql`), on a one-connection store whose
/// connection this dialect watches for a lock wait.
async fn a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(existing: bool) {
    let Some(store) = store().await else { return };
    let Some((waiter, pid)) = store_with_one_connection().await else {
        return;
    };
    let key = fresh_key("waited-lease");
    let b_is_waiting = wait_on_a_lock(&store, pid);
    idem_tests::sql::a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(
        &store,
        store.pool(),
        waiter,
        b_is_waiting,
        key,
        existing,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_on_an_uncommitted_insert_starts_its_lease_when_it_wins() {
    a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_on_a_locked_row_starts_its_lease_when_it_wins() {
    // Released, then re-claimed by A, so the release must not be purged.
    let _table = idem_tests::conformance::share_table("waited-lease").await;
    a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(true).await;
}

/// The owner's renewal waits on a row lock another transaction holds; the
/// renewed lease counts from when it got the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row() {
    let Some(store) = store().await else { return };
    let Some((owner, pid)) = store_with_one_connection().await else {
        return;
    };
    let pool = store.pool().clone();
    let lock_row = |key: Key| async move {
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idem_records WHERE key = $1 FOR UPDATE")
            .bind(key.as_bytes().to_vec())
            .execute(&mut *holder)
            .await
            .unwrap();
        holder
    };
    let owner_is_waiting = wait_on_a_lock(&store, pid);
    idem_tests::sql::a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row(
        &store,
        owner,
        lock_row,
        owner_is_waiting,
        fresh_key("waited-renewal"),
    )
    .await;
}

/// Replays inside transactions take no row lock on PostgreSQL either.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock() {
    let Some(store) = store().await else { return };
    idem_tests::sql::replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock(
        &store,
        store.pool(),
    )
    .await;
}

/// Nor does a Busy answer inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner() {
    let Some(store) = store().await else { return };
    idem_tests::sql::a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner(
        &store,
        store.pool(),
    )
    .await;
}
