//! The record's shorter name, `<prefix>{<32 hex>}`, and the records an
//! earlier version left under `<prefix>{<64 hex>}`, written here by hand as it
//! wrote them (a raw `SET` of its layout and name) before the store connects:
//! a DONE one is replayed, never run again; a live claim makes a claim Busy;
//! a released or abandoned one is taken over with its next fence; an expired
//! or absent one lets the claim run; the recovery worker still finds an
//! abandoned recoverable one. Then the marker that ends all this on a fresh
//! deployment (counted with `INFO commandstats`), every key of a record in one
//! cluster slot, and the bytes a first-call record costs (`MEMORY USAGE`).

use std::time::Duration;

use idem_runtime::Key;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::{Claim, ClaimRequest, RecoveryArgs, Store, StoredOutcome, Token};
use idem_tests::services;
use redis::aio::ConnectionLike;

use crate::{
    Ledger, OwnRedis, address, command_calls, completion, key, request, unique_prefix,
    wait_until_earlier_names_are_not_read,
};

/// A record's name in the earlier layout: the whole digest in hex.
fn earlier_name(prefix: &str, key: &Key) -> String {
    format!("{prefix}{{{}}}", key.to_hex())
}

/// A DONE record as the earlier version wrote it: no fingerprint, fence 1,
/// outcome 1 (success).
fn done_value(payload: &[u8]) -> Vec<u8> {
    let mut v = b"D1".to_vec();
    v.extend_from_slice(Token::random().as_bytes());
    v.extend_from_slice(b"-1:1:");
    v.extend_from_slice(payload);
    v
}

/// A PROCESSING record: its lease ends `margin` ms before the key expires.
fn processing_value(token: Token, fence: u64, ttl: u64, margin: u64) -> Vec<u8> {
    let mut v = b"P1".to_vec();
    v.extend_from_slice(token.as_bytes());
    v.extend_from_slice(format!("-{fence}:{ttl}:{margin}").as_bytes());
    v
}

async fn set_px(conn: &mut impl ConnectionLike, name: &str, value: &[u8], px: u64) {
    let () = redis::cmd("SET")
        .arg(name)
        .arg(value)
        .arg("PX")
        .arg(px)
        .query_async(conn)
        .await
        .unwrap();
}

async fn get(conn: &mut impl ConnectionLike, name: &str) -> Option<Vec<u8>> {
    redis::cmd("GET").arg(name).query_async(conn).await.unwrap()
}

