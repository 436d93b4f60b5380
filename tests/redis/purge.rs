//! Purging released records: at most `limit`, under the store's own prefix.

use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::{Claim, Store, Token};

use crate::{cluster_store, key, request, single_store};

/// Purging deletes released records under the store's own prefix, at most
/// `limit` per call, and nothing live nor another prefix's.
async fn purge_respects_limit_and_prefix(store: RedisStore, other: RedisStore) {
    let mut released = Vec::new();
    for i in 0..20 {
        let k = key(&format!("purge-{i}"));
        let t = Token::random();
        assert!(matches!(
            store.claim(request(&k, t)).await.unwrap(),
            Claim::Acquired { .. }
        ));
        assert!(store.release(&k, t).await.unwrap());
        released.push(k);
    }
    let live = key("purge-live");
    store.claim(request(&live, Token::random())).await.unwrap();
    let elsewhere = key("purge-elsewhere");
    let t = Token::random();
    other.claim(request(&elsewhere, t)).await.unwrap();
    assert!(other.release(&elsewhere, t).await.unwrap());

    assert_eq!(store.purge_expired(7).await.unwrap(), 7);
    assert_eq!(store.purge_expired(1000).await.unwrap(), 13);
    assert_eq!(store.purge_expired(1000).await.unwrap(), 0);
    for k in &released {
        assert!(!store.evict(k).await.unwrap(), "a released record survived");
    }
    assert!(
        store.inspect(&live).await.unwrap().is_some(),
        "a live record was purged"
    );
    // Still there: its fence counts on (a purged record would start at 1).
    let again = other
        .claim(request(&elsewhere, Token::random()))
        .await
        .unwrap();
    assert!(
        matches!(again, Claim::Acquired { fence: 2, .. }),
        "another prefix's record was purged: {again:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_purge_respects_limit_and_prefix() {
    let (Some(a), Some(b)) = (single_store().await, single_store().await) else {
        return;
    };
    purge_respects_limit_and_prefix(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_purge_respects_limit_and_prefix() {
    let (Some(a), Some(b)) = (cluster_store().await, cluster_store().await) else {
        return;
    };
    purge_respects_limit_and_prefix(a, b).await;
}
