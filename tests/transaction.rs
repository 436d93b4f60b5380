//! `#[idempotent(tx = tx)]`: the record commits or rolls back with the
//! caller's business writes.
//!
//! SQLite runs here with no server; PostgreSQL, where a concurrent duplicate
//! blocks on the record's unique key, runs against the local server (skipped
//! loudly when it is unreachable, failed under IDEM_REQUIRE_SERVICES=1).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_runtime::Key;
use idem_runtime::idempotent;
use idem_runtime::store::sql::SqliteStore;
use idem_runtime::store::tx::TxConnection;
use idem_runtime::store::{RecordState, Store};
use sqlx::{Sqlite, Transaction};

#[derive(Debug, thiserror::Error)]
enum AppError {
    #[error(transparent)]
    Idem(#[from] idem_runtime::Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error("card declined")]
    Declined,
}

static SQLITE_RUNS: AtomicUsize = AtomicUsize::new(0);

/// Inserts the order on the caller's transaction; the record rides along.
#[idempotent(key = "order_no", tx = tx, scope = "tx-tests.sqlite.create")]
async fn create_order(
    tx: &mut Transaction<'_, Sqlite>,
    order_no: String,
    decline: bool,
) -> Result<i64, AppError> {
    SQLITE_RUNS.fetch_add(1, Ordering::SeqCst);
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (order_no) VALUES (?1) RETURNING id")
        .bind(&order_no)
        .fetch_one(&mut **tx)
        .await?;
    if decline {
        return Err(AppError::Declined);
    }
    Ok(id)
}

async fn sqlite() -> SqliteStore {
    let store = SqliteStore::in_memory().await.expect("in-memory sqlite");
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL UNIQUE)")
        .execute(store.pool())
        .await
        .unwrap();
    store
}

async fn count_orders(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

fn key(order_no: &str) -> Key {
    Key::builder("tx-tests.sqlite.create")
        .part(order_no)
        .finish()
}

#[tokio::test]
async fn sqlite_committed_call_replays_and_rolled_back_call_leaves_nothing() {
    let store = sqlite().await;

    // Rolled back: neither the order nor the record survives, so a retry runs.
    let runs = SQLITE_RUNS.load(Ordering::SeqCst);
    let mut tx = store.pool().begin().await.unwrap();
    let id = create_order(&mut tx, "o-1".into(), false).await.unwrap();
    assert!(id > 0);
    tx.rollback().await.unwrap();
    assert_eq!(count_orders(&store).await, 0);
    assert!(
        store.inspect(&key("o-1")).await.unwrap().is_none(),
        "record rolled back too"
    );

    // Committed: the order and a DONE record, together.
    let mut tx = store.pool().begin().await.unwrap();
    let first = create_order(&mut tx, "o-1".into(), false).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count_orders(&store).await, 1);
    let info = store
        .inspect(&key("o-1"))
        .await
        .unwrap()
        .expect("record committed");
    assert_eq!(info.state, RecordState::Done);

    // A duplicate in a later transaction replays without touching the table.
    let mut tx = store.pool().begin().await.unwrap();
    let again = create_order(&mut tx, "o-1".into(), false).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(again, first);
    assert_eq!(count_orders(&store).await, 1);
    assert_eq!(
        SQLITE_RUNS.load(Ordering::SeqCst) - runs,
        2,
        "rolled back + committed"
    );
}

#[tokio::test]
async fn sqlite_error_releases_inside_the_transaction() {
    let store = sqlite().await;
    let mut tx = store.pool().begin().await.unwrap();
    let err = create_order(&mut tx, "o-2".into(), true).await.unwrap_err();
    assert!(matches!(err, AppError::Declined));
    // Even a caller that commits after an error leaves the key free to retry.
    tx.commit().await.unwrap();
    assert!(store.inspect(&key("o-2")).await.unwrap().is_none());
    let mut tx = store.pool().begin().await.unwrap();
    // The declined attempt's order row committed with it; the retry's insert hits
    // the UNIQUE constraint, which proves the body ran again.
    let retry = create_order(&mut tx, "o-2".into(), false).await;
    assert!(matches!(retry, Err(AppError::Db(_))), "{retry:?}");
}

#[tokio::test]
async fn sqlite_concurrent_duplicate_waits_for_the_writer_and_replays() {
    let store = sqlite().await;
    // A file database: two connections, so the second writer must wait on the first.
    let path = std::env::temp_dir().join(format!("idem-tx-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let file = SqliteStore::open(&path).await.unwrap();
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, order_no TEXT NOT NULL UNIQUE)")
        .execute(file.pool())
        .await
        .unwrap();
    drop(store);

    let mut first = file.pool().begin().await.unwrap();
    let id = create_order(&mut first, "o-3".into(), false).await.unwrap();
    let pool = file.pool().clone();
    let duplicate = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let r = create_order(&mut tx, "o-3".into(), false).await;
        tx.commit().await.unwrap();
        r
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate must wait for the first writer"
    );
    first.commit().await.unwrap();
    let replayed = duplicate.await.unwrap().unwrap();
    assert_eq!(replayed, id);
    assert_eq!(count_orders(&file).await, 1);
    let _ = std::fs::remove_file(&path);
}