/// The earlier version's records, one per state, and what a claim after the
/// upgrade makes of each.
async fn earlier_records_are_honoured(
    conn: &mut impl ConnectionLike,
    connect: impl AsyncFnOnce(&str) -> Option<RedisStore>,
) {
    let prefix = unique_prefix();
    let [done, live, abandoned, released, expired, absent, unmoved] = [
        "done",
        "live",
        "abandoned",
        "released",
        "expired",
        "absent",
        "unmoved",
    ]
    .map(key);
    let payload = [7u8; 40];
    let done_record = done_value(&payload);
    set_px(conn, &earlier_name(&prefix, &done), &done_record, 600_000).await;
    // Lease: the key's life less the margin, so 30 s left.
    let live_record = processing_value(Token::random(), 1, 600_000, 570_000);
    set_px(conn, &earlier_name(&prefix, &live), &live_record, 600_000).await;
    // A margin as long as the key's life: the lease is over.
    let stalled = processing_value(Token::random(), 4, 600_000, 600_000);
    set_px(conn, &earlier_name(&prefix, &abandoned), &stalled, 600_000).await;
    set_px(conn, &earlier_name(&prefix, &released), b"R13", 600_000).await;
    set_px(
        conn,
        &earlier_name(&prefix, &expired),
        &done_value(b"x"),
        300,
    )
    .await;

    // A claim of this version stopped between its SET and moving the earlier
    // DONE record over it: its lease is over, and the record must still win.
    set_px(
        conn,
        &earlier_name(&prefix, &unmoved),
        &done_record,
        600_000,
    )
    .await;
    let new_name = format!("{prefix}{{{}}}", &unmoved.to_hex()[..32]);
    let stopped = processing_value(Token::random(), 1, 600_000, 600_000);
    set_px(conn, &new_name, &stopped, 600_000).await;

    let Some(store) = connect(&prefix).await else {
        return;
    };
    assert!(store.reads_earlier_names());
    assert_eq!(store.redis_key(&unmoved), new_name);
    assert!(
        matches!(
            store
                .claim(request(&unmoved, Token::random()))
                .await
                .unwrap(),
            Claim::Done(_)
        ),
        "a claim stopped before moving the earlier record let the body run"
    );

    let claim = store.claim(request(&done, Token::random())).await.unwrap();
    let Claim::Done(result) = claim else {
        panic!("the earlier DONE record was not replayed: {claim:?}");
    };
    assert_eq!(
        (result.outcome, &result.payload[..]),
        (StoredOutcome::Success, &payload[..])
    );
    // Moved, with its expiry: the next claim finds it under the new name.
    assert_eq!(get(conn, &earlier_name(&prefix, &done)).await, None);
    assert_eq!(
        get(conn, &store.redis_key(&done)).await.as_deref(),
        Some(&done_record[..])
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg(store.redis_key(&done))
        .query_async(conn)
        .await
        .unwrap();
    assert!((1..=600_000).contains(&pttl), "{pttl}");
    assert!(matches!(
        store.claim(request(&done, Token::random())).await.unwrap(),
        Claim::Done(_)
    ));

    let claim = store.claim(request(&live, Token::random())).await.unwrap();
    let Claim::Busy {
        lease_remaining, ..
    } = claim
    else {
        panic!("a live earlier claim did not hold its key: {claim:?}");
    };
    assert!(
        lease_remaining > Duration::from_secs(20),
        "{lease_remaining:?}"
    );

    assert_eq!(
        store
            .claim(request(&abandoned, Token::random()))
            .await
            .unwrap(),
        Claim::Acquired {
            fence: 5,
            takeover: true
        },
        "an abandoned earlier claim is taken over with its next fence"
    );
    assert_eq!(
        store
            .claim(request(&released, Token::random()))
            .await
            .unwrap(),
        Claim::Acquired {
            fence: 4,
            takeover: false
        },
        "a released earlier record counts its fence on"
    );

    tokio::time::sleep(Duration::from_millis(400)).await;
    for k in [&expired, &absent] {
        assert_eq!(
            store.claim(request(k, Token::random())).await.unwrap(),
            Claim::Acquired {
                fence: 1,
                takeover: false
            },
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_honours_records_under_their_earlier_names() {
    let url = services::redis_url();
    let Ok(client) = redis::Client::open(url.as_str()) else {
        return;
    };
    let conn = client.get_multiplexed_async_connection().await;
    let Some(mut conn) = services::reachable("Redis", &address(&url), conn) else {
        return;
    };
    earlier_records_are_honoured(&mut conn, async |prefix: &str| {
        let store = RedisStore::builder().key_prefix(prefix).connect(&url).await;
        services::reachable("Redis", &address(&url), store)
    })
    .await;
}

/// On the cluster the two names of a record are in different slots: each
/// command names one of them, so nothing is CROSSSLOT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_honours_records_under_their_earlier_names() {
    let urls = services::redis_cluster_urls();
    let at = urls
        .iter()
        .map(|u| address(u))
        .collect::<Vec<_>>()
        .join(",");
    let conn = redis::cluster::ClusterClient::new(urls.clone())
        .unwrap()
        .get_async_connection()
        .await;
    let Some(mut conn) = services::reachable("Redis Cluster", &at, conn) else {
        return;
    };
    earlier_records_are_honoured(&mut conn, async |prefix: &str| {
        let store = RedisStore::builder()
            .key_prefix(prefix)
            .connect_cluster(&urls)
            .await;
        services::reachable("Redis Cluster", &at, store)
    })
    .await;
}

/// inspect, evict and `stats` see a record under its earlier name (inspect
/// and evict move it first); once evicted, the next claim runs, at the next
/// fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_evict_and_stats_find_earlier_records() {
    let url = services::redis_url();
    let Ok(client) = redis::Client::open(url.as_str()) else {
        return;
    };
    let conn = client.get_multiplexed_async_connection().await;
    let Some(mut conn) = services::reachable("Redis", &address(&url), conn) else {
        return;
    };
    let prefix = unique_prefix();
    let [counted, inspected] = ["counted", "inspected"].map(key);
    for k in [&counted, &inspected] {
        set_px(
            &mut conn,
            &earlier_name(&prefix, k),
            &done_value(b"1"),
            600_000,
        )
        .await;
    }
    let store = RedisStore::builder()
        .key_prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    assert_eq!(store.stats().await.unwrap().done, 2);
    let info = store.inspect(&inspected).await.unwrap().expect("found");
    assert_eq!(
        (info.state, info.fence),
        (idem_runtime::store::RecordState::Done, 1)
    );
    assert!(store.evict(&inspected).await.unwrap());
    assert_eq!(
        store
            .claim(request(&inspected, Token::random()))
            .await
            .unwrap(),
        Claim::Acquired {
            fence: 2,
            takeover: false
        }
    );
    assert!(store.evict(&counted).await.unwrap());
    assert!(matches!(
        store
            .claim(request(&counted, Token::random()))
            .await
            .unwrap(),
        Claim::Acquired { fence: 2, .. }
    ));
}

/// End to end: a call completed by the earlier version (its DONE record, as
/// this version writes the same value, put under the earlier name) is
/// replayed after the upgrade, and the body does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_done_before_the_upgrade_is_replayed_not_run() {
    let url = services::redis_url();
    let before = RedisStore::builder()
        .key_prefix(unique_prefix())
        .connect(&url)
        .await;
    let Some(before) = services::reachable("Redis", &address(&url), before) else {
        return;
    };
    let ledger = Ledger::new(before.clone());
    assert_eq!(ledger.settle(21).await.unwrap(), 42);
    let key = Key::builder("idem-tests::redis::settle")
        .part(&21u64)
        .finish();
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let value = get(&mut conn, &before.redis_key(&key))
        .await
        .expect("the DONE record of settle(21)");

    let prefix = unique_prefix();
    set_px(&mut conn, &earlier_name(&prefix, &key), &value, 600_000).await;
    let after = RedisStore::builder()
        .key_prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    let upgraded = Ledger::new(after);
    assert_eq!(upgraded.settle(21).await.unwrap(), 42);
    assert_eq!(upgraded.runs(), 0, "the body ran again after the upgrade");
}

/// A recoverable claim the earlier version abandoned (its record, its
/// arguments' hash beside it, its index entry) is found by the worker, and
/// its turn taken, under the new name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_finds_an_abandoned_earlier_recoverable_claim() {
    let url = services::redis_url();
    let Ok(client) = redis::Client::open(url.as_str()) else {
        return;
    };
    let conn = client.get_multiplexed_async_connection().await;
    let Some(mut conn) = services::reachable("Redis", &address(&url), conn) else {
        return;
    };
    let prefix = unique_prefix();
    let scope = format!("{prefix}scope");
    let k = key("earlier-recoverable");
    let token = Token::random();
    let name = earlier_name(&prefix, &k);
    set_px(
        &mut conn,
        &name,
        &processing_value(token, 3, 600_000, 600_000),
        600_000,
    )
    .await;
    let () = redis::pipe()
        .hset_multiple(
            format!("{name}:recovery"),
            &[
                ("token", &token.as_bytes()[..]),
                ("scope", scope.as_bytes()),
                ("args", &b"sealed"[..]),
                ("attempts", &b"1"[..]),
                ("next_at", &b"0"[..]),
            ],
        )
        .ignore()
        .pexpire(format!("{name}:recovery"), 600_000)
        .ignore()
        .zadd(format!("{prefix}{{recovery}}:due:{scope}"), k.to_hex(), 0)
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();

    let store = RedisStore::builder()
        .key_prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    let found = store.abandoned(&scope, 10).await.unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (
            found[0].key,
            found[0].fence,
            &found[0].args[..],
            found[0].attempts
        ),
        (k, 3, &b"sealed"[..], 1)
    );
    let info = store
        .recovery_info(&k)
        .await
        .unwrap()
        .expect("its arguments");
    assert_eq!((info.scope.as_str(), info.attempts), (scope.as_str(), 1));
    assert_eq!(
        get(&mut conn, &name).await,
        None,
        "left under the earlier name"
    );
}

