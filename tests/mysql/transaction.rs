//! Claims inside the caller's transaction: rolled back, committed, released,
//! duplicates waiting on the record's row lock, deadlocks reaching the caller,
//! and a connection in autocommit refused.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::tx::{AsTxConnection, TxConnection};
use idem_runtime::store::{Claim, RecordState, Store, Token};
use idem_runtime::{Error, Key, idempotent};
use idem_tests::conformance::fresh_key;

use crate::{AppError, request, soon, store, success};

/// A transaction in which `key` was claimed and completed with `payload`, left
/// open for the test to commit or roll back.
async fn claimed_and_completed(
    store: &MySqlStore,
    key: &Key,
    payload: &[u8],
) -> sqlx::Transaction<'static, sqlx::MySql> {
    let token = Token::random();
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx.tx_connection().claim(request(key, token)).await.unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "got {claim:?}");
    assert!(
        tx.tx_connection()
            .complete(key, token, success(payload))
            .await
            .unwrap()
    );
    tx
}

/// The classic "record exists but the business did not run": a claim and
/// completion inside a transaction that rolls back leave nothing behind, and a
/// retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolled_back_transaction_leaves_no_record() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-tx-rollback");
    let tx = claimed_and_completed(&store, &key, b"1").await;
    tx.rollback().await.unwrap();

    assert!(
        store.inspect(&key).await.unwrap().is_none(),
        "a rolled-back claim left a record"
    );
    let retry = store.claim(request(&key, Token::random())).await.unwrap();
    assert!(matches!(retry, Claim::Acquired { .. }), "got {retry:?}");
}

/// Committed with the business writes, the record replays to a later caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_transaction_replays() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-tx-commit");
    let tx = claimed_and_completed(&store, &key, b"{\"order\":9}").await;
    tx.commit().await.unwrap();

    let Claim::Done(stored) = store.claim(request(&key, Token::random())).await.unwrap() else {
        panic!("expected a replay");
    };
    assert_eq!(stored.payload, b"{\"order\":9}");
}

/// A release inside the transaction frees the key for a retry in the same one
/// (the protocol releases on `Err`), and the fence never goes backwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn release_inside_a_transaction() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-tx-release");
    let (first, second) = (Token::random(), Token::random());
    let mut tx = store.pool().begin().await.unwrap();
    let conn = tx.tx_connection();
    let Claim::Acquired { fence: f1, .. } = conn.claim(request(&key, first)).await.unwrap() else {
        panic!("expected to acquire");
    };
    assert!(conn.release(&key, first).await.unwrap());
    assert!(!conn.release(&key, first).await.unwrap(), "released twice");
    let Claim::Acquired { fence: f2, .. } = conn.claim(request(&key, second)).await.unwrap() else {
        panic!("expected to acquire again");
    };
    assert!(f2 > f1, "fence went from {f1} to {f2}");
    tx.commit().await.unwrap();
    assert_eq!(
        store.inspect(&key).await.unwrap().map(|i| i.state),
        Some(RecordState::Processing)
    );
}

