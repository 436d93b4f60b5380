//! Failing closed: a closed port, Redis stopping mid-test, and the connection
//! lost between claim and complete.

use std::time::{Duration, Instant};

use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::{RecordState, Store, Token};
use idem_runtime::{Error, Key};

use crate::{AppError, Ledger, OwnRedis, direct_and_proxy, store_error};

fn assert_names_redis_at(e: &idem_runtime::StoreError, at: &str, secret: Option<&str>) {
    let shown = format!("{e} / {e:?}");
    assert!(e.backend().starts_with("redis"), "backend: {shown}");
    assert_eq!(e.location(), at, "location: {shown}");
    assert!(shown.contains("redis") && shown.contains(at), "{shown}");
    if let Some(secret) = secret {
        assert!(!shown.contains(secret), "the password leaked: {shown}");
    }
}

/// (a) A store pointed at a closed port: connecting fails naming redis and
/// the address, never the password; a lazily connected store fails every
/// call with `Error::Store` and the body never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_port_fails_closed_without_showing_the_password() {
    let url = "redis://:s3cret@127.0.0.1:1";
    let err = RedisStore::connect(url)
        .await
        .expect_err("port 1 is closed");
    assert_names_redis_at(&err, "127.0.0.1:1", Some("s3cret"));
    assert!(!format!("{err:?}").contains("s3cret"));

    let store = RedisStore::builder()
        .reconnect_retries(1)
        .connect_lazy(url)
        .expect("a well-formed URL");
    assert!(!format!("{store:?}").contains("s3cret"));
    let ledger = Ledger::new(store);
    for order in [1, 1, 2] {
        let e = store_error(ledger.settle(order).await);
        assert_names_redis_at(&e, "127.0.0.1:1", Some("s3cret"));
        let whole = AppError::Idem(Error::Store(e)).to_string();
        assert!(!whole.contains("s3cret"), "{whole}");
    }
    assert_eq!(ledger.runs(), 0, "a body ran without a claim");
}

/// (b) Redis stops mid-test: the next calls return `Error::Store` naming
/// redis and the address, and their bodies never run. When Redis is back, the
/// same store reconnects by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_mid_test_fails_closed() {
    let Some(mut server) = OwnRedis::start() else {
        return;
    };
    let store = RedisStore::builder()
        .reconnect_retries(1)
        .connect(&server.url())
        .await
        .expect("own redis-server");
    let ledger = Ledger::new(store);
    assert_eq!(ledger.settle(7).await.unwrap(), 14);
    assert_eq!(ledger.settle(7).await.unwrap(), 14, "replayed");
    assert_eq!(ledger.runs(), 1);

    server.kill();
    for order in [8, 8, 9] {
        let started = Instant::now();
        let e = store_error(ledger.settle(order).await);
        assert_names_redis_at(&e, &server.at(), None);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "failing took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(ledger.runs(), 1, "a body ran while Redis was down");

    // Back on the same port (empty: it kept nothing): calls work again.
    let port = server.port;
    drop(server);
    let Some(_server) = OwnRedis::start_on(port, &[]) else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match ledger.settle(8).await {
            Ok(v) => {
                assert_eq!(v, 16);
                break;
            }
            Err(e) if Instant::now() < deadline => {
                let _ = store_error::<u64>(Err(e));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the store did not reconnect: {e}"),
        }
    }
    assert_eq!(ledger.runs(), 2);
}

/// (c) The connection is lost between claim and complete: the body ran, the
/// caller gets its result, but the record stays PROCESSING. A duplicate is
/// told the call is in progress; once the lease has run out, a later caller
/// takes over (with a higher fence) and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_lost_between_claim_and_complete_is_taken_over_after_the_lease() {
    let Some((direct, proxy, prefix)) = direct_and_proxy().await else {
        return;
    };
    let through_proxy = RedisStore::builder()
        // The same records as `direct`: same server, same prefix.
        .key_prefix(&prefix)
        .reconnect_retries(0)
        .connect(&format!("redis://127.0.0.1:{}", proxy.port()))
        .await
        .expect("through the proxy");
    let mut first = Ledger::new(through_proxy);
    first.cut = Some(proxy);
    let order = u64::from(Token::random().as_bytes()[0]) + 1_000;
    assert_eq!(
        first.settle(order).await.unwrap(),
        order * 2,
        "the body's result"
    );
    assert_eq!(first.runs(), 1);

    let later = Ledger::new(direct.clone());
    let k = Key::builder("idem-tests::redis::settle")
        .part(&order)
        .finish();
    let info = direct
        .inspect(&k)
        .await
        .unwrap()
        .expect("the record is left");
    assert_eq!(info.state, RecordState::Processing, "{info:?}");
    assert_eq!(info.fence, 1);

    match later.settle(order).await {
        Err(AppError::Idem(Error::InProgress { retry_after, .. })) => {
            assert!(retry_after <= Duration::from_millis(600));
        }
        other => panic!("expected InProgress within the lease, got {other:?}"),
    }
    assert_eq!(later.runs(), 0);

    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(later.settle(order).await.unwrap(), order * 2);
    assert_eq!(
        later.runs(),
        1,
        "the later caller took over and ran the body"
    );
    let info = direct.inspect(&k).await.unwrap().expect("record");
    assert_eq!((info.state, info.fence), (RecordState::Done, 2));
    assert_eq!(later.settle(order).await.unwrap(), order * 2, "replayed");
    assert_eq!(later.runs(), 1);
}
