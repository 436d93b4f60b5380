//! The MySQL/MariaDB store on a real server: the whole conformance suite,
//! claims inside the caller's transaction, migrations from several processes
//! at once, a crashed owner taken over, and failing closed.
//!
//! The server is `IDEM_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).
//! When it is unreachable each test says so and returns, or fails under
//! `IDEM_REQUIRE_SERVICES=1`.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use idem_runtime::protocol::{Kind, Spec, execute};
use idem_runtime::store::sql::MySqlStore;
use idem_runtime::store::tx::{AsTxConnection, TxConnection};
use idem_runtime::{
    Claim, ClaimRequest, Completion, Error, Key, Outcome, RecordState, Store, StoreRef, Token,
    idempotent,
};
use idem_tests::conformance::{Subject, fresh_key};
use idem_tests::services;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};

/// A store on the test server, migrated, or `None` (said loudly) when the
/// server is unreachable.
async fn store() -> Option<MySqlStore> {
    let url = services::mysql_url();
    services::reachable("MariaDB", &url, MySqlStore::connect(&url).await)
}

/// Server time, so the cases wait in real time: 250 ms per unit keeps the
/// leases (3 units) well clear of the server's millisecond clock and the
/// round trips.
async fn subject() -> Option<Subject> {
    let store = store().await?;
    Some(Subject::real(
        StoreRef::new(store),
        Duration::from_millis(250),
    ))
}

idem_tests::conformance_suite!(mysql_store, subject());

fn request(key: &Key, token: Token) -> ClaimRequest<'_> {
    ClaimRequest {
        key,
        token,
        fingerprint: None,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    }
}

fn success(payload: &[u8]) -> Completion<'_> {
    Completion {
        outcome: Outcome::Success,
        payload,
        ttl: Duration::from_secs(3600),
    }
}

// --- the claim's assignment order ---------------------------------------------

/// The owner's own token, re-sent after it completed (a client retrying a
/// claim whose answer was lost, very late), must replay: the upsert assigns
/// `token` before the other columns, and a row that already carried our token
/// must not be mistaken for one we just won.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn own_token_after_completion_replays() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-own-token-done");
    let token = Token::random();
    let Claim::Acquired { fence, .. } = store.claim(request(&key, token)).await.unwrap() else {
        panic!("expected to acquire");
    };
    assert!(store.complete(&key, token, success(b"done")).await.unwrap());
    let again = store.claim(request(&key, token)).await.unwrap();
    let Claim::Done(stored) = again else {
        panic!("the completed record was reopened: {again:?}");
    };
    assert_eq!(stored.payload, b"done");
    let info = store.inspect(&key).await.unwrap().expect("record");
    assert_eq!((info.state, info.fence), (RecordState::Done, fence));
}

/// A takeover re-sent under the same token is the same takeover: same fence,
/// still reported as a takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retried_takeover_keeps_its_fence_and_flag() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-retried-takeover");
    let short = |token| ClaimRequest {
        lease: Duration::from_millis(300),
        ..request(&key, token)
    };
    let Claim::Acquired { fence: first, .. } = store.claim(short(Token::random())).await.unwrap()
    else {
        panic!("expected to acquire");
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let token = Token::random();
    for _ in 0..2 {
        let claim = store.claim(short(token)).await.unwrap();
        let Claim::Acquired { fence, takeover } = claim else {
            panic!("expected the takeover, got {claim:?}");
        };
        assert_eq!(fence, first + 1);
        assert!(takeover);
    }
}

/// On the pool, a claim that runs out of lock wait (1205) behind a caller's
/// transaction is run again and then sees what that transaction committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_wait_timeout_on_the_pool_is_retried() {
    let Some(holder) = store().await else { return };
    let pool = MySqlPoolOptions::new()
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .connect(&services::mysql_url())
        .await
        .unwrap();
    let impatient = MySqlStore::builder().pool(pool).await.unwrap();

    let key = fresh_key("mysql-lock-wait");
    let token = Token::random();
    let mut tx = holder.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim(request(&key, token))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "got {claim:?}");

    let started = std::time::Instant::now();
    let waiter = tokio::spawn(async move { impatient.claim(request(&key, Token::random())).await });
    // Longer than one lock wait (1 s), shorter than all the attempts together.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        tx.tx_connection()
            .complete(&key, token, success(b"held"))
            .await
            .unwrap()
    );
    tx.commit().await.unwrap();
    let claim = waiter
        .await
        .unwrap()
        .expect("the lock wait timeout was not retried");
    let Claim::Done(stored) = claim else {
        panic!("expected a replay, got {claim:?}");
    };
    assert_eq!(stored.payload, b"held");
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "it never waited"
    );
}