/// Logs the state of every update of a record into `record_updates`:
/// sqlx runs SQLite's statements on a worker thread of its own, out of sight
/// of the statement recorder. A completion is an UPDATE; the claim of a
/// fresh key, an INSERT.
async fn log_record_updates(store: &SqliteStore) {
    for ddl in [
        "CREATE TABLE record_updates (state INTEGER NOT NULL)",
        "CREATE TRIGGER count_record_updates AFTER UPDATE ON idem_records
         BEGIN INSERT INTO record_updates VALUES (NEW.state); END",
    ] {
        sqlx::query(ddl).execute(store.pool()).await.unwrap();
    }
}

/// A `()` result is known before the body runs: the claim writes the record
/// DONE at once and no completion follows (`TxConnection::claim_done`).
#[idempotent(key = "order_no", tx = tx, scope = "tx-tests.sqlite.settle")]
async fn settle(
    tx: &mut Transaction<'_, Sqlite>,
    order_no: String,
    decline: bool,
) -> Result<(), AppError> {
    sqlx::query("INSERT INTO orders (order_no) VALUES (?1)")
        .bind(&order_no)
        .execute(&mut **tx)
        .await?;
    if decline {
        return Err(AppError::Declined);
    }
    Ok(())
}

fn settle_key(order_no: &str) -> Key {
    Key::builder("tx-tests.sqlite.settle")
        .part(order_no)
        .finish()
}

/// The record written DONE by the claim commits with the body's insert and
/// replays; rolled back, it goes with the insert. A second run of the body
/// would fail on the UNIQUE order number, so an `Ok` replay proves it did
/// not run.
#[tokio::test]
async fn sqlite_a_unit_result_is_done_from_the_claim_and_commits_or_rolls_back_with_the_body() {
    let store = sqlite().await;
    log_record_updates(&store).await;
    let mut tx = store.pool().begin().await.unwrap();
    settle(&mut tx, "u-1".into(), false).await.unwrap();
    let updates: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM record_updates")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(
        updates, 0,
        "a first call: the claim inserts it DONE, no completion"
    );
    let state: i64 = sqlx::query_scalar("SELECT state FROM idem_records")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(state, 2, "DONE from the claim on");
    tx.rollback().await.unwrap();
    assert!(store.inspect(&settle_key("u-1")).await.unwrap().is_none());
    assert_eq!(count_orders(&store).await, 0);

    let mut tx = store.pool().begin().await.unwrap();
    settle(&mut tx, "u-1".into(), false).await.unwrap();
    tx.commit().await.unwrap();
    let record = store.inspect(&settle_key("u-1")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Done);

    let mut tx = store.pool().begin().await.unwrap();
    settle(&mut tx, "u-1".into(), false)
        .await
        .expect("a replay of the committed call, not a second insert");
    tx.commit().await.unwrap();
    assert_eq!(count_orders(&store).await, 1);
}

/// An `Err` from the body releases the record the claim wrote DONE, so a
/// caller that commits after the error leaves the key free: the retry runs
/// the body (and meets the declined attempt's order row).
#[tokio::test]
async fn sqlite_a_unit_result_that_fails_releases_the_record_the_claim_wrote_done() {
    let store = sqlite().await;
    let mut tx = store.pool().begin().await.unwrap();
    let err = settle(&mut tx, "u-2".into(), true).await.unwrap_err();
    assert!(matches!(err, AppError::Declined), "{err:?}");
    tx.commit().await.unwrap();
    let record = store.inspect(&settle_key("u-2")).await.unwrap();
    assert!(record.is_none(), "the failed call left {record:?}");

    let mut tx = store.pool().begin().await.unwrap();
    let retry = settle(&mut tx, "u-2".into(), false).await;
    assert!(matches!(retry, Err(AppError::Db(_))), "{retry:?}");
    tx.rollback().await.unwrap();
    // Once the row is gone the retry takes the released record over, DONE.
    sqlx::query("DELETE FROM orders")
        .execute(store.pool())
        .await
        .unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    settle(&mut tx, "u-2".into(), false).await.unwrap();
    tx.commit().await.unwrap();
    let record = store.inspect(&settle_key("u-2")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Done);
    assert_eq!(record.fence, 2, "the released record's fence grew");
}

