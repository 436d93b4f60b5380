//! Purging and sweeping dead records, in a schema of the test's own.

use std::time::Duration;

use idem_runtime::Key;
use idem_runtime::store::StoreRef;
use idem_runtime::store::spawn_sweeper;
use idem_runtime::store::sql::PgStore;
use idem_runtime::store::{Store, Token};
use idem_tests::conformance::fresh_key;

use crate::{Schema, request, success, until};

/// Fills a private schema with `dead` expired records, one released and one
/// live, and returns the live key.
async fn dead_and_live(store: &PgStore, dead: usize) -> Key {
    let lease = Duration::from_secs(30);
    for _ in 0..dead {
        let (key, token) = (fresh_key("dead"), Token::random());
        store.claim(request(&key, token, lease)).await.unwrap();
        assert!(
            store
                .complete(&key, token, success(b"d", Duration::from_millis(1)))
                .await
                .unwrap()
        );
    }
    let (released, token) = (fresh_key("released"), Token::random());
    store.claim(request(&released, token, lease)).await.unwrap();
    assert!(store.release(&released, token).await.unwrap());
    let (live, token) = (fresh_key("live"), Token::random());
    store.claim(request(&live, token, lease)).await.unwrap();
    assert!(
        store
            .complete(&live, token, success(b"l", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    live
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_is_bounded_and_skips_rows_a_transaction_holds() {
    let Some(schema) = Schema::create("purge").await else {
        return;
    };
    let store = PgStore::builder()
        .connect_with(schema.options.clone())
        .await
        .unwrap();
    let live = dead_and_live(&store, 6).await;

    // A transaction holds one dead row: purging passes it by instead of waiting.
    let mut holder = store.pool().begin().await.unwrap();
    let held: Vec<u8> = sqlx::query_scalar(
        "SELECT key FROM idem_records
         WHERE state = 2 AND expires_at <= (extract(epoch FROM clock_timestamp()) * 1000)::bigint
         LIMIT 1 FOR UPDATE",
    )
    .fetch_one(&mut *holder)
    .await
    .unwrap();
    let mut batches = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), store.purge_expired(3))
            .await
            .expect("purging waited on a locked row")
            .unwrap();
        batches.push(n);
        if n < 3 {
            break;
        }
    }
    // 6 dead + 1 released, less the held one, 3 at a time.
    assert_eq!(batches, vec![3, 3, 0]);
    holder.commit().await.unwrap();
    assert_eq!(store.purge_expired(3).await.unwrap(), 1);
    let gone: bool =
        sqlx::query_scalar("SELECT NOT EXISTS (SELECT 1 FROM idem_records WHERE key = $1)")
            .bind(&held)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert!(gone, "the held row went last");
    assert_eq!(schema.count("idem_records").await, 1);
    assert!(store.inspect(&live).await.unwrap().is_some());
    store.pool().close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_deletes_dead_records_in_batches_and_keeps_live_ones() {
    let Some(schema) = Schema::create("sweep").await else {
        return;
    };
    let store = PgStore::builder()
        .connect_with(schema.options.clone())
        .await
        .unwrap();
    let live = dead_and_live(&store, 10).await;
    assert_eq!(schema.count("idem_records").await, 12);

    let sweeper = spawn_sweeper(StoreRef::new(store.clone()), Duration::from_millis(50), 4);
    until("the sweeper to leave only the live record", || async {
        schema.count("idem_records").await == 1
    })
    .await;
    assert!(store.inspect(&live).await.unwrap().is_some());

    // Later deaths go in a later round.
    let (key, token) = (fresh_key("later"), Token::random());
    store
        .claim(request(&key, token, Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(
        store
            .complete(&key, token, success(b"x", Duration::from_millis(1)))
            .await
            .unwrap()
    );
    until("the later record to go", || async {
        schema.count("idem_records").await == 1
    })
    .await;
    assert!(!sweeper.is_finished());
    sweeper.abort();
    store.pool().close().await;
    schema.drop().await;
}