// --- the caller's transaction ----------------------------------------------

/// A transaction in which `key` was claimed and completed with `payload`, left
/// open for the test to commit or roll back.
async fn claimed_and_completed(
    store: &MySqlStore,
    key: &Key,
    payload: &[u8],
) -> sqlx::Transaction<'static, sqlx::MySql> {
    let token = Token::random();
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx.tx_connection().claim(request(key, token)).await.unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "got {claim:?}");
    assert!(
        tx.tx_connection()
            .complete(key, token, success(payload))
            .await
            .unwrap()
    );
    tx
}

/// The classic "record exists but the business did not run": a claim and
/// completion inside a transaction that rolls back leave nothing behind, and a
/// retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolled_back_transaction_leaves_no_record() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-tx-rollback");
    let tx = claimed_and_completed(&store, &key, b"1").await;
    tx.rollback().await.unwrap();

    assert!(
        store.inspect(&key).await.unwrap().is_none(),
        "a rolled-back claim left a record"
    );
    let retry = store.claim(request(&key, Token::random())).await.unwrap();
    assert!(matches!(retry, Claim::Acquired { .. }), "got {retry:?}");
}

/// Committed with the business writes, the record replays to a later caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_transaction_replays() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-tx-commit");
    let tx = claimed_and_completed(&store, &key, b"{\"order\":9}").await;
    tx.commit().await.unwrap();

    let Claim::Done(stored) = store.claim(request(&key, Token::random())).await.unwrap() else {
        panic!("expected a replay");
    };
    assert_eq!(stored.payload, b"{\"order\":9}");
}

/// A release inside the transaction frees the key for a retry in the same one
/// (the protocol releases on `Err`), and the fence never goes backwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn release_inside_a_transaction() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-tx-release");
    let (first, second) = (Token::random(), Token::random());
    let mut tx = store.pool().begin().await.unwrap();
    let conn = tx.tx_connection();
    let Claim::Acquired { fence: f1, .. } = conn.claim(request(&key, first)).await.unwrap() else {
        panic!("expected to acquire");
    };
    assert!(conn.release(&key, first).await.unwrap());
    assert!(!conn.release(&key, first).await.unwrap(), "released twice");
    let Claim::Acquired { fence: f2, .. } = conn.claim(request(&key, second)).await.unwrap() else {
        panic!("expected to acquire again");
    };
    assert!(f2 > f1, "fence went from {f1} to {f2}");
    tx.commit().await.unwrap();
    assert_eq!(
        store.inspect(&key).await.unwrap().map(|i| i.state),
        Some(RecordState::Processing)
    );
}

/// A duplicate in a second transaction blocks on the record's row lock until
/// the first transaction ends, then replays its committed result (`commit`)
/// or claims the key itself (rollback).
async fn duplicate_waits_for_the_first_transaction(commit: bool) {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-tx-duplicate");
    let first = Token::random();
    let mut tx1 = store.pool().begin().await.unwrap();
    let claim = tx1
        .tx_connection()
        .claim(request(&key, first))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "got {claim:?}");

    let pool = store.pool().clone();
    let duplicate = tokio::spawn(async move {
        let mut tx2 = pool.begin().await.unwrap();
        let claim = tx2
            .tx_connection()
            .claim(request(&key, Token::random()))
            .await;
        tx2.rollback().await.unwrap();
        claim
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate did not wait for the first transaction: {:?}",
        duplicate.await
    );

    assert!(
        tx1.tx_connection()
            .complete(&key, first, success(b"\"first\""))
            .await
            .unwrap()
    );
    if commit {
        tx1.commit().await.unwrap();
    } else {
        tx1.rollback().await.unwrap();
    }
    let claim = tokio::time::timeout(Duration::from_secs(10), duplicate)
        .await
        .expect("the duplicate is still blocked after the first transaction ended")
        .unwrap()
        .expect("the duplicate's claim failed");
    match (commit, claim) {
        (true, Claim::Done(stored)) => assert_eq!(stored.payload, b"\"first\""),
        (false, Claim::Acquired { takeover, .. }) => assert!(!takeover),
        (_, other) => panic!("commit={commit}: got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_waits_then_replays_the_commit() {
    duplicate_waits_for_the_first_transaction(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_waits_then_claims_after_a_rollback() {
    duplicate_waits_for_the_first_transaction(false).await;
}

/// Two transactions claiming two keys in opposite orders deadlock. InnoDB has
/// already rolled the victim back, so the claim must not be retried on its
/// connection (it would run outside the caller's transaction): the victim gets
/// a store error that `is_retryable` recognises, the survivor gets its claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlock_inside_a_transaction_reaches_the_caller() {
    let Some(store) = store().await else { return };
    let (a, b) = (fresh_key("mysql-deadlock-a"), fresh_key("mysql-deadlock-b"));
    let mut tx1 = store.pool().begin().await.unwrap();
    let mut tx2 = store.pool().begin().await.unwrap();
    for (tx, key) in [(&mut tx1, &a), (&mut tx2, &b)] {
        let claim = tx
            .tx_connection()
            .claim(request(key, Token::random()))
            .await
            .unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }), "got {claim:?}");
    }
    let one = tokio::spawn(async move {
        let r = tx1
            .tx_connection()
            .claim(request(&b, Token::random()))
            .await;
        let _ = tx1.rollback().await;
        r
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let two = tokio::spawn(async move {
        let r = tx2
            .tx_connection()
            .claim(request(&a, Token::random()))
            .await;
        let _ = tx2.rollback().await;
        r
    });
    let results = [one.await.unwrap(), two.await.unwrap()];
    let victims: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(victims.len(), 1, "{results:?}");
    let victim = victims[0];
    assert_eq!(victim.backend(), "mysql");
    assert!(MySqlStore::is_retryable(victim), "{victim}");
    assert!(victim.to_string().contains("1213"), "{victim}");
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Ok(Claim::Acquired { .. }))),
        "{results:?}"
    );
}

