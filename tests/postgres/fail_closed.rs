//! Failing closed: a closed port or a silent server, and a connection lost
//! between claim and complete, taken over after the lease.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idem_runtime::store::sql::PgStore;
use idem_runtime::store::{Claim, RecordState, Store, Token};
use idem_runtime::{Error, idempotent};
use idem_tests::conformance::fresh_key;
use idem_tests::services;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::{random_u32, request, store, success};

#[tokio::test]
async fn a_closed_port_is_a_store_error_naming_the_server_never_the_password() {
    let url = "postgres://app:s3cret@127.0.0.1:1/test";
    let started = Instant::now();
    let err = PgStore::builder()
        .acquire_timeout(Duration::from_millis(500))
        .connect(url)
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "gave up after {:?}",
        started.elapsed()
    );
    assert_eq!(err.backend(), "postgres");
    assert_eq!(err.location(), "127.0.0.1:1/test");
    let text = err.to_string();
    assert!(
        text.contains("postgres") && text.contains("127.0.0.1:1"),
        "{text}"
    );
    // The cause, not just "pool timed out".
    assert!(text.to_lowercase().contains("refused"), "{text}");
    for shown in [text, format!("{err:?}")] {
        assert!(
            !shown.contains("s3cret") && !shown.contains("app@"),
            "{shown}"
        );
    }

    // An application's own pool: the location comes from its options too.
    let options = PgConnectOptions::from_str(url).unwrap();
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy_with(options);
    let err = PgStore::builder()
        .pool(pool)
        .await
        .expect_err("unreachable");
    assert_eq!(err.location(), "127.0.0.1:1/test");
    assert!(!format!("{err} {err:?}").contains("s3cret"));
}

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
}

struct Payments {
    store: PgStore,
    runs: AtomicUsize,
}

impl Payments {
    fn on(store: PgStore) -> Self {
        Payments {
            store,
            runs: AtomicUsize::new(0),
        }
    }

    #[idempotent(key = "order_id", scope = "pg.pay", ttl = "2m", lease = "1s", store = self.store)]
    async fn pay(&self, order_id: u64) -> Result<u64, AppError> {
        self.runs.fetch_add(1, SeqCst);
        Ok(order_id * 10)
    }

    /// The same call, but this process loses its database while the body runs.
    #[idempotent(key = "order_id", scope = "pg.pay", ttl = "2m", lease = "1s", store = self.store)]
    async fn pay_and_lose_the_database(&self, order_id: u64) -> Result<u64, AppError> {
        self.runs.fetch_add(1, SeqCst);
        self.store.pool().close().await;
        Ok(order_id * 10)
    }
}

/// The story at the store's level: the owner's completion fails, its record
/// stays PROCESSING, and another instance takes it over once the lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_between_claim_and_complete_is_taken_over_after_the_lease() {
    let Some(a) = store().await else { return };
    let b = PgStore::connect(&services::postgres_url())
        .await
        .expect("a second instance");
    let key = fresh_key("lost-connection");
    let lease = Duration::from_millis(800);

    let stale = Token::random();
    let first = a.claim(request(&key, stale, lease)).await.unwrap();
    assert_eq!(
        first,
        Claim::Acquired {
            fence: 1,
            takeover: false
        }
    );
    a.pool().close().await;
    let err = a
        .complete(&key, stale, success(b"lost", Duration::from_secs(60)))
        .await
        .expect_err("the pool is closed");
    assert_eq!(err.backend(), "postgres");
    assert!(err.to_string().contains(err.location()), "{err}");

    let info = b
        .inspect(&key)
        .await
        .unwrap()
        .expect("the claim is still there");
    assert_eq!(info.state, RecordState::Processing);
    assert!(matches!(
        b.claim(request(&key, Token::random(), lease))
            .await
            .unwrap(),
        Claim::Busy { .. }
    ));

    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    let fresh = Token::random();
    assert_eq!(
        b.claim(request(&key, fresh, lease)).await.unwrap(),
        Claim::Acquired {
            fence: 2,
            takeover: true
        }
    );
    assert!(
        b.complete(&key, fresh, success(b"fresh", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    let Claim::Done(stored) = b
        .claim(request(&key, Token::random(), lease))
        .await
        .unwrap()
    else {
        panic!("expected the fresh owner's result");
    };
    assert_eq!(stored.payload, b"fresh");
}

/// The same story as users meet it: through `#[idempotent]`. Once the store is
/// unreachable, a call fails with `Error::Store` and its body never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotated_calls_fail_closed_and_a_lost_call_is_taken_over() {
    let Some(store_a) = store().await else { return };
    let store_b = PgStore::connect(&services::postgres_url())
        .await
        .expect("a second instance");
    let (a, b) = (Payments::on(store_a), Payments::on(store_b));
    let order = u64::from(random_u32());

    // The body ran, so its caller gets the result; the record could not be
    // completed and stays PROCESSING.
    assert_eq!(
        a.pay_and_lose_the_database(order).await.unwrap(),
        order * 10
    );
    assert_eq!(a.runs.load(SeqCst), 1);

    let Err(AppError::Idem(Error::Store(e))) = a.pay(order + 1).await else {
        panic!("expected a store error");
    };
    assert_eq!(a.runs.load(SeqCst), 1, "the body ran without a claim");
    let text = e.to_string();
    assert!(
        text.contains("postgres") && text.contains(e.location()),
        "{text}"
    );

    assert!(matches!(
        b.pay(order).await,
        Err(AppError::Idem(Error::InProgress { .. }))
    ));
    assert_eq!(b.runs.load(SeqCst), 0);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(b.pay(order).await.unwrap(), order * 10);
    assert_eq!(b.pay(order).await.unwrap(), order * 10);
    assert_eq!(b.runs.load(SeqCst), 1, "taken over once, then replayed");
}

/// The pool times out on a server that never answers; the one direct attempt
/// that says why must time out too, not hang the start-up.
#[tokio::test]
async fn opening_on_a_server_that_never_answers_fails_in_bounded_time() {
    idem_tests::sql::opening_on_a_silent_server_is_bounded("postgres", |addr| async move {
        PgStore::builder()
            .acquire_timeout(Duration::from_secs(1))
            .connect(&format!("postgres://app:secret@{addr}/orders"))
            .await
    })
    .await;
}
