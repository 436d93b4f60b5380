//! The shared SQL record layer: records it cannot read fail closed, and
//! durations are clamped, as on every SQL store.

use std::time::Duration;

use idem_runtime::Key;
use idem_runtime::store::sql::PgStore;

use crate::store;

async fn set_on_key(store: &PgStore, assignment: &str, key: &Key) {
    sqlx::query(&format!(
        "UPDATE idem_records SET {assignment} WHERE key = $1"
    ))
    .bind(&key.as_bytes()[..])
    .execute(store.pool())
    .await
    .expect("write the record by hand");
}

#[tokio::test]
async fn an_unknown_state_fails_closed() {
    let Some(store) = store().await else { return };
    idem_tests::sql::unknown_state_fails_closed(&store.clone(), |key| async move {
        set_on_key(&store, "state = 7", &key).await
    })
    .await;
}

#[tokio::test]
async fn a_done_record_without_an_outcome_fails_closed() {
    let Some(store) = store().await else { return };
    idem_tests::sql::done_without_outcome_fails_closed(&store.clone(), |key| async move {
        set_on_key(&store, "outcome = NULL", &key).await
    })
    .await;
}

#[tokio::test]
async fn absurd_durations_are_clamped_like_every_sql_store() {
    let Some(store) = store().await else { return };
    idem_tests::sql::absurd_durations_are_clamped_alike(&store).await;
}

async fn expires_at<'c>(conn: impl sqlx::PgExecutor<'c>, key: &Key) -> i64 {
    sqlx::query_scalar("SELECT expires_at FROM idem_records WHERE key = $1")
        .bind(&key.as_bytes()[..])
        .fetch_one(conn)
        .await
        .expect("the record")
}

/// A completion moments after its claim keeps the expiry the claim wrote, so
/// no indexed column changes and PostgreSQL rewrites the row on its page with
/// no new index entries (a HOT update, counted by the server for the
/// transaction). Setting the expiry afresh made every completion a new tuple
/// and an entry in both of the table's indexes.
#[tokio::test]
async fn a_prompt_completion_is_rewritten_in_place() {
    use idem_runtime::store::tx::{AsTxConnection, TxConnection};
    let Some(store) = store().await else { return };
    let (key, token) = (
        idem_tests::conformance::fresh_key("hot-completion"),
        idem_runtime::store::Token::random(),
    );
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim(crate::request(&key, token, Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(
        matches!(claim, idem_runtime::store::Claim::Acquired { .. }),
        "{claim:?}"
    );
    let claimed = expires_at(&mut *tx, &key).await;
    let completion = crate::success(b"order-1", Duration::from_secs(120));
    assert!(
        tx.tx_connection()
            .complete(&key, token, completion)
            .await
            .unwrap()
    );
    let hot: i64 =
        sqlx::query_scalar("SELECT pg_stat_get_xact_tuples_hot_updated('idem_records'::regclass)")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    assert_eq!(hot, 1, "the completion was not a HOT update");
    assert_eq!(expires_at(&mut *tx, &key).await, claimed);
    tx.commit().await.unwrap();
}

/// Past the slack (a hundredth of the ttl, at most a minute) a completion
/// counts the ttl from itself, as it always did: a record never expires more
/// than the slack before its ttl from completion.
#[tokio::test]
async fn a_late_completion_counts_the_ttl_from_itself() {
    use idem_runtime::store::Store;
    let Some(store) = store().await else { return };
    let ttl = Duration::from_secs(2); // a slack of 20 ms
    let (key, token) = (
        idem_tests::conformance::fresh_key("late-completion"),
        idem_runtime::store::Token::random(),
    );
    let request = idem_runtime::store::ClaimRequest {
        ttl,
        ..crate::request(&key, token, Duration::from_secs(1))
    };
    store.claim(request).await.unwrap();
    let claimed = expires_at(store.pool(), &key).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        store
            .complete(&key, token, crate::success(b"order-2", ttl))
            .await
            .unwrap()
    );
    let completed = expires_at(store.pool(), &key).await;
    assert!(
        completed >= claimed + 250,
        "the expiry stayed at the claim's: {claimed} then {completed}"
    );
}