/// A deployment with no earlier records: the walk finds none and writes the
/// marker, after which a claim sends nothing for earlier names, and a store
/// connecting later reads the marker (one `GET`) and does not walk at all.
/// While earlier records may remain, a claim adds one `GET` and one `PTTL`
/// of the earlier name, in the same round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_marker_ends_the_reads_of_earlier_names() {
    let Some(server) = OwnRedis::start() else {
        return;
    };
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let reset = async |admin: &mut redis::aio::MultiplexedConnection| {
        let () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(admin)
            .await
            .unwrap();
    };
    let calls = async |admin: &mut redis::aio::MultiplexedConnection| {
        command_calls(admin)
            .await
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
    };

    let first = RedisStore::connect(&server.url()).await.unwrap();
    wait_until_earlier_names_are_not_read(&first).await;
    let marker: Option<String> = redis::cmd("GET")
        .arg("idem:{layout}:short-names")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(marker.is_some(), "no marker written");

    let claimed = async |store: &RedisStore, case: &str| {
        let k = key(case);
        let token = Token::random();
        assert!(matches!(
            store.claim(request(&k, token)).await.unwrap(),
            Claim::Acquired { fence: 1, .. }
        ));
        assert!(store.complete(&k, token, completion(b"1")).await.unwrap());
    };
    claimed(&first, "warm-up").await; // loads the scripts
    reset(&mut admin).await;
    claimed(&first, "after-marker").await;
    let sent = calls(&mut admin).await;
    assert!(
        !sent.contains_key("pttl"),
        "earlier names read after the marker: {sent:?}"
    );
    assert_eq!(
        sent.get("get").copied().unwrap_or(0),
        u64::from(!first.completes_with_set_ifeq()),
        "only complete.lua's own GET: {sent:?}"
    );

    reset(&mut admin).await;
    let second = RedisStore::connect(&server.url()).await.unwrap();
    assert!(!second.reads_earlier_names());
    let sent = calls(&mut admin).await;
    assert_eq!(sent.get("get"), Some(&1), "{sent:?}");
    assert!(!sent.contains_key("scan"), "{sent:?}");

    // Without the marker and with an earlier record left, a claim reads the
    // earlier name beside its SET.
    let () = redis::cmd("DEL")
        .arg("idem:{layout}:short-names")
        .query_async(&mut admin)
        .await
        .unwrap();
    set_px(
        &mut admin,
        &earlier_name("idem:", &key("left")),
        &done_value(b"1"),
        600_000,
    )
    .await;
    let third = RedisStore::connect(&server.url()).await.unwrap();
    claimed(&third, "warm-up-3").await;
    // Its walk of the keyspace (a SCAN, a PTTL of what it finds) is over.
    tokio::time::sleep(Duration::from_millis(500)).await;
    reset(&mut admin).await;
    claimed(&third, "beside-earlier").await;
    let sent = calls(&mut admin).await;
    assert!(third.reads_earlier_names());
    assert_eq!(
        (sent.get("pttl"), sent.get("get").copied().unwrap_or(0)),
        (Some(&1), 1 + u64::from(!third.completes_with_set_ifeq())),
        "{sent:?}"
    );
}

