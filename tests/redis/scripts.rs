//! The scripts: run with `EVALSHA` and reloaded after `SCRIPT FLUSH`, and what
//! a call costs in commands.

use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::{Claim, Store, Token};
use idem_tests::services;

use crate::{
    Ledger, OwnRedis, cluster_store, command_calls, completion, key, request,
    wait_until_earlier_names_are_not_read,
};

/// The claim is a plain command; the completion is the script every first
/// call runs.
fn complete_script_sha() -> String {
    redis::Script::new(include_str!(
        "../../idem-runtime/src/store/redis/complete.lua"
    ))
    .get_hash()
    .to_owned()
}

/// Whether the server (every master, on a cluster) has the completion script.
async fn script_loaded(conn: &mut impl redis::aio::ConnectionLike) -> bool {
    let exists: Vec<bool> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(complete_script_sha())
        .query_async(conn)
        .await
        .expect("SCRIPT EXISTS");
    exists == [true]
}

async fn script_flush(conn: &mut impl redis::aio::ConnectionLike) {
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(conn)
        .await
        .expect("SCRIPT FLUSH");
}

async fn completes_fresh_key(store: &RedisStore, case: &str) {
    let (key, token) = (key(case), Token::random());
    let claim = store.claim(request(&key, token)).await;
    assert!(
        matches!(claim, Ok(Claim::Acquired { fence: 1, .. })),
        "{case}: {claim:?}"
    );
    let done = store.complete(&key, token, completion(b"1")).await;
    assert!(matches!(done, Ok(true)), "{case}: {done:?}");
}

/// After `SCRIPT FLUSH` the server has forgotten every script: the next
/// completion gets NOSCRIPT, loads the script once and succeeds. On a server of the
/// test's own, so no other test reloads the script in between and the
/// server's counters show exactly that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_reloads_scripts_after_script_flush() {
    let Some(server) = OwnRedis::start() else {
        return;
    };
    // The script path even on a server with `SET … IFEQ` (Valkey), where
    // completions would otherwise run no script to reload.
    let store = RedisStore::builder()
        .script_completion()
        .connect(&server.url())
        .await
        .unwrap();
    assert!(!store.completes_with_set_ifeq());
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    completes_fresh_key(&store, "before-flush").await;
    assert!(script_loaded(&mut admin).await);

    script_flush(&mut admin).await;
    assert!(
        !script_loaded(&mut admin).await,
        "SCRIPT FLUSH left the script"
    );
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await
        .unwrap();
    completes_fresh_key(&store, "after-flush").await;
    assert!(
        script_loaded(&mut admin).await,
        "the completion reloaded the script"
    );

    let errors: String = redis::cmd("INFO")
        .arg("errorstats")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(errors.contains("errorstat_NOSCRIPT:count=1"), "{errors}");
    let calls = command_calls(&mut admin).await;
    assert!(calls.contains(&("script|load".to_owned(), 1)), "{calls:?}");

    completes_fresh_key(&store, "after-reload").await;
}

/// The same on the cluster: SCRIPT FLUSH and SCRIPT EXISTS go to every
/// master, and EXISTS is true only when all of them have the script. The
/// cluster is shared with the other tests of this binary, which may reload
/// the script at any moment, so only the outcome is checked here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_reloads_scripts_after_script_flush() {
    let Some(store) = cluster_store().await else {
        return;
    };
    let client = redis::cluster::ClusterClient::new(services::redis_cluster_urls()).unwrap();
    let mut conn = client.get_async_connection().await.unwrap();
    completes_fresh_key(&store, "before-flush").await;
    script_flush(&mut conn).await;
    // Keys spread over the masters: each one that answers NOSCRIPT reloads.
    for i in 0..8 {
        completes_fresh_key(&store, &format!("after-flush-{i}")).await;
    }
    assert!(
        script_loaded(&mut conn).await,
        "the completions reloaded the script"
    );
}

/// Round trips, counted by the server: a first call is one `SET` to claim and
/// one `EVALSHA` to complete (commandstats also counts the `GET` and `SET`
/// that complete.lua runs inside the server), or on a server with
/// conditional `SET` two plain `SET`s; a duplicate is one `SET` that finds
/// the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_costs_a_set_and_an_evalsha_and_a_replay_one_set() {
    let Some(server) = OwnRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    wait_until_earlier_names_are_not_read(&store).await;
    let plain = store.completes_with_set_ifeq();
    let ledger = Ledger::new(store);
    ledger.settle(1).await.unwrap(); // loads the scripts
    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();

    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await
        .unwrap();
    ledger.settle(2).await.unwrap();
    let first = command_calls(&mut admin).await;
    let sorted: std::collections::BTreeMap<_, _> = first.into_iter().collect();
    let expected = if plain {
        [("set", 2)].map(|(n, c)| (n.to_owned(), c)).into()
    } else {
        [("evalsha", 1), ("get", 1), ("set", 2)]
            .map(|(n, c)| (n.to_owned(), c))
            .into()
    };
    assert_eq!(sorted, expected);

    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut admin)
        .await
        .unwrap();
    ledger.settle(2).await.unwrap();
    assert_eq!(command_calls(&mut admin).await, [("set".to_owned(), 1)]);
    assert_eq!(ledger.runs(), 2);
}
