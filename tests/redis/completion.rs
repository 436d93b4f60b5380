//! Which path a completion takes, watched on the server with `MONITOR`: one
//! plain `SET … IFEQ` where the server has conditional `SET` (Valkey ≥ 8.1,
//! Redis ≥ 8.4), `complete.lua` elsewhere; and the cases only the plain path
//! has (the held record kept through renewals, a re-sent completion read
//! back).

use std::time::Duration;

use futures_util::StreamExt;
use idem_runtime::store::{Claim, Store, Token};
use idem_tests::services;

use super::*;

/// Whether the server itself takes `SET … IFEQ`.
async fn server_takes_ifeq(conn: &mut redis::aio::MultiplexedConnection) -> bool {
    let probe: redis::RedisResult<Option<String>> = redis::cmd("SET")
        .arg(format!("{}probe", unique_prefix()))
        .arg("x")
        .arg("IFEQ")
        .arg("y")
        .query_async(conn)
        .await;
    probe.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completion_is_one_plain_set_ifeq_exactly_where_the_server_has_it() {
    let Some(store) = single_store().await else {
        return;
    };
    let client = redis::Client::open(services::redis_url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let ifeq = server_takes_ifeq(&mut conn).await;
    assert_eq!(store.completes_with_set_ifeq(), ifeq);

    // Sends MONITOR itself.
    let monitor = client.get_async_monitor().await.unwrap();
    let mut lines = monitor.into_on_message::<String>();
    let key = key("completion");
    let name = store.redis_key(&key);
    let token = Token::random();
    assert!(matches!(
        store.claim(request(&key, token)).await.unwrap(),
        Claim::Acquired { fence: 1, .. }
    ));
    assert!(
        store
            .complete(&key, token, completion(b"42"))
            .await
            .unwrap()
    );
    // A marker after both, so every command of the two has been seen.
    let _: () = redis::cmd("ECHO")
        .arg(format!("end {name}"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut ours = Vec::new();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next())
            .await
            .expect("MONITOR lines")
            .expect("the monitor stream");
        if line.contains("\"ECHO\"") && line.contains(&name) {
            break;
        }
        if line.contains(&name) {
            ours.push(line);
        }
    }
    let sent: Vec<&str> = ours
        .iter()
        .filter(|l| !l.contains(" lua]"))
        .map(|l| l.split('"').nth(1).unwrap_or_default())
        .collect();
    if ifeq {
        assert_eq!(sent, ["SET", "SET"], "{ours:#?}");
        assert!(ours[1].contains("\"IFEQ\""), "{ours:#?}");
        assert!(
            !ours.iter().any(|l| l.contains(" lua]")),
            "no script ran: {ours:#?}"
        );
    } else {
        assert_eq!(sent, ["SET", "EVALSHA"], "{ours:#?}");
    }
    let info = store.inspect(&key).await.unwrap().expect("record");
    assert_eq!(info.state, idem_runtime::store::RecordState::Done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_then_a_completion_and_a_resent_completion_all_succeed_and_a_stale_one_fails() {
    let Some(store) = single_store().await else {
        return;
    };
    let held = key("completion");
    let token = Token::random();
    store.claim(request(&held, token)).await.unwrap();
    // Each renewal rewrites the record's margin: the held record follows,
    // or `IFEQ` would compare against a value the key no longer holds.
    for lease in [Duration::from_secs(7), Duration::from_secs(3)] {
        assert!(store.renew(&held, token, lease).await.unwrap());
    }
    assert!(
        store
            .complete(&held, token, completion(b"ok"))
            .await
            .unwrap()
    );
    assert!(
        store
            .complete(&held, token, completion(b"ok"))
            .await
            .unwrap(),
        "the same completion re-sent is a success"
    );
    // Another owner's token never completes a record it does not hold.
    let other = key("completion");
    let (first, second) = (Token::random(), Token::random());
    store.claim(request(&other, first)).await.unwrap();
    store.evict(&other).await.unwrap();
    assert!(matches!(
        store.claim(request(&other, second)).await.unwrap(),
        Claim::Acquired { fence: 2, .. }
    ));
    assert!(
        !store
            .complete(&other, first, completion(b"stale"))
            .await
            .unwrap(),
        "the evicted owner is fenced"
    );
    assert!(
        store
            .complete(&other, second, completion(b"fresh"))
            .await
            .unwrap()
    );
    let info = store.inspect(&other).await.unwrap().expect("record");
    assert_eq!(info.fence, 2);
}

/// A completion whose owner holds no record bytes (the claim was made by
/// another store instance: another process, or one restarted) falls back to
/// `complete.lua`, on every server, and is still fenced by token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_without_the_held_record_takes_the_script_and_is_still_fenced() {
    let url = services::redis_url();
    let prefix = unique_prefix();
    let open = || {
        RedisStore::builder()
            .key_prefix(prefix.clone())
            .connect(&url)
    };
    let Some(claimer) = services::reachable("Redis", &address(&url), open().await) else {
        return;
    };
    let completer = open().await.unwrap();
    let key = key("completion-elsewhere");
    let token = Token::random();
    assert!(matches!(
        claimer.claim(request(&key, token)).await.unwrap(),
        Claim::Acquired { fence: 1, .. }
    ));
    assert!(
        !completer
            .complete(&key, Token::random(), completion(b"not mine"))
            .await
            .unwrap(),
        "another token is fenced"
    );
    assert!(
        completer
            .complete(&key, token, completion(b"done elsewhere"))
            .await
            .unwrap()
    );
    let info = claimer.inspect(&key).await.unwrap().expect("record");
    assert_eq!(info.state, idem_runtime::store::RecordState::Done);
}
