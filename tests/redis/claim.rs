//! The claim: a re-sent claim is the same claim, and a record's key is
//! hash-tagged so a cluster spreads records over its masters.

use idem_runtime::Key;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::{Claim, RecordState, Store, Token};
use idem_tests::services;

use crate::{cluster_store, key, request, single_store};

/// redis-rs's cluster client re-sends a request after an I/O error, so one
/// claim can reach the server twice, even at once. Both answers are the same
/// acquisition; another caller is still busy.
async fn resent_claim_is_recognised(store: RedisStore) {
    let key = key("resent");
    let token = Token::random();
    let (a, b) = tokio::join!(
        store.claim(request(&key, token)),
        store.claim(request(&key, token))
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        a,
        Claim::Acquired {
            fence: 1,
            takeover: false
        }
    );
    assert_eq!(a, b, "the re-sent claim got another answer");
    assert_eq!(
        store.claim(request(&key, token)).await.unwrap(),
        a,
        "re-sent later"
    );
    assert!(matches!(
        store.claim(request(&key, Token::random())).await.unwrap(),
        Claim::Busy { .. }
    ));
    let info = store.inspect(&key).await.unwrap().expect("record");
    assert_eq!((info.state, info.fence), (RecordState::Processing, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_recognises_a_resent_claim() {
    if let Some(store) = single_store().await {
        resent_claim_is_recognised(store).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_recognises_a_resent_claim() {
    if let Some(store) = cluster_store().await {
        resent_claim_is_recognised(store).await;
    }
}

/// The record is one hash-tagged key: on the cluster its slot is the slot of
/// the tag, so every script touches one slot (no CROSSSLOT), and records
/// spread over the masters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_keys_are_hash_tagged_and_spread() {
    let Some(store) = cluster_store().await else {
        return;
    };
    let client = redis::cluster::ClusterClient::new(services::redis_cluster_urls()).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    let mut slots = std::collections::BTreeSet::new();
    for i in 0..32u32 {
        let k = Key::builder("idem-tests::spread").part(&i).finish();
        let name = store.redis_key(&k);
        let hex = &k.to_hex()[..32];
        let tag = format!("{{{hex}}}");
        assert!(name.ends_with(&tag), "{name} does not end with {tag}");
        let (of_key, of_tag): (u16, u16) = (
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(&name)
                .query_async(&mut conn)
                .await
                .unwrap(),
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(hex)
                .query_async(&mut conn)
                .await
                .unwrap(),
        );
        assert_eq!(of_key, of_tag, "the prefix changed the slot of {name}");
        slots.insert(of_key / 5462); // 3 masters own about 5461 slots each
    }
    assert!(slots.len() > 1, "32 records all landed on one master");
}
