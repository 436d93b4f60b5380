//! The recovery index (`<prefix>{recovery}:due:<scope>`) and the claims it
//! points at: a recoverable claim writes its index entry, then its record, in
//! two commands; a worker's pass that reads the index between the two must
//! not lose the claim.

use std::time::Duration;

use idem_runtime::Key;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::{Claim, ClaimRequest, RecoveryArgs, Store, Token};
use idem_tests::services;

use super::{address, direct_and_proxy, unique_prefix};

const LEASE: Duration = Duration::from_millis(600);

/// A pass that runs while the claim is between its index write and its
/// record write, after the lease the entry announces, sees no record and
/// drops the entry. The claim, once its record is written, must still be
/// found abandoned when its lease runs out (was: never, the flow stayed
/// PROCESSING, counted nowhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_indexed_while_a_pass_reads_the_index_is_recovered() {
    let Some((direct, proxy, prefix)) = direct_and_proxy().await else {
        return;
    };
    let stalled = RedisStore::builder()
        .key_prefix(&prefix)
        .connect(&format!("redis://127.0.0.1:{}", proxy.port()))
        .await
        .expect("through the proxy");

    let scope = format!("{prefix}scope");
    let key = Key::builder("idem-tests::redis::recovery_index")
        .part(scope.as_str())
        .finish();
    // The record's write is the claim's only script call: hold it.
    proxy.hold_requests_with(b"EVALSHA");
    let claim = tokio::spawn({
        let (stalled, scope) = (stalled.clone(), scope.clone());
        async move {
            let req = ClaimRequest {
                key: &key,
                token: Token::random(),
                fingerprint: None,
                lease: LEASE,
                ttl: Duration::from_secs(60),
            };
            let args = RecoveryArgs {
                scope: &scope,
                args: b"sealed",
            };
            stalled.claim_recoverable(req, args).await
        }
    });
    proxy.request_held().await;
    // Past the moment the index entry says to look: the pass finds no
    // record behind it.
    tokio::time::sleep(LEASE + Duration::from_millis(100)).await;
    assert!(direct.abandoned(&scope, 10).await.unwrap().is_empty());
    proxy.release_requests();
    let claim = claim.await.unwrap().unwrap();
    let Claim::Acquired { fence, .. } = claim else {
        panic!("expected to acquire, got {claim:?}");
    };
    assert!(
        direct.abandoned(&scope, 10).await.unwrap().is_empty(),
        "a live claim is not abandoned"
    );

    // Its caller never comes back: once the lease is over, a pass finds it.
    tokio::time::sleep(LEASE + Duration::from_millis(200)).await;
    let found = direct.abandoned(&scope, 10).await.unwrap();
    assert_eq!(found.len(), 1, "the claim was lost to the index: {found:?}");
    assert_eq!((found[0].key, found[0].fence), (key, fence));
    assert_eq!(found[0].args, b"sealed");
}

/// Without a stall, the entry is not due before the lease would end: a pass
/// right after the claim does not peek at it (and so cannot drop it).
#[tokio::test]
async fn a_new_claims_entry_is_due_when_its_lease_would_end() {
    let url = services::redis_url();
    let prefix = unique_prefix();
    let store = RedisStore::builder()
        .key_prefix(&prefix)
        .connect(&url)
        .await;
    let Some(store) = services::reachable("Redis", &address(&url), store) else {
        return;
    };
    let scope = format!("{prefix}due");
    let key = Key::builder("idem-tests::redis::recovery_index")
        .part(scope.as_str())
        .finish();
    let req = ClaimRequest {
        key: &key,
        token: Token::random(),
        fingerprint: None,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    };
    let args = RecoveryArgs {
        scope: &scope,
        args: b"sealed",
    };
    let before = now_ms();
    store.claim_recoverable(req, args).await.unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let score: f64 = redis::cmd("ZSCORE")
        .arg(format!("{prefix}{{recovery}}:due:{scope}"))
        .arg(key.to_hex())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        score >= (before + 30_000) as f64,
        "due at {score}, before the lease that began at {before} would end"
    );
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}
