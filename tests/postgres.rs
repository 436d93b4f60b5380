//! The PostgreSQL store: the conformance suite on a real server, failing
//! closed, a connection lost mid-call, migrations from several processes,
//! sweeping, and claims inside the caller's transaction.
//!
//! Needs the server `services::postgres_url()` names; without it every test
//! says SKIPPED (or fails, with `IDEM_REQUIRE_SERVICES=1`). Keys are random
//! per test, and tests that count or delete rows table-wide run in a schema
//! of their own, so runs and tests never see each other's records.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use idem_runtime::store::spawn_sweeper;
use idem_runtime::store::sql::PgStore;
use idem_runtime::store::tx::{AsTxConnection, TxConnection};
use idem_runtime::{
    Claim, ClaimRequest, Completion, Error, Key, Outcome, RecordState, Store, StoreRef, Token,
    idempotent,
};
use idem_tests::conformance::{Subject, fresh_key};
use idem_tests::services;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};

/// Long enough that a loaded two-core machine never misses a lease boundary
/// by a whole unit, short enough that the slowest case takes about 3 s.
const UNIT: Duration = Duration::from_millis(400);

async fn store() -> Option<PgStore> {
    let url = services::postgres_url();
    services::reachable("PostgreSQL", &url, PgStore::connect(&url).await)
}

async fn subject() -> Option<Subject> {
    store()
        .await
        .map(|store| Subject::real(StoreRef::new(store), UNIT))
}

idem_tests::conformance_suite!(postgres_store, subject());

fn request(key: &Key, token: Token, lease: Duration) -> ClaimRequest<'_> {
    ClaimRequest {
        key,
        token,
        fingerprint: None,
        lease,
        ttl: Duration::from_secs(120),
    }
}

fn success(payload: &[u8], ttl: Duration) -> Completion<'_> {
    Completion {
        outcome: Outcome::Success,
        payload,
        ttl,
    }
}

fn random_u32() -> u32 {
    u32::from_le_bytes(Token::random().0[..4].try_into().unwrap())
}

/// Polls `check` until it holds, failing after 10 s.
async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------
// A schema of one's own, for tests that look at the whole table
// ---------------------------------------------------------------------------

struct Schema {
    name: String,
    options: PgConnectOptions,
    admin: PgPool,
}

impl Schema {
    async fn create(tag: &str) -> Option<Schema> {
        let url = services::postgres_url();
        let admin = services::reachable(
            "PostgreSQL",
            &url,
            PgPoolOptions::new().max_connections(2).connect(&url).await,
        )?;
        let name = format!("idem_test_{tag}_{:08x}", random_u32());
        sqlx::query(&format!("CREATE SCHEMA {name}"))
            .execute(&admin)
            .await
            .expect("create schema");
        let options = PgConnectOptions::from_str(&url)
            .expect("postgres url")
            .options([("search_path", name.as_str())]);
        Some(Schema {
            name,
            options,
            admin,
        })
    }

    async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {}.{table}", self.name))
            .fetch_one(&self.admin)
            .await
            .expect("count")
    }

    async fn drop(self) {
        sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.name))
            .execute(&self.admin)
            .await
            .expect("drop schema");
    }
}

// ---------------------------------------------------------------------------
// Failing closed
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// Migrations, purging, sweeping
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrating_twice_and_from_several_stores_at_once_is_harmless() {
    let Some(schema) = Schema::create("migrate").await else {
        return;
    };
    // Four processes starting at once on an empty schema.
    let opening: Vec<_> = (0..4)
        .map(|_| {
            let options = schema.options.clone();
            tokio::spawn(async move {
                PgStore::builder()
                    .max_connections(2)
                    .connect_with(options)
                    .await
            })
        })
        .collect();
    let mut stores = Vec::new();
    for t in opening {
        stores.push(t.await.unwrap().expect("every store opens"));
    }
    stores[0].migrate().await.expect("migrating again");
    stores[3].migrate().await.expect("and again");

    let ledger: Vec<(i64, String)> = sqlx::query_as(&format!(
        "SELECT version, description FROM {}.idem_schema_migrations ORDER BY version",
        schema.name
    ))
    .fetch_all(&schema.admin)
    .await
    .unwrap();
    assert_eq!(ledger, vec![(1, "create idem_records".to_owned())]);
    let indexed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_indexes WHERE schemaname = $1 AND indexname = 'idem_records_expires_at')",
    )
    .bind(&schema.name)
    .fetch_one(&schema.admin)
    .await
    .unwrap();
    assert!(indexed);

    let key = fresh_key("migrated");
    let claim = stores[1]
        .claim(request(&key, Token::random(), Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }));
    assert_eq!(schema.count("idem_records").await, 1);
    for s in &stores {
        s.pool().close().await;
    }
    schema.drop().await;
}

