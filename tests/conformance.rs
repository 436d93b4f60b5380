//! Every embedded store runs the whole conformance suite.

use idem_runtime::ManualClock;
use idem_runtime::store::StoreRef;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::sql::SqliteStore;
use idem_tests::conformance::Subject;

async fn memory() -> Subject {
    let clock = ManualClock::default();
    let store = MemoryStore::builder().clock(clock.clone()).build();
    Subject::manual(StoreRef::new(store), clock)
}

async fn sqlite_in_memory() -> Subject {
    let clock = ManualClock::default();
    let store = SqliteStore::builder()
        .clock(clock.clone())
        .in_memory()
        .await
        .expect("in-memory sqlite");
    Subject::manual(StoreRef::new(store), clock)
}

async fn sqlite_file() -> Subject {
    let clock = ManualClock::default();
    let path = std::env::temp_dir().join(format!(
        "idem-conformance-{}-{}.db",
        std::process::id(),
        idem_runtime::store::Token::random().as_bytes()[0] as u32 * 1000 + rand_suffix()
    ));
    let store = SqliteStore::builder()
        .clock(clock.clone())
        .open(&path)
        .await
        .expect("sqlite file");
    Subject::manual(StoreRef::new(store), clock)
}

fn rand_suffix() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

idem_tests::conformance_suite!(memory_store, memory());
idem_tests::conformance_suite!(sqlite_memory_store, sqlite_in_memory());
idem_tests::conformance_suite!(sqlite_file_store, sqlite_file());

/// Two pools on one file behave like two processes: migrations run twice
/// without harm, and a storm split across both still runs the body once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_file_shared_by_two_pools() {
    use idem_runtime::Error;
    use idem_runtime::protocol::{Kind, Spec, execute};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    let path = std::env::temp_dir().join(format!(
        "idem-two-pools-{}-{}.db",
        std::process::id(),
        rand_suffix()
    ));
    let a = StoreRef::new(SqliteStore::open(&path).await.expect("first pool"));
    let b = StoreRef::new(
        SqliteStore::open(&path)
            .await
            .expect("second pool, migrated again"),
    );

    const SPEC: Spec = Spec::new("idem-conformance::two-pools", Kind::Call);
    let key = idem_tests::conformance::fresh_key("two-pools");
    let runs = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        let runs = runs.clone();
        tasks.push(tokio::spawn(async move {
            execute::<u32, _, Error, _>(&SPEC, Some(store), key, None, async {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(7)
            })
            .await
        }));
    }
    for t in tasks {
        match t.await.unwrap() {
            Ok(v) => assert_eq!(v, 7),
            Err(Error::InProgress { .. }) => {}
            Err(e) => panic!("a writer failed instead of waiting: {e}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let _ = std::fs::remove_file(&path);
}

/// A database that cannot be opened is a store error naming the backend and
/// the file, before any call runs.
#[tokio::test]
async fn sqlite_unopenable_file_is_a_store_error() {
    let err = SqliteStore::open("/nonexistent-dir/idem.db")
        .await
        .unwrap_err();
    assert_eq!(err.backend(), "sqlite");
    assert!(
        err.to_string().contains("/nonexistent-dir/idem.db"),
        "{err}"
    );
}

// The shared SQL record layer: the same behaviour as every SQL store.

async fn set_on_key(store: &SqliteStore, assignment: &str, key: idem_runtime::Key) {
    sqlx::query(&format!(
        "UPDATE idem_records SET {assignment} WHERE key = ?1"
    ))
    .bind(&key.as_bytes()[..])
    .execute(store.pool())
    .await
    .expect("write the record by hand");
}

#[tokio::test]
async fn sqlite_unknown_state_fails_closed() {
    let store = SqliteStore::in_memory().await.unwrap();
    idem_tests::sql::unknown_state_fails_closed(&store.clone(), |key| async move {
        set_on_key(&store, "state = 7", key).await
    })
    .await;
}

#[tokio::test]
async fn sqlite_done_record_without_an_outcome_fails_closed() {
    let store = SqliteStore::in_memory().await.unwrap();
    idem_tests::sql::done_without_outcome_fails_closed(&store.clone(), |key| async move {
        set_on_key(&store, "outcome = NULL", key).await
    })
    .await;
}

#[tokio::test]
async fn sqlite_absurd_durations_are_clamped_like_every_sql_store() {
    let store = SqliteStore::in_memory().await.unwrap();
    idem_tests::sql::absurd_durations_are_clamped_alike(&store).await;
}

/// With `skip_migrations` the store runs no DDL: on a file whose table was
/// created by hand it works, and no ledger appears.
#[tokio::test]
async fn sqlite_store_that_skips_migrations_runs_no_ddl() {
    let path = std::env::temp_dir().join(format!(
        "idem-skip-migrations-{}-{}.db",
        std::process::id(),
        rand_suffix()
    ));
    let url = format!("sqlite://{}?mode=rwc", path.display());
    let by_hand = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::raw_sql(include_str!(
        "../idem-runtime/migrations/sqlite/0001_create_records.sql"
    ))
    .execute(&by_hand)
    .await
    .expect("the schema, applied by hand");
    by_hand.close().await;
    let store = SqliteStore::builder()
        .skip_migrations()
        .open(&path)
        .await
        .expect("open without migrating");
    let key = idem_tests::conformance::fresh_key("skip-migrations");
    let claimed = idem_runtime::store::Store::claim(
        &store,
        idem_runtime::store::ClaimRequest {
            key: &key,
            token: idem_runtime::store::Token::random(),
            fingerprint: None,
            lease: std::time::Duration::from_secs(30),
            ttl: std::time::Duration::from_secs(60),
        },
    )
    .await
    .unwrap();
    assert!(
        matches!(claimed, idem_runtime::store::Claim::Acquired { .. }),
        "{claimed:?}"
    );
    let ledgers: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM sqlite_master WHERE name = 'idem_schema_migrations'",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(
        ledgers, 0,
        "a store told to skip migrations created the ledger"
    );
    store.pool().close().await;
    let _ = std::fs::remove_file(&path);
}
