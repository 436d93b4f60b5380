use sqlx::Row as _;

use super::SqliteStore;
use super::statements::PURGE;

/// The purge reads a range of the `expires_at` index, never the whole
/// table (which it would do under the database's one write lock).
#[tokio::test]
async fn purge_walks_the_expires_at_index() {
    let store = SqliteStore::in_memory().await.unwrap();
    // Rows of (id, parent, notused, detail).
    let plan: Vec<String> = sqlx::query(&format!("EXPLAIN QUERY PLAN {PURGE}"))
        .bind(0_i64)
        .bind(10_i64)
        .fetch_all(store.pool())
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<String, _>(3))
        .collect();
    assert!(
        plan.iter()
            .any(|d| d.contains("INDEX idem_records_expires_at (expires_at<?)")),
        "{plan:?}"
    );
    assert!(
        !plan.iter().any(|d| d.starts_with("SCAN idem_records")),
        "{plan:?}"
    );
}
