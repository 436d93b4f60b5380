//! Claims inside the caller's transaction: rolled back, committed, released,
//! one statement each, duplicates waiting on the row, and serialization
//! failures the caller may retry.

use std::time::Duration;

use idem_runtime::Key;
use idem_runtime::store::sql::PgStore;
use idem_runtime::store::tx::{AsTxConnection, TxConnection};
use idem_runtime::store::{Claim, Store, Token};
use idem_tests::conformance::fresh_key;
use sqlx::postgres::PgConnection;

use crate::{request, store, success, until};

const TX_LEASE: Duration = Duration::from_secs(30);

#[tokio::test]
async fn in_a_rolled_back_transaction_the_record_rolls_back_too() {
    let Some(store) = store().await else { return };
    let (key, token) = (fresh_key("tx-rollback"), Token::random());
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim(request(&key, token, TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { fence: 1, .. }));
    assert!(
        tx.tx_connection()
            .complete(&key, token, success(b"42", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    assert!(
        store.inspect(&key).await.unwrap().is_none(),
        "uncommitted, so invisible outside"
    );
    tx.rollback().await.unwrap();

    assert!(
        store.inspect(&key).await.unwrap().is_none(),
        "a rolled-back call left a record"
    );
    assert_eq!(
        store
            .claim(request(&key, Token::random(), TX_LEASE))
            .await
            .unwrap(),
        Claim::Acquired {
            fence: 1,
            takeover: false
        }
    );
}

#[tokio::test]
async fn in_a_committed_transaction_the_record_replays_to_later_callers() {
    let Some(store) = store().await else { return };
    let (key, token) = (fresh_key("tx-commit"), Token::random());
    // A bare connection with its own BEGIN works as well as a Transaction.
    let mut pooled = store.pool().acquire().await.unwrap();
    let conn: &mut PgConnection = &mut pooled;
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let claim = conn
        .tx_connection()
        .claim(request(&key, token, TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }));
    assert!(
        conn.tx_connection()
            .complete(&key, token, success(b"order-7", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();

    let Claim::Done(stored) = store
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap()
    else {
        panic!("expected a replay");
    };
    assert_eq!(stored.payload, b"order-7");
}

/// A replay inside a caller's transaction reads the record without locking it:
/// replays of a hot key must not queue behind each other's transactions.
#[tokio::test]
async fn a_replay_inside_a_transaction_takes_no_row_lock() {
    let Some(store) = store().await else { return };
    let (key, token) = (fresh_key("tx-replay-lock"), Token::random());
    assert!(matches!(
        store.claim(request(&key, token, TX_LEASE)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(
        store
            .complete(&key, token, success(b"order-9", Duration::from_secs(60)))
            .await
            .unwrap()
    );

    let mut replaying = store.pool().begin().await.unwrap();
    let replay = replaying
        .tx_connection()
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(replay, Claim::Done(_)), "{replay:?}");

    // While the replaying transaction is still open, another one can lock the row
    // at once: the replay holds no lock on it.
    let mut other = store.pool().begin().await.unwrap();
    let locked = sqlx::query("SELECT 1 FROM idem_records WHERE key = $1 FOR UPDATE NOWAIT")
        .bind(&key.as_bytes()[..])
        .execute(&mut *other)
        .await;
    assert!(locked.is_ok(), "the replay left the row locked: {locked:?}");
    other.rollback().await.unwrap();
    replaying.commit().await.unwrap();
}

/// On the pool, a claim, a Busy answer, a completion and a replay are one
/// statement each, counted from sqlx's per-statement events (see
/// `idem_tests::statements`). Inside a caller's transaction a claim bets on a
/// new key first (a plain insert), so a first claim there is one statement
/// and a replay two: the insert that finds the row, and the claim that reads
/// it.
#[tokio::test]
async fn statements_per_claim_busy_answer_completion_and_replay() {
    let Some(store) = store().await else { return };
    let (key, token) = (fresh_key("statements"), Token::random());
    let seen = idem_tests::statements::Statements::record();
    let count = |what: &str, n: usize| {
        let sent = seen.take();
        assert_eq!(sent.len(), n, "{what}: {sent:#?}");
    };
    let one = |what: &str| count(what, 1);
    let claim = store.claim(request(&key, token, TX_LEASE)).await.unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    one("a first claim");
    let busy = store
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(busy, Claim::Busy { .. }), "{busy:?}");
    one("a Busy answer");
    assert!(
        store
            .complete(&key, token, success(b"order-3", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    one("a completion");
    let replay = store
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(replay, Claim::Done(_)), "{replay:?}");
    one("a replay on the pool");

    let mut tx = store.pool().begin().await.unwrap();
    seen.take();
    let replay = tx
        .tx_connection()
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(replay, Claim::Done(_)), "{replay:?}");
    count("a replay in a transaction", 2);
    let fresh = fresh_key("statements-in-tx");
    let claim = tx
        .tx_connection()
        .claim(request(&fresh, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    one("a first claim in a transaction");
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn in_a_transaction_a_release_and_a_busy_claim_leave_it_usable() {
    let Some(store) = store().await else { return };
    // The conformance purge case deletes released records table-wide, which
    // would reset the fence this test checks.
    let _table = idem_tests::conformance::share_table("tx-release").await;
    let (key, token) = (fresh_key("tx-release"), Token::random());
    let mut tx = store.pool().begin().await.unwrap();
    tx.tx_connection()
        .claim(request(&key, token, TX_LEASE))
        .await
        .unwrap();
    assert!(tx.tx_connection().release(&key, token).await.unwrap());
    tx.commit().await.unwrap();
    let next = Token::random();
    assert_eq!(
        store.claim(request(&key, next, TX_LEASE)).await.unwrap(),
        Claim::Acquired {
            fence: 2,
            takeover: false
        },
        "a release committed in a transaction keeps the fence"
    );

    // `next` holds a live claim outside any transaction: a claim in one is
    // told so, and its transaction carries on.
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Busy { .. }), "{claim:?}");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *tx)
        .await
        .expect("the transaction is not aborted");
    assert_eq!(one, 1);
    tx.commit().await.unwrap();
}

#[derive(Debug, Clone, Copy)]
enum FirstEnds {
    Commit,
    Rollback,
}

/// What the duplicate's transaction saw, and the transaction, still open.
struct Duplicate {
    store: PgStore,
    key: Key,
    token: Token,
    claim: Claim,
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
}

/// A first transaction claims and completes; a second one, on another
/// connection, claims the same key and must wait on the record's row until the
/// first ends.
async fn a_duplicate_waits_for(ends: FirstEnds) -> Option<Duplicate> {
    let store = store().await?;
    let key = fresh_key("tx-wait");
    let first = Token::random();
    let mut tx1 = store.pool().begin().await.unwrap();
    assert!(matches!(
        tx1.tx_connection()
            .claim(request(&key, first, TX_LEASE))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(
        tx1.tx_connection()
            .complete(&key, first, success(b"first", Duration::from_secs(60)))
            .await
            .unwrap()
    );

    let mut tx2 = store.pool().begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx2)
        .await
        .unwrap();
    let token = Token::random();
    let second = tokio::spawn(async move {
        let claim = tx2
            .tx_connection()
            .claim(request(&key, token, TX_LEASE))
            .await
            .expect("the duplicate's claim");
        // No SQLSTATE 25P02: the claim did not abort the transaction.
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *tx2)
            .await
            .expect("the duplicate's transaction is still usable");
        assert_eq!(one, 1);
        (claim, tx2)
    });

    until("the duplicate to wait on a lock", || async {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_one(store.pool())
                .await
                .unwrap();
        waiting.as_deref() == Some("Lock")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!second.is_finished(), "the duplicate did not wait");

    match ends {
        FirstEnds::Commit => tx1.commit().await.unwrap(),
        FirstEnds::Rollback => tx1.rollback().await.unwrap(),
    }
    let (claim, tx) = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the duplicate was released when the first transaction ended")
        .unwrap();
    Some(Duplicate {
        store,
        key,
        token,
        claim,
        tx,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_waits_and_then_replays_the_committed_result() {
    let Some(dup) = a_duplicate_waits_for(FirstEnds::Commit).await else {
        return;
    };
    let Claim::Done(stored) = dup.claim else {
        panic!("expected the committed result, got {:?}", dup.claim);
    };
    assert_eq!(stored.payload, b"first");
    dup.tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_waits_and_then_claims_after_a_rollback() {
    let Some(mut dup) = a_duplicate_waits_for(FirstEnds::Rollback).await else {
        return;
    };
    assert_eq!(
        dup.claim,
        Claim::Acquired {
            fence: 1,
            takeover: false
        }
    );
    // The duplicate owns the key now: what it commits is what replays.
    assert!(
        dup.tx
            .tx_connection()
            .complete(
                &dup.key,
                dup.token,
                success(b"second", Duration::from_secs(60))
            )
            .await
            .unwrap()
    );
    dup.tx.commit().await.unwrap();
    let Claim::Done(stored) = dup
        .store
        .claim(request(&dup.key, Token::random(), TX_LEASE))
        .await
        .unwrap()
    else {
        panic!("expected the duplicate's result");
    };
    assert_eq!(stored.payload, b"second");
}

/// A claim inside a REPEATABLE READ transaction that meets a row committed
/// after its snapshot is a serialization failure: the caller's transaction is
/// aborted, and `is_retryable` tells the caller to run it again.
#[tokio::test]
async fn a_serialization_failure_in_a_transaction_is_retryable() {
    let Some(store) = store().await else { return };
    let key = fresh_key("serialization");
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    // The snapshot is taken here, before the other caller's claim commits.
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    let owner = store
        .claim(request(&key, Token::random(), Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(matches!(owner, Claim::Acquired { .. }), "{owner:?}");
    // Let the owner's lease lapse so the transaction's claim may take the
    // row: it must then update a row its snapshot cannot see.
    sqlx::query("UPDATE idem_records SET lease_until = 0, expires_at = 0 WHERE key = $1")
        .bind(&key.as_bytes()[..])
        .execute(store.pool())
        .await
        .unwrap();
    let err = tx
        .tx_connection()
        .claim(request(&key, Token::random(), Duration::from_secs(30)))
        .await
        .expect_err("a serialization failure");
    assert!(PgStore::is_retryable(&err), "{err}");
    let other = idem_runtime::StoreError::new("postgres", "x", std::io::Error::other("reset"));
    assert!(!PgStore::is_retryable(&other));
    tx.rollback().await.unwrap();
}

/// Under REPEATABLE READ, a claim in a transaction whose snapshot predates
/// the live owner's renewal answers Busy from the snapshot's row and leaves
/// the transaction usable. A plain insert's conflict check would meet the
/// renewed row, which the snapshot cannot see, and abort the caller's
/// transaction with a serialization failure.
#[tokio::test]
async fn under_repeatable_read_a_busy_key_renewed_after_the_snapshot_answers_busy() {
    let Some(store) = store().await else { return };
    let (key, owner) = (fresh_key("rr-busy"), Token::random());
    assert!(matches!(
        store.claim(request(&key, owner, TX_LEASE)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    // The snapshot is taken here, with the owner's first version of the row.
    sqlx::query("SELECT count(*) FROM idem_records WHERE key = $1")
        .bind(&key.as_bytes()[..])
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(store.renew(&key, owner, TX_LEASE).await.unwrap());
    let claim = tx
        .tx_connection()
        .claim(request(&key, Token::random(), TX_LEASE))
        .await;
    assert!(
        matches!(claim, Ok(Claim::Busy { .. })),
        "a Busy key aborted the caller's transaction: {claim:?}"
    );
    sqlx::query("SELECT 1")
        .execute(&mut *tx)
        .await
        .expect("the transaction is still usable");
    tx.rollback().await.unwrap();
}