/// Every key of one record (its value and its recovery arguments) is in the
/// slot of its hash tag, the first 16 bytes of the key's digest in hex.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_every_key_of_a_record_is_in_one_slot() {
    let urls = services::redis_cluster_urls();
    let at = urls
        .iter()
        .map(|u| address(u))
        .collect::<Vec<_>>()
        .join(",");
    let store = RedisStore::builder()
        .key_prefix(unique_prefix())
        .connect_cluster(&urls)
        .await;
    let Some(store) = services::reachable("Redis Cluster", &at, store) else {
        return;
    };
    let mut conn = redis::cluster::ClusterClient::new(urls)
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let slot = async |conn: &mut redis::cluster_async::ClusterConnection, name: &str| -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(name)
            .query_async(conn)
            .await
            .unwrap()
    };
    for i in 0..16u32 {
        let k = Key::builder("idem-tests::slots").part(&i).finish();
        let name = store.redis_key(&k);
        let tag = &k.to_hex()[..32];
        assert!(name.ends_with(&format!("{{{tag}}}")), "{name}");
        let of_tag = slot(&mut conn, tag).await;
        assert_eq!(slot(&mut conn, &name).await, of_tag, "{name}");
        assert_eq!(
            slot(&mut conn, &format!("{name}:recovery")).await,
            of_tag,
            "the recovery hash of {name}"
        );
    }
    // A recoverable claim writes both at once, in one script: no CROSSSLOT.
    let k = key("recoverable-slot");
    let scope = format!("{}scope", unique_prefix());
    let req = ClaimRequest {
        key: &k,
        token: Token::random(),
        fingerprint: None,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    };
    let args = RecoveryArgs {
        scope: &scope,
        args: b"sealed",
    };
    assert!(matches!(
        store.claim_recoverable(req, args).await.unwrap(),
        Claim::Acquired { fence: 1, .. }
    ));
}