/// A duplicate in a second transaction blocks on the record's row lock until
/// the first transaction ends, then replays its committed result (`commit`)
/// or claims the key itself (rollback).
async fn duplicate_waits_for_the_first_transaction(commit: bool) {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-tx-duplicate");
    let first = Token::random();
    let mut tx1 = store.pool().begin().await.unwrap();
    let claim = tx1
        .tx_connection()
        .claim(request(&key, first))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "got {claim:?}");

    let pool = store.pool().clone();
    let duplicate = tokio::spawn(async move {
        let mut tx2 = pool.begin().await.unwrap();
        let claim = tx2
            .tx_connection()
            .claim(request(&key, Token::random()))
            .await;
        tx2.rollback().await.unwrap();
        claim
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate did not wait for the first transaction: {:?}",
        duplicate.await
    );

    assert!(
        tx1.tx_connection()
            .complete(&key, first, success(b"\"first\""))
            .await
            .unwrap()
    );
    if commit {
        tx1.commit().await.unwrap();
    } else {
        tx1.rollback().await.unwrap();
    }
    let claim = tokio::time::timeout(Duration::from_secs(10), duplicate)
        .await
        .expect("the duplicate is still blocked after the first transaction ended")
        .unwrap()
        .expect("the duplicate's claim failed");
    match (commit, claim) {
        (true, Claim::Done(stored)) => assert_eq!(stored.payload, b"\"first\""),
        (false, Claim::Acquired { takeover, .. }) => assert!(!takeover),
        (_, other) => panic!("commit={commit}: got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_waits_then_replays_the_commit() {
    duplicate_waits_for_the_first_transaction(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_waits_then_claims_after_a_rollback() {
    duplicate_waits_for_the_first_transaction(false).await;
}

/// Two transactions claiming two keys in opposite orders deadlock. InnoDB has
/// already rolled the victim back, so the claim must not be retried on its
/// connection (it would run outside the caller's transaction): the victim gets
/// a store error that `is_retryable` recognises, the survivor gets its claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlock_inside_a_transaction_reaches_the_caller() {
    let Some(store) = store().await else { return };
    let (a, b) = (fresh_key("mysql-deadlock-a"), fresh_key("mysql-deadlock-b"));
    let mut tx1 = store.pool().begin().await.unwrap();
    let mut tx2 = store.pool().begin().await.unwrap();
    for (tx, key) in [(&mut tx1, &a), (&mut tx2, &b)] {
        let claim = tx
            .tx_connection()
            .claim(request(key, Token::random()))
            .await
            .unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }), "got {claim:?}");
    }
    let one = tokio::spawn(async move {
        let r = tx1
            .tx_connection()
            .claim(request(&b, Token::random()))
            .await;
        let _ = tx1.rollback().await;
        r
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let two = tokio::spawn(async move {
        let r = tx2
            .tx_connection()
            .claim(request(&a, Token::random()))
            .await;
        let _ = tx2.rollback().await;
        r
    });
    let results = [one.await.unwrap(), two.await.unwrap()];
    let victims: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(victims.len(), 1, "{results:?}");
    let victim = victims[0];
    assert_eq!(victim.backend(), "mysql");
    assert!(MySqlStore::is_retryable(victim), "{victim}");
    assert!(victim.to_string().contains("1213"), "{victim}");
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Ok(Claim::Acquired { .. }))),
        "{results:?}"
    );
}

/// A lock wait timeout (1205) inside the caller's transaction: InnoDB rolls
/// back the statement only (`innodb_rollback_on_timeout` is off by default),
/// so the transaction and what it wrote before go on. The claim's error is
/// retryable; a claim whose holder lets go within the wait wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_wait_timeout_inside_a_transaction_keeps_the_transaction() {
    let Some(store) = store().await else { return };
    for (held_ms, case) in [(100u64, "under"), (3_000, "over")] {
        let key = fresh_key(&format!("mysql-lock-wait-{case}"));
        let mut holder = store.pool().begin().await.unwrap();
        let claim = holder
            .tx_connection()
            .claim(request(&key, Token::random()))
            .await
            .unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");

        let mut caller = store.pool().begin().await.unwrap();
        sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
            .execute(&mut *caller)
            .await
            .unwrap();
        let waiting = tokio::spawn(async move {
            let got = caller
                .tx_connection()
                .claim(request(&key, Token::random()))
                .await;
            (got, caller)
        });
        tokio::time::sleep(Duration::from_millis(held_ms)).await;
        holder.rollback().await.unwrap();
        let (got, mut caller) = waiting.await.unwrap();
        if case == "under" {
            assert!(matches!(got, Ok(Claim::Acquired { .. })), "{got:?}");
        } else {
            let err = got.expect_err("waited past innodb_lock_wait_timeout");
            assert!(err.to_string().contains("1205"), "{err}");
            assert!(MySqlStore::is_retryable(&err), "{err}");
            let open: i64 = sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
                .fetch_one(&mut *caller)
                .await
                .unwrap();
            assert_eq!(
                open, 1,
                "the statement, not the transaction, was rolled back"
            );
            let again = caller
                .tx_connection()
                .claim(request(&key, Token::random()))
                .await
                .unwrap();
            assert!(matches!(again, Claim::Acquired { .. }), "{again:?}");
        }
        caller.rollback().await.unwrap();
    }
}