/// What the README warns of: a caller that commits after its call's future
/// was dropped mid-body (a timeout) commits what the body had written, and
/// for a `()` result a record that says done; for another result, a
/// PROCESSING claim that a retry takes over once its lease runs out.
#[tokio::test]
async fn sqlite_a_commit_after_a_dropped_call_keeps_what_the_claim_wrote() {
    #[idempotent(key = "order_no", tx = tx, scope = "tx-tests.sqlite.stuck")]
    async fn stuck(tx: &mut Transaction<'_, Sqlite>, order_no: String) -> Result<(), AppError> {
        sqlx::query("INSERT INTO orders (order_no) VALUES (?1)")
            .bind(&order_no)
            .execute(&mut **tx)
            .await?;
        std::future::pending::<()>().await;
        Ok(())
    }

    #[idempotent(key = "order_no", tx = tx, scope = "tx-tests.sqlite.stuck-order")]
    async fn stuck_order(
        tx: &mut Transaction<'_, Sqlite>,
        order_no: String,
    ) -> Result<i64, AppError> {
        sqlx::query("INSERT INTO orders (order_no) VALUES (?1)")
            .bind(&order_no)
            .execute(&mut **tx)
            .await?;
        std::future::pending::<()>().await;
        Ok(1)
    }

    let store = sqlite().await;
    let mut tx = store.pool().begin().await.unwrap();
    let cut = tokio::time::timeout(Duration::from_millis(50), stuck(&mut tx, "d-1".into())).await;
    assert!(cut.is_err(), "the call was dropped mid-body");
    tx.commit().await.unwrap();
    let key = Key::builder("tx-tests.sqlite.stuck").part("d-1").finish();
    let record = store.inspect(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Done, "a () result: done");
    assert_eq!(count_orders(&store).await, 1, "with the body's insert");

    let mut tx = store.pool().begin().await.unwrap();
    let cut = tokio::time::timeout(
        Duration::from_millis(50),
        stuck_order(&mut tx, "d-2".into()),
    )
    .await;
    assert!(cut.is_err(), "the call was dropped mid-body");
    tx.commit().await.unwrap();
    let key = Key::builder("tx-tests.sqlite.stuck-order")
        .part("d-2")
        .finish();
    let record = store.inspect(&key).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::Processing,
        "another result: a claim"
    );
}

/// A record the claim wrote DONE must not stay DONE for a body that failed:
/// when its release fails too, the call fails with a store error (so the
/// caller rolls back) instead of handing back the body's own error, after
/// which a caller might commit. A hand caller whose body returns another
/// value than the `known` one the claim recorded fails the same way.
#[tokio::test]
async fn sqlite_a_done_record_that_cannot_be_released_or_is_wrong_fails_the_call() {
    use idem_runtime::protocol::{Kind, Spec, execute_in_tx};

    let store = sqlite().await;
    sqlx::query(
        "CREATE TRIGGER refuse_release BEFORE UPDATE ON idem_records WHEN NEW.state = 0
         BEGIN SELECT RAISE(ABORT, 'injected: the release cannot be written'); END",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let err = settle(&mut tx, "r-1".into(), true).await.unwrap_err();
    assert!(
        matches!(err, AppError::Idem(idem_runtime::Error::Store(_))),
        "{err:?}"
    );
    tx.rollback().await.unwrap();

    const SPEC: Spec = Spec::new("tx-tests.sqlite.known", Kind::Call);
    let mut tx = store.pool().begin().await.unwrap();
    let key = Key::builder(SPEC.scope).part("k-1").finish();
    let out: Result<u32, idem_runtime::Error> =
        execute_in_tx(&SPEC, &mut *tx, key, None, Some(5), async |_| Ok(6)).await;
    assert!(matches!(out, Err(idem_runtime::Error::Store(_))), "{out:?}");
    tx.rollback().await.unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let out: Result<u32, idem_runtime::Error> =
        execute_in_tx(&SPEC, &mut *tx, key, None, Some(5), async |_| Ok(5)).await;
    assert_eq!(out.unwrap(), 5);
    tx.commit().await.unwrap();
    assert_eq!(
        store.inspect(&key).await.unwrap().unwrap().state,
        RecordState::Done
    );
}

/// A connection of someone else's that implements `TxConnection` with the
/// required methods only: `claims_done` says no, so a `()` result is claimed
/// PROCESSING and completed after its body, as any other.
struct Forwarding<'c>(&'c mut sqlx::SqliteConnection);

