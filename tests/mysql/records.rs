//! The shared SQL record layer: records it cannot read fail closed, and
//! durations are clamped, as on every SQL store.

use idem_runtime::Key;
use idem_runtime::store::sql::MySqlStore;

use crate::store;

async fn set_on_key(store: &MySqlStore, assignment: &str, key: &Key) {
    sqlx::query(&format!(
        "UPDATE idem_records SET {assignment} WHERE `key` = ?"
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
