//! Failing closed: a server that is gone, unreachable or silent, and a
//! connection lost after the claim, never run a body unclaimed nor show the
//! password.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idem_runtime::Error;
use idem_runtime::protocol::{Kind, Spec, execute};
use idem_runtime::store::StoreRef;
use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::{RecordState, Store};
use idem_tests::conformance::fresh_key;
use sqlx::mysql::MySqlPoolOptions;

use crate::{AppError, charge, store};

/// The owner loses its database connection after the claim (here: its pool
/// is closed inside the body, as if the process died). Its result cannot be
/// recorded, so the record stays PROCESSING; duplicates are told to wait, and
/// once the lease runs out a later caller takes over and runs the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_lost_after_the_claim_is_taken_over_after_the_lease() {
    let Some(owner) = store().await else { return };
    let Some(later) = store().await else { return };
    let spec = Spec::new("idem-tests::mysql::lost-connection", Kind::Call)
        .lease(Duration::from_millis(600));
    let key = fresh_key("mysql-lost-connection");
    let runs = Arc::new(AtomicUsize::new(0));

    let pool = owner.pool().clone();
    let first: Result<u32, Error> = execute(&spec, Some(StoreRef::new(owner)), key, None, {
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, SeqCst);
            pool.close().await;
            Ok(1)
        }
    })
    .await;
    assert_eq!(
        first.unwrap(),
        1,
        "the body's result still reaches its caller"
    );
    let info = later
        .inspect(&key)
        .await
        .unwrap()
        .expect("the claim is left");
    assert_eq!(info.state, RecordState::Processing);

    let later = StoreRef::new(later);
    let early: Result<u32, Error> =
        execute(&spec, Some(later.clone()), key, None, async { Ok(2) }).await;
    assert!(matches!(early, Err(Error::InProgress { .. })), "{early:?}");

    tokio::time::sleep(Duration::from_millis(800)).await;
    let taken: Result<u32, Error> = execute(&spec, Some(later.clone()), key, None, {
        let runs = runs.clone();
        async move {
            runs.fetch_add(1, SeqCst);
            Ok(3)
        }
    })
    .await;
    assert_eq!(taken.unwrap(), 3);
    assert_eq!(runs.load(SeqCst), 2);
    let replay: Result<u32, Error> = execute(&spec, Some(later), key, None, async { Ok(4) }).await;
    assert_eq!(replay.unwrap(), 3);
}

const CLOSED_PORT_URL: &str = "mysql://app:s3cret@127.0.0.1:1/test";

fn assert_safe_store_error(e: &idem_runtime::StoreError) {
    assert_eq!(e.backend(), "mysql");
    assert_eq!(e.location(), "127.0.0.1:1/test");
    for text in [e.to_string(), format!("{e:?}")] {
        assert!(text.contains("mysql"), "{text}");
        assert!(text.contains("127.0.0.1:1"), "{text}");
        assert!(!text.contains("s3cret"), "the password leaked: {text}");
    }
}

/// Nothing listens on the port: opening the store is a store error naming the
/// backend and the address, never the password.
#[tokio::test]
async fn unreachable_server_is_a_store_error_without_the_password() {
    let err = MySqlStore::builder()
        .acquire_timeout(Duration::from_millis(300))
        .connect(CLOSED_PORT_URL)
        .await
        .unwrap_err();
    assert_safe_store_error(&err);
    assert!(
        err.to_string().contains("refused"),
        "the reason is lost: {err}"
    );

    let err = MySqlStore::connect("mysql://app:s3cret@[bad")
        .await
        .unwrap_err();
    assert!(!err.to_string().contains("s3cret"), "{err}");
}

/// An annotated call on a store whose server is gone fails with
/// `Error::Store`, and its body never runs.
#[tokio::test]
async fn annotated_call_fails_closed_when_the_server_is_gone() {
    let pool = MySqlPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy(CLOSED_PORT_URL)
        .unwrap();
    // Migrations off: the store is built without reaching the server, like one
    // whose server went away after start-up.
    let store = MySqlStore::builder()
        .migrate(false)
        .pool(pool)
        .await
        .unwrap();
    let runs = AtomicUsize::new(0);
    match charge(&store, 42, &runs).await {
        Err(AppError::Idem(Error::Store(e))) => assert_safe_store_error(&e),
        other => panic!("expected a store error, got {other:?}"),
    }
    assert_eq!(runs.load(SeqCst), 0, "the body ran without a claim");
}

/// The pool times out on a server that never sends its greeting; the one
/// direct attempt that says why must time out too, not hang the start-up.
#[tokio::test]
async fn opening_on_a_server_that_never_answers_fails_in_bounded_time() {
    idem_tests::sql::opening_on_a_silent_server_is_bounded("mysql", |addr| async move {
        MySqlStore::builder()
            .acquire_timeout(Duration::from_secs(1))
            .connect(&format!("mysql://app:secret@{addr}/orders"))
            .await
    })
    .await;
}