/// What a first call's DONE record (a 40-byte result, no fingerprint) costs
/// the server, `MEMORY USAGE … SAMPLES 0`, with the default prefix, beside
/// the same value under the earlier name. At most 150 bytes on Valkey; other
/// servers' figures are printed only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_call_record_is_small() {
    let Some(server) = OwnRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let k = key("memory");
    let token = Token::random();
    store.claim(request(&k, token)).await.unwrap();
    assert!(
        store
            .complete(&k, token, completion(&[b'r'; 40]))
            .await
            .unwrap()
    );
    let name = store.redis_key(&k);
    let value = get(&mut admin, &name).await.unwrap();
    set_px(&mut admin, &earlier_name("idem:", &k), &value, 600_000).await;
    let usage = async |admin: &mut redis::aio::MultiplexedConnection, name: &str| {
        redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(name)
            .arg("SAMPLES")
            .arg(0)
            .query_async::<Option<u64>>(admin)
            .await
    };
    let Ok(Some(bytes)) = usage(&mut admin, &name).await else {
        eprintln!("SKIPPED: MEMORY USAGE is not available on this server");
        return;
    };
    let earlier = usage(&mut admin, &earlier_name("idem:", &k))
        .await
        .unwrap()
        .unwrap();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut admin)
        .await
        .unwrap();
    let valkey = info
        .lines()
        .find_map(|l| l.strip_prefix("valkey_version:"))
        .map(str::trim);
    let version = valkey.map(|v| format!("Valkey {v}")).unwrap_or_else(|| {
        info.lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .map(|v| format!("Redis {}", v.trim()))
            .unwrap_or_default()
    });
    eprintln!(
        "{version}: a first-call DONE record ({} B value, {} B name) uses {bytes} B; \
         under its earlier {} B name, {earlier} B",
        value.len(),
        name.len(),
        earlier_name("idem:", &k).len()
    );
    if valkey.is_some() {
        assert!(bytes <= 150, "{bytes} B on {version}");
    }
}

/// A hash of idem's oldest Redis layout under the earlier name (what the
/// version before the string records wrote) is no record this version can
/// move: a claim fails with an error that names it and the layout, leaves
/// the new name free instead of holding it for a lease with nothing
/// running, and runs no body; evict, the operator's way out, deletes it,
/// after which the key is claimed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hash_of_the_oldest_layout_under_the_earlier_name_is_a_clear_error_and_holds_nothing() {
    let url = services::redis_url();
    let Some(mut conn) = services::reachable(
        "Redis",
        &address(&url),
        match redis::Client::open(url.as_str()) {
            Ok(c) => c.get_multiplexed_async_connection().await,
            Err(e) => Err(e),
        },
    ) else {
        return;
    };
    let prefix = unique_prefix();
    let key = Key::builder("idem-tests::redis::settle")
        .part(&31u64)
        .finish();
    let old = earlier_name(&prefix, &key);
    let () = redis::pipe()
        .hset_multiple(&old, &[("state", "done"), ("fence", "2"), ("result", "42")])
        .ignore()
        .pexpire(&old, 600_000)
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    let store = RedisStore::builder()
        .key_prefix(&prefix)
        .connect(&url)
        .await
        .unwrap();
    let ledger = Ledger::new(store.clone());
    let shown = ledger
        .settle(31)
        .await
        .expect_err("a call over a hash of the oldest layout")
        .to_string();
    assert!(
        shown.contains(&old) && shown.contains("earlier Redis layout"),
        "the error does not say why: {shown}"
    );
    assert_eq!(
        ledger.runs(),
        0,
        "a body ran over an unreadable earlier record"
    );
    let held = get(&mut conn, &store.redis_key(&key)).await;
    assert!(
        held.as_deref().is_none_or(|v| !v.starts_with(b"P1")),
        "the claim on the new name was left holding the key: {held:?}"
    );

    store.evict(&key).await.expect("evict removes it");
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&old)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0, "evict left the hash");
    assert!(matches!(
        store.claim(request(&key, Token::random())).await.unwrap(),
        Claim::Acquired { .. }
    ));
}
