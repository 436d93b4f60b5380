//! Row locks: leases and renewals that waited on a lock count from when they
//! got the row, and replays and Busy answers take none.

use std::time::Duration;

use idem_runtime::Key;
use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::tx::{AsTxConnection, TxConnection};
use idem_runtime::store::{Claim, Token};
use idem_tests::conformance::fresh_key;

use crate::{done_key, request, store, store_with_one_connection};

/// Until the connection's statement has run for a while: a claim or a renewal
/// is a one-row statement, so one still running is waiting on a lock.
/// (MariaDB's INNODB_TRX does not reliably list an autocommit statement.)
async fn wait_on_a_lock(store: &MySqlStore, connection: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST
             WHERE ID = ? AND INFO IS NOT NULL AND TIME_MS > 200",
        )
        .bind(connection)
        .fetch_one(store.pool())
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the call never waited on a lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The shared case (`idem_tests::sql`), on a one-connection store whose
/// connection this dialect watches for a lock wait.
async fn a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(existing: bool) {
    let Some(store) = store().await else { return };
    let Some((waiter, connection)) = store_with_one_connection().await else {
        return;
    };
    let key = fresh_key("mysql-waited-lease");
    let b_is_waiting = wait_on_a_lock(&store, connection);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_waited_on_an_uncommitted_insert_starts_its_lease_when_it_wins() {
    a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_waited_on_a_locked_row_starts_its_lease_when_it_wins() {
    // Released, then re-claimed by A, so the release must not be purged.
    let _table = idem_tests::conformance::share_table("mysql-waited-lease").await;
    a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(true).await;
}

/// The owner's renewal waits on a row lock another transaction holds; the
/// renewed lease counts from when it got the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row() {
    let Some(store) = store().await else { return };
    let Some((owner, connection)) = store_with_one_connection().await else {
        return;
    };
    let pool = store.pool().clone();
    let lock_row = |key: Key| async move {
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idem_records WHERE `key` = ? FOR UPDATE")
            .bind(key.as_bytes().to_vec())
            .execute(&mut *holder)
            .await
            .unwrap();
        holder
    };
    let owner_is_waiting = wait_on_a_lock(&store, connection);
    idem_tests::sql::a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row(
        &store,
        owner,
        lock_row,
        owner_is_waiting,
        fresh_key("mysql-waited-renewal"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock() {
    let Some(store) = store().await else { return };
    idem_tests::sql::replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock(
        &store,
        store.pool(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner() {
    let Some(store) = store().await else { return };
    idem_tests::sql::a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner(
        &store,
        store.pool(),
    )
    .await;
}

/// A replay inside an open transaction holds no lock on the row: another
/// transaction locks it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_inside_a_transaction_takes_no_row_lock() {
    let Some(store) = store().await else { return };
    let key = done_key(&store, "mysql-replay-lock", b"r").await;
    let mut replaying = store.pool().begin().await.unwrap();
    let replay = replaying
        .tx_connection()
        .claim(request(&key, Token::random()))
        .await
        .unwrap();
    assert!(matches!(replay, Claim::Done(_)), "{replay:?}");

    let mut other = store.pool().begin().await.unwrap();
    let locked = sqlx::query("SELECT 1 FROM idem_records WHERE `key` = ? FOR UPDATE NOWAIT")
        .bind(&key.as_bytes()[..])
        .execute(&mut *other)
        .await;
    assert!(locked.is_ok(), "the replay left the row locked: {locked:?}");
    other.rollback().await.unwrap();
    replaying.commit().await.unwrap();
}