#[idem_runtime::store::async_trait]
impl TxConnection for Forwarding<'_> {
    fn backend(&self) -> &'static str {
        self.0.backend()
    }

    fn in_transaction(&self) -> bool {
        self.0.in_transaction()
    }

    async fn claim(
        &mut self,
        req: idem_runtime::store::ClaimRequest<'_>,
    ) -> Result<idem_runtime::store::Claim, idem_runtime::StoreError> {
        self.0.claim(req).await
    }

    async fn complete(
        &mut self,
        key: &Key,
        token: idem_runtime::store::Token,
        completion: idem_runtime::store::Completion<'_>,
    ) -> Result<bool, idem_runtime::StoreError> {
        self.0.complete(key, token, completion).await
    }

    async fn release(
        &mut self,
        key: &Key,
        token: idem_runtime::store::Token,
    ) -> Result<bool, idem_runtime::StoreError> {
        self.0.release(key, token).await
    }
}

#[idempotent(key = "order_no", tx = conn, scope = "tx-tests.sqlite.forwarding")]
async fn settle_forwarded(
    conn: &mut Forwarding<'_>,
    order_no: String,
    decline: bool,
) -> Result<(), AppError> {
    sqlx::query("INSERT INTO orders (order_no) VALUES (?1)")
        .bind(&order_no)
        .execute(&mut *conn.0)
        .await?;
    // What the record says while the body runs.
    sqlx::query("INSERT INTO seen_states SELECT state FROM idem_records WHERE state <> 2")
        .execute(&mut *conn.0)
        .await?;
    if decline {
        return Err(AppError::Declined);
    }
    Ok(())
}

/// On a connection that does not write DONE in its claim, a `()` result
/// takes the usual path: PROCESSING while the body runs, then one completion
/// to DONE, committed, replayed; an `Err` releases the PROCESSING record.
#[tokio::test]
async fn sqlite_a_connection_that_does_not_claim_done_completes_after_the_body() {
    let store = sqlite().await;
    log_record_updates(&store).await;
    sqlx::query("CREATE TABLE seen_states (state INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let key = |no: &str| Key::builder("tx-tests.sqlite.forwarding").part(no).finish();

    let mut tx = store.pool().begin().await.unwrap();
    settle_forwarded(&mut Forwarding(&mut tx), "f-1".into(), false)
        .await
        .unwrap();
    let updates: Vec<i64> = sqlx::query_scalar("SELECT state FROM record_updates")
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(
        updates,
        [2],
        "claimed PROCESSING, then one completion to DONE"
    );
    let seen: Vec<i64> = sqlx::query_scalar("SELECT state FROM seen_states")
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(seen, [1], "PROCESSING while the body ran");
    tx.commit().await.unwrap();
    let record = store.inspect(&key("f-1")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Done);
    let mut tx = store.pool().begin().await.unwrap();
    settle_forwarded(&mut Forwarding(&mut tx), "f-1".into(), false)
        .await
        .expect("a replay, not a second insert of the UNIQUE order number");
    tx.commit().await.unwrap();

    let mut tx = store.pool().begin().await.unwrap();
    let err = settle_forwarded(&mut Forwarding(&mut tx), "f-2".into(), true)
        .await
        .unwrap_err();
    assert!(matches!(err, AppError::Declined), "{err:?}");
    tx.commit().await.unwrap();
    let record = store.inspect(&key("f-2")).await.unwrap();
    assert!(record.is_none(), "the failed call left {record:?}");
    assert_eq!(
        count_orders(&store).await,
        2,
        "f-1 once, and f-2's declined row"
    );
}

/// SQLite has one writer: a store caller's claim waits for a transaction
/// holding the write lock (up to the busy timeout) with its clock read before.
/// Once it wins, its lease counts from then: a third caller is busy, not a
/// takeover of a lease that began while the claim was still waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_claim_that_waited_for_the_write_lock_starts_its_lease_when_it_wins() {
    use idem_runtime::store::tx::{AsTxConnection, TxConnection};
    use idem_runtime::store::{Claim, ClaimRequest, Token};

    let path = std::env::temp_dir().join(format!(
        "idem-tx-waited-{}-{:x}.db",
        std::process::id(),
        u64::from_le_bytes(Token::random().as_bytes()[..8].try_into().unwrap())
    ));
    let store = SqliteStore::open(&path).await.unwrap();
    let lease = Duration::from_secs(1);
    let key = key("waited-lease");
    let request = |token| ClaimRequest {
        key: &key,
        token,
        fingerprint: None,
        lease,
        ttl: Duration::from_secs(3600),
    };

    let mut a = store.pool().begin().await.unwrap();
    let claim = a
        .tx_connection()
        .claim(request(Token::random()))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    let b = tokio::spawn({
        let (store, key) = (store.clone(), key);
        async move {
            store
                .claim(ClaimRequest {
                    key: &key,
                    token: Token::random(),
                    fingerprint: None,
                    lease,
                    ttl: Duration::from_secs(3600),
                })
                .await
        }
    });
    // Longer than B's lease, shorter than the 5 s busy timeout.
    tokio::time::sleep(lease * 2).await;
    assert!(!b.is_finished(), "B did not wait for the write lock");
    a.rollback().await.unwrap();
    let won = b.await.unwrap().unwrap();
    assert!(
        matches!(
            won,
            Claim::Acquired {
                takeover: false,
                ..
            }
        ),
        "{won:?}"
    );

    let third = store.claim(request(Token::random())).await.unwrap();
    assert!(
        matches!(third, Claim::Busy { .. }),
        "B's fresh lease was taken over at once: {third:?}"
    );
    store.pool().close().await;
    let _ = std::fs::remove_file(&path);
}

