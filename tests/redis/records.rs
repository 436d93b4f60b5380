//! Record integrity: a re-sent completion, a value this version cannot read,
//! a hash of the earlier layout, and renewals past the ttl.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use idem_runtime::Key;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::{Claim, ClaimRequest, RecordState, Store, Token};
use idem_tests::services;

use crate::{Ledger, cluster_store, completion, key, request, single_store, store_error};

async fn single_admin() -> redis::aio::MultiplexedConnection {
    redis::Client::open(services::redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn cluster_admin() -> redis::cluster_async::ClusterConnection {
    redis::cluster::ClusterClient::new(services::redis_cluster_urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap()
}

/// Everything Redis holds for a record: its value and its expiry
/// (`PEXPIRETIME`, -2 once the key is gone).
async fn raw_record(
    conn: &mut impl redis::aio::ConnectionLike,
    name: &str,
) -> (Option<Vec<u8>>, i64) {
    let value: Option<Vec<u8>> = redis::cmd("GET").arg(name).query_async(conn).await.unwrap();
    let expiry: i64 = redis::cmd("PEXPIRETIME")
        .arg(name)
        .query_async(conn)
        .await
        .unwrap();
    (value, expiry)
}

/// A hash's fields and its expiry.
async fn raw_hash(
    conn: &mut impl redis::aio::ConnectionLike,
    name: &str,
) -> (BTreeMap<Vec<u8>, Vec<u8>>, i64) {
    let fields: BTreeMap<Vec<u8>, Vec<u8>> = redis::cmd("HGETALL")
        .arg(name)
        .query_async(conn)
        .await
        .unwrap();
    let expiry: i64 = redis::cmd("PEXPIRETIME")
        .arg(name)
        .query_async(conn)
        .await
        .unwrap();
    (fields, expiry)
}

/// The cluster client re-sends a request after an I/O error, so a completion
/// whose reply was lost can reach the server twice. The second finds the
/// record DONE under its own token: that is the same completion, a success
/// that changes nothing. Another token (a stale owner) is still refused.
async fn resent_complete_is_the_same_completion(
    store: RedisStore,
    admin: &mut impl redis::aio::ConnectionLike,
) {
    let key = key("resent-complete");
    let name = store.redis_key(&key);
    let token = Token::random();
    assert!(matches!(
        store.claim(request(&key, token)).await.unwrap(),
        Claim::Acquired { fence: 1, .. }
    ));
    assert!(store.complete(&key, token, completion(b"1")).await.unwrap());
    let done = raw_record(admin, &name).await;

    assert!(
        store.complete(&key, token, completion(b"1")).await.unwrap(),
        "the re-sent completion was reported as a lost claim"
    );
    assert_eq!(
        raw_record(admin, &name).await,
        done,
        "the re-sent completion changed the record"
    );

    assert!(
        !store
            .complete(&key, Token::random(), completion(b"stale"))
            .await
            .unwrap(),
        "another token completed a DONE record"
    );
    assert_eq!(raw_record(admin, &name).await, done);
    let claim = store.claim(request(&key, Token::random())).await.unwrap();
    let Claim::Done(stored) = claim else {
        panic!("expected a replay, got {claim:?}");
    };
    assert_eq!(stored.payload, b"1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_resent_complete_is_the_same_completion() {
    if let Some(store) = single_store().await {
        resent_complete_is_the_same_completion(store, &mut single_admin().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_resent_complete_is_the_same_completion() {
    if let Some(store) = cluster_store().await {
        resent_complete_is_the_same_completion(store, &mut cluster_admin().await).await;
    }
}

/// A value at a record's key that this version cannot read (a kind it does
/// not know, written by a newer version or by hand; a truncated record;
/// another application's value under the same prefix) is not an absent
/// record: claiming and inspecting it fail with a `StoreError` that names the
/// problem, the body never runs, and the value is left as it was.
async fn unknown_state_fails_closed(
    store: RedisStore,
    admin: &mut impl redis::aio::ConnectionLike,
) {
    let ledger = Ledger::new(store.clone());
    let mut truncated = b"P1".to_vec();
    truncated.extend_from_slice(&[7; 16]);
    truncated.extend_from_slice(b"-4:");
    for (i, value) in [
        b"A1archived".to_vec(),
        b"another application".to_vec(),
        truncated,
        b"R1".to_vec(),
    ]
    .into_iter()
    .enumerate()
    {
        let order = u64::from(Token::random().as_bytes()[0]) + 10_000 * (i as u64 + 1);
        let key = Key::builder("idem-tests::redis::settle")
            .part(&order)
            .finish();
        let name = store.redis_key(&key);
        let () = redis::cmd("SET")
            .arg(&name)
            .arg(&value)
            .arg("PX")
            .arg(600_000)
            .query_async(admin)
            .await
            .unwrap();
        let written = raw_record(admin, &name).await;

        let e = store
            .claim(request(&key, Token::random()))
            .await
            .expect_err("a claim over an unreadable record");
        let shown = e.to_string();
        assert!(e.backend().starts_with("redis"), "{shown}");
        assert!(
            shown.contains(&name) && shown.contains("cannot read"),
            "the error does not say why: {shown}"
        );
        let e = store
            .inspect(&key)
            .await
            .expect_err("inspecting an unreadable record");
        assert!(e.to_string().contains("cannot read"), "{e}");
        let e = store_error(ledger.settle(order).await);
        assert!(e.to_string().contains("cannot read"), "{e}");
        assert_eq!(ledger.runs(), 0, "a body ran over an unreadable record");
        assert_eq!(
            raw_record(admin, &name).await,
            written,
            "the unreadable record was changed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_unknown_state_fails_closed() {
    if let Some(store) = single_store().await {
        unknown_state_fails_closed(store, &mut single_admin().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_unknown_state_fails_closed() {
    if let Some(store) = cluster_store().await {
        unknown_state_fails_closed(store, &mut cluster_admin().await).await;
    }
}

/// Records written by the earlier layout (one hash per record, written by
/// the old claim.lua and complete.lua) are never replayed wrongly nor claimed
/// over: every operation on one fails with a `StoreError` saying the key
/// holds a hash of the earlier layout, no body runs, and the hash is left as
/// it was, to expire at its own ttl (or be evicted). A purge walks past it.
async fn earlier_layout_is_a_clear_error(
    store: RedisStore,
    admin: &mut impl redis::aio::ConnectionLike,
) {
    let ledger = Ledger::new(store.clone());
    let token = String::from_utf8_lossy(&[b'k'; 16]).into_owned();
    let old: [&[(&str, &str)]; 3] = [
        &[
            ("state", "done"),
            ("token", &token),
            ("fence", "2"),
            ("outcome", "1"),
            ("result", "424242"),
            ("fingerprint", ""),
            ("expires_at", "99999999999999"),
        ],
        &[
            ("state", "processing"),
            ("token", &token),
            ("fence", "1"),
            ("lease_until", "1"),
            ("expires_at", "99999999999999"),
            ("ttl", "600000"),
            ("fingerprint", ""),
        ],
        &[("state", "released"), ("fence", "3")],
    ];
    for (i, fields) in old.into_iter().enumerate() {
        let order = u64::from(Token::random().as_bytes()[0]) + 10_000 * (i as u64 + 1);
        let key = Key::builder("idem-tests::redis::settle")
            .part(&order)
            .finish();
        let name = store.redis_key(&key);
        let () = redis::pipe()
            .hset_multiple(&name, fields)
            .ignore()
            .pexpire(&name, 600_000)
            .ignore()
            .query_async(admin)
            .await
            .unwrap();
        let written = raw_hash(admin, &name).await;

        let says_why = |e: &idem_runtime::StoreError| {
            let shown = e.to_string();
            assert!(
                shown.contains(&name) && shown.contains("earlier Redis layout"),
                "the error does not say why: {shown}"
            );
        };
        says_why(
            &store
                .claim(request(&key, Token::random()))
                .await
                .expect_err("a claim over a record of the earlier layout"),
        );
        says_why(&store.inspect(&key).await.expect_err("inspect"));
        let owner = Token::from_bytes([b'k'; 16]);
        says_why(
            &store
                .complete(&key, owner, completion(b"1"))
                .await
                .expect_err("complete"),
        );
        says_why(
            &store
                .renew(&key, owner, Duration::from_secs(1))
                .await
                .expect_err("renew"),
        );
        says_why(&store.release(&key, owner).await.expect_err("release"));
        says_why(&store_error(ledger.settle(order).await));
        assert_eq!(ledger.runs(), 0, "a body ran over an earlier record");
        store
            .purge_expired(1000)
            .await
            .expect("a purge walks past it");
        assert_eq!(
            raw_hash(admin, &name).await,
            written,
            "the earlier record was changed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_earlier_layout_is_a_clear_error() {
    if let Some(store) = single_store().await {
        earlier_layout_is_a_clear_error(store, &mut single_admin().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_earlier_layout_is_a_clear_error() {
    if let Some(store) = cluster_store().await {
        earlier_layout_is_a_clear_error(store, &mut cluster_admin().await).await;
    }
}

/// A body that outlives its ttl but heartbeats is alive: every renewal keeps
/// the key (Redis must not expire it under a live lease), a newcomer stays
/// Busy throughout, and the owner completes at the end.
async fn renewals_keep_a_live_claim_past_its_ttl(
    store: RedisStore,
    admin: &mut impl redis::aio::ConnectionLike,
) {
    let key = key("renew-past-ttl");
    let name = store.redis_key(&key);
    let token = Token::random();
    let ttl = Duration::from_secs(1);
    let claim = store
        .claim(ClaimRequest {
            lease: Duration::from_millis(500),
            ttl,
            ..request(&key, token)
        })
        .await
        .unwrap();
    assert!(
        matches!(claim, Claim::Acquired { fence: 1, .. }),
        "{claim:?}"
    );
    // A lease far longer than the pause between beats, so a slow machine
    // cannot let it lapse; the ttl is what must not end the claim.
    let lease = Duration::from_secs(3);
    let started = Instant::now();
    let mut beats = 0;
    while started.elapsed() < ttl * 3 {
        assert!(
            store.renew(&key, token, lease).await.unwrap(),
            "the live owner lost its claim after {beats} renewals, {:?} into a {ttl:?} ttl",
            started.elapsed()
        );
        beats += 1;
        let newcomer = store.claim(request(&key, Token::random())).await.unwrap();
        assert!(
            matches!(newcomer, Claim::Busy { .. }),
            "a live claim was taken after {:?}: {newcomer:?}",
            started.elapsed()
        );
        let (fields, expiry) = raw_record(admin, &name).await;
        assert!(fields.is_some() && expiry > 0, "the key expired");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        store
            .complete(&key, token, completion(b"late"))
            .await
            .unwrap()
    );
    let info = store.inspect(&key).await.unwrap().expect("record");
    assert_eq!((info.state, info.fence), (RecordState::Done, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_renewals_keep_a_live_claim_past_its_ttl() {
    if let Some(store) = single_store().await {
        renewals_keep_a_live_claim_past_its_ttl(store, &mut single_admin().await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_renewals_keep_a_live_claim_past_its_ttl() {
    if let Some(store) = cluster_store().await {
        renewals_keep_a_live_claim_past_its_ttl(store, &mut cluster_admin().await).await;
    }
}
