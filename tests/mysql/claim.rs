//! The claim's one `INSERT … ON DUPLICATE KEY UPDATE`: the order of its
//! assignments, and a lock wait timeout on the pool retried.

use std::time::Duration;

use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::tx::{AsTxConnection, TxConnection};
use idem_runtime::store::{Claim, ClaimRequest, RecordState, Store, Token};
use idem_tests::conformance::fresh_key;
use idem_tests::services;
use sqlx::mysql::MySqlPoolOptions;

use crate::{request, store, success};

/// The owner's own token, re-sent after it completed (a client retrying a
/// claim whose answer was lost, very late), must replay: the upsert assigns
/// `token` before the other columns, and a row that already carried our token
/// must not be mistaken for one we just won.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn own_token_after_completion_replays() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-own-token-done");
    let token = Token::random();
    let Claim::Acquired { fence, .. } = store.claim(request(&key, token)).await.unwrap() else {
        panic!("expected to acquire");
    };
    assert!(store.complete(&key, token, success(b"done")).await.unwrap());
    let again = store.claim(request(&key, token)).await.unwrap();
    let Claim::Done(stored) = again else {
        panic!("the completed record was reopened: {again:?}");
    };
    assert_eq!(stored.payload, b"done");
    let info = store.inspect(&key).await.unwrap().expect("record");
    assert_eq!((info.state, info.fence), (RecordState::Done, fence));
}

/// A takeover re-sent under the same token is the same takeover: same fence,
/// still reported as a takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retried_takeover_keeps_its_fence_and_flag() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-retried-takeover");
    let short = |token| ClaimRequest {
        lease: Duration::from_millis(300),
        ..request(&key, token)
    };
    let Claim::Acquired { fence: first, .. } = store.claim(short(Token::random())).await.unwrap()
    else {
        panic!("expected to acquire");
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let token = Token::random();
    for _ in 0..2 {
        let claim = store.claim(short(token)).await.unwrap();
        let Claim::Acquired { fence, takeover } = claim else {
            panic!("expected the takeover, got {claim:?}");
        };
        assert_eq!(fence, first + 1);
        assert!(takeover);
    }
}

/// On the pool, a claim that runs out of lock wait (1205) behind a caller's
/// transaction is run again and then sees what that transaction committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_wait_timeout_on_the_pool_is_retried() {
    let Some(holder) = store().await else { return };
    let pool = MySqlPoolOptions::new()
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .connect(&services::mysql_url())
        .await
        .unwrap();
    let impatient = MySqlStore::builder().pool(pool).await.unwrap();

    let key = fresh_key("mysql-lock-wait");
    let token = Token::random();
    let mut tx = holder.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim(request(&key, token))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "got {claim:?}");

    let started = std::time::Instant::now();
    let waiter = tokio::spawn(async move { impatient.claim(request(&key, Token::random())).await });
    // Longer than one lock wait (1 s), shorter than all the attempts together.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        tx.tx_connection()
            .complete(&key, token, success(b"held"))
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    let claim = waiter
        .await
        .unwrap()
        .expect("the lock wait timeout was not retried");
    let Claim::Done(stored) = claim else {
        panic!("expected a replay, got {claim:?}");
    };
    assert_eq!(stored.payload, b"held");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "it never waited"
    );
}