// --- migrations, crashes, failing closed -------------------------------------

/// Four processes opening a fresh database at once: every one succeeds (they
/// take turns under `GET_LOCK`; without it two would race to insert the same
/// ledger row), the migration is recorded once, and the table works.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_are_harmless() {
    let Some(admin) = store().await else { return };
    let database = format!(
        "idem_migrate_{:016x}",
        u64::from_le_bytes(Token::random().0[..8].try_into().unwrap())
    );
    sqlx::raw_sql(&format!("CREATE DATABASE `{database}`"))
        .execute(admin.pool())
        .await
        .expect("the test user may create a scratch database");
    let options = MySqlConnectOptions::from_str(&services::mysql_url())
        .unwrap()
        .database(&database);
    let open = || MySqlStore::builder().connect_with(options.clone());
    let (s1, s2, s3, s4) = tokio::join!(open(), open(), open(), open());
    let stores = [s1, s2, s3, s4].map(|s| s.expect("a concurrent migration failed"));

    let (rows, version): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), MAX(version) FROM idem_schema_migrations")
            .fetch_one(stores[0].pool())
            .await
            .unwrap();
    assert_eq!((rows, version), (1, 1));
    stores[1]
        .migrate()
        .await
        .expect("migrating again is a no-op");

    let key = fresh_key("mysql-migrated");
    assert!(matches!(
        stores[2]
            .claim(request(&key, Token::random()))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(matches!(
        stores[3]
            .claim(request(&key, Token::random()))
            .await
            .unwrap(),
        Claim::Busy { .. }
    ));

    for s in &stores {
        s.pool().close().await;
    }
    sqlx::raw_sql(&format!("DROP DATABASE `{database}`"))
        .execute(admin.pool())
        .await
        .unwrap();
}

/// The owner loses its database connection after the claim (here: its pool
/// is closed inside the body, as if the process died). Its result cannot be
/// recorded, so the record stays PROCESSING; duplicates are told to wait, and
/// once the lease runs out a later caller takes over and runs the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connection_lost_after_the_claim_is_taken_over_after_the_lease() {
    let Some(owner) = store().await else { return };
    let Some(later) = store().await else { return };
    let spec = Spec {
        lease: Duration::from_millis(600),
        ..Spec::new("idem-tests::mysql::lost-connection", Kind::Call)
    };
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

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[idempotent(key = "order_id", ttl = "1h", store = store)]
async fn charge(store: &MySqlStore, order_id: u64, runs: &AtomicUsize) -> Result<u64, AppError> {
    runs.fetch_add(1, SeqCst);
    Ok(order_id)
}

/// `tx = conn` on a connection in autocommit: the claim would commit at once
/// with nothing renewing its lease while the body holds the connection.
#[idempotent(key = "order_id", tx = conn, scope = "mysql-tests.autocommit")]
async fn charge_on_connection(
    conn: &mut sqlx::MySqlConnection,
    order_id: u64,
    runs: &AtomicUsize,
) -> Result<u64, AppError> {
    let _ = &conn;
    runs.fetch_add(1, SeqCst);
    Ok(order_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_in_autocommit_is_refused_before_the_body_runs() {
    let Some(store) = store().await else { return };
    let runs = AtomicUsize::new(0);
    let order_id = u64::from_le_bytes(Token::random().0[..8].try_into().unwrap());
    let mut conn = store.pool().acquire().await.unwrap();
    let err = charge_on_connection(&mut conn, order_id, &runs)
        .await
        .unwrap_err();
    assert!(
        matches!(err, AppError::Idem(Error::NotInTransaction { .. })),
        "{err:?}"
    );
    assert_eq!(runs.load(SeqCst), 0, "the body never ran");
    let key = Key::builder("mysql-tests.autocommit")
        .part(&order_id)
        .finish();
    assert!(
        store.inspect(&key).await.unwrap().is_none(),
        "nothing claimed"
    );

    // Inside a transaction begun through sqlx the same call runs.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    assert_eq!(
        charge_on_connection(&mut tx, order_id, &runs)
            .await
            .unwrap(),
        order_id
    );
    tx.rollback().await.unwrap();
    assert_eq!(runs.load(SeqCst), 1);
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

// --- locks: leases that waited, replays that take none, purging ----------------

/// A store with one connection, and that connection's id: whatever the store
/// runs, `wait_on_a_lock` can watch.
async fn store_with_one_connection() -> Option<(MySqlStore, u64)> {
    store().await?;
    let pool = MySqlPoolOptions::new()
        .max_connections(1)
        .connect(&services::mysql_url())
        .await
        .unwrap();
    // After opening: migrating closes the connection it used.
    let store = MySqlStore::builder().pool(pool).await.unwrap();
    let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    Some((store, id))
}

/// Until the connection's statement has run for a while: a claim or a renewal
/// is a one-row statement, so one still running is waiting on a lock.
/// (MariaDB's INNODB_TRX does not reliably list an autocommit statement.)
async fn wait_on_a_lock(store: &MySqlStore, connection: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST
             WHERE ID = ? AND INFO IS NOT NULL AND TIME_MS > 200",
        )
        .bind(connection)
        .fetch_one(store.pool())
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the call never waited on a lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The shared case (`idem_tests::sql`), on a one-connection store whose
/// connection this dialect watches for a lock wait.
async fn a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(existing: bool) {
    let Some(store) = store().await else { return };
    let Some((waiter, connection)) = store_with_one_connection().await else {
        return;
    };
    let key = fresh_key("mysql-waited-lease");
    let b_is_waiting = wait_on_a_lock(&store, connection);
    idem_tests::sql::a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(
        &store,
        store.pool(),
        waiter,
        b_is_waiting,
        key,
        existing,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_waited_on_an_uncommitted_insert_starts_its_lease_when_it_wins() {
    a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_waited_on_a_locked_row_starts_its_lease_when_it_wins() {
    // Released, then re-claimed by A, so the release must not be purged.
    let _table = idem_tests::conformance::share_table("mysql-waited-lease").await;
    a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(true).await;
}

/// The owner's renewal waits on a row lock another transaction holds; the
/// renewed lease counts from when it got the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row() {
    let Some(store) = store().await else { return };
    let Some((owner, connection)) = store_with_one_connection().await else {
        return;
    };
    let pool = store.pool().clone();
    let lock_row = |key: Key| async move {
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idem_records WHERE `key` = ? FOR UPDATE")
            .bind(key.as_bytes().to_vec())
            .execute(&mut *holder)
            .await
            .unwrap();
        holder
    };
    let owner_is_waiting = wait_on_a_lock(&store, connection);
    idem_tests::sql::a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row(
        &store,
        owner,
        lock_row,
        owner_is_waiting,
        fresh_key("mysql-waited-renewal"),
    )
    .await;
}

/// A key completed on the pool, ready to replay.
async fn done_key(store: &MySqlStore, name: &str, payload: &[u8]) -> Key {
    let (key, token) = (fresh_key(name), Token::random());
    assert!(matches!(
        store.claim(request(&key, token)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(store.complete(&key, token, success(payload)).await.unwrap());
    key
}

/// Ends in time or fails the test: a lock wait would otherwise last
/// `innodb_lock_wait_timeout` (50 s) and be retried.
async fn soon<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} waited on a lock"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock() {
    let Some(store) = store().await else { return };
    idem_tests::sql::replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock(
        &store,
        store.pool(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner() {
    let Some(store) = store().await else { return };
    idem_tests::sql::a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner(
        &store,
        store.pool(),
    )
    .await;
}

/// A replay inside an open transaction holds no lock on the row: another
/// transaction locks it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_inside_a_transaction_takes_no_row_lock() {
    let Some(store) = store().await else { return };
    let key = done_key(&store, "mysql-replay-lock", b"r").await;
    let mut replaying = store.pool().begin().await.unwrap();
    let replay = replaying
        .tx_connection()
        .claim(request(&key, Token::random()))
        .await
        .unwrap();
    assert!(matches!(replay, Claim::Done(_)), "{replay:?}");

    let mut other = store.pool().begin().await.unwrap();
    let locked = sqlx::query("SELECT 1 FROM idem_records WHERE `key` = ? FOR UPDATE NOWAIT")
        .bind(&key.as_bytes()[..])
        .execute(&mut *other)
        .await;
    assert!(locked.is_ok(), "the replay left the row locked: {locked:?}");
    other.rollback().await.unwrap();
    replaying.commit().await.unwrap();
}

// --- statements per call ------------------------------------------------------

/// What one connection has sent the server so far, by the server's own
/// counters for that connection's session.
///
/// `Questions` counts every statement a client sends, a text query (BEGIN,
/// COMMIT) or a prepared statement's execution, and neither prepares, pings
/// nor statements run inside stored programs. The server's count rather than
/// the client's (sqlx's `sqlx::query` events): it sees what the driver sends
/// on its own too, and needs no log level or subscriber shared with the tests
/// running beside this one. `Com_stmt_prepare` shows the prepares: none after
/// a warm-up call (sqlx keeps each connection's prepared statements), so the
/// statements are then also the round trips. MariaDB ships with
/// performance_schema off, so no other connection can read these counters for
/// this one's thread: the connection reads its own, as text queries (no
/// prepare), and each reading counts itself once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sent {
    statements: i64,
    prepares: i64,
}

async fn sent_so_far(conn: &mut sqlx::MySqlConnection) -> Sent {
    use sqlx::{Executor as _, Row as _};

    let rows = conn
        .fetch_all("SHOW SESSION STATUS WHERE Variable_name IN ('Questions', 'Com_stmt_prepare')")
        .await
        .unwrap();
    let value = |name: &str| -> i64 {
        rows.iter()
            .find(|r| r.get::<String, _>(0).eq_ignore_ascii_case(name))
            .unwrap_or_else(|| panic!("no {name} in SHOW SESSION STATUS"))
            .get::<String, _>(1)
            .parse()
            .unwrap()
    };
    Sent {
        statements: value("Questions"),
        prepares: value("Com_stmt_prepare"),
    }
}

/// What the connection sent between two readings, the second reading not
/// counted.
async fn sent_since(conn: &mut sqlx::MySqlConnection, before: Sent) -> Sent {
    let now = sent_so_far(conn).await;
    Sent {
        statements: now.statements - before.statements - 1,
        prepares: now.prepares - before.prepares,
    }
}

static PLACED: AtomicUsize = AtomicUsize::new(0);

/// One business statement on the caller's transaction, under the claim.
#[idempotent(key = "order_no", tx = tx, scope = "mysql-tests.statements")]
async fn place_order(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    order_no: u64,
) -> Result<u64, AppError> {
    PLACED.fetch_add(1, SeqCst);
    let placed: u64 = sqlx::query_scalar("SELECT CAST(? AS UNSIGNED)")
        .bind(order_no)
        .fetch_one(&mut **tx)
        .await?;
    Ok(placed)
}

/// `place_order` in a transaction of its own on `conn`, committed.
async fn place_order_and_commit(conn: &mut sqlx::MySqlConnection, order_no: u64) -> u64 {
    let mut tx = sqlx::Connection::begin(conn).await.unwrap();
    let placed = place_order(&mut tx, order_no).await.unwrap();
    tx.commit().await.unwrap();
    placed
}

fn random_u64() -> u64 {
    u64::from_le_bytes(Token::random().0[..8].try_into().unwrap())
}

/// The reference flow inside the business transaction is BEGIN, its dedup
/// insert, the business statement, COMMIT. `#[idempotent(tx = tx)]` adds two
/// statements to that on a first call (a plain read that finds nothing, the
/// claim, and the completion, in place of the dedup insert), and a replay is
/// BEGIN, one read, COMMIT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_call_inside_a_transaction_sends_three_statements_of_its_own_and_a_replay_one() {
    let Some(store) = store().await else { return };
    let mut conn = store.pool().acquire().await.unwrap();
    // A first call and a replay, so every statement of both is prepared.
    let warm_up = random_u64();
    place_order_and_commit(&mut conn, warm_up).await;
    place_order_and_commit(&mut conn, warm_up).await;

    let order_no = random_u64();
    let before = sent_so_far(&mut conn).await;
    assert_eq!(place_order_and_commit(&mut conn, order_no).await, order_no);
    let runs = PLACED.load(SeqCst);
    assert_eq!(
        sent_since(&mut conn, before).await,
        Sent {
            statements: 6,
            prepares: 0
        },
        "a first call: BEGIN, read, claim, the business statement, completion, COMMIT"
    );
    let before = sent_so_far(&mut conn).await;
    assert_eq!(place_order_and_commit(&mut conn, order_no).await, order_no);
    assert_eq!(
        sent_since(&mut conn, before).await,
        Sent {
            statements: 3,
            prepares: 0
        },
        "a replay: BEGIN, read, COMMIT"
    );
    assert_eq!(PLACED.load(SeqCst), runs, "the replay ran the body");
}

/// On the pool (`MySqlStore`, each statement its own transaction) a first
/// call is the read, the claim and the completion; a replay is the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_call_on_the_store_sends_three_statements_and_a_replay_one() {
    let Some((store, connection)) = store_with_one_connection().await else {
        return;
    };
    // The pool's one connection, the store's between two readings.
    let reading = async |store: &MySqlStore, since: Option<Sent>| {
        let mut conn = store.pool().acquire().await.unwrap();
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        assert_eq!(id, connection, "the pool replaced its connection");
        match since {
            // The reading's own SELECT counts as well.
            Some(before) => {
                let d = sent_since(&mut conn, before).await;
                Sent {
                    statements: d.statements - 1,
                    ..d
                }
            }
            None => sent_so_far(&mut conn).await,
        }
    };
    let runs = AtomicUsize::new(0);
    let warm_up = random_u64();
    charge(&store, warm_up, &runs).await.unwrap();
    charge(&store, warm_up, &runs).await.unwrap();
    reading(&store, None).await;

    let order_id = random_u64();
    let before = reading(&store, None).await;
    assert_eq!(charge(&store, order_id, &runs).await.unwrap(), order_id);
    assert_eq!(
        reading(&store, Some(before)).await,
        Sent {
            statements: 3,
            prepares: 0
        },
        "a first call: read, claim, completion"
    );
    let before = reading(&store, None).await;
    assert_eq!(charge(&store, order_id, &runs).await.unwrap(), order_id);
    assert_eq!(
        reading(&store, Some(before)).await,
        Sent {
            statements: 1,
            prepares: 0
        },
        "a replay: the read"
    );
    assert_eq!(runs.load(SeqCst), 2, "each body ran once");
}

/// The claim tells a row it inserted from one it found by the statement's
/// insert id: 0 unless its ON DUPLICATE KEY branch set one with
/// `LAST_INSERT_ID(…)`. That id is the statement's own. A value an earlier
/// statement on the connection left in `LAST_INSERT_ID()` does not reach the
/// next statement's OK packet, whatever it is: here the markers for "lost",
/// "won with fence 1" and "won with fence 7 by takeover".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_last_insert_id_on_the_connection_never_reaches_a_claim() {
    use sqlx::Executor as _;

    let Some(store) = store().await else { return };
    let mut conn = store.pool().acquire().await.unwrap();

    // The server's behaviour itself, on a table without AUTO_INCREMENT.
    conn.execute("CREATE TEMPORARY TABLE idem_insert_id (k INT PRIMARY KEY, v INT NOT NULL)")
        .await
        .unwrap();
    sqlx::query("SELECT LAST_INSERT_ID(15)")
        .execute(&mut *conn)
        .await
        .unwrap();
    // Insert ids of: a fresh row, the same key again (the marker), a fresh row.
    let mut ids = Vec::new();
    for k in [1, 1, 2] {
        let done = sqlx::query(
            "INSERT INTO idem_insert_id (k, v) VALUES (?, 0)
             ON DUPLICATE KEY UPDATE v = IF(LAST_INSERT_ID(7), v, v)",
        )
        .bind(k)
        .execute(&mut *conn)
        .await
        .unwrap();
        ids.push(done.last_insert_id());
    }
    assert_eq!(ids, [0, 7, 0]);
    conn.execute("DROP TEMPORARY TABLE idem_insert_id")
        .await
        .unwrap();

    // And the claim, inside a transaction as on the pool.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let warm_up = fresh_key("mysql-stale-insert-id");
    tx.tx_connection()
        .claim(request(&warm_up, Token::random()))
        .await
        .unwrap();
    for stale in [1_u64, 2, 15] {
        sqlx::query("SELECT LAST_INSERT_ID(?)")
            .bind(stale)
            .execute(&mut *tx)
            .await
            .unwrap();
        let key = fresh_key("mysql-stale-insert-id");
        let before = sent_so_far(&mut tx).await;
        let claim = tx
            .tx_connection()
            .claim(request(&key, Token::random()))
            .await
            .unwrap();
        assert!(
            matches!(
                claim,
                Claim::Acquired {
                    fence: 1,
                    takeover: false
                }
            ),
            "after LAST_INSERT_ID({stale}): {claim:?}"
        );
        assert_eq!(
            sent_since(&mut tx, before).await.statements,
            2,
            "after LAST_INSERT_ID({stale}): the read and the claim, nothing more"
        );
    }
    tx.rollback().await.unwrap();
}

/// A database of one's own, for tests that count or delete table-wide.
struct Database {
    name: String,
    admin: MySqlStore,
    store: MySqlStore,
}

impl Database {
    async fn create(tag: &str) -> Option<Database> {
        let admin = store().await?;
        let name = format!(
            "idem_{tag}_{:016x}",
            u64::from_le_bytes(Token::random().0[..8].try_into().unwrap())
        );
        sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
            .execute(admin.pool())
            .await
            .expect("the test user may create a scratch database");
        let options = MySqlConnectOptions::from_str(&services::mysql_url())
            .unwrap()
            .database(&name);
        let store = MySqlStore::builder()
            .connect_with(options)
            .await
            .expect("open the scratch database");
        Some(Database { name, admin, store })
    }

    async fn count(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM `{}`.idem_records",
            self.name
        ))
        .fetch_one(self.admin.pool())
        .await
        .unwrap()
    }

    async fn drop(self) {
        self.store.pool().close().await;
        sqlx::raw_sql(&format!("DROP DATABASE `{}`", self.name))
            .execute(self.admin.pool())
            .await
            .unwrap();
    }
}

/// Purging takes bounded batches of dead records (released ones included), in
/// index order, and waits on nothing: not on a live row an open transaction
/// holds, not on a dead one another transaction has locked (it is skipped and
/// goes in a later batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purging_is_bounded_skips_locked_rows_and_waits_for_no_claim() {
    let Some(db) = Database::create("purge").await else {
        return;
    };
    let store = &db.store;
    for _ in 0..6 {
        let (key, token) = (fresh_key("dead"), Token::random());
        store.claim(request(&key, token)).await.unwrap();
        let short = Completion {
            ttl: Duration::from_millis(1),
            ..success(b"d")
        };
        assert!(store.complete(&key, token, short).await.unwrap());
    }
    let (released, token) = (fresh_key("released"), Token::random());
    store.claim(request(&released, token)).await.unwrap();
    assert!(store.release(&released, token).await.unwrap());
    let live = done_key(store, "live", b"l").await;
    tokio::time::sleep(Duration::from_millis(20)).await;

    // An open transaction claims a new key (its row stays locked), and another
    // holds one dead row.
    let mut claiming = store.pool().begin().await.unwrap();
    let claim = claiming
        .tx_connection()
        .claim(request(&fresh_key("claiming"), Token::random()))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    let mut holder = store.pool().begin().await.unwrap();
    let held: Vec<u8> = sqlx::query_scalar(
        "SELECT `key` FROM idem_records WHERE state = 2 ORDER BY expires_at LIMIT 1 FOR UPDATE",
    )
    .fetch_one(&mut *holder)
    .await
    .unwrap();

    let mut batches = Vec::new();
    loop {
        let n = soon("purging", store.purge_expired(3)).await.unwrap();
        batches.push(n);
        if n < 3 {
            break;
        }
    }
    // 6 dead + 1 released, less the held one, 3 at a time.
    assert_eq!(batches, vec![3, 3, 0]);
    holder.commit().await.unwrap();
    assert_eq!(soon("purging", store.purge_expired(3)).await.unwrap(), 1);
    let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_records WHERE `key` = ?")
        .bind(&held)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(left, 0, "the held row went last");
    claiming.rollback().await.unwrap();
    assert_eq!(db.count().await, 1, "only the live record is left");
    assert!(store.inspect(&live).await.unwrap().is_some());
    db.drop().await;
}

/// The one place a duplicate inside a transaction can still be a deadlock
/// victim, as `TxConnection for MySqlConnection` documents: two duplicates
/// wait on a first transaction's claim of a new key, and it rolls back. Their
/// inserts then meet on the key's gap. Exactly one claims; the other is told
/// Busy or gets a 1213 that `is_retryable` recognises, never anything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_duplicates_waiting_on_a_rolled_back_claim_one_wins_the_other_is_busy_or_retryable() {
    let Some(store) = store().await else { return };
    let key = fresh_key("mysql-two-waiting");
    let mut first = store.pool().begin().await.unwrap();
    let claim = first
        .tx_connection()
        .claim(request(&key, Token::random()))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    let duplicate = || {
        let pool = store.pool().clone();
        tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let claim = tx
                .tx_connection()
                .claim(request(&key, Token::random()))
                .await;
            let _ = tx.commit().await;
            claim
        })
    };
    let (one, two) = (duplicate(), duplicate());
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.rollback().await.unwrap();
    let results = soon("the duplicates", async {
        [one.await.unwrap(), two.await.unwrap()]
    })
    .await;
    let won = results
        .iter()
        .filter(|r| matches!(r, Ok(Claim::Acquired { .. })))
        .count();
    assert_eq!(won, 1, "{results:?}");
    for r in &results {
        match r {
            Ok(Claim::Acquired { .. } | Claim::Busy { .. }) => {}
            Err(e) if MySqlStore::is_retryable(e) && e.to_string().contains("1213") => {}
            other => panic!("{other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// The shared SQL record layer: the same behaviour as every SQL store
// ---------------------------------------------------------------------------

async fn set_on_key(store: &MySqlStore, assignment: &str, key: &Key) {
    sqlx::query(&format!(
        "UPDATE idem_records SET {assignment} WHERE `key` = ?"
    ))
    .bind(&key.as_bytes()[..])
    .execute(store.pool())
    .await
    .expect("write the record by hand");
}

#[tokio::test]
async fn an_unknown_state_fails_closed() {
    let Some(store) = store().await else { return };
    idem_tests::sql::unknown_state_fails_closed(&store.clone(), |key| async move {
        set_on_key(&store, "state = 7", &key).await
    })
    .await;
}

#[tokio::test]
async fn a_done_record_without_an_outcome_fails_closed() {
    let Some(store) = store().await else { return };
    idem_tests::sql::done_without_outcome_fails_closed(&store.clone(), |key| async move {
        set_on_key(&store, "outcome = NULL", &key).await
    })
    .await;
}

#[tokio::test]
async fn absurd_durations_are_clamped_like_every_sql_store() {
    let Some(store) = store().await else { return };
    idem_tests::sql::absurd_durations_are_clamped_alike(&store).await;
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

/// With `skip_migrations` the store runs no DDL: on a database whose table
/// was created by hand (by whoever may), it works, and no ledger appears.
#[tokio::test]
async fn a_store_that_skips_migrations_runs_no_ddl() {
    let Some(admin) = store().await else { return };
    let name = format!(
        "idem_skipmig_{:016x}",
        u64::from_le_bytes(Token::random().0[..8].try_into().unwrap())
    );
    sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
        .execute(admin.pool())
        .await
        .expect("the test user may create a scratch database");
    let options = MySqlConnectOptions::from_str(&services::mysql_url())
        .unwrap()
        .database(&name);
    let by_hand = MySqlPoolOptions::new()
        .connect_with(options.clone())
        .await
        .unwrap();
    sqlx::raw_sql(include_str!(
        "../idem-runtime/migrations/mysql/0001_create_records.sql"
    ))
    .execute(&by_hand)
    .await
    .expect("the schema, applied by hand");
    by_hand.close().await;
    let store = MySqlStore::builder()
        .skip_migrations()
        .connect_with(options)
        .await
        .expect("open without migrating");
    let key = fresh_key("skip-migrations");
    let claimed = store.claim(request(&key, Token::random())).await.unwrap();
    assert!(matches!(claimed, Claim::Acquired { .. }), "{claimed:?}");
    let ledgers: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables
         WHERE table_schema = ? AND table_name = 'idem_schema_migrations'",
    )
    .bind(&name)
    .fetch_one(admin.pool())
    .await
    .unwrap();
    store.pool().close().await;
    sqlx::raw_sql(&format!("DROP DATABASE `{name}`"))
        .execute(admin.pool())
        .await
        .unwrap();
    assert_eq!(
        ledgers, 0,
        "a store told to skip migrations created the ledger"
    );
}