/// SQLite's one writer: a claim waits for another writer up to the store's
/// `busy_timeout` (2 s here). Held for 50 ms, the claim waits and wins;
/// held for 3 s, the claim fails closed with SQLite's reason (the call's
/// body would not run), and once the writer is gone the key claims.
#[tokio::test]
async fn sqlite_a_writer_held_past_busy_timeout_fails_the_claim_closed() {
    use idem_runtime::store::{Claim, ClaimRequest, Token};

    let path = std::env::temp_dir().join(format!(
        "idem-tx-busy-{}-{:x}.db",
        std::process::id(),
        u64::from_le_bytes(Token::random().as_bytes()[..8].try_into().unwrap())
    ));
    let store = SqliteStore::builder()
        .busy_timeout(Duration::from_secs(2))
        .open(&path)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE holder (x INTEGER)")
        .execute(store.pool())
        .await
        .unwrap();
    let claim = |key: Key| {
        let store = store.clone();
        async move {
            store
                .claim(ClaimRequest {
                    key: &key,
                    token: Token::random(),
                    fingerprint: None,
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_secs(3600),
                })
                .await
        }
    };
    for (held_ms, key) in [(50, key("busy-under")), (3_000, key("busy-over"))] {
        let mut writer = store.pool().begin().await.unwrap();
        sqlx::query("INSERT INTO holder (x) VALUES (1)")
            .execute(&mut *writer)
            .await
            .unwrap();
        let waiting = tokio::spawn(claim(key));
        tokio::time::sleep(Duration::from_millis(held_ms)).await;
        writer.rollback().await.unwrap();
        let got = waiting.await.unwrap();
        if held_ms < 2_000 {
            assert!(matches!(got, Ok(Claim::Acquired { .. })), "{got:?}");
        } else {
            let err = got.expect_err("claimed past busy_timeout");
            let text = format!("{err:?}");
            assert!(text.contains("locked") || text.contains("busy"), "{text}");
            let again = claim(key).await.unwrap();
            assert!(matches!(again, Claim::Acquired { .. }), "{again:?}");
        }
    }
    store.pool().close().await;
    let _ = std::fs::remove_file(&path);
}

static STEP_RUNS: AtomicUsize = AtomicUsize::new(0);

#[idem_runtime::step("reserve")]
async fn reserve(order_no: &str) -> Result<usize, AppError> {
    STEP_RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(order_no.len())
}

/// A step inside a transactional call: it simply runs, because the transaction
/// already makes the whole call all-or-nothing.
#[idempotent(key = "order_no", tx = tx, scope = "tx-tests.sqlite.with-step")]
async fn create_with_step(
    tx: &mut Transaction<'_, Sqlite>,
    order_no: String,
) -> Result<usize, AppError> {
    let reserved = reserve(&order_no).await?;
    sqlx::query("INSERT INTO orders (order_no) VALUES (?1)")
        .bind(&order_no)
        .execute(&mut **tx)
        .await?;
    Ok(reserved)
}

#[tokio::test]
async fn sqlite_steps_inside_a_transactional_call_run_directly() {
    let store = sqlite().await;
    let before = STEP_RUNS.load(Ordering::SeqCst);
    let mut tx = store.pool().begin().await.unwrap();
    assert_eq!(create_with_step(&mut tx, "o-4".into()).await.unwrap(), 3);
    tx.commit().await.unwrap();
    assert_eq!(STEP_RUNS.load(Ordering::SeqCst) - before, 1);
    let mut tx = store.pool().begin().await.unwrap();
    assert_eq!(
        create_with_step(&mut tx, "o-4".into()).await.unwrap(),
        3,
        "replayed"
    );
    tx.commit().await.unwrap();
    assert_eq!(
        STEP_RUNS.load(Ordering::SeqCst) - before,
        1,
        "the replay ran no step"
    );
}