/// The one place a duplicate inside a transaction can still be a deadlock
/// victim, as `TxConnection for MySqlConnection` documents: two duplicates
/// wait on a first transaction's claim of a new key, and it rolls back. Their
/// inserts then meet on the key's gap. Exactly one claims; the other is told
/// Busy or gets a 1213 that `is_retryable` recognises, never anything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_duplicates_waiting_on_a_rolled_back_claim_one_wins_the_other_is_busy_or_retryable() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-two-waiting");
    let mut first = store.pool().begin().await.unwrap();
    let claim = first
        .tx_connection()
        .claim(request(&key, Token::random()))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    let duplicate = || {
        let pool = store.pool().clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let claim = tx
                .tx_connection()
                .claim(request(&key, Token::random()))
                .await;
            let _ = tx.commit().await;
            claim
        })
    };
    let (one, two) = (duplicate(), duplicate());
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.rollback().await.unwrap();
    let results = soon("the duplicates", async {
        [one.await.unwrap(), two.await.unwrap()]
    })
    .await;
    let won = results
        .iter()
        .filter(|r| matches!(r, Ok(Claim::Acquired { .. })))
        .count();
    assert_eq!(won, 1, "{results:?}");
    for r in &results {
        match r {
            Ok(Claim::Acquired { .. } | Claim::Busy { .. }) => {}
            Err(e) if MySqlStore::is_retryable(e) && e.to_string().contains("1213") => {}
            other => panic!("{other:?}"),
        }
    }
}

/// `tx = conn` on a connection in autocommit: the claim would commit at once
/// with nothing renewing its lease while the body holds the connection.
#[idempotent(key = "order_id", tx = conn, scope = "mysql-tests.autocommit")]
async fn charge_on_connection(
    conn: &mut sqlx::MySqlConnection,
    order_id: u64,
    runs: &AtomicUsize,
) -> Result<u64, AppError> {
    let _ = &conn;
    runs.fetch_add(1, SeqCst);
    Ok(order_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_in_autocommit_is_refused_before_the_body_runs() {
    let Some(store) = store().await else { return };
    let runs = AtomicUsize::new(0);
    let order_id = u64::from_le_bytes(Token::random().as_bytes()[..8].try_into().unwrap());
    let mut conn = store.pool().acquire().await.unwrap();
    let err = charge_on_connection(&mut conn, order_id, &runs)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AppError::Idem(Error::NotInTransaction { .. })),
        "{err:?}"
    );
    assert_eq!(runs.load(SeqCst), 0, "the body never ran");
    let key = Key::builder("mysql-tests.autocommit")
        .part(&order_id)
        .finish();
    assert!(
        store.inspect(&key).await.unwrap().is_none(),
        "nothing claimed"
    );

    // Inside a transaction begun through sqlx the same call runs.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    assert_eq!(
        charge_on_connection(&mut tx, order_id, &runs)
            .await
            .unwrap(),
        order_id
    );
    tx.rollback().await.unwrap();
    assert_eq!(runs.load(SeqCst), 1);
}

/// `claim_done` on a released record: the claim's update branch writes it
/// PROCESSING (MySQL assigns columns left to right, see CLAIM) and the record
/// is completed in the same call, so it commits DONE with the fence grown; a
/// fresh key is inserted DONE in the claim itself. Released again (the body
/// failed), the record a claim wrote DONE frees the key.
#[tokio::test]
async fn claim_done_takes_a_released_record_and_its_release_frees_it_again() {
    let Some(store) = store().await else { return };
    let key = fresh_key("tx-claim-done");
    let first = Token::random();
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim_done(request(&key, first), success(b"1"))
        .await
        .unwrap();
    assert!(
        matches!(claim, Claim::Acquired { fence: 1, .. }),
        "{claim:?}"
    );
    assert!(
        tx.tx_connection().release(&key, first).await.unwrap(),
        "its own DONE record"
    );
    tx.commit().await.unwrap();
    assert!(store.inspect(&key).await.unwrap().is_none(), "released");

    let second = Token::random();
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim_done(request(&key, second), success(b"2"))
        .await
        .unwrap();
    assert!(
        matches!(claim, Claim::Acquired { fence: 2, .. }),
        "{claim:?}"
    );
    tx.commit().await.unwrap();
    match store.claim(request(&key, Token::random())).await.unwrap() {
        Claim::Done(stored) => assert_eq!(stored.payload, b"2"),
        other => panic!("expected the DONE record, got {other:?}"),
    }
}