/// Fills a private schema with `dead` expired records, one released and one
/// live, and returns the live key.
async fn dead_and_live(store: &PgStore, dead: usize) -> Key {
    let lease = Duration::from_secs(30);
    for _ in 0..dead {
        let (key, token) = (fresh_key("dead"), Token::random());
        store.claim(request(&key, token, lease)).await.unwrap();
        assert!(
            store
                .complete(&key, token, success(b"d", Duration::from_millis(1)))
                .await
                .unwrap()
        );
    }
    let (released, token) = (fresh_key("released"), Token::random());
    store.claim(request(&released, token, lease)).await.unwrap();
    assert!(store.release(&released, token).await.unwrap());
    let (live, token) = (fresh_key("live"), Token::random());
    store.claim(request(&live, token, lease)).await.unwrap();
    assert!(
        store
            .complete(&live, token, success(b"l", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    live
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_is_bounded_and_skips_rows_a_transaction_holds() {
    let Some(schema) = Schema::create("purge").await else {
        return;
    };
    let store = PgStore::builder()
        .connect_with(schema.options.clone())
        .await
        .unwrap();
    let live = dead_and_live(&store, 6).await;

    // A transaction holds one dead row: purging passes it by instead of waiting.
    let mut holder = store.pool().begin().await.unwrap();
    let held: Vec<u8> = sqlx::query_scalar(
        "SELECT key FROM idem_records
         WHERE state = 2 AND expires_at <= (extract(epoch FROM clock_timestamp()) * 1000)::bigint
         LIMIT 1 FOR UPDATE",
    )
    .fetch_one(&mut *holder)
    .await
    .unwrap();
    let mut batches = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), store.purge_expired(3))
            .await
            .expect("purging waited on a locked row")
            .unwrap();
        batches.push(n);
        if n < 3 {
            break;
        }
    }
    // 6 dead + 1 released, less the held one, 3 at a time.
    assert_eq!(batches, vec![3, 3, 0]);
    holder.commit().await.unwrap();
    assert_eq!(store.purge_expired(3).await.unwrap(), 1);
    let gone: bool =
        sqlx::query_scalar("SELECT NOT EXISTS (SELECT 1 FROM idem_records WHERE key = $1)")
            .bind(&held)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert!(gone, "the held row went last");
    assert_eq!(schema.count("idem_records").await, 1);
    assert!(store.inspect(&live).await.unwrap().is_some());
    store.pool().close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_deletes_dead_records_in_batches_and_keeps_live_ones() {
    let Some(schema) = Schema::create("sweep").await else {
        return;
    };
    let store = PgStore::builder()
        .connect_with(schema.options.clone())
        .await
        .unwrap();
    let live = dead_and_live(&store, 10).await;
    assert_eq!(schema.count("idem_records").await, 12);

    let sweeper = spawn_sweeper(StoreRef::new(store.clone()), Duration::from_millis(50), 4);
    until("the sweeper to leave only the live record", || async {
        schema.count("idem_records").await == 1
    })
    .await;
    assert!(store.inspect(&live).await.unwrap().is_some());

    // Later deaths go in a later round.
    let (key, token) = (fresh_key("later"), Token::random());
    store
        .claim(request(&key, token, Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(
        store
            .complete(&key, token, success(b"x", Duration::from_millis(1)))
            .await
            .unwrap()
    );
    until("the later record to go", || async {
        schema.count("idem_records").await == 1
    })
    .await;
    assert!(!sweeper.is_finished());
    sweeper.abort();
    store.pool().close().await;
    schema.drop().await;
}

// ---------------------------------------------------------------------------
// Claims inside the caller's transaction
// ---------------------------------------------------------------------------

const TX_LEASE: Duration = Duration::from_secs(30);

#[tokio::test]
async fn in_a_rolled_back_transaction_the_record_rolls_back_too() {
    let Some(store) = store().await else { return };
    let (key, token) = (fresh_key("tx-rollback"), Token::random());
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim(request(&key, token, TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { fence: 1, .. }));
    assert!(
        tx.tx_connection()
            .complete(&key, token, success(b"42", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    assert!(
        store.inspect(&key).await.unwrap().is_none(),
        "uncommitted, so invisible outside"
    );
    tx.rollback().await.unwrap();

    assert!(
        store.inspect(&key).await.unwrap().is_none(),
        "a rolled-back call left a record"
    );
    assert_eq!(
        store
            .claim(request(&key, Token::random(), TX_LEASE))
            .await
            .unwrap(),
        Claim::Acquired {
            fence: 1,
            takeover: false
        }
    );
}

#[tokio::test]
async fn in_a_committed_transaction_the_record_replays_to_later_callers() {
    let Some(store) = store().await else { return };
    let (key, token) = (fresh_key("tx-commit"), Token::random());
    // A bare connection with its own BEGIN works as well as a Transaction.
    let mut pooled = store.pool().acquire().await.unwrap();
    let conn: &mut PgConnection = &mut pooled;
    sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
    let claim = conn
        .tx_connection()
        .claim(request(&key, token, TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }));
    assert!(
        conn.tx_connection()
            .complete(&key, token, success(b"order-7", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();

    let Claim::Done(stored) = store
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap()
    else {
        panic!("expected a replay");
    };
    assert_eq!(stored.payload, b"order-7");
}

/// A replay inside a caller's transaction reads the record without locking it:
/// replays of a hot key must not queue behind each other's transactions.
#[tokio::test]
async fn a_replay_inside_a_transaction_takes_no_row_lock() {
    let Some(store) = store().await else { return };
    let (key, token) = (fresh_key("tx-replay-lock"), Token::random());
    assert!(matches!(
        store.claim(request(&key, token, TX_LEASE)).await.unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(
        store
            .complete(&key, token, success(b"order-9", Duration::from_secs(60)))
            .await
            .unwrap()
    );

    let mut replaying = store.pool().begin().await.unwrap();
    let replay = replaying
        .tx_connection()
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(replay, Claim::Done(_)), "{replay:?}");

    // While the replaying transaction is still open, another one can lock the row
    // at once: the replay holds no lock on it.
    let mut other = store.pool().begin().await.unwrap();
    let locked = sqlx::query("SELECT 1 FROM idem_records WHERE key = $1 FOR UPDATE NOWAIT")
        .bind(&key.as_bytes()[..])
        .execute(&mut *other)
        .await;
    assert!(locked.is_ok(), "the replay left the row locked: {locked:?}");
    other.rollback().await.unwrap();
    replaying.commit().await.unwrap();
}

/// On the pool, a claim, a Busy answer, a completion and a replay are one
/// statement each, counted from sqlx's per-statement events (see
/// `idem_tests::statements`); so is a replay inside a caller's transaction.
#[tokio::test]
async fn a_claim_a_busy_answer_a_completion_and_a_replay_are_one_statement_each() {
    let Some(store) = store().await else { return };
    let (key, token) = (fresh_key("statements"), Token::random());
    let seen = idem_tests::statements::Statements::record();
    let one = |what: &str| {
        let sent = seen.take();
        assert_eq!(sent.len(), 1, "{what}: {sent:#?}");
    };
    let claim = store.claim(request(&key, token, TX_LEASE)).await.unwrap();
    assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
    one("a first claim");
    let busy = store
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(busy, Claim::Busy { .. }), "{busy:?}");
    one("a Busy answer");
    assert!(
        store
            .complete(&key, token, success(b"order-3", Duration::from_secs(60)))
            .await
            .unwrap()
    );
    one("a completion");
    let replay = store
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(replay, Claim::Done(_)), "{replay:?}");
    one("a replay on the pool");

    let mut tx = store.pool().begin().await.unwrap();
    seen.take();
    let replay = tx
        .tx_connection()
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(replay, Claim::Done(_)), "{replay:?}");
    one("a replay in a transaction");
    tx.commit().await.unwrap();
}

#[tokio::test]
async fn in_a_transaction_a_release_and_a_busy_claim_leave_it_usable() {
    let Some(store) = store().await else { return };
    // The conformance purge case deletes released records table-wide, which
    // would reset the fence this test checks.
    let _table = idem_tests::conformance::share_table("tx-release").await;
    let (key, token) = (fresh_key("tx-release"), Token::random());
    let mut tx = store.pool().begin().await.unwrap();
    tx.tx_connection()
        .claim(request(&key, token, TX_LEASE))
        .await
        .unwrap();
    assert!(tx.tx_connection().release(&key, token).await.unwrap());
    tx.commit().await.unwrap();
    let next = Token::random();
    assert_eq!(
        store.claim(request(&key, next, TX_LEASE)).await.unwrap(),
        Claim::Acquired {
            fence: 2,
            takeover: false
        },
        "a release committed in a transaction keeps the fence"
    );

    // `next` holds a live claim outside any transaction: a claim in one is
    // told so, and its transaction carries on.
    let mut tx = store.pool().begin().await.unwrap();
    let claim = tx
        .tx_connection()
        .claim(request(&key, Token::random(), TX_LEASE))
        .await
        .unwrap();
    assert!(matches!(claim, Claim::Busy { .. }), "{claim:?}");
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&mut *tx)
        .await
        .expect("the transaction is not aborted");
    assert_eq!(one, 1);
    tx.commit().await.unwrap();
}

#[derive(Debug, Clone, Copy)]
enum FirstEnds {
    Commit,
    Rollback,
}

/// What the duplicate's transaction saw, and the transaction, still open.
struct Duplicate {
    store: PgStore,
    key: Key,
    token: Token,
    claim: Claim,
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
}

/// A first transaction claims and completes; a second one, on another
/// connection, claims the same key and must wait on the record's row until the
/// first ends.
async fn a_duplicate_waits_for(ends: FirstEnds) -> Option<Duplicate> {
    let store = store().await?;
    let key = fresh_key("tx-wait");
    let first = Token::random();
    let mut tx1 = store.pool().begin().await.unwrap();
    assert!(matches!(
        tx1.tx_connection()
            .claim(request(&key, first, TX_LEASE))
            .await
            .unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(
        tx1.tx_connection()
            .complete(&key, first, success(b"first", Duration::from_secs(60)))
            .await
            .unwrap()
    );

    let mut tx2 = store.pool().begin().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx2)
        .await
        .unwrap();
    let token = Token::random();
    let second = tokio::spawn(async move {
        let claim = tx2
            .tx_connection()
            .claim(request(&key, token, TX_LEASE))
            .await
            .expect("the duplicate's claim");
        // No SQLSTATE 25P02: the claim did not abort the transaction.
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *tx2)
            .await
            .expect("the duplicate's transaction is still usable");
        assert_eq!(one, 1);
        (claim, tx2)
    });

    until("the duplicate to wait on a lock", || async {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_one(store.pool())
                .await
                .unwrap();
        waiting.as_deref() == Some("Lock")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!second.is_finished(), "the duplicate did not wait");

    match ends {
        FirstEnds::Commit => tx1.commit().await.unwrap(),
        FirstEnds::Rollback => tx1.rollback().await.unwrap(),
    }
    let (claim, tx) = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("the duplicate was released when the first transaction ended")
        .unwrap();
    Some(Duplicate {
        store,
        key,
        token,
        claim,
        tx,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_waits_and_then_replays_the_committed_result() {
    let Some(dup) = a_duplicate_waits_for(FirstEnds::Commit).await else {
        return;
    };
    let Claim::Done(stored) = dup.claim else {
        panic!("expected the committed result, got {:?}", dup.claim);
    };
    assert_eq!(stored.payload, b"first");
    dup.tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_waits_and_then_claims_after_a_rollback() {
    let Some(mut dup) = a_duplicate_waits_for(FirstEnds::Rollback).await else {
        return;
    };
    assert_eq!(
        dup.claim,
        Claim::Acquired {
            fence: 1,
            takeover: false
        }
    );
    // The duplicate owns the key now: what it commits is what replays.
    assert!(
        dup.tx
            .tx_connection()
            .complete(
                &dup.key,
                dup.token,
                success(b"second", Duration::from_secs(60))
            )
            .await
            .unwrap()
    );
    dup.tx.commit().await.unwrap();
    let Claim::Done(stored) = dup
        .store
        .claim(request(&dup.key, Token::random(), TX_LEASE))
        .await
        .unwrap()
    else {
        panic!("expected the duplicate's result");
    };
    assert_eq!(stored.payload, b"second");
}

/// Opening and migrating can be spawned: their futures are `Send` for any
/// lifetime, which sqlx's lifetime-generic executors make easy to lose.
#[allow(dead_code)]
fn opening_and_migrating_can_be_spawned(url: String, options: PgConnectOptions, pool: PgPool) {
    fn send<T: Send>(_: T) {}
    let store = async move {
        let a = PgStore::connect(&url).await?;
        let b = PgStore::builder().connect_with(options).await?;
        let c = PgStore::builder().pool(pool).await?;
        a.migrate().await?;
        Ok::<_, idem_runtime::StoreError>((a, b, c))
    };
    send(store);
}

// ---------------------------------------------------------------------------
// Leases that waited on a lock
// ---------------------------------------------------------------------------

/// A store with one connection, and that connection's backend pid: whatever
/// the store runs, `waits_on_a_lock(pid)` can watch.
async fn store_with_one_connection() -> Option<(PgStore, i32)> {
    let store = store().await?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(store.pool().connect_options().as_ref().clone())
        .await
        .unwrap();
    let one = PgStore::builder().pool(pool).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(one.pool())
        .await
        .unwrap();
    Some((one, pid))
}

async fn wait_on_a_lock(store: &PgStore, pid: i32) {
    until("the call to wait on a row lock", || async {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_one(store.pool())
                .await
                .unwrap();
        waiting.as_deref() == Some("Lock")
    })
    .await;
}

/// The shared case (`idem_tests::sql`), on a one-connection store whose
/// connection this dialect watches for a lock wait.
async fn a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(existing: bool) {
    let Some(store) = store().await else { return };
    let Some((waiter, pid)) = store_with_one_connection().await else {
        return;
    };
    let key = fresh_key("waited-lease");
    let b_is_waiting = wait_on_a_lock(&store, pid);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_on_an_uncommitted_insert_starts_its_lease_when_it_wins() {
    a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_on_a_locked_row_starts_its_lease_when_it_wins() {
    // Released, then re-claimed by A, so the release must not be purged.
    let _table = idem_tests::conformance::share_table("waited-lease").await;
    a_claim_that_waited_on_a_lock_starts_its_lease_when_it_wins(true).await;
}

/// The owner's renewal waits on a row lock another transaction holds; the
/// renewed lease counts from when it got the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row() {
    let Some(store) = store().await else { return };
    let Some((owner, pid)) = store_with_one_connection().await else {
        return;
    };
    let pool = store.pool().clone();
    let lock_row = |key: Key| async move {
        let mut holder = pool.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idem_records WHERE key = $1 FOR UPDATE")
            .bind(key.as_bytes().to_vec())
            .execute(&mut *holder)
            .await
            .unwrap();
        holder
    };
    let owner_is_waiting = wait_on_a_lock(&store, pid);
    idem_tests::sql::a_renewal_that_waited_on_a_lock_counts_from_when_it_got_the_row(
        &store,
        owner,
        lock_row,
        owner_is_waiting,
        fresh_key("waited-renewal"),
    )
    .await;
}

/// Replays inside transactions take no row lock on PostgreSQL either.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock() {
    let Some(store) = store().await else { return };
    idem_tests::sql::replays_in_opposite_orders_inside_transactions_neither_wait_nor_deadlock(
        &store,
        store.pool(),
    )
    .await;
}

/// Nor does a Busy answer inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner() {
    let Some(store) = store().await else { return };
    idem_tests::sql::a_busy_duplicate_in_an_open_transaction_does_not_block_the_owner(
        &store,
        store.pool(),
    )
    .await;
}

// ---------------------------------------------------------------------------
// The shared SQL record layer: the same behaviour as every SQL store
// ---------------------------------------------------------------------------

async fn set_on_key(store: &PgStore, assignment: &str, key: &Key) {
    sqlx::query(&format!(
        "UPDATE idem_records SET {assignment} WHERE key = $1"
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

/// With `skip_migrations` the store runs no DDL: on a schema whose table was
/// created by hand (by whoever may), it works, and no ledger appears.
#[tokio::test]
async fn a_store_that_skips_migrations_runs_no_ddl() {
    let Some(schema) = Schema::create("skipmig").await else {
        return;
    };
    let by_hand = PgPool::connect_with(schema.options.clone()).await.unwrap();
    sqlx::raw_sql(include_str!(
        "../idem-runtime/migrations/postgres/0001_create_records.sql"
    ))
    .execute(&by_hand)
    .await
    .expect("the schema, applied by hand");
    by_hand.close().await;
    let store = PgStore::builder()
        .skip_migrations()
        .connect_with(schema.options.clone())
        .await
        .expect("open without migrating");
    let key = fresh_key("skip-migrations");
    let claimed = store
        .claim(request(&key, Token::random(), Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(matches!(claimed, Claim::Acquired { .. }), "{claimed:?}");
    let ledger: bool = sqlx::query_scalar(&format!(
        "SELECT to_regclass('{}.idem_schema_migrations') IS NOT NULL",
        schema.name
    ))
    .fetch_one(&schema.admin)
    .await
    .unwrap();
    assert!(
        !ledger,
        "a store told to skip migrations created the ledger"
    );
    store.pool().close().await;
    schema.drop().await;
}

/// A claim inside a REPEATABLE READ transaction that meets a row committed
/// after its snapshot is a serialization failure: the caller's transaction is
/// aborted, and `is_retryable` tells the caller to run it again.
#[tokio::test]
async fn a_serialization_failure_in_a_transaction_is_retryable() {
    let Some(store) = store().await else { return };
    let key = fresh_key("serialization");
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    // The snapshot is taken here, before the other caller's claim commits.
    sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
    let owner = store
        .claim(request(&key, Token::random(), Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(matches!(owner, Claim::Acquired { .. }), "{owner:?}");
    // Let the owner's lease lapse so the transaction's claim may take the
    // row: it must then update a row its snapshot cannot see.
    sqlx::query("UPDATE idem_records SET lease_until = 0, expires_at = 0 WHERE key = $1")
        .bind(&key.as_bytes()[..])
        .execute(store.pool())
        .await
        .unwrap();
    let err = tx
        .tx_connection()
        .claim(request(&key, Token::random(), Duration::from_secs(30)))
        .await
        .expect_err("a serialization failure");
    assert!(PgStore::is_retryable(&err), "{err}");
    let other = idem_runtime::StoreError::new("postgres", "x", std::io::Error::other("reset"));
    assert!(!PgStore::is_retryable(&other));
    tx.rollback().await.unwrap();
}