/// If the record cannot be written, the call fails, so the caller rolls back
/// instead of committing an order that has no record.
#[tokio::test]
async fn sqlite_a_record_that_cannot_be_written_fails_the_call() {
    let store = sqlite().await;
    sqlx::query(
        "CREATE TRIGGER refuse_done BEFORE UPDATE OF state ON idem_records
         WHEN NEW.state = 2 BEGIN SELECT RAISE(ABORT, 'injected: the record cannot be written'); END",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let mut tx = store.pool().begin().await.unwrap();
    let err = create_order(&mut tx, "o-5".into(), false)
        .await
        .unwrap_err();
    let AppError::Idem(idem_runtime::Error::Store(e)) = &err else {
        panic!("expected a store error, got {err:?}");
    };
    assert!(e.to_string().contains("injected"), "{e}");
    tx.rollback().await.unwrap();
    assert_eq!(count_orders(&store).await, 0);
}

/// A bare connection in autocommit: the claim would commit at once with no
/// heartbeat while the body holds the connection, so a slow body could be
/// taken over while alive. It is refused before anything runs or is written.
#[idempotent(key = "order_no", tx = conn, scope = "tx-tests.sqlite.autocommit")]
async fn create_on_connection(
    conn: &mut sqlx::SqliteConnection,
    order_no: String,
) -> Result<i64, AppError> {
    SQLITE_RUNS.fetch_add(1, Ordering::SeqCst);
    let id: i64 = sqlx::query_scalar("INSERT INTO orders (order_no) VALUES (?1) RETURNING id")
        .bind(&order_no)
        .fetch_one(&mut *conn)
        .await?;
    Ok(id)
}

#[tokio::test]
async fn sqlite_a_connection_in_autocommit_is_refused_and_one_in_a_transaction_works() {
    let store = sqlite().await;
    let runs = SQLITE_RUNS.load(Ordering::SeqCst);
    let mut conn = store.pool().acquire().await.unwrap();
    let err = create_on_connection(&mut conn, "o-auto".into())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            AppError::Idem(idem_runtime::Error::NotInTransaction { .. })
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("begin()"),
        "says what to do: {err}"
    );
    assert_eq!(
        SQLITE_RUNS.load(Ordering::SeqCst),
        runs,
        "the body never ran"
    );
    // The in-memory pool has one connection: hand it back to count.
    drop(conn);
    assert_eq!(count_orders(&store).await, 0);
    let autocommit_key = Key::builder("tx-tests.sqlite.autocommit")
        .part("o-auto")
        .finish();
    assert!(store.inspect(&autocommit_key).await.unwrap().is_none());

    // A connection inside a transaction begun through sqlx is accepted.
    let mut conn = store.pool().acquire().await.unwrap();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    create_on_connection(&mut tx, "o-auto".into())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    drop(conn);
    assert_eq!(count_orders(&store).await, 1);
}

mod postgres {
    //! The same through the attribute on PostgreSQL, where a concurrent
    //! duplicate blocks on the record's primary key.

    use super::*;
    use idem_runtime::store::sql::PgStore;
    use idem_tests::services;
    use idem_tests::statements::Statements;
    use sqlx::Postgres;

    #[idempotent(key = "order_no", tx = tx, scope = "tx-tests.pg.create")]
    async fn create_order(
        tx: &mut Transaction<'_, Postgres>,
        order_no: String,
    ) -> Result<i64, AppError> {
        let id: i64 =
            sqlx::query_scalar("INSERT INTO tx_test_orders (order_no) VALUES ($1) RETURNING id")
                .bind(&order_no)
                .fetch_one(&mut **tx)
                .await?;
        Ok(id)
    }

    async fn pg() -> Option<PgStore> {
        let url = services::postgres_url();
        let store = services::reachable("PostgreSQL", &url, PgStore::connect(&url).await)?;
        // Two tests creating the table at once race in PostgreSQL's catalog.
        static TABLE: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        TABLE.get_or_init(|| async {
            sqlx::query(
            "CREATE TABLE IF NOT EXISTS tx_test_orders (id BIGSERIAL PRIMARY KEY, order_no TEXT NOT NULL UNIQUE)",
        )
            .execute(store.pool())
            .await
            .unwrap();
        })
        .await;
        Some(store)
    }

    fn order_no(case: &str) -> String {
        format!(
            "{case}-{}",
            idem_runtime::store::Token::random().as_bytes()[0] as u32 * 100_000
                + std::process::id() % 100_000
        )
    }

    async fn orders(store: &PgStore, order_no: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM tx_test_orders WHERE order_no = $1")
            .bind(order_no)
            .fetch_one(store.pool())
            .await
            .unwrap()
    }

    fn pg_key(order_no: &str) -> Key {
        Key::builder("tx-tests.pg.create").part(order_no).finish()
    }

    #[tokio::test]
    async fn a_rolled_back_business_transaction_leaves_no_record() {
        let Some(store) = pg().await else { return };
        let no = order_no("rollback");
        let mut tx = store.pool().begin().await.unwrap();
        create_order(&mut tx, no.clone()).await.unwrap();
        tx.rollback().await.unwrap();
        assert_eq!(orders(&store, &no).await, 0);
        assert!(
            store.inspect(&pg_key(&no)).await.unwrap().is_none(),
            "no record without the order"
        );

        let mut tx = store.pool().begin().await.unwrap();
        let id = create_order(&mut tx, no.clone()).await.unwrap();
        tx.commit().await.unwrap();
        let mut tx = store.pool().begin().await.unwrap();
        assert_eq!(
            create_order(&mut tx, no.clone()).await.unwrap(),
            id,
            "replayed"
        );
        tx.commit().await.unwrap();
        assert_eq!(orders(&store, &no).await, 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_concurrent_duplicate_waits_then_replays_and_its_transaction_stays_usable() {
        let Some(store) = pg().await else { return };
        let no = order_no("concurrent");
        let mut first = store.pool().begin().await.unwrap();
        let id = create_order(&mut first, no.clone()).await.unwrap();

        let (pool, dup_no) = (store.pool().clone(), no.clone());
        let duplicate = tokio::spawn(async move {
            let mut tx = pool.begin().await.unwrap();
            let replayed = create_order(&mut tx, dup_no).await;
            // No SQLSTATE 25P02: the duplicate's transaction still works.
            let one: i32 = sqlx::query_scalar("SELECT 1")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            (replayed, one)
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !duplicate.is_finished(),
            "the duplicate waits on the record's key"
        );
        first.commit().await.unwrap();
        let (replayed, one) = duplicate.await.unwrap();
        assert_eq!(replayed.unwrap(), id);
        assert_eq!(one, 1);
        assert_eq!(orders(&store, &no).await, 1);
        // A second run of the body would have failed on the UNIQUE order_no.
    }

    /// What `tx = tx` adds to the caller's transaction, counted from sqlx's
    /// per-statement events (see `idem_tests::statements` for why that count
    /// is exact): a first call is the claim (a plain insert), the body's
    /// insert and the completion; a replay is that insert, which finds the
    /// row, and the claim that reads it.
    #[tokio::test]
    async fn a_first_call_adds_two_statements_and_a_replay_two() {
        let Some(store) = pg().await else { return };
        let no = order_no("statements");
        let body = |sql: &String| sql.contains("tx_test_orders");

        let mut tx = store.pool().begin().await.unwrap();
        let seen = Statements::record();
        let id = create_order(&mut tx, no.clone()).await.unwrap();
        let first = seen.take();
        tx.commit().await.unwrap();
        assert_eq!(
            first.iter().map(body).collect::<Vec<_>>(),
            [false, true, false],
            "a first call: claim, body, completion: {first:#?}"
        );

        let mut tx = store.pool().begin().await.unwrap();
        seen.take();
        assert_eq!(create_order(&mut tx, no.clone()).await.unwrap(), id);
        let replay = seen.take();
        tx.commit().await.unwrap();
        assert_eq!(
            replay.len(),
            2,
            "a replay: the insert that finds the row, the claim: {replay:#?}"
        );
        assert!(!replay.iter().any(body), "{replay:#?}");
        assert_eq!(orders(&store, &no).await, 1);
    }

    /// A `()` result: the claim writes the record DONE at once.
    #[idempotent(key = "order_no", tx = tx, scope = "tx-tests.pg.settle")]
    async fn settle(
        tx: &mut Transaction<'_, Postgres>,
        order_no: String,
        decline: bool,
    ) -> Result<(), AppError> {
        sqlx::query("INSERT INTO tx_test_orders (order_no) VALUES ($1)")
            .bind(&order_no)
            .execute(&mut **tx)
            .await?;
        if decline {
            return Err(AppError::Declined);
        }
        Ok(())
    }

    fn settle_key(order_no: &str) -> Key {
        Key::builder("tx-tests.pg.settle").part(order_no).finish()
    }

    /// With a `()` result a first call adds one statement to the caller's
    /// transaction, as the reference notes' dedup row does: a plain insert of
    /// the record DONE. A replay is that insert, which finds the row, and
    /// the claim that reads it: two.
    #[tokio::test]
    async fn a_unit_result_adds_one_statement_and_a_replay_two() {
        let Some(store) = pg().await else { return };
        let no = order_no("unit-statements");
        let body = |sql: &String| sql.contains("tx_test_orders");

        let mut tx = store.pool().begin().await.unwrap();
        let seen = Statements::record();
        settle(&mut tx, no.clone(), false).await.unwrap();
        let first = seen.take();
        assert!(
            store.inspect(&settle_key(&no)).await.unwrap().is_none(),
            "uncommitted, so invisible outside"
        );
        tx.commit().await.unwrap();
        assert_eq!(
            first.iter().map(body).collect::<Vec<_>>(),
            [false, true],
            "a first call: the claim, then the body; no completion: {first:#?}"
        );
        let record = store.inspect(&settle_key(&no)).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Done);

        let mut tx = store.pool().begin().await.unwrap();
        seen.take();
        settle(&mut tx, no.clone(), false)
            .await
            .expect("a replay, not a second insert of the UNIQUE order number");
        let replay = seen.take();
        tx.commit().await.unwrap();
        assert_eq!(
            replay.len(),
            2,
            "a replay: the insert that finds the row, the claim: {replay:#?}"
        );
        assert!(!replay.iter().any(body), "{replay:#?}");
        assert_eq!(orders(&store, &no).await, 1);
    }

    /// A duplicate blocks on the uncommitted DONE record, then replays it
    /// once the first transaction commits; if that transaction rolls back
    /// instead, the duplicate runs the body itself.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_unit_duplicate_waits_for_the_first_transaction_then_replays_or_runs() {
        let Some(store) = pg().await else { return };
        for commit in [true, false] {
            let no = order_no(if commit {
                "unit-commit"
            } else {
                "unit-rollback"
            });
            let mut first = store.pool().begin().await.unwrap();
            settle(&mut first, no.clone(), false).await.unwrap();
            let (pool, dup_no) = (store.pool().clone(), no.clone());
            let duplicate = tokio::spawn(async move {
                let mut tx = pool.begin().await.unwrap();
                let out = settle(&mut tx, dup_no, false).await;
                tx.commit().await.unwrap();
                out
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(
                !duplicate.is_finished(),
                "the duplicate waits on the record"
            );
            if commit {
                first.commit().await.unwrap();
            } else {
                first.rollback().await.unwrap();
            }
            duplicate.await.unwrap().unwrap();
            assert_eq!(orders(&store, &no).await, 1, "commit = {commit}");
            let record = store.inspect(&settle_key(&no)).await.unwrap().unwrap();
            assert_eq!(record.state, RecordState::Done, "commit = {commit}");
        }
    }

    /// An `Err` releases the record the claim wrote DONE: a caller that
    /// commits anyway leaves the key free, and the retry takes the released
    /// record over (the update branch of the claim, DONE again).
    #[tokio::test]
    async fn a_unit_result_that_fails_releases_its_record_and_the_retry_takes_it() {
        let Some(store) = pg().await else { return };
        let no = order_no("unit-declined");
        let mut tx = store.pool().begin().await.unwrap();
        let err = settle(&mut tx, no.clone(), true).await.unwrap_err();
        assert!(matches!(err, AppError::Declined), "{err:?}");
        tx.commit().await.unwrap();
        let record = store.inspect(&settle_key(&no)).await.unwrap();
        assert!(record.is_none(), "the failed call left {record:?}");
        sqlx::query("DELETE FROM tx_test_orders WHERE order_no = $1")
            .bind(&no)
            .execute(store.pool())
            .await
            .unwrap();

        let mut tx = store.pool().begin().await.unwrap();
        settle(&mut tx, no.clone(), false).await.unwrap();
        tx.commit().await.unwrap();
        let record = store.inspect(&settle_key(&no)).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Done);
        assert_eq!(record.fence, 2, "the released record's fence grew");
        let mut tx = store.pool().begin().await.unwrap();
        settle(&mut tx, no.clone(), false).await.expect("replayed");
        tx.commit().await.unwrap();
        assert_eq!(orders(&store, &no).await, 1);
    }

    #[idempotent(key = "order_no", tx = conn, scope = "tx-tests.pg.autocommit")]
    async fn create_on_connection(
        conn: &mut sqlx::PgConnection,
        order_no: String,
    ) -> Result<i64, AppError> {
        let id: i64 =
            sqlx::query_scalar("INSERT INTO tx_test_orders (order_no) VALUES ($1) RETURNING id")
                .bind(&order_no)
                .fetch_one(&mut *conn)
                .await?;
        Ok(id)
    }

    #[tokio::test]
    async fn a_connection_in_autocommit_is_refused_before_the_body_runs() {
        let Some(store) = pg().await else { return };
        let no = order_no("autocommit");
        let mut conn = store.pool().acquire().await.unwrap();
        let err = create_on_connection(&mut conn, no.clone())
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                AppError::Idem(idem_runtime::Error::NotInTransaction { .. })
            ),
            "{err:?}"
        );
        assert_eq!(orders(&store, &no).await, 0, "the body never ran");
        let key = Key::builder("tx-tests.pg.autocommit").part(&no).finish();
        assert!(
            store.inspect(&key).await.unwrap().is_none(),
            "nothing claimed"
        );
    }
}
